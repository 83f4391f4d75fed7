"""``pdserve bench offline``: the model FLOP count against a hand computation, and MFU in the report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ops.bench import offline
from ops.bench.model_flops import ModelShape, decode_token_flops, sequence_flops, workload_flops

# hidden 8, 2 query heads and 1 key/value head of dim 4, MLP 16, vocabulary 10, 2 layers.
DIMS: dict[str, Any] = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 4, "vocab_size": 10, "num_hidden_layers": 2}
# One token, one layer: q 8*2*4 + k 8*1*4 + v 8*1*4 + o 2*4*8 + gate, up, down 3*8*16 = 576 weights.
LAYER_WEIGHTS = 64 + 32 + 32 + 64 + 384


def _shape(sliding_window: int | None = None) -> ModelShape:
    from transformers import LlamaConfig, MistralConfig

    config = LlamaConfig(**DIMS) if sliding_window is None else MistralConfig(**DIMS, sliding_window=sliding_window)
    return ModelShape.from_config(config)


def test_layer_weights_are_the_seven_projections() -> None:
    assert _shape().layer_matmul_params == LAYER_WEIGHTS


def test_a_mixture_of_experts_counts_the_experts_a_token_is_routed_to() -> None:
    from transformers import Qwen2MoeConfig

    # Layer 1 of 2 a mixture (decoder_sparse_step 2): 2 of 6 experts 4 wide, a shared expert 12 wide.
    config = Qwen2MoeConfig(**DIMS, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=4,
                            shared_expert_intermediate_size=12, decoder_sparse_step=2)
    shape = ModelShape.from_config(config)
    attention = 64 + 32 + 32 + 64
    # router 8*6, two experts 2*3*8*4, shared expert 3*8*12 and its gate 8*1
    moe_layer = attention + 48 + 192 + 288 + 8
    assert shape.moe_layers == (1,) and shape.moe_layer_matmul_params == moe_layer
    assert shape.matmul_params == LAYER_WEIGHTS + moe_layer
    assert sequence_flops(shape, 1, 0) == 2 * (LAYER_WEIGHTS + moe_layer) + 2 * 4 * 2 * 4


def test_flops_of_a_sequence_equal_the_hand_count_with_full_attention() -> None:
    # 5 tokens, logits for 2 of them. Token i (1-based) attends to i keys: 1+2+3+4+5 = 15.
    linear = 2 * 5 * 2 * LAYER_WEIGHTS  # 11,520
    attention = 2 * (4 * 2 * 4 * 15)  # QK^T and PV, 2 heads of dim 4, both layers: 960
    logits = 2 * 2 * 8 * 10  # 320
    assert sequence_flops(_shape(), 5, 2) == linear + attention + logits == 12_800


def test_a_sliding_window_caps_each_tokens_context() -> None:
    # Window 3 on every layer: token i attends to min(i, 3) keys: 1+2+3+3+3 = 12.
    assert sequence_flops(_shape(sliding_window=3), 5, 2) == 11_520 + 2 * (4 * 2 * 4 * 12) + 320 == 12_608


def test_workload_flops_equal_a_prefill_then_one_token_decode_steps() -> None:
    """The count does not depend on how the engine splits a sequence into steps."""
    shape = _shape(sliding_window=3)
    # A 4-token prompt asking for 3 tokens: the prefill samples the first, two decode steps the rest.
    by_steps = sequence_flops(shape, 4, 1) + decode_token_flops(shape, 5) + decode_token_flops(shape, 6)
    assert workload_flops(shape, [(4, 3)]) == by_steps
    assert workload_flops(shape, [(4, 3), (2, 1)]) == by_steps + sequence_flops(shape, 2, 1)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    from tests.engine.tiny_models import TINY_DIMS, build_checkpoint, build_tokenizer

    # Long enough a context for the benchmark's prompts (up to 500) and outputs (up to 256).
    folder = build_checkpoint(LlamaConfig(**{**TINY_DIMS, "max_position_embeddings": 1024}),
                              tmp_path_factory.mktemp("tiny-llama"))
    build_tokenizer(folder)
    return folder


def test_the_report_prints_and_saves_the_engine_mfu(tiny_llama: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "offline.json"
    args = ["--model", str(tiny_llama), "--device", "cpu", "--num-requests", "3", "--skip-baselines",
            "--num-blocks", "256", "--json", str(out)]
    assert offline.main(args) == 0
    table = capsys.readouterr().out
    # The retired target's wording is gone (a ratio may well print as "0.10x": that is no target).
    assert "engine MFU" in table and "GEMM peak" in table and "target >= 10x" not in table
    report = json.loads(out.read_text())
    mfu = report["mfu"]
    workload = offline.build_workload(3, 0, 128, {0, 1, 2})
    shape = ModelShape.from_config(_config(tiny_llama))
    assert mfu["model_flops"] == workload_flops(shape, ((len(r.prompt_token_ids), r.max_tokens) for r in workload))
    assert mfu["engine_flops_per_s"] == pytest.approx(mfu["model_flops"] / report["engine"]["duration_s"])
    assert mfu["engine_mfu"] == pytest.approx(mfu["engine_flops_per_s"] / mfu["gemm_peak"]["flops_per_s"])
    assert report["ratios"]["engine_mfu"] == mfu["engine_mfu"]
    assert 0 < mfu["engine_mfu"] < 1  # a tiny model on the CPU is far from the matmul peak
    assert mfu["gemm_peak"]["shape"] == [offline.GEMM_ROWS, 64, 128]  # (tokens, hidden) @ (hidden, MLP)
    assert mfu["gemm_peak"]["threads"] == report["machine"]["torch_threads"]
    assert "vs_static" not in report["ratios"]["targets"]


def _config(folder: Path) -> object:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))
