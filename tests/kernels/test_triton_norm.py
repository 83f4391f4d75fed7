"""RMSNorm's Triton kernel against the torch reference (transformers' formula), under the interpreter:
every dtype, the four forms (Llama's weight after the rounding, Gemma's ``1 + weight``, OLMo's
weight before it, and Cohere's LayerNorm, centred first), a 3-D input as the per-head query norms pass, a width that is no power of two, and
rows wider than one pass of the kernel; the reference's forms against transformers' own norms."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest
import torch

from pdserve_kernels import reference, triton_norm

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
FORMS = [reference.NORM_LLAMA, reference.NORM_GEMMA, reference.NORM_OLMO, reference.NORM_LAYER]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=gen) + 2).to(dtype)  # off centre, so that centring shows
    weight = (1 + 0.5 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, weight


def _ulps(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, form: int,
          bias: torch.Tensor | None = None) -> float:
    """The largest difference in units in the last place of what was rounded: of each output, and for the
    LayerNorm also of the mean it subtracted (scaled as the entry is), whose last bits depend on the order
    of the sum and carry into every entry, the more so where the entry cancels it; with a bias, also of the
    entry before the bias was added (where the bias cancels it, the output is smaller than its error)."""
    scale = want.float().abs()
    if bias is not None:
        scale = torch.maximum(scale, (want.float() - bias.float()).abs())
    if form == reference.NORM_LAYER:
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        scale = scale + (mean * torch.rsqrt((h - mean).pow(2).mean(-1, keepdim=True)) * weight.float()).abs()
    ulp = torch.finfo(want.dtype).eps * scale.clamp(min=torch.finfo(want.dtype).tiny)
    return ((got.float() - want.float()).abs() / ulp).max().item()


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(7, 576), (5, 3, 80), (2, 64)])
def test_the_kernel_normalizes_as_the_reference_does(dtype: torch.dtype, form: int, shape: tuple[int, ...]) -> None:
    x, weight = _inputs(shape, dtype, seed=len(shape) * 10 + shape[-1])
    got = triton_norm.rms_norm(x, weight, 1e-6, form)
    expected = reference.rms_norm(x, weight, 1e-6, form)
    assert got.shape == x.shape and got.dtype == expected.dtype == dtype
    # The same formula; the order of the float32 sum of squares (and the interpreter's square root) may
    # differ: at most two units in the last place of a 16-bit output, four of a float32 one (the scale's
    # own rounding carries into every entry there). The interpreter casts float32
    # to bfloat16 by truncation where a GPU rounds to nearest, so there bfloat16 differs more often.
    assert _ulps(got, expected, x, weight, form) <= (4.0 if dtype == F32 else 2.0)
    exact = (got == expected).float().mean().item()
    assert exact > {F32: 0.5, F16: 0.99, BF16: 0.2}[dtype], f"only {exact:.1%} of entries equal the reference's"


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_weight_per_head_meets_each_head_s_rows_as_cohere_s_q_and_k_norms(dtype: torch.dtype) -> None:
    """Command R+'s q and k LayerNorms: ``x`` ``[tokens, heads, d]`` and a weight ``[heads, d]``; the
    reference against transformers' ``CohereLayerNorm`` to the bit, the kernel against the reference."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    x, _ = _inputs((6, 3, 64), dtype, seed=8)
    weight = (1 + 0.5 * torch.randn(3, 64, generator=torch.Generator().manual_seed(9))).to(dtype)
    module = CohereLayerNorm((3, 64), eps=1e-5).to(dtype)
    with torch.no_grad():
        module.weight.copy_(weight)
        want = module(x)
    got = reference.rms_norm(x, weight, 1e-5, reference.NORM_LAYER)
    assert torch.equal(got, want)
    kernel = triton_norm.rms_norm(x[:, :, :], weight, 1e-5, reference.NORM_LAYER)
    assert _ulps(kernel, want, x, weight, reference.NORM_LAYER) <= 4.0
    # Each head met with its own weight: one weight for all would differ.
    assert not torch.equal(got, reference.rms_norm(x, weight[0].contiguous(), 1e-5, reference.NORM_LAYER))
    with pytest.raises(AssertionError, match="heads"):
        triton_norm.rms_norm(x, weight[:2].contiguous(), 1e-5, reference.NORM_LAYER)


