"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 2, SmolLM, ..., and mixtures of experts:
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE, GLM-4.5, MiniMax-M2; DeepSeek-V2/V3 with their
Multi-head Latent Attention, ``common.model.mla``) over a paged KV cache.

The forward pass takes the flattened tokens of many sequences at once, with their positions and
an ``AttentionMetadata`` that says where each token's K/V goes (``slot_mapping``) and which blocks
each sequence reads (``block_tables``). The math follows Hugging Face's implementation step for
step, so float32 greedy output is identical. What a config asks for (biases, norms, activation,
scalings, soft-capping, each layer's sliding window, RoPE kind) is decided and checked in
``common/model/arch.py``.

Each layer's q, k and v projections are one matrix product, and so are the MLP's gate and up (as
vLLM's fused linear layers do): two launches where there were five, each reading the same input.
The checkpoint's matrices are stacked at load (``FUSED_PROJECTIONS``); every output is the dot
product it was, over the same input and weights. Each block's output is added to the residual stream
by the norm that reads the sum (``RMSNorm.add``): on a GPU the kernels' ``add_rms_norm`` is one launch
for both, as vLLM's fused residual norm is, ``silu_mul`` one for the MLP's activation, and
``rope_and_store`` one for the rotary embedding and the KV cache's write.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.model.arch import (
    NTK_ALPHA,
    ROUTER_SIGMOID,
    ROUTER_SIGMOID_GROUPS,
    ROUTER_SIGMOID_SCALED_INPUT,
    ROUTER_SOFTMAX_CORRECTED,
    ROUTER_SOFTMAX_GROUPS,
    ROUTER_TOPK_SOFTMAX,
    ROUTER_TOPK_SOFTMAX_BIASED,
    ModelArch,
    rope_parameters,
)
from common.model.loader import classifier_architecture, headless_architecture, num_labels
from common.model.parallel import SINGLE, TensorParallel
from pdserve_kernels import reference
from pdserve_kernels.packed_weights import MXFP4_GROUP, ExpertWeights, Fp8Weights, IntWeights, Mxfp4Weights
from pdserve_kernels.reference import NORM_LLAMA

if TYPE_CHECKING:
    from common.model.mla import MLAttention

_ONE_ROPE = "all_layers"  # the key of a model's one RoPE (``LlamaForCausalLM.rotary_embs``)
_NO_ROPE = "no_rope"  # the key of the layers without RoPE (``NoRotation``)
# Stacked projections: each fused module's weight (and bias) is its checkpoint parts', in this order.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass
class AttentionMetadata:
    slot_mapping: Tensor  # [num_tokens] int64
    block_tables: Tensor  # [num_seqs, max_num_blocks] int32
    query_start_loc: Tensor  # [num_seqs + 1] int32
    context_lens: Tensor  # [num_seqs] int32, tokens in cache after this step's store
    max_query_len: int
    # The same two on the host, where the runner has them (an attention that splits a step by sequence reads
    # them there: reading the device's would wait for everything queued before it).
    host_query_start_loc: Tensor | None = None
    host_context_lens: Tensor | None = None
    # Per token, the position of the last key it sees where a step's prompt chunk holds an image whose tokens
    # attend to each other both ways (``ModelRunner.key_limits``); None: causal.
    key_limits: Tensor | None = None

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


class RMSNorm(nn.Module):
    """Llama's RMSNorm, or in another ``form`` (``pdserve_kernels.reference.NORM_*``) Gemma's, scaled by
    ``1 + weight`` before the cast back, OLMo's, by the weight before it, or Cohere's LayerNorm (centred)."""

    def __init__(self, size: int | tuple[int, int], eps: float, form: int = NORM_LLAMA,
                 kernels: ModuleType | None = None, bias: bool = False, weightless: bool = False) -> None:
        """``size``: the normalized width, or ``(heads, width)`` for a weight per head; ``bias``: the LayerNorm
        form's (torch's LayerNorm, StarCoder2's); ``weightless``: no weight in the checkpoint (OLMo 1's
        LayerNorm), met with ones instead, which leaves every entry as it is, through the same kernels."""
        super().__init__()
        self.weight: Tensor
        if weightless:
            with torch.device("cpu"):  # real values where the model is built on the meta device (as RotaryEmbedding)
                self.register_buffer("weight", torch.ones(size), persistent=False)
        else:
            self.weight = nn.Parameter(torch.ones(size))
        self.bias = nn.Parameter(torch.zeros(size)) if bias else None
        self.eps = eps
        self.form = form
        # The kernels' ``rms_norm``: the torch formula, or on a GPU one Triton kernel for its eight operations.
        self.kernels = kernels or reference

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.kernels.rms_norm(x, self.weight, self.eps, self.form, self.bias)
        return out

    def add(self, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        """``x`` added to the residual stream (none yet: ``x`` is the stream), normalized: ``(normed,
        stream)``; on a GPU the sum and the norm are one kernel (``add_rms_norm``)."""
        if residual is None:
            return self(x), x
        out: tuple[Tensor, Tensor] = self.kernels.add_rms_norm(x, residual, self.weight, self.eps, self.form, self.bias)
        return out


def _rope_inv_freq(config: Any, rotary_dim: int, layer_type: str | None = None,
                   ntk_alpha: bool = False) -> tuple[Tensor, float]:
    """``ntk_alpha``: the config's RoPE is Hunyuan's fixed-alpha one (``ModelArch.rope_type``)."""
    params = rope_parameters(config)
    if layer_type is not None:  # a RoPE per layer type (``ModelArch.rope_layer_types``)
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)), 1.0
    if ntk_alpha:  # Hunyuan: only the base changes
        base = params["rope_theta"] * params["alpha"] ** (rotary_dim / (rotary_dim - 2))
        return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[rope_type]
    inv_freq, scaling = init(config, None) if layer_type is None else init(config, None, layer_type=layer_type)
    return inv_freq, float(scaling)


