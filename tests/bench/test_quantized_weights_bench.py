"""``pdserve bench quantized-weights``: short runs on the default model, its GPTQ and FP8 weights packed beside
widened."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.bench import quantized_weights


def test_the_packed_weights_take_less_than_half_the_widened_and_compute_the_same(tmp_path: Path) -> None:
    out = tmp_path / "quantized-weights.json"
    assert quantized_weights.main(["--bits", "4", "--group", "64", "--prompt-len", "16", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["layers_quantized"] == 7 * 30 and result["products_packed"] == result["products"] == 4 * 30
    sizes = result["bytes"]
    assert sizes["unquantized"] == sizes["widened"] and sizes["packed"] < 0.5 * sizes["widened"]
    assert result["freed_kv_blocks_of_16"] > 0
    assert result["packed_equals_widened_max_abs"] == 0.0 and result["prompt_len"] == 16


def test_a_group_that_does_not_divide_a_projection_is_refused() -> None:
    with pytest.raises(SystemExit, match="--group 128 does not divide"):
        quantized_weights.main(["--group", "128"])


def test_fp8_weights_take_about_half_the_widened_and_compute_the_same(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    assert quantized_weights.main(["--format", "fp8", "--group", "64", "--prompt-len", "16", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["products_packed"] == result["products"] == 4 * 30
    sizes = result["bytes"]
    assert 0.5 * sizes["widened"] < sizes["packed"] < 0.65 * sizes["widened"]  # the embeddings stay 16-bit
    assert result["packed_equals_widened_max_abs"] == 0.0


@pytest.mark.parametrize(("fmt", "ratio"), [("gptq", 0.5), ("fp8", 0.65)])
def test_a_mixture_s_experts_stay_packed_too(tmp_path: Path, fmt: str, ratio: float) -> None:
    """A mixture (a tiny Qwen3-MoE: one dense layer, two of eight experts each), its experts quantized one by one:
    every product packed, each mixture's two stacks of experts too, the logits the widened model's."""
    from tests.engine.tiny_models import build_checkpoint, build_tokenizer, family_configs

    folder = build_checkpoint(family_configs()["qwen3-moe-dense-layer"], tmp_path / "moe")
    build_tokenizer(folder)
    out = tmp_path / "moe.json"
    assert quantized_weights.main(["--model", str(folder), "--format", fmt, "--group", "16", "--prompt-len", "16",
                                   "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # 3 layers of 4 attention projections; layers 0 and 2 of 8 experts' 3, layer 1 a dense MLP's 3.
    assert result["layers_quantized"] == 3 * 4 + 2 * 8 * 3 + 3
    # q/k/v stacked, o; the experts' two stacks, or gate/up stacked and down.
    assert result["products_packed"] == result["products"] == 3 * 2 + 3 * 2
    sizes = result["bytes"]
    assert sizes["packed"] < ratio * sizes["widened"]  # the tiny model's embeddings are a large part of it
    assert result["packed_equals_widened_max_abs"] == 0.0
