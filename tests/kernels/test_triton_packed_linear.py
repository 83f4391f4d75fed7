"""Products with packed integer weights (``triton_packed_linear.int_linear``) and block-wise FP8 ones (``fp8_linear``)
against the torch reference, under the interpreter: 2, 4 and 8 bits, every activation dtype with the scales' dtypes
checkpoints use, widths that are no multiple of a tile, a bias, rows of a decode step and of a prefill chunk, the
inputs summed in several parts; the packing the loader does, whose widening is the checkpoint's; and which layers
stay packed."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest
import torch

from common.model.quantization import IntValues
from pdserve_kernels import reference, triton_packed_linear

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _values(out: int, inputs: int, group: int, bits: int, scales_dtype: torch.dtype, seed: int) -> IntValues:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (out, inputs), generator=gen, dtype=torch.int32)
    q[0] = (1 << bits) - 1  # every word's high bits set: its int32 is negative
    zeros = torch.randint(0, 1 << bits, (out, inputs // group), generator=gen, dtype=torch.int32)
    scales = (torch.rand(out, inputs // group, generator=gen) * 0.02 + 1e-3).to(scales_dtype)
    return IntValues(q, zeros, scales, None, bits).checked()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("scales_dtype", [F32, F16, BF16])
def test_packing_keeps_the_values_the_checkpoint_widens_to(bits: int, scales_dtype: torch.dtype) -> None:
    values = _values(24, 96, 32, bits, scales_dtype, seed=bits)
    packed = values.pack()
    assert packed["qweight"].shape == (24, 96 * bits // 32) and packed["qweight"].dtype == torch.int32
    assert (packed["qweight"][0] < 0).all()
    for dtype in (F32, BF16):
        widened = reference.unpack_int_weight(packed["qweight"], packed["qzeros"], packed["scales"], dtype, bits)
        assert torch.equal(widened, values.widen().to(dtype))


def test_groups_in_order_are_contiguous_and_reordered_ones_keep_each_input_s_group() -> None:
    values = _values(8, 64, 16, 4, F16, seed=1)
    in_order = IntValues(values.q, values.zeros, values.scales, torch.arange(64) // 16, 4).checked()
    assert in_order.g_idx is None and in_order.packable() and "g_idx" not in in_order.pack()
    reordered = IntValues(values.q, values.zeros, values.scales, torch.arange(64) % 4, 4).checked()
    assert reordered.g_idx is not None and reordered.packable()
    packed = reordered.pack()
    assert torch.equal(packed["g_idx"], (torch.arange(64) % 4).int())
    assert torch.equal(reference.unpack_int_weight(packed["qweight"], packed["qzeros"], packed["scales"], F32, 4,
                                                   packed["g_idx"]), reordered.widen().float())
    x = torch.randn(5, 64)
    got = triton_packed_linear.int_linear(x, packed["qweight"], packed["qzeros"], packed["scales"], 4,
                                          g_idx=packed["g_idx"], splits=2)
    torch.testing.assert_close(got, x @ reordered.widen().float().T, atol=1e-5, rtol=1e-5)
    # 60 inputs in 4 groups of 15: not whole words of 4-bit values (8 a word), whole ones of 8-bit values.
    assert not IntValues(values.q[:, :60], values.zeros, values.scales, None, 4).checked().packable()
    assert IntValues(values.q[:, :60], values.zeros, values.scales, None, 8).checked().packable()
    with pytest.raises(ValueError, match="do not split into"):
        IntValues(values.q[:, :62], values.zeros, values.scales, None, 4).checked()


@pytest.mark.parametrize(("rows", "out", "inputs", "group", "splits"), [
    (1, 70, 448, 32, None),  # a decode row; outputs no multiple of a tile; inputs split among programs
    (7, 64, 256, 128, 1),  # one part
    (40, 96, 192, 64, 3),  # three parts, the last shorter
    (130, 48, 128, 128, None),  # a prefill chunk's rows: 64-row tiles; one group per row
])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(("dtype", "scales_dtype"), [(F32, F32), (F16, F16), (BF16, F16), (BF16, BF16)])
def test_the_kernel_computes_the_reference(rows: int, out: int, inputs: int, group: int, splits: int | None, bits: int,
                                           dtype: torch.dtype, scales_dtype: torch.dtype) -> None:
    packed = _values(out, inputs, group, bits, scales_dtype, seed=rows + bits).pack()
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inputs + 8, generator=gen).to(dtype)[:, 4:-4]  # rows with a stride of their own
    bias = torch.randn(out, generator=gen).to(dtype)
    for b in (None, bias):
        got = triton_packed_linear.int_linear(x, *packed.values(), bits, b, splits=splits)
        want = reference.int_linear(x, *packed.values(), bits, b)
        assert got.shape == want.shape == (rows, out) and got.dtype == dtype
        # The sums go in another order than torch's; each weight is the reference's, exactly.
        tol = {F32: 1e-5, F16: 2e-3, BF16: 2e-2}[dtype]
        torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)


def test_a_decode_step_splits_its_inputs_and_a_prefill_chunk_does_not() -> None:
    # Llama-8B's down projection: 4096 outputs (64 tiles) over 14336 inputs.
    assert triton_packed_linear.splits_for(1, 4096, 14336, 16) == 4
    assert triton_packed_linear.splits_for(512, 4096, 14336, 64) == 1
    assert triton_packed_linear.splits_for(1, 64, 256, 16) == 1  # too few inputs to split
    empty = triton_packed_linear.int_linear(torch.empty(0, 64), *_values(8, 64, 32, 4, F16, 0).pack().values(), 4)
    assert empty.shape == (0, 8)


def test_a_stack_stays_packed_only_whole_and_alike() -> None:
    """q/k/v (and gate/up) stay packed together or not at all: not where one part is unquantized or has another
    width or group size; an ungated MLP's up projection alone; a mixture's experts all alike; over two ranks, not
    a projection whose inputs the ranks split where its groups do not split evenly."""
    from common.model.packed_linear import int_kind, packed_layers

    four, eight, other_groups = _values(8, 64, 16, 4, F16, 0), _values(8, 64, 16, 8, F16, 0), _values(8, 64, 32, 4, F16, 0)
    attn = "model.layers.0.self_attn"

    def kept(layers: dict[str, IntValues], unquantized: frozenset[str] = frozenset(), tp_size: int = 1) -> set[str]:
        return packed_layers({name: int_kind(v, name, tp_size) for name, v in layers.items()},
                             {name: name for name in layers}, unquantized)

    qkv = {f"{attn}.{p}": four for p in ("q_proj", "k_proj", "v_proj")}
    assert kept(qkv) == set(qkv)
    assert kept({**qkv, f"{attn}.v_proj": eight}) == set()
    assert kept({**qkv, f"{attn}.v_proj": other_groups}) == set()
    assert kept({k: v for k, v in qkv.items() if "v_proj" not in k}, frozenset({f"{attn}.v_proj"})) == set()
    reordered = IntValues(four.q, four.zeros, four.scales, torch.arange(64) % 4, 4).checked()
    other_order = IntValues(four.q, four.zeros, four.scales, torch.arange(64).flip(0) % 4, 4).checked()
    assert kept(dict.fromkeys(qkv, reordered)) == set(qkv)  # the parts read one input in one order
    assert kept({**dict.fromkeys(qkv, reordered), f"{attn}.v_proj": other_order}) == set()
    assert kept({f"{attn}.o_proj": reordered}, tp_size=2) == set()  # the ranks would split its inputs' groups
    assert kept({"model.layers.0.mlp.up_proj": four}) == {"model.layers.0.mlp.up_proj"}
    assert kept({"lm_head": four}) == set()
    # A mixture's experts: every expert's gate and up (or down) alike, or none; not in their own groups' orders.
    experts = "model.layers.0.mlp.experts"
    gate_up = {f"{experts}.{e}.{p}": four for e in range(3) for p in ("gate_proj", "up_proj")}
    down = {f"{experts}.{e}.down_proj": four for e in range(3)}
    assert kept({**gate_up, **down}) == set(gate_up) | set(down)
    assert kept({**gate_up, f"{experts}.2.up_proj": eight, **down}) == set(down)
    assert kept({**gate_up, **down, f"{experts}.1.down_proj": other_groups}) == set(gate_up)
    assert kept({**gate_up, **down}, frozenset({f"{experts}.0.down_proj"})) == set(gate_up)
    assert kept(dict.fromkeys(down, reordered)) == set()
    assert kept({f"{experts}.down_proj": four}) == {f"{experts}.down_proj"}  # stacked in the checkpoint
    # 64 inputs in 4 groups of 16 split over 8 ranks: half a group each.
    assert kept({f"{attn}.o_proj": four}, tp_size=2) == {f"{attn}.o_proj"}
    assert kept({f"{attn}.o_proj": four}, tp_size=8) == set()
    assert kept({f"{attn}.q_proj": four, f"{attn}.k_proj": four, f"{attn}.v_proj": four}, tp_size=8) == set(qkv)


@pytest.mark.parametrize(("rows", "out", "inputs", "block", "splits"), [
    (1, 96, 512, (32, 64), None),  # a decode row; inputs split among programs
    (40, 80, 192, (16, 16), 3),  # three parts; outputs no multiple of a tile
    (130, 64, 128, (64, 128), None),  # a prefill chunk's rows
])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_the_fp8_kernel_computes_the_reference(rows: int, out: int, inputs: int, block: tuple[int, int],
                                               splits: int | None, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = (100 * torch.randn(out, inputs, generator=gen)).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(out // block[0], inputs // block[1], generator=gen) * 1e-3 + 1e-5
    x = torch.randn(rows, inputs, generator=gen).to(dtype)
    bias = torch.randn(out, generator=gen).to(dtype)
    for b in (None, bias):
        got = triton_packed_linear.fp8_linear(x, weight, scale_inv, b, splits=splits)
        want = reference.fp8_linear(x, weight, scale_inv, b)
        assert got.shape == want.shape == (rows, out) and got.dtype == dtype
        tol = {F32: 1e-5, F16: 2e-3, BF16: 2e-2}[dtype]
        torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)


def test_an_fp8_layer_stays_packed_only_in_whole_blocks_of_e4m3() -> None:
    from common.model.packed_linear import fp8_kind

    weight, scales = torch.zeros(64, 96, dtype=torch.float8_e4m3fn), torch.ones(4, 3)
    assert fp8_kind(weight, scales) == ("fp8", 16, 32)
    assert fp8_kind(weight, torch.ones(5, 3)) is None  # blocks that do not tile it
    assert fp8_kind(weight, torch.ones(())) is None  # one scale for all
    assert fp8_kind(weight.to(torch.float8_e5m2), scales) is None
    # A mixture's experts stacked ([E, out, in]): a grid per expert.
    assert fp8_kind(weight.expand(3, 64, 96), scales.expand(3, 4, 3)) == ("fp8", 16, 32)
    assert fp8_kind(weight.expand(3, 64, 96), scales) is None
