"""A mixture's experts in Triton (``triton_moe.moe_experts``) against the torch reference, under the
interpreter: every dtype, routing weights in float32 or the dtype, widths that are no multiple of a
tile, experts no token chose, one expert and one slot, and more pairs than a decode step has (the
wider row tile); experts' weights kept quantized (packed integers, FP8 blocks, MXFP4); and the grouping of pairs by expert
that both products read."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest
import torch

from common.model.quantization import IntValues
from pdserve_kernels import reference, triton_moe
from pdserve_kernels.packed_weights import (
    Fp8Weights,
    IntWeights,
    Mxfp4Weights,
    expert_count,
    expert_weight,
    widen_mxfp4,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int, used: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` distinct experts among the first ``used``, and softmax-like weights."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, used or num_experts, generator=gen)
    weights, ids = torch.topk(scores.softmax(-1), top_k, dim=-1)
    return ids, weights


@pytest.mark.parametrize(("num_tokens", "hidden", "inter", "num_experts", "top_k", "used"), [
    (1, 16, 8, 1, 1, None),  # one expert, one slot
    (7, 48, 40, 4, 2, None),  # widths no multiple of a tile
    (37, 96, 72, 8, 3, 5),  # three of the experts chosen by no token
    (530, 32, 24, 6, 2, None),  # more than 1,024 pairs: 64-row tiles
])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_the_kernel_computes_the_reference(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                                           used: int | None, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(hidden + num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    ids, weights = _routing(num_tokens, num_experts, top_k, seed=num_tokens, used=used)
    for routing_dtype in {F32, dtype}:  # Mixtral keeps its weights in float32, Qwen rounds them
        got = triton_moe.moe_experts(x, ids, weights.to(routing_dtype), w13, w2)
        want = reference.moe_experts(x, ids, weights.to(routing_dtype), w13, w2)
        assert got.shape == want.shape == x.shape and got.dtype == dtype
        # The products' sums go in another order than torch's; each term and sum is rounded as the
        # reference rounds it.
        tol = {F32: 1e-5, F16: 2e-3, BF16: 2e-2}[dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def _int_experts(num_experts: int, out: int, inputs: int, group: int, bits: int, scales_dtype: torch.dtype,
                 seed: int) -> IntWeights:
    """Random packed integer weights for each expert (``IntValues.pack``'s layout, stacked)."""
    gen = torch.Generator().manual_seed(seed)
    packed = []
    for _ in range(num_experts):
        q = torch.randint(0, 1 << bits, (out, inputs), generator=gen, dtype=torch.int32)
        zeros = torch.randint(0, 1 << bits, (out, inputs // group), generator=gen, dtype=torch.int32)
        scales = ((torch.rand(out, inputs // group, generator=gen) + 0.5) * 4 / inputs**0.5 / (1 << bits)).to(scales_dtype)
        packed.append(IntValues(q, zeros, scales, None, bits).checked().pack())
    return IntWeights(*(torch.stack([p[name] for p in packed]) for name in ("qweight", "qzeros", "scales")), bits)


def _fp8_experts(num_experts: int, out: int, inputs: int, block: tuple[int, int], seed: int) -> Fp8Weights:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(num_experts, out, inputs, generator=gen) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = (out // block[0], inputs // block[1])
    return Fp8Weights(weight, (torch.rand(num_experts, *grid, generator=gen) + 0.5) * 0.04 / inputs**0.5)


def _mxfp4_experts(num_experts: int, out: int, inputs: int, seed: int) -> Mxfp4Weights:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (num_experts, out, inputs // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    # Each group's power of two about 1 / sqrt(inputs) over the values' ~2.
    exponent = round(-0.5 * torch.log2(torch.tensor(float(inputs))).item()) - 2 + 127
    scales = torch.randint(exponent - 1, exponent + 2, (num_experts, out, inputs // 32), generator=gen,
                           dtype=torch.int32).to(torch.uint8)
    return Mxfp4Weights(blocks, scales)


def _widened(weights: IntWeights | Fp8Weights | Mxfp4Weights, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([expert_weight(weights, e, dtype) for e in range(expert_count(weights))])


# Each form in every dtype over a decode step's tokens, and in bfloat16 over a prefill chunk's.
_PACKED_CASES = [(form, dtype, dtype, tokens, used) for form in ("int2", "int4", "int8", "fp8", "fp8+bf16-down", "mxfp4")
                 for dtype, tokens, used in ((F32, 3, None), (F16, 3, None), (BF16, 3, None), (BF16, 300, 5))]


@pytest.mark.parametrize(("quantization", "dtype", "scales_dtype", "num_tokens", "used"), _PACKED_CASES)
def test_packed_experts_multiply_as_their_widened_weights(num_tokens: int, used: int | None, quantization: str,
                                                          dtype: torch.dtype, scales_dtype: torch.dtype) -> None:
    """Each projection's weights kept quantized (integers in groups, FP8 in blocks; one projection packed and the
    other widened): the torch reference widens each expert hit as the loader widens a checkpoint, so it equals
    itself over the widened weights exactly; so does the Triton kernel, which widens each tile as it reads it, and
    it equals the reference but for the order of its sums."""
    num_experts, hidden, inter, top_k = 6, 96, 64, 2
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    ids, weights = _routing(num_tokens, num_experts, top_k, seed=num_tokens, used=used)
    w13: IntWeights | Fp8Weights | Mxfp4Weights | torch.Tensor
    w2: IntWeights | Fp8Weights | Mxfp4Weights | torch.Tensor
    if quantization.startswith("int"):
        bits = int(quantization[3:])
        w13 = _int_experts(num_experts, 2 * inter, hidden, 32, bits, scales_dtype, seed=1)
        w2 = _int_experts(num_experts, hidden, inter, 16, bits, scales_dtype, seed=2)
    elif quantization == "mxfp4":
        w13, w2 = _mxfp4_experts(num_experts, 2 * inter, hidden, seed=1), _mxfp4_experts(num_experts, hidden, inter, 2)
    else:
        w13 = _fp8_experts(num_experts, 2 * inter, hidden, (32, 32), seed=1)
        w2 = _fp8_experts(num_experts, hidden, inter, (16, 32), seed=2)
        if quantization.endswith("bf16-down"):  # a projection left unquantized, the other packed
            w2 = _widened(w2, dtype)
    wide13 = _widened(w13, dtype) if not isinstance(w13, torch.Tensor) else w13
    wide2 = _widened(w2, dtype) if not isinstance(w2, torch.Tensor) else w2
    want = reference.moe_experts(x, ids, weights, wide13, wide2)
    assert want.abs().max() > 0.1  # the weights' values reach the output
    assert torch.equal(reference.moe_experts(x, ids, weights, w13, w2), want)
    got = triton_moe.moe_experts(x, ids, weights, w13, w2)
    assert torch.equal(got, triton_moe.moe_experts(x, ids, weights, wide13, wide2))
    # Outputs of several units, each product and the activation rounded to the dtype: a tolerance of the largest
    # output's size.
    tol = {F32: 1e-5, F16: 4e-3, BF16: 4e-2}[dtype] * float(want.abs().max())
    torch.testing.assert_close(got, want, atol=tol, rtol=0)


def test_every_mxfp4_byte_and_exponent_widens_as_the_reference_widens_it() -> None:
    """The kernel's MXFP4 widening, read back through products with one-hot rows (each row one input's weights): all
    256 bytes (both codes of each), under exponents from 2 ** -127 (a subnormal) to 2 ** 127 and e8m0's 255,
    bit for bit against ``widen_mxfp4``, in float32 (its subnormals too) and bfloat16. A row with an infinite weight
    (its values times 2 ** 126 and up overflow) gives NaN in every product (infinity times a zero input)."""
    inputs, out = 512, 32  # the 256 bytes along each output's row; an exponent per row
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).expand(1, out, inputs // 2)
    exponents = torch.tensor([0, 1, 2, 3, 60, 100, 120, 126, 127, 128, 134, 160, 200, 250, 251, 252, 253, 254, 255])
    scales = exponents[torch.arange(out) % len(exponents)][:, None].expand(out, inputs // 32).to(torch.uint8)[None]
    weights = Mxfp4Weights(blocks.contiguous(), scales.contiguous())
    ids = torch.zeros(inputs, 1, dtype=torch.long)  # every row to expert 0
    pairs, block_expert = triton_moe.align_pairs(ids, 1, 16)
    for dtype in (F32, BF16):
        want = widen_mxfp4(weights.blocks[0], weights.scales[0], dtype)
        finite = torch.isfinite(want).all(dim=1)
        assert 0 < int(finite.sum()) < out and (want[finite].abs() < 2.0**-120).any()
        got = triton_moe._matmul(torch.eye(inputs, dtype=dtype), weights, pairs, block_expert, inputs, 1, None, 16)
        assert torch.isnan(got.T[~finite]).all()
        # bfloat16's subnormals (the interpreter's conversions flush them) aside: float32's are compared.
        subnormal = (want[finite] != 0) & (want[finite].abs() < torch.finfo(dtype).tiny)
        compared = ~subnormal if dtype == BF16 else torch.ones_like(subnormal)
        assert subnormal.any() and torch.equal(got.T[finite][compared], want[finite][compared])


def test_pairs_are_grouped_by_expert_in_whole_tiles() -> None:
    ids, _ = _routing(23, 8, 3, seed=3, used=6)  # experts 6 and 7 chosen by no token
    block_m = 4
    pairs, block_expert = triton_moe.align_pairs(ids, 8, block_m)
    num_pairs = ids.numel()
    flat = ids.reshape(-1)
    assert pairs.numel() == block_expert.numel() * block_m
    real = pairs[pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs)), "each pair exactly once"
    assert set(pairs[pairs >= num_pairs].tolist()) == {num_pairs}, "padding is one id past the pairs"
    tiles = pairs.view(-1, block_m)
    seen = []
    for tile, expert in zip(tiles.tolist(), block_expert.tolist(), strict=True):
        members = [p for p in tile if p < num_pairs]
        if expert == 8:  # past the last group
            assert not members
            continue
        assert members and all(int(flat[p]) == expert for p in members), "a tile holds one expert's pairs"
        assert tile == members + [num_pairs] * (block_m - len(members)), "padding only at a group's end"
        seen.append(expert)
    assert seen == sorted(seen) and set(seen) == set(flat.tolist()), "groups in expert order, none empty"


def test_no_tokens() -> None:
    x = torch.empty(0, 16)
    out = triton_moe.moe_experts(x, torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2), torch.randn(4, 16, 16),
                                 torch.randn(4, 16, 8))
    assert out.shape == (0, 16)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gpt_oss_biases_and_activation_match_the_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(9)
    num_tokens, hidden, inter, num_experts, top_k = 29, 48, 40, 6, 2
    x = (3 * torch.randn(num_tokens, hidden, generator=gen)).to(dtype)  # some gate/up entries past the clamp
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    b13 = torch.randn(num_experts, 2 * inter, generator=gen).to(dtype)
    b2 = torch.randn(num_experts, hidden, generator=gen).to(dtype)
    ids, weights = _routing(num_tokens, num_experts, top_k, seed=9)
    swiglu = (1.702, 7.0)
    got = triton_moe.moe_experts(x, ids, weights.to(dtype), w13, w2, b13, b2, swiglu)
    # Against the float32 reference over the same values: in bfloat16 each product, bias and the
    # activation round, and the grouped products sum in another order than torch's.
    wide = [t.float() for t in (x, w13, w2, b13, b2)]
    want = reference.moe_experts(wide[0], ids, weights, wide[1], wide[2], wide[3], wide[4], swiglu)
    tol = {F32: 1e-5, BF16: 2e-2}[dtype] * float(want.abs().max())
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)
    plain = reference.moe_experts(x, ids, weights.to(dtype), w13, w2).float()
    assert (want.float() - plain.float()).abs().max() > 0.1  # the biases and the activation matter


def test_gpt_oss_swiglu_clamps_as_transformers_does() -> None:
    gate_up = torch.tensor([[10.0, -10.0, 1.0, 9.0, -9.0, 0.5]])  # gate 10, -10, 1; up 9, -9, 0.5
    got = reference.gpt_oss_swiglu(gate_up, 1.702, 7.0)
    gate, up = torch.tensor([7.0, -10.0, 1.0]), torch.tensor([7.0, -7.0, 0.5])
    torch.testing.assert_close(got[0], (up + 1) * gate * torch.sigmoid(1.702 * gate))