class RotaryEmbedding(nn.Module):
    """Each step's cos/sin, computed from the positions as transformers computes them per call (float32 products
    and cos/sin, times the attention scaling, then the caller's dtype); of one layer type's RoPE where the family
    has one per type; ``rotary_dim`` wide (a head's width, or the part of it a partial RoPE rotates). No table
    over the model's positions is kept: Llama 4 Scout's 10M positions would take gigabytes before the KV cache
    were even sized."""

    def __init__(self, config: Any, rotary_dim: int, layer_type: str | None = None, ntk_alpha: bool = False) -> None:
        super().__init__()
        # Computed for real even where the model is built on the meta device (its buffers are not
        # loaded from the checkpoint); on meta these operations would also import torch._dynamo (~4 s).
        with torch.device("cpu"):
            inv_freq, self.scaling = _rope_inv_freq(config, rotary_dim, layer_type, ntk_alpha)
        self.inv_freq: Tensor  # float32 whatever the model's dtype (``LlamaForCausalLM.float32_buffers``)
        self.register_buffer("inv_freq", torch.cat((inv_freq, inv_freq)).float(), persistent=False)

    def _cos_sin(self, freqs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return (freqs.cos() * self.scaling).to(dtype)[:, None, :], (freqs.sin() * self.scaling).to(dtype)[:, None, :]

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The positions' cos and sin in ``dtype``, ``[num_tokens, 1, rotary_dim]``: once per forward, for
        every layer (per layer they were four more kernel launches each)."""
        return self._cos_sin(positions.float()[:, None] * self.inv_freq[None, :], dtype)

    def cos_sin_sections(self, positions: Tensor, columns: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """M-RoPE's: ``positions`` ``[3, num_tokens]`` (time, height, width), each column of the rotation turned by
        the position of its section (``columns``: the component of each of the ``rotary_dim`` columns), as
        transformers' Qwen2.5-VL recomposes its frequencies."""
        return self._cos_sin(positions[columns].T.float() * self.inv_freq[None, :], dtype)


class NoRotation(nn.Module):
    """RoPE's place in a layer that applies none (SmolLM3's ``no_rope_layers``): cos 1 and sin 0, which
    leave q and k as they are, through the same kernels as every other layer's."""

    def __init__(self, head_size: int) -> None:
        super().__init__()
        self.cos: Tensor
        self.sin: Tensor
        with torch.device("cpu"):  # real values where the model is built on the meta device (as RotaryEmbedding)
            self.register_buffer("cos", torch.ones(1, head_size), persistent=False)
            self.register_buffer("sin", torch.zeros(1, head_size), persistent=False)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        rows = torch.zeros_like(positions)
        return self.cos[rows].to(dtype)[:, None, :], self.sin[rows].to(dtype)[:, None, :]


def _sharded(tp: TensorParallel | None) -> TensorParallel | None:
    """``tp`` where it has more than one rank, else None: a single process's modules hold everything and
    sum nothing, their forward the one they had before tensor parallelism (one ``is None`` test more)."""
    return tp if tp is not None and tp.size > 1 else None


class Attention(nn.Module):
    def __init__(self, config: Any, arch: ModelArch, layer_idx: int, kernels: ModuleType,
                 tp: TensorParallel | None = None) -> None:
        """``tp``: the layer holds its rank's share of the query and KV heads (their q/k/v rows, their columns
        of ``o_proj``), and the output is summed over the ranks."""
        super().__init__()
        self.tp = _sharded(tp)
        size = 1 if self.tp is None else self.tp.size
        heads = config.num_attention_heads
        self.num_heads = heads // size
        # Fewer KV heads than ranks: each rank holds the one its query heads read (replicated, as vLLM does).
        self.total_kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.num_kv_heads = max(1, self.total_kv_heads // size)
        self.head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.scale = arch.attention_multiplier or (arch.query_pre_attn_scalar or self.head_size) ** -0.5
        self.soft_cap = arch.attn_soft_cap
        hidden = config.hidden_size
        self.q_size, self.kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        # q, k and v in one matrix product (the checkpoint's three matrices stacked: ``FUSED_PROJECTIONS``).
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.clip_qkv = arch.clip_qkv  # OLMo 1's: q, k and v clamped (one clamp of their stacked product)
        self.o_proj = nn.Linear(self.num_heads * self.head_size, hidden, bias=arch.o_bias)
        # AFMoE: a sigmoid gate over the attention's output, from the layer's input (checkpoints: ``gate_proj``).
        self.output_gate = nn.Linear(hidden, self.q_size, bias=False) if arch.attn_output_gate else None
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        # Per head (Qwen3, Gemma 3), or across all heads at once (OLMo: one norm of q_size, one of kv_size).
        self.qk_norm_full_width = arch.qk_norm_full_width
        if arch.qk_norm or arch.qk_norm_full_width:
            q_width, k_width = (
                (self.q_size, self.kv_size) if arch.qk_norm_full_width
                else ((self.num_heads, self.head_size), (self.num_kv_heads, self.head_size)) if arch.qk_norm_per_head
                else (self.head_size, self.head_size))
            # Persimmon's LayerNorms of q and k have a bias too.
            self.q_norm = RMSNorm(q_width, arch.norm_eps, arch.norm_form, kernels, arch.qk_norm_bias)
            self.k_norm = RMSNorm(k_width, arch.norm_eps, arch.norm_form, kernels, arch.qk_norm_bias)
        # Hunyuan's norms after RoPE, under its checkpoints' names; Llama 4's, without a weight, where it rotates.
        self.query_layernorm: RMSNorm | None = None
        self.key_layernorm: RMSNorm | None = None
        weightless = arch.qk_norm_weightless_after_rope and layer_idx not in arch.no_rope_layers
        if arch.qk_norm_after_rope or weightless:
            self.query_layernorm = RMSNorm(self.head_size, arch.norm_eps, kernels=kernels, weightless=weightless)
            self.key_layernorm = RMSNorm(self.head_size, arch.norm_eps, kernels=kernels, weightless=weightless)
        self.sliding_window = arch.sliding_windows[layer_idx]
        self.attention_chunk = arch.attention_chunks[layer_idx] if arch.attention_chunks else None
        # gpt-oss: a sink logit per query head, in every softmax of the layer.
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if arch.attention_sinks else None
        self.layer_idx = layer_idx
        self.kernels = kernels

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], meta: AttentionMetadata, kv_layer: Tensor,
                q_scale: Tensor | None = None) -> Tensor:
        """``rope``: the step's cos and sin (``RotaryEmbedding.cos_sin``); ``q_scale``: each token's factor
        for its rotated queries (Ministral 3's, Llama 4's: ``LlamaForCausalLM.query_scales``), None for none."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        q, k = qkv[:, :q_end], qkv[:, q_end:k_end]  # views of the product's columns
        if self.qk_norm_full_width and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(n, self.num_heads, self.head_size)
        k = k.view(n, self.num_kv_heads, self.head_size)
        v = qkv[:, k_end:].view(n, self.num_kv_heads, self.head_size)
        if not self.qk_norm_full_width and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.query_layernorm is not None and self.key_layernorm is not None:  # rotate, norm, then store
            q, k = self.kernels.rope(q, k, *rope)
            q, k = self.query_layernorm(q), self.key_layernorm(k)
            self.kernels.store_kv(k, v, kv_layer, meta.slot_mapping)
        else:
            q = self.kernels.rope_and_store(q, k, v, *rope, kv_layer, meta.slot_mapping)  # on a GPU, one kernel
        if q_scale is not None:  # (Llama 4's float32 factor: the product rounded once)
            q = (q * q_scale).to(q.dtype)
        if meta.decode_only:
            o = self.kernels.paged_decode_attention(
                q, kv_layer, meta.block_tables, meta.context_lens, self.scale, sliding_window=self.sliding_window,
                soft_cap=self.soft_cap, attention_chunk=self.attention_chunk, **self._sinks(),
            )
        else:
            o = self.kernels.paged_prefill_attention(
                q, kv_layer, meta.block_tables, meta.query_start_loc, meta.context_lens, self.scale,
                sliding_window=self.sliding_window, soft_cap=self.soft_cap, key_limits=meta.key_limits,
                attention_chunk=self.attention_chunk, **self._sinks(),
            )
        o = o.reshape(n, self.num_heads * self.head_size)
        if self.output_gate is not None:
            o = o * torch.sigmoid(self.output_gate(x))
        out: Tensor = self.o_proj(o)
        return out if self.tp is None else self.tp.all_reduce(out)  # this rank's heads' share, summed

    def _sinks(self) -> dict[str, Tensor]:
        """The kernels' ``sinks`` argument where the layer has them (no argument otherwise)."""
        return {} if self.sinks is None else {"sinks": self.sinks}


