"""The rotary embedding's Triton kernel against the torch reference (transformers' formula), under
the interpreter: queries and keys with different head counts, float32 and float16 bit for bit (each
product and the sum rounded in turn, no fused multiply-add), bfloat16 within the interpreter's
truncating casts, float32 tables rounding once (ERNIE 4.5), strided inputs, and bad arguments refused."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest
import torch

from pdserve_kernels import reference, triton_rope

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _inputs(num_tokens: int, q_heads: int, k_heads: int, head_size: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(num_tokens, q_heads, head_size, generator=gen)).to(dtype)
    k = (2 * torch.randn(num_tokens, k_heads, head_size, generator=gen)).to(dtype)
    angles = torch.rand(num_tokens, 1, head_size, generator=gen) * 100
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize(("q_heads", "k_heads", "head_size"), [(9, 3, 64), (4, 4, 80), (2, 5, 128)])
def test_the_kernel_rotates_as_the_reference_does(dtype: torch.dtype, q_heads: int, k_heads: int, head_size: int) -> None:
    q, k, cos, sin = _inputs(7, q_heads, k_heads, head_size, dtype, seed=head_size + q_heads)
    got_q, got_k = triton_rope.rope(q, k, cos, sin)
    want_q, want_k = reference.rope(q, k, cos, sin)
    for x, got, want in ((q, got_q, want_q), (k, got_k, want_k)):
        assert got.shape == want.shape and got.dtype == want.dtype == dtype
        if dtype == BF16:
            # The interpreter truncates to bfloat16 where a GPU (and torch) rounds: each of the two
            # products and their sum may be off by a unit in the last place of its own magnitude.
            half = head_size // 2
            partner = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # rotate_half's, but for the sign
            terms = x.float().abs() + partner.float().abs()  # bounds each product and the sum
            assert ((got.float() - want.float()).abs() <= 3 * torch.finfo(dtype).eps * terms).all()
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize(("head_size", "rotary_dim"), [(64, 32), (128, 64), (80, 48), (16, 2)])
def test_a_partial_rope_rotates_the_first_entries_and_passes_the_rest(dtype: torch.dtype, head_size: int,
                                                                      rotary_dim: int) -> None:
    """GLM-4.5's partial RoPE: tables as wide as the rotated part, the rest of each head as it is."""
    q, k, cos, sin = _inputs(7, 4, 2, head_size, dtype, seed=rotary_dim)
    cos, sin = cos[..., :rotary_dim].contiguous(), sin[..., :rotary_dim].contiguous()
    got_q, got_k = triton_rope.rope(q, k, cos, sin)
    want_q, want_k = reference.rope(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:]) and not torch.equal(got_q, q)
    full_q, _ = reference.rope(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin)  # transformers' own split
    assert torch.equal(want_q[..., :rotary_dim], full_q)
    v = torch.randn(7, 2, head_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    slots = torch.tensor([0, 5, -1, 9, 2, 11, 7])
    got_cache, want_cache = torch.zeros(2, 3, 4, 2, head_size, dtype=dtype), torch.zeros(2, 3, 4, 2, head_size, dtype=dtype)
    assert torch.equal(triton_rope.rope_and_store(q, k, v, cos, sin, got_cache, slots), want_q)
    reference.store_kv(want_k, v, want_cache, slots)
    assert torch.equal(got_cache, want_cache)


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_float32_tables_rotate_in_float32_and_round_once_as_ernie_does(rotary_dim: int) -> None:
    """ERNIE 4.5 rotates float16/bfloat16 q and k against float32 tables in float32, rounding only the
    result: the kernel (in the fused store too) equals the reference, which equals transformers' formula,
    and differs from rounding each operation."""
    q, k, _, _ = _inputs(7, 4, 2, 64, F16, seed=rotary_dim)
    angles = torch.rand(7, 1, rotary_dim, generator=torch.Generator().manual_seed(5)) * 100
    cos, sin = angles.cos(), angles.sin()  # float32
    got_q, got_k = triton_rope.rope(q, k, cos, sin)
    want_q, want_k = reference.rope(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and got_q.dtype == F16
    half = rotary_dim // 2
    x = q[..., :rotary_dim].float()
    ernie = (x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin).to(F16)
    assert torch.equal(want_q[..., :rotary_dim], ernie)
    assert not torch.equal(want_q, reference.rope(q, k, cos.half(), sin.half())[0])
    v = torch.randn(7, 2, 64, generator=torch.Generator().manual_seed(3)).to(F16)
    slots = torch.tensor([0, 5, -1, 9, 2, 11, 7])
    got_cache, want_cache = torch.zeros(2, 3, 4, 2, 64, dtype=F16), torch.zeros(2, 3, 4, 2, 64, dtype=F16)
    assert torch.equal(triton_rope.rope_and_store(q, k, v, cos, sin, got_cache, slots), want_q)
    reference.store_kv(want_k, v, want_cache, slots)
    assert torch.equal(got_cache, want_cache)


def test_strided_inputs_are_read_with_their_strides_and_bad_arguments_are_refused() -> None:
    q, k, cos, sin = _inputs(5, 4, 2, 64, F32, seed=1)
    qkv = torch.cat([q, k, k], dim=1)  # q and k as views of one tensor, as a fused projection gives them
    got_q, got_k = triton_rope.rope(qkv[:, :4], qkv[:, 4:6], cos, sin)
    want_q, want_k = reference.rope(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    empty_q, empty_k = triton_rope.rope(q[:0], k[:0], cos[:0], sin[:0])
    assert empty_q.shape == (0, 4, 64) and empty_k.shape == (0, 2, 64)
    with pytest.raises(AssertionError, match="k must be"):
        triton_rope.rope(q, k[:3], cos, sin)
    with pytest.raises(AssertionError, match="dtype"):
        triton_rope.rope(q, k, cos.half(), sin.half())
    with pytest.raises(AssertionError, match="even"):
        triton_rope.rope(q[..., :63], k[..., :63], cos[..., :63], sin[..., :63])


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize(("q_heads", "k_heads", "head_size", "block_size"), [(9, 3, 64, 16), (4, 4, 80, 8), (2, 5, 128, 4)])
def test_rotating_and_storing_in_one_kernel_writes_what_rope_then_store_kv_write(
    dtype: torch.dtype, q_heads: int, k_heads: int, head_size: int, block_size: int
) -> None:
    """The queries come back rotated; the rotated keys and the values land in the cache at their slots,
    bit for bit as the reference's two steps put them there; a negative slot writes nothing."""
    q, k, cos, sin = _inputs(7, q_heads, k_heads, head_size, dtype, seed=head_size + k_heads)
    v = torch.randn(7, k_heads, head_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    qkv = torch.cat([q, k, v], dim=1)  # views of one tensor, as the stacked projection gives them
    q, k, v = qkv[:, :q_heads], qkv[:, q_heads : q_heads + k_heads], qkv[:, q_heads + k_heads :]
    slots = torch.tensor([5, 0, -1, 17, 3, 30, 9])
    got_cache = torch.full((2, 40 // block_size, block_size, k_heads, head_size), 7.0, dtype=dtype)
    want_cache = got_cache.clone()
    got_q = triton_rope.rope_and_store(q, k, v, cos, sin, got_cache, slots)
    want_q = reference.rope_and_store(q, k, v, cos, sin, want_cache, slots)
    assert torch.equal(got_q, want_q) and torch.equal(got_cache, want_cache)
    assert int((got_cache != 7.0).any(dim=-1).any(dim=-1).sum()) == 2 * 6  # six slots written, K and V


def test_rotating_and_storing_refuses_values_that_do_not_fit_the_cache() -> None:
    q, k, cos, sin = _inputs(3, 4, 2, 64, F32, seed=3)
    cache = torch.zeros(2, 4, 8, 2, 64)
    with pytest.raises(AssertionError, match="v must be"):
        triton_rope.rope_and_store(q, k, k[:, :1], cos, sin, cache, torch.arange(3))
    with pytest.raises(AssertionError, match="slot_mapping"):
        triton_rope.rope_and_store(q, k, k, cos, sin, cache, torch.arange(2))
