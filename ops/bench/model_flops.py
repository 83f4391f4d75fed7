"""Model FLOP utilisation (MFU) for the benchmarks: the forward's FLOPs counted from the model config,
and the GEMM peak measured on this device at this torch thread count.

MFU = (model FLOPs of the useful work / wall time) / measured GEMM peak. Useful work is each request's
forward once (no recompute after a preemption, no padding), so anything the engine spends beyond the
model's math (scheduling, sampling, recompute, attention kernels slower than a GEMM) lowers it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from common.model.arch import ModelArch


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set a decoder's matmul FLOPs; ``sliding_windows`` per layer (None: full attention).
    A mixture of experts counts what a token multiplies: in ``moe_layers`` the router and its
    ``experts_per_token`` experts (and a shared expert), not every expert it holds."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    sliding_windows: tuple[int | None, ...]
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = False

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        num_heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        arch = ModelArch.from_config(config)
        return cls(
            hidden_size=int(config.hidden_size),
            intermediate_size=int(arch.mlp_width or config.intermediate_size),  # Falcon's: ffn_hidden_size
            num_heads=num_heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            vocab_size=int(config.vocab_size),
            sliding_windows=arch.sliding_windows,
            moe_layers=arch.moe_layers,
            num_experts=arch.num_experts,
            experts_per_token=arch.experts_per_token,
            moe_intermediate_size=arch.moe_intermediate_size,
            shared_expert_intermediate_size=arch.shared_expert_intermediate_size,
            shared_expert_gated=arch.shared_expert_gated,
        )

    @property
    def num_layers(self) -> int:
        return len(self.sliding_windows)

    @property
    def layer_matmul_params(self) -> int:
        """Weights one token multiplies in a dense layer: q, k, v, o projections and gate, up, down."""
        return self._attention_params + 3 * self.hidden_size * self.intermediate_size

    @property
    def moe_layer_matmul_params(self) -> int:
        """Weights one token multiplies in a mixture's layer: q, k, v, o, the router over every expert, the
        gate, up and down of each expert it is routed to, and a shared expert (with its one-column gate in
        Qwen2-MoE)."""
        h = self.hidden_size
        experts = self.experts_per_token * 3 * h * self.moe_intermediate_size
        shared = 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_gated else 0)
        return self._attention_params + h * self.num_experts + experts + shared

    @property
    def matmul_params(self) -> int:
        """Weights one token multiplies in all the layers."""
        num_moe = len(self.moe_layers)
        return (self.num_layers - num_moe) * self.layer_matmul_params + num_moe * self.moe_layer_matmul_params

    @property
    def _attention_params(self) -> int:
        q_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return q_o + k_v


def _sum_of_contexts(num_tokens: int, window: int | None) -> int:
    """sum over positions i = 1..num_tokens of min(i, window): the keys each query attends to."""
    full = num_tokens if window is None else min(num_tokens, window)
    return full * (full + 1) // 2 + (num_tokens - full) * (window or 0)


def sequence_flops(shape: ModelShape, num_tokens: int, num_logits: int) -> int:
    """FLOPs of the forward over one sequence of ``num_tokens`` tokens (positions 0..num_tokens - 1,
    each attending causally to the ones before it), computing logits for ``num_logits`` of them.

        linear    = 2 * num_tokens * num_layers * (h*(2*H*d + 2*K*d) + 3*h*I)     q, k, v, o, gate, up, down
        attention = sum over layers, i = 1..num_tokens of 4 * H * d * min(i, window)   QK^T and PV
        logits    = 2 * num_logits * h * V                                          the LM head

    (a mixture's layer: ``ModelShape.moe_layer_matmul_params`` in place of 3*h*I's layer) with h the
    hidden size, I the MLP's intermediate size, H query heads, K key/value heads, d the head
    dim, V the vocabulary. A multiply-add counts 2. Norms, RoPE, softmax, activations, biases and the
    embedding lookup are left out (a few FLOPs per element, not per weight).

    The context a token sees does not depend on how the sequence was split into chunks or steps, so
    this is the same whether it ran as one prefill, chunks, or prefill plus one-token decode steps.
    """
    linear = 2 * num_tokens * shape.matmul_params
    attention = sum(4 * shape.num_heads * shape.head_dim * _sum_of_contexts(num_tokens, w)
                    for w in shape.sliding_windows)
    return linear + attention + 2 * num_logits * shape.hidden_size * shape.vocab_size


def workload_flops(shape: ModelShape, requests: Iterable[tuple[int, int]]) -> int:
    """Model FLOPs to serve (prompt length, max_tokens) pairs, EOS ignored: the forward runs over the
    prompt and every output token but the last (prompt + max_tokens - 1 tokens), and samples
    max_tokens times (logits for the prompt's last token and each decode step's token)."""
    return sum(sequence_flops(shape, prompt_len + max_tokens - 1, max_tokens) for prompt_len, max_tokens in requests)


def decode_token_flops(shape: ModelShape, context_len: int) -> int:
    """FLOPs of one decode token that attends to ``context_len`` keys (itself included), logits included."""
    return sequence_flops(shape, context_len, 1) - sequence_flops(shape, context_len - 1, 0)


@torch.inference_mode()
def measure_gemm_peak(m: int, k: int, n: int, device: torch.device, dtype: torch.dtype, num_runs: int = 5) -> dict[str, Any]:
    """FLOP/s of ``torch.matmul`` of an (m, k) by a (k, n) matrix, best of ``num_runs`` after a warm-up,
    on ``device`` with this process's torch thread count; random data (never zeros)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.matmul(a, b)  # warm-up: thread pool, kernel selection
    sync()
    best = float("inf")
    for _ in range(num_runs):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
    flops = 2 * m * k * n
    return {"shape": [m, k, n], "dtype": str(dtype), "threads": torch.get_num_threads(), "best_ms": best * 1000,
            "flops_per_s": flops / best}