def _relu2(x: Tensor) -> Tensor:
    """transformers' relu2 (Arcee's): the ReLU, then its square."""
    return torch.square(F.relu(x))


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_new(x: Tensor) -> Tensor:
    """GELU's tanh approximation by transformers' formula (``NewGELUActivation``, Phi's), operation by operation."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


_UNGATED: dict[str, Callable[[Tensor], Tensor]] = {
    "relu2": _relu2, "gelu_pytorch_tanh": _gelu_tanh, "gelu_new": _gelu_new, "gelu": F.gelu,
}


class MLP(nn.Module):
    def __init__(self, config: Any, arch: ModelArch, kernels: ModuleType | None = None, inter: int | None = None,
                 tp: TensorParallel | None = None, reduce: bool = True) -> None:
        """``inter``: the width of its gate and up, where not the config's ``intermediate_size`` (a shared expert;
        Falcon's ``ffn_hidden_size``, ``ModelArch.mlp_width``). ``tp``: it holds its rank's share of that width
        (rows of gate and up, columns of down), its output summed over the ranks unless not ``reduce`` (a
        shared expert, whose mixture sums its share with the experts' in one reduction)."""
        super().__init__()
        sharded = _sharded(tp)
        self.tp = sharded if reduce else None
        hidden, inter = config.hidden_size, inter or arch.mlp_width or config.intermediate_size
        inter //= 1 if sharded is None else sharded.size
        bias = arch.mlp_bias
        self.inter = inter
        # Without a gate, down(act(up(x))): Arcee's squared ReLU, Apertus's xIELU, StarCoder2's GELU (tanh
        # approximation), Phi's (by transformers' formula), GPT-NeoX's (exact).
        self.act_fn: Callable[[Tensor], Tensor] | None = (
            XIELU() if arch.activation == "xielu" else _UNGATED.get(arch.activation))
        if self.act_fn is not None:
            self.up_proj = nn.Linear(hidden, inter, bias=bias)
        else:
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)  # gate and up stacked, one product
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.gelu = arch.activation == "gelu_tanh"
        # The kernels' ``silu_mul``: the torch formula, or on a GPU one Triton kernel for its two operations.
        self.kernels = kernels or reference

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor
        if self.act_fn is not None:
            out = self.down_proj(self.act_fn(self.up_proj(x)))
        else:
            gate_up = self.gate_up_proj(x)
            if not self.gelu:
                out = self.down_proj(self.kernels.silu_mul(gate_up))
            else:
                gate, up = gate_up[..., : self.inter], gate_up[..., self.inter :]
                out = self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class XIELU(nn.Module):
    """Apertus's xIELU activation, as transformers computes it (its torch formula): learned ``alpha_p`` and
    ``alpha_n`` (through a softplus) and the checkpoint's ``beta`` and ``eps``; for x > 0,
    alpha_p x^2 + beta x, else (expm1(min(x, eps)) - x) alpha_n' + beta x, alpha_n' = beta + softplus(alpha_n)."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.empty(1))
        self.alpha_n = nn.Parameter(torch.empty(1))
        self.beta = nn.Parameter(torch.empty(()))
        self.eps = nn.Parameter(torch.empty(()))

    def forward(self, x: Tensor) -> Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)


def frozen_parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """A parameter without gradients, so that the loader checks and assigns it as it does every weight."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Experts(nn.Module):
    """A mixture's experts, each a gated MLP, their weights stacked: ``gate_up_proj`` ``[E, 2I, H]`` (each
    expert's gate and up, as ``MLP.gate_up_proj``), ``down_proj`` ``[E, H, I]``; transformers' layout, into
    which ``common.model.weights.stack_experts`` stacks a checkpoint's experts as it loads them.

    Either projection's weights may stay quantized as the checkpoint holds them (``hold_int``, ``hold_fp8``,
    ``hold_mxfp4``), for kernels that widen them as they multiply (``common.model.packed_linear``); ``weights`` gives
    each as ``moe_experts`` takes it."""

    PROJECTIONS = ("gate_up_proj", "down_proj")

    def __init__(self, num_experts: int, hidden: int, inter: int, bias: bool = False) -> None:
        """``bias``: each projection with a bias (gpt-oss), ``gate_up_proj_bias`` ``[E, 2I]`` and
        ``down_proj_bias`` ``[E, H]``."""
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None
        self.bits: dict[str, int] = {}  # a projection's bits per value, where its weights are packed integers
        self.fp8: set[str] = set()  # projections whose weights are block-wise FP8
        self.mxfp4: set[str] = set()  # projections whose weights are MXFP4 (gpt-oss's)

    def hold_int(self, projection: str, bits: int, groups: int, scales_dtype: torch.dtype) -> None:
        """``projection``'s weights as packed integers of ``bits`` in ``groups`` contiguous groups of inputs
        (``IntWeights``' layout): ``<projection>_qweight`` ``[E, out, in * bits / 32]`` int32, ``_qzeros`` (uint8) and
        ``_scales`` (``scales_dtype``) ``[E, out, groups]``, in its ``[E, out, in]`` weight's place."""
        experts, out, inputs = getattr(self, projection).shape
        if bits not in (2, 4, 8) or inputs % (32 // bits) or inputs % groups:
            raise ValueError(f"{projection}: {inputs} inputs are not whole words of {bits}-bit values in {groups} groups")
        delattr(self, projection)
        setattr(self, f"{projection}_qweight", frozen_parameter(experts, out, inputs * bits // 32, dtype=torch.int32))
        setattr(self, f"{projection}_qzeros", frozen_parameter(experts, out, groups, dtype=torch.uint8))
        setattr(self, f"{projection}_scales", frozen_parameter(experts, out, groups, dtype=scales_dtype))
        self.bits[projection] = bits

    def hold_fp8(self, projection: str, grid: tuple[int, int]) -> None:
        """``projection``'s weights in 8 bits (e4m3, held as their bytes, as ``Fp8Linear``'s) with a float32 scale per
        block of a ``grid`` over each expert's (``<projection>_scale_inv`` ``[E, *grid]``)."""
        experts, out, inputs = getattr(self, projection).shape
        if out % grid[0] or inputs % grid[1]:
            raise ValueError(f"{projection}: a {out} x {inputs} weight does not split into {grid[0]} x {grid[1]} blocks")
        setattr(self, projection, frozen_parameter(experts, out, inputs, dtype=torch.uint8))
        setattr(self, f"{projection}_scale_inv", frozen_parameter(experts, *grid, dtype=torch.float32))
        self.fp8.add(projection)

    def hold_mxfp4(self, projection: str) -> None:
        """``projection``'s weights in MXFP4, as gpt-oss's checkpoints hold them (``Mxfp4Weights``' layout):
        ``<projection>_blocks`` ``[E, out, in / 2]`` bytes of two e2m1 values and ``_scales`` ``[E, out, in / 32]``, each
        group's exponent, in its ``[E, out, in]`` weight's place."""
        experts, out, inputs = getattr(self, projection).shape
        if inputs % MXFP4_GROUP:
            raise ValueError(f"{projection}: {inputs} inputs are not whole groups of {MXFP4_GROUP}")
        delattr(self, projection)
        setattr(self, f"{projection}_blocks", frozen_parameter(experts, out, inputs // 2, dtype=torch.uint8))
        setattr(self, f"{projection}_scales", frozen_parameter(experts, out, inputs // MXFP4_GROUP, dtype=torch.uint8))
        self.mxfp4.add(projection)

    def weights(self, projection: str) -> ExpertWeights:
        """``projection``'s weights as ``moe_experts`` takes them: a tensor, or packed (``IntWeights``, ``Fp8Weights``)."""
        if projection in self.bits:
            return IntWeights(getattr(self, f"{projection}_qweight"), getattr(self, f"{projection}_qzeros"),
                              getattr(self, f"{projection}_scales"), self.bits[projection])
        if projection in self.mxfp4:
            return Mxfp4Weights(getattr(self, f"{projection}_blocks"), getattr(self, f"{projection}_scales"))
        weight: Tensor = getattr(self, projection)
        if projection in self.fp8:
            return Fp8Weights(weight.view(torch.float8_e4m3fn), getattr(self, f"{projection}_scale_inv"))
        return weight

    def extra_repr(self) -> str:
        packed = [f"{p}={self.bits[p]}-bit" for p in self.bits] + [f"{p}=fp8" for p in sorted(self.fp8)] + \
            [f"{p}=mxfp4" for p in sorted(self.mxfp4)]
        return ", ".join(packed)


# Routers that choose by score plus a correction bias (``e_score_correction_bias``, kept on the gate).
_CORRECTED_ROUTERS = (ROUTER_SIGMOID_GROUPS, ROUTER_SIGMOID, ROUTER_SOFTMAX_CORRECTED)


class SparseMoE(nn.Module):
    """A mixture of experts in the MLP's place: the router (``gate``) scores every expert and picks each
    token's ``experts_per_token`` best as the family's code does (``ModelArch.router``: a softmax, with or
    without a correction bias to the choice, or sigmoid scores with one), and the kernels' ``moe_experts``
    runs only those (the torch loop over the experts hit, or on a GPU one Triton grouped matrix product per
    projection); a shared expert is added, scaled by its gate in Qwen2-MoE."""

    def __init__(self, config: Any, arch: ModelArch, kernels: ModuleType, tp: TensorParallel | None = None) -> None:
        """``tp``: the router whole, each expert's (and the shared expert's) width this rank's share; the
        experts' and the shared expert's partial outputs added, then summed over the ranks at once (the shared
        expert's gate is a number per token, from the whole input, so it scales each rank's share alike)."""
        super().__init__()
        hidden = config.hidden_size
        self.tp = _sharded(tp)
        size = 1 if self.tp is None else self.tp.size
        # gpt-oss's router has a bias; its experts too, and an activation of their own.
        self.gate = nn.Linear(hidden, arch.num_experts, bias=arch.router == ROUTER_TOPK_SOFTMAX_BIASED)
        self.experts = Experts(arch.num_experts, hidden, arch.moe_intermediate_size // size, bias=arch.expert_bias)
        self.swiglu = (arch.swiglu_alpha, arch.swiglu_limit) if arch.expert_activation == "gpt_oss" else None
        self.top_k = arch.experts_per_token
        self.norm_topk_prob = arch.norm_topk_prob
        self.routing_weights_float32 = arch.routing_weights_float32
        self.router = arch.router
        if self.router in _CORRECTED_ROUTERS:  # a correction bias: the gate's own here
            self.gate.register_parameter("e_score_correction_bias", nn.Parameter(torch.zeros(arch.num_experts)))
        if self.router in (*_CORRECTED_ROUTERS, ROUTER_SOFTMAX_GROUPS):
            self.groups, self.topk_groups = arch.num_expert_groups, arch.topk_groups
            self.routed_scaling_factor = arch.routed_scaling_factor
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if arch.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, arch, kernels, inter=arch.shared_expert_intermediate_size, tp=tp,
                                     reduce=False)
            if arch.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.kernels = kernels

    def forward(self, x: Tensor) -> Tensor:
        routed_in = x  # each chosen expert's input (Llama 4's: scaled per expert, ``routed_inputs``)
        if self.router == ROUTER_SIGMOID_SCALED_INPUT:
            routed_in, ids, weights = self._routed_inputs(x)
        elif self.router in (ROUTER_SIGMOID_GROUPS, ROUTER_SIGMOID):
            weights, ids = self._sigmoid(x)
        elif self.router == ROUTER_SOFTMAX_CORRECTED:  # ERNIE 4.5: in float32, its weight kept so
            probs = torch.softmax(F.linear(x.float(), self.gate.weight.float()), dim=-1, dtype=torch.float32)
            ids = torch.topk(probs + self.gate.get_parameter("e_score_correction_bias"), self.top_k, dim=-1)[1]
            weights = probs.gather(1, ids)
            weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        elif self.router == ROUTER_SOFTMAX_GROUPS:
            weights, ids = self._softmax_groups(x)
        else:
            logits = self.gate(x)
            if self.router == ROUTER_TOPK_SOFTMAX:  # Granite: the top k logits, then a softmax over them
                top, ids = torch.topk(logits.float(), self.top_k, dim=-1)
                weights = torch.softmax(top, dim=-1)
            elif self.router == ROUTER_TOPK_SOFTMAX_BIASED:  # gpt-oss: the same, in the logits' dtype
                top, ids = torch.topk(logits, self.top_k, dim=-1)
                weights = torch.softmax(top, dim=-1, dtype=top.dtype)
            else:
                weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if not self.routing_weights_float32:
                weights = weights.to(logits.dtype)
        experts = self.experts
        out: Tensor = self.kernels.moe_experts(routed_in, ids, weights, experts.weights("gate_up_proj"),
                                               experts.weights("down_proj"), experts.gate_up_proj_bias,
                                               experts.down_proj_bias, self.swiglu)
        if routed_in is not x:  # a row per token and expert: each token's summed
            out = out.view(x.shape[0], self.top_k, -1).sum(dim=1)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out = out + (shared if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * shared)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _routed_inputs(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Llama 4's router: the top k logits, each one's sigmoid (in float32, rounded to the dtype) scaling the
        token's input to that expert; returns those inputs (a row per token and expert), each row's one expert,
        and weights of 1 (its output joins the sum as it is), as transformers computes them."""
        top, ids = torch.topk(self.gate(x), self.top_k, dim=-1)
        scores = torch.sigmoid(top.float()).to(x.dtype)
        routed_in = (x[:, None, :] * scores[..., None]).reshape(-1, x.shape[1])
        return routed_in, ids.reshape(-1, 1), torch.ones_like(scores).reshape(-1, 1)

    def _softmax_groups(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """DeepSeek-V2's router, in float32 as transformers computes it (its weight kept in float32): the k most
        probable experts, within the ``topk_groups`` groups whose best expert is most probable where there are
        groups (the others' probabilities 0 for the choice), weighed by probability, scaled, in float32."""
        probs = torch.softmax(F.linear(x.float(), self.gate.weight.float()), dim=-1, dtype=torch.float32)
        if self.groups > 1:
            num_tokens, num_experts = probs.shape
            grouped = probs.view(num_tokens, self.groups, num_experts // self.groups)
            best_groups = torch.topk(grouped.max(dim=-1).values, self.topk_groups, dim=-1, sorted=False)[1]
            allowed = torch.zeros_like(grouped[..., 0]).scatter_(1, best_groups, 1.0).bool()
            probs = grouped.masked_fill(~allowed[..., None], 0.0).view(num_tokens, num_experts)
        weights, ids = torch.topk(probs, self.top_k, dim=-1, sorted=False)
        return weights * self.routed_scaling_factor, ids

    def _sigmoid(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """GLM-4.5's router (DeepSeek-V3's), in float32 as transformers computes it (its weight and bias
        are kept in float32 whatever the model's dtype: ``LlamaForCausalLM.float32_parameters``), or
        MiniMax-M2's: its logits in the model's dtype, no groups (AFMoE's the same, scaled)."""
        bias: Tensor = self.gate.get_parameter("e_score_correction_bias")
        if self.router == ROUTER_SIGMOID:  # (AFMoE's: scaled; MiniMax-M2's scale is 1)
            scores = self.gate(x).float().sigmoid()
            ids = torch.topk(scores + bias, self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            return weights / weights.sum(dim=-1, keepdim=True) * self.routed_scaling_factor, ids
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        choice = scores + bias
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, self.groups, num_experts // self.groups)
        best_groups = torch.topk(grouped.topk(2, dim=-1)[0].sum(dim=-1), self.topk_groups, dim=-1, sorted=False)[1]
        allowed = torch.zeros_like(grouped[..., 0]).scatter_(1, best_groups, 1.0).bool()
        choice = grouped.masked_fill(~allowed[..., None], float("-inf")).view(num_tokens, num_experts)
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, arch: ModelArch, layer_idx: int, kernels: ModuleType,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.self_attn: Attention | MLAttention
        if arch.mla:  # DeepSeek's: its own module (``common.model.mla``), the layer's forward the same
            from common.model.mla import MLAttention

            self.self_attn = MLAttention(config, arch, layer_idx, kernels, tp)
        else:
            self.self_attn = Attention(config, arch, layer_idx, kernels, tp)
        self.mlp: MLP | SparseMoE = (
            SparseMoE(config, arch, kernels, tp) if layer_idx in arch.moe_layers else MLP(config, arch, kernels, tp=tp)
        )
        size, eps, form = config.hidden_size, arch.norm_eps, arch.norm_form

        def norm() -> RMSNorm:  # the layer's norms: all of one form, with a bias or not, with a weight or not
            return RMSNorm(size, eps, form, kernels, arch.norm_bias, arch.norm_weightless)

        # OLMo has no norm before a block: its checkpoints hold no input_layernorm.
        self.input_layernorm = None if arch.post_norms_only else norm()
        # Cohere's and Phi's layers have one norm, read by attention and MLP alike; GPT-NeoX's MLP (and the new
        # Falcon layer's) reads a norm of its own of the same stream.
        self.parallel = arch.parallel_block
        self.post_attention_layernorm = (
            None if arch.parallel_block and not arch.parallel_mlp_norm else norm())
        self.residual_multiplier = arch.residual_multiplier  # Granite: each block's output scaled
        self.parallel_sum_first = arch.parallel_sum_first
        # Gemma and GLM-4 normalize each block's output too: post_attention_layernorm then applies to the
        # attention's output, and the MLP gets a norm of its own on each side; OLMo only the one after.
        # (GLM-4's checkpoints name them otherwise: ``common.model.weights`` renames them as they load.)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if arch.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
        if arch.sandwich_norms or arch.post_norms_only:
            self.post_feedforward_layernorm = norm()

    def forward(
        self, x: Tensor, residual: Tensor | None, rope: tuple[Tensor, Tensor], meta: AttentionMetadata, kv_layer: Tensor,
        q_scale: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``x``: the last block's output, not yet added to ``residual``, the stream before it (None
        before the first layer: ``x`` is the stream). Returns this layer's last block's output and the
        stream before it: each addition is done by the norm that reads the sum (``RMSNorm.add``), the
        last by the model's final norm. The sums are the ones transformers computes, in its order."""
        if self.parallel:  # attention and MLP side by side on the stream
            assert self.input_layernorm is not None
            h, stream = self.input_layernorm.add(x, residual)
            attn = self.self_attn(h, rope, meta, kv_layer, q_scale)
            if self.post_attention_layernorm is not None:  # GPT-NeoX: the MLP's own norm of the stream
                h = self.post_attention_layernorm(stream)
            if self.parallel_sum_first:  # Phi, GPT-NeoX: attention + MLP, then + the stream (the next norm's sum)
                return attn + self.mlp(h), stream
            return self.mlp(h), stream + attn  # Cohere: the stream + attention, then + MLP, as transformers sums
        assert self.post_attention_layernorm is not None  # every layer but Cohere's and Phi's has one
        if self.input_layernorm is None:  # OLMo: each block reads the stream itself; its output is normed
            assert self.post_feedforward_layernorm is not None
            stream = x if residual is None else x + residual
            stream = stream + self.post_attention_layernorm(self.self_attn(stream, rope, meta, kv_layer, q_scale))
            return self.post_feedforward_layernorm(self.mlp(stream)), stream
        h, residual = self.input_layernorm.add(x, residual)
        attn = self.self_attn(h, rope, meta, kv_layer, q_scale)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            m = self.residual_multiplier  # Granite's; None elsewhere
            h, residual = self.post_attention_layernorm.add(attn if m is None else attn * m, residual)
            out = self.mlp(h)
            return (out if m is None else out * m), residual
        h, residual = self.pre_feedforward_layernorm.add(self.post_attention_layernorm(attn), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class LlamaBackbone(nn.Module):
    def __init__(self, config: Any, arch: ModelArch, kernels: ModuleType, tp: TensorParallel | None = None) -> None:
        super().__init__()
        # Given its weight, the embedding skips its random init, which on the meta device (where the model
        # is built before its weights are loaded) runs a Python reference that imports torch._dynamo (~2 s).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, arch, i, kernels, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, arch.norm_eps, arch.norm_form, kernels, arch.norm_bias,
                            arch.norm_weightless)


class LlamaForCausalLM(nn.Module):
    """Parameter names match Hugging Face checkpoints but for the projections stacked into one matrix
    product each (``FUSED_PROJECTIONS``), which ``common.model.weights.load_model`` stacks as it loads.

    With a ``TensorParallel`` of more than one rank (``tp``), each layer holds this rank's share
    (``common.model.parallel``) and sums its blocks' outputs over the ranks; the embeddings, norms and output
    head are whole, so every rank's forward returns the same hidden states. ``num_kv_heads`` is then this
    rank's (its KV cache's); a model that does not divide among the ranks is refused by name
    (``ModelArch.check_tensor_parallel``)."""

    def __init__(self, config: Any, kernels: ModuleType, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.arch = ModelArch.from_config(config)
        self.tp = tp or SINGLE
        self.arch.check_tensor_parallel(config, self.tp.size)
        self.model = LlamaBackbone(config, self.arch, kernels, tp)
        # A base model saved without its output head (``headless_architecture``: an embedding model) has none,
        # nor has a sequence classifier: they serve pooling requests only (``compute_logits`` gives zeros for
        # the token a pooling request drops). A classifier's ``score`` maps the last token's hidden state to
        # its labels' logits, without a bias, as transformers' ``...ForSequenceClassification``.
        self.headless = headless_architecture(config)
        self.classifier = classifier_architecture(config)
        self.vocab_size = int(config.vocab_size)
        self.lm_head: nn.Linear | None = None
        self.score: nn.Linear | None = None
        if self.classifier is not None:
            self.score = nn.Linear(config.hidden_size, num_labels(config), bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False)) and self.headless is None
        if self.headless is None:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=self.arch.lm_head_bias)
        if self.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn: Attention = self.model.layers[0].self_attn  # type: ignore[assignment]
        self.num_kv_heads: int = attn.num_kv_heads
        # The checkpoint's KV heads (``num_kv_heads`` times the ranks, or fewer: replicated over them).
        self.total_kv_heads: int = getattr(attn, "total_kv_heads", attn.num_kv_heads)
        self.head_size: int = attn.head_size
        # One RoPE, or one per layer type (Gemma 3): each computed once per forward, for its layers.
        per_type = self.arch.rope_layer_types
        kinds = tuple(_NO_ROPE if i in self.arch.no_rope_layers else kind
                      for i, kind in enumerate(per_type or (_ONE_ROPE,) * len(self.model.layers)))
        self.rotary_embs = nn.ModuleDict({
            kind: NoRotation(self.head_size) if kind == _NO_ROPE
            else RotaryEmbedding(config, self.arch.rotary_dim or self.head_size, kind if per_type else None,
                                 self.arch.rope_type == NTK_ALPHA)
            for kind in sorted(set(kinds))
        })
        self.layer_rope_kinds = kinds
        # The layers whose queries ``query_scales`` scales: Llama 4's without RoPE (its temperature), else all.
        self.query_scaled_layers = tuple(
            kind == _NO_ROPE or self.arch.query_temperature is None for kind in kinds)
        # M-RoPE's sections (Qwen2.5-VL: of each head's frequencies, in order time, height, width, both halves
        # alike): which of a token's three positions turns each column. None: one position per token.
        sections = rope_parameters(config).get("mrope_section") if not per_type else None
        columns = None
        if sections:
            if rope_parameters(config).get("mrope_interleaved"):  # Qwen3-VL's: t, h, w, t, h, w, ... then t
                half = [0] * ((self.arch.rotary_dim or self.head_size) // 2)
                for component in (1, 2):  # every third column from its own, within 3 x its section (and the width)
                    for column in range(component, min(3 * sections[component], len(half)), 3):
                        half[column] = component
            else:  # Qwen2.5-VL's: a run of each
                half = [i % 3 for i, n in enumerate(sections) for _ in range(n)]
            with torch.device("cpu"):
                columns = torch.tensor(half + half)
        self.mrope_columns: Tensor | None
        self.register_buffer("mrope_columns", columns, persistent=False)

    def float32_parameters(self) -> list[str]:
        """Parameters kept in float32 whatever the model's dtype, as transformers keeps them: GLM-4.5's
        and ERNIE 4.5's routers' weight and correction bias, AFMoE's correction bias."""
        names = []
        for name, module in self.named_modules():
            if not isinstance(module, SparseMoE):
                continue
            whole_router = module.router in (ROUTER_SIGMOID_GROUPS, ROUTER_SOFTMAX_CORRECTED, ROUTER_SOFTMAX_GROUPS)
            if whole_router:
                names.append(f"{name}.gate.weight")
            if module.router in _CORRECTED_ROUTERS and (whole_router or self.arch.router_bias_float32):
                names.append(f"{name}.gate.e_score_correction_bias")
        return names

    def float32_buffers(self) -> list[str]:
        """Buffers kept in float32 whatever the model's dtype: the RoPE frequencies, which transformers keeps in
        float32 and multiplies the positions by in float32."""
        return [f"rotary_embs.{name}" for name, _ in self.rotary_embs.named_buffers() if name.endswith("inv_freq")]

    def rope_tables(self, positions: Tensor, dtype: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
        """Each RoPE kind's cos and sin at ``positions``, in ``dtype``, or float32 where the family rotates
        in float32 (the tables' dtype is the rotation's): ERNIE 4.5's as computed, Cohere's rounded to
        ``dtype`` first, as transformers hands them over."""
        tables = {kind: cast(RotaryEmbedding, emb).cos_sin(positions, torch.float32 if self.arch.rope_tables_float32 else dtype)
                  for kind, emb in self.rotary_embs.items()}
        if self.arch.rope_float32 and not self.arch.rope_tables_float32:
            tables = {kind: (cos.float(), sin.float()) for kind, (cos, sin) in tables.items()}
        return tables

    def query_scales(self, positions: Tensor, dtype: torch.dtype) -> Tensor | None:
        """Ministral 3's factor for each token's rotated queries, ``[tokens, 1, 1]`` in ``dtype``, as
        transformers computes it: 1 + beta * log(1 + floor(position / original context)), 1 within the
        context it was trained on; Llama 4's attention temperature for its layers without RoPE, in float32
        (``ModelArch.query_temperature``); None for other families. ``query_scaled_layers`` says which
        layers take it."""
        if self.arch.query_temperature is not None:
            floor_scale, attn_scale = self.arch.query_temperature
            return (torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0)[:, None, None]
        beta = self.arch.query_scale_beta
        if beta is None:
            return None
        scale = 1 + beta * torch.log(1 + torch.floor(positions / self.arch.query_scale_positions))
        return scale.to(dtype)[:, None, None]

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_cache: Tensor,
                images: tuple[Tensor, Tensor] | None = None, rope_positions: Tensor | None = None) -> Tensor:
        """Hidden states ``[num_tokens, hidden]``; writes this step's K/V into ``kv_cache``. ``images``: rows
        of the input whose embeddings an image's features replace, and those features (an image-text model's
        image tokens: ``ModelRunner.image_rows``). ``rope_positions``: M-RoPE's three positions of each token
        ``[3, num_tokens]``, where a prompt's images make them differ from ``positions``."""
        x = self.model.embed_tokens(input_ids)
        if self.arch.embed_scale is not None:  # as transformers: the scale rounded to the weights' dtype
            # Rounded on the host and passed as a number: a device tensor made here would be a copy to
            # the device, which a CUDA graph capture cannot hold.
            x = x * float(torch.tensor(self.arch.embed_scale, dtype=x.dtype))
        if self.arch.embedding_multiplier is not None:  # Granite: the number as it is, as transformers
            x = x * self.arch.embedding_multiplier
        if images is not None:
            x = x.index_copy(0, images[0], images[1][:, :x.shape[1]])
        if rope_positions is None:
            ropes = self.rope_tables(positions, x.dtype)
        else:
            assert self.mrope_columns is not None, "three positions per token need M-RoPE's sections"
            columns = self.mrope_columns
            ropes = {kind: cast(RotaryEmbedding, emb).cos_sin_sections(rope_positions, columns, x.dtype)
                     for kind, emb in self.rotary_embs.items()}
        q_scale = self.query_scales(positions, x.dtype)
        scaled = self.query_scaled_layers
        residual: Tensor | None = None
        # Qwen3-VL's deepstack: the vision tower's earlier layers' features, one width each after the embeddings',
        # added to the image tokens' stream after each of the first layers (transformers' ``_deepstack_process``).
        deepstack = 0 if images is None else images[1].shape[1] // x.shape[1] - 1
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, ropes[self.layer_rope_kinds[i]], meta, kv_cache[i], q_scale if scaled[i] else None)
            if i < deepstack:
                assert images is not None and residual is not None
                width = x.shape[1]
                stream = (x + residual).index_add(0, images[0], images[1][:, width * (i + 1):width * (i + 2)])
                x, residual = stream, torch.zeros_like(stream)  # the sum made here, as transformers makes it
        return self.model.norm.add(x, residual)[0]

    @property
    def base_model_only(self) -> bool:
        """A base model saved alone (no head at all): its weights' names lack the causal LM's ``model.``."""
        return self.headless is not None and self.classifier is None

    def classify(self, hidden: Tensor) -> Tensor:
        """A sequence classifier's logits of final hidden states (``[rows, num_labels]``, float32): the
        ``score`` projection in the weights' dtype, as transformers computes it."""
        assert self.score is not None, "only a ...ForSequenceClassification checkpoint classifies (the engine checks)"
        return self.score(hidden).float()

    def compute_logits(self, hidden: Tensor) -> Tensor:
        if self.lm_head is None:  # headless: only pooling requests run, and drop their token
            return hidden.new_zeros(hidden.shape[0], self.vocab_size, dtype=torch.float32)
        logits = self.lm_head(hidden)
        if self.arch.logits_scaling is not None:  # Granite: in the weights' dtype, as transformers
            logits = logits / self.arch.logits_scaling
        if self.arch.logit_scale is not None:  # Cohere: the same, multiplied
            logits = logits * self.arch.logit_scale
        logits = logits.float()
        cap = self.arch.final_soft_cap
        return logits if cap is None else torch.tanh(logits / cap) * cap