@pytest.mark.parametrize("form", FORMS)
def test_rows_wider_than_one_pass_are_summed_over_every_pass(monkeypatch: pytest.MonkeyPatch, form: int) -> None:
    monkeypatch.setattr(triton_norm, "MAX_BLOCK", 64)  # 200 entries: four passes, the last a partial one
    x, weight = _inputs((3, 200), F32, seed=3)
    torch.testing.assert_close(triton_norm.rms_norm(x, weight, 1e-5, form), reference.rms_norm(x, weight, 1e-5, form))
    got, summed = triton_norm.add_rms_norm(x, x.flip(0), weight, 1e-5, form)
    torch.testing.assert_close(got, reference.rms_norm(x + x.flip(0), weight, 1e-5, form))


def test_a_row_slice_is_read_with_its_stride_and_bad_arguments_are_refused() -> None:
    x, weight = _inputs((6, 96), F32, seed=4)
    wide = torch.cat([x, x], dim=1)[:, :96]  # rows with a stride of 192
    torch.testing.assert_close(triton_norm.rms_norm(wide, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    assert triton_norm.rms_norm(x[:0], weight, 1e-5).shape == (0, 96)
    with pytest.raises(AssertionError, match="weight"):
        triton_norm.rms_norm(x, weight[:10], 1e-5)
    with pytest.raises(AssertionError, match="dtype"):
        triton_norm.rms_norm(x, weight.half(), 1e-5)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("max_block", [None, 64])  # one pass, or four (the sum read back from where it was written)
def test_the_residual_sum_is_rounded_as_torch_adds_and_then_normalized(
    dtype: torch.dtype, form: int, max_block: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if max_block is not None:
        monkeypatch.setattr(triton_norm, "MAX_BLOCK", max_block)
    x, weight = _inputs((7, 200), dtype, seed=5)
    residual = (10 * torch.randn(7, 200, generator=torch.Generator().manual_seed(6))).to(dtype)
    normed, summed = triton_norm.add_rms_norm(x, residual, weight, 1e-6, form)
    want_normed, want_summed = reference.add_rms_norm(x, residual, weight, 1e-6, form)
    if dtype != BF16:  # the interpreter truncates float32 to bfloat16 where torch (and a GPU) round
        assert torch.equal(summed, want_summed)
    limit = 4.0 if dtype == F32 else 2.0 if dtype == F16 else 4.0  # bfloat16: the truncated sum carries
    assert _ulps(normed, want_normed, want_summed, weight, form) <= limit
    assert normed.shape == summed.shape == x.shape and normed.dtype == summed.dtype == dtype


def test_the_residual_sum_refuses_a_residual_of_another_shape_or_dtype() -> None:
    x, weight = _inputs((3, 64), F32, seed=7)
    with pytest.raises(AssertionError, match="residual"):
        triton_norm.add_rms_norm(x, x[:2], weight, 1e-6)
    with pytest.raises(AssertionError, match="residual"):
        triton_norm.add_rms_norm(x, x.half(), weight, 1e-6)


def test_each_form_is_its_family_s_norm_in_transformers_to_the_bit() -> None:
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    x, weight = _inputs((64, 96), BF16, seed=7)
    outputs = {}
    for form, module in ((reference.NORM_LLAMA, LlamaRMSNorm(96, eps=1e-6)),
                         (reference.NORM_GEMMA, Gemma2RMSNorm(96, eps=1e-6)),
                         (reference.NORM_OLMO, Olmo2RMSNorm(96, eps=1e-6)),
                         (reference.NORM_LAYER, CohereLayerNorm(96, eps=1e-6))):
        module = module.to(BF16)
        with torch.no_grad():
            module.weight.copy_(weight)
            want = module(x)
        outputs[form] = reference.rms_norm(x, weight, 1e-6, form)
        assert torch.equal(outputs[form], want), form
    # In bfloat16 the forms round differently: no form stands in for another.
    assert not torch.equal(outputs[reference.NORM_LLAMA], outputs[reference.NORM_OLMO])
    # Off centre, the LayerNorm is no RMSNorm in any form.
    assert (outputs[reference.NORM_LAYER].float() - outputs[reference.NORM_OLMO].float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("add", [False, True])
def test_the_layer_norm_with_a_bias_is_torch_s_layer_norm(dtype: torch.dtype, add: bool) -> None:
    """StarCoder2's norms: torch's ``nn.LayerNorm``, a bias added in float32 before the one rounding. The
    kernel (alone, and after the residual sum) against the reference, and the reference against torch's
    own: the same formula, the mean and variance summed in another order (within two units in the last
    place of the output, and of the mean it subtracts)."""
    x, weight = _inputs((9, 200), dtype, seed=11)
    bias = (0.7 * torch.randn(200, generator=torch.Generator().manual_seed(12))).to(dtype)
    residual = (5 * torch.randn(9, 200, generator=torch.Generator().manual_seed(13))).to(dtype)
    if add:
        got, summed = triton_norm.add_rms_norm(x, residual, weight, 1e-5, reference.NORM_LAYER, bias)
        want, want_summed = reference.add_rms_norm(x, residual, weight, 1e-5, reference.NORM_LAYER, bias)
        rows = want_summed
    else:
        got = triton_norm.rms_norm(x, weight, 1e-5, reference.NORM_LAYER, bias)
        want = reference.rms_norm(x, weight, 1e-5, reference.NORM_LAYER, bias)
        rows = x
    assert _ulps(got, want, rows, weight, reference.NORM_LAYER, bias) <= 4.0
    # The bias is added: without it nearly every entry moves.
    moved = want.float() != reference.rms_norm(rows, weight, 1e-5, reference.NORM_LAYER).float()
    assert moved.float().mean() > 0.9
    torch_norm = torch.nn.LayerNorm(200, eps=1e-5).to(dtype)
    with torch.no_grad():
        torch_norm.weight.copy_(weight)
        torch_norm.bias.copy_(bias)
        theirs = torch_norm(rows)
    assert _ulps(want, theirs, rows, weight, reference.NORM_LAYER, bias) <= 2.0
    with pytest.raises(AssertionError, match="bias"):
        triton_norm.rms_norm(x, weight, 1e-5, reference.NORM_LLAMA, bias)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_a_layer_norm_without_weight_or_bias_is_the_layer_form_met_with_ones(dtype: torch.dtype) -> None:
    """OLMo 1's LayerNorm (no weight, no bias, in float32): the model runs it as the LayerNorm form with a
    weight of ones. Ones change nothing (torch's own LayerNorm gives the same bits with a weight of ones as
    without one); what is left is the form's formula against torch's, within two units in the last place as
    for the LayerNorm with a bias; the kernel against the reference as for any weight."""
    import torch.nn.functional as F
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    x, _ = _inputs((9, 200), dtype, seed=14)
    ones = torch.ones(200, dtype=dtype)
    h = x.float()
    assert torch.equal(F.layer_norm(h, (200,), ones.float(), None, 1e-5), F.layer_norm(h, (200,), None, None, 1e-5))
    want = OlmoLayerNorm(200)(x)
    got = reference.rms_norm(x, ones, 1e-5, reference.NORM_LAYER)
    assert _ulps(got, want, x, ones, reference.NORM_LAYER) <= 2.0
    kernel = triton_norm.rms_norm(x, ones, 1e-5, reference.NORM_LAYER)
    assert _ulps(kernel, got, x, ones, reference.NORM_LAYER) <= 4.0
    summed, stream = triton_norm.add_rms_norm(x, x.flip(0), ones, 1e-5, reference.NORM_LAYER)
    want_summed, want_stream = reference.add_rms_norm(x, x.flip(0), ones, 1e-5, reference.NORM_LAYER)
    assert _ulps(summed, want_summed, want_stream, ones, reference.NORM_LAYER) <= 4.0
