"""An 8-bit KV cache (``--kv-cache-dtype fp8``, ``fp8_e5m2``): K and V stored as float8 e4m3 or e5m2 (saturated,
never NaN or infinite) and read back into the queries' dtype, in the torch reference and in the Triton kernels (under the
interpreter): stores equal to the byte, attention equal to attention over the widened cache, block
moves byte-exact."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest
import torch

from pdserve_kernels import reference, triton_decode, triton_kv, triton_prefill, triton_rope
from tests.kernels.test_triton_kernels import TOLERANCE, paged_cache, random_query

FP8, E5M2, F32, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float32, torch.bfloat16
EIGHT_BITS = pytest.mark.parametrize("fp8", [FP8, E5M2], ids=["e4m3", "e5m2"])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _fp8_cache(context_lens: list[int], block_size: int, heads: int, head_size: int, seed: int,
               fp8: torch.dtype = FP8) -> tuple[torch.Tensor, torch.Tensor]:
    kv_layer, tables = paged_cache(context_lens, block_size, heads, head_size, F32, seed)
    return (3 * kv_layer).to(fp8), tables


@pytest.mark.parametrize(("fp8", "largest"), [(FP8, 448.0), (E5M2, 57344.0)], ids=["e4m3", "e5m2"])
def test_stores_saturate_and_round_as_torch_rounds(fp8: torch.dtype, largest: float) -> None:
    """Past the largest finite value, the largest (not NaN, not infinite); else the nearest value, ties to even,
    where rounding carries into the next binade too (7.9 to 8 in e4m3, 7.5 to 8 in e5m2), and subnormals."""
    key = torch.tensor([[[1e6, -1e6, 0.3, 447.9, 500.0, -0.0, 1e-9, 17.3, 7.9, 7.5, -122.0, 61000.0, 1.6e-5, 2e-3,
                          1.25, 1.125]]])
    value = -key
    cache = torch.zeros(2, 2, 4, 1, 16, dtype=fp8)
    reference.store_kv(key, value, cache, torch.tensor([5]))
    stored = cache[0, 1, 1, 0].float()
    assert stored.tolist()[:2] == [largest, -largest], "saturated, not NaN or infinite"
    assert cache.float().isfinite().all()
    assert torch.equal(_bytes(cache[0, 1, 1, 0]), _bytes(key[0, 0].clamp(-largest, largest).to(fp8)))
    for dtype in (F32, BF16):  # the Triton stores: the same bytes, from either dtype
        got = torch.zeros_like(cache)
        triton_kv.store_kv(key.to(dtype), value.to(dtype), got, torch.tensor([5]))
        want = torch.zeros_like(cache)
        reference.store_kv(key.to(dtype), value.to(dtype), want, torch.tensor([5]))
        assert torch.equal(_bytes(got), _bytes(want)), dtype


@EIGHT_BITS
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_rope_and_store_writes_the_rotated_keys_as_the_reference_stores_them(dtype: torch.dtype, fp8: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    scale = float(torch.finfo(fp8).max) / 2  # some beyond the largest value
    q, k, v = (scale * torch.randn(9, n, 16, generator=gen).to(dtype) for n in (4, 2, 2))
    angles = 100 * torch.rand(9, 1, 16, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([3, 0, 7, -1, 12, 5, 9, 15, 1])
    got, want = torch.zeros(2, 4, 4, 2, 16, dtype=fp8), torch.zeros(2, 4, 4, 2, 16, dtype=fp8)
    triton_rope.rope_and_store(q, k, v, cos, sin, got, slots)
    # The keys as Triton's own rope rotates them: under the interpreter bfloat16 rounds by truncation,
    # so its rotation differs from torch's there (test_triton_rope.py); the store must not add to that.
    _, rotated = triton_rope.rope(q, k, cos, sin)
    reference.store_kv(rotated, v, want, slots)
    assert torch.equal(_bytes(got), _bytes(want))
    assert float(got.float().abs().max()) == torch.finfo(fp8).max and got.float().isfinite().all()


@EIGHT_BITS
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_reference_attention_reads_the_cache_widened_to_the_queries_dtype(dtype: torch.dtype, fp8: torch.dtype) -> None:
    lens = [5, 17, 33]
    cache, tables = _fp8_cache(lens, 8, 2, 16, seed=4, fp8=fp8)
    widened = cache.to(dtype)
    q = random_query(3, 4, 16, dtype, seed=4)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    got = reference.paged_decode_attention(q, cache, tables, lens_t, 0.25)
    assert got.dtype == dtype
    assert torch.equal(got, reference.paged_decode_attention(q, widened, tables, lens_t, 0.25))
    chunk = random_query(3 + 9 + 1, 4, 16, dtype, seed=5)
    starts = torch.tensor([0, 3, 12, 13], dtype=torch.int32)
    got = reference.paged_prefill_attention(chunk, cache, tables, starts, lens_t, 0.25, sliding_window=7)
    assert torch.equal(got, reference.paged_prefill_attention(chunk, widened, tables, starts, lens_t, 0.25,
                                                              sliding_window=7))


@pytest.mark.parametrize(("dtype", "num_splits", "fp8"), [(F32, 1, FP8), (F32, 3, FP8), (BF16, 1, FP8), (BF16, 3, FP8),
                                                         (BF16, 3, E5M2), (F32, 1, E5M2)])
def test_triton_decode_over_an_fp8_cache_matches_the_reference(dtype: torch.dtype, num_splits: int,
                                                                fp8: torch.dtype) -> None:
    lens = [1, 9, 40, 70]
    cache, tables = _fp8_cache(lens, 16, 2, 32, seed=6, fp8=fp8)
    q = random_query(4, 8, 32, dtype, seed=6)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    got = triton_decode.run_paged_decode(q, cache, tables, lens_t, 0.2, num_splits=num_splits, sliding_window=33,
                                         soft_cap=20.0)
    # Against the reference in float32 over the same values (the 8-bit ones widen exactly): the kernel
    # computes in float32 too; the reference in bfloat16 would round its capped scores.
    want = reference.paged_decode_attention(q.float(), cache.float(), tables, lens_t, 0.2, sliding_window=33,
                                            soft_cap=20.0)
    atol, rtol = TOLERANCE[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@EIGHT_BITS
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_triton_prefill_over_an_fp8_cache_matches_the_reference(dtype: torch.dtype, fp8: torch.dtype) -> None:
    lens = [20, 37, 9]
    q_lens = [6, 37, 1]
    cache, tables = _fp8_cache(lens, 8, 2, 32, seed=7, fp8=fp8)
    q = random_query(sum(q_lens), 4, 32, dtype, seed=7)
    starts = torch.tensor([0, 6, 43, 44], dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    got = triton_prefill.paged_prefill_attention(q, cache, tables, starts, lens_t, 0.2)
    want = reference.paged_prefill_attention(q.float(), cache.float(), tables, starts, lens_t, 0.2)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@EIGHT_BITS
@pytest.mark.parametrize("kernels", [reference, triton_kv], ids=["reference", "triton"])
def test_blocks_move_byte_exact(kernels, fp8: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(8)
    cache = (50 * torch.randn(3, 2, 10, 4, 2, 8, generator=gen)).to(fp8)
    ids = torch.tensor([7, 2, 5])
    packed = kernels.gather_blocks(cache, ids)
    assert packed.dtype == fp8 and torch.equal(_bytes(packed), _bytes(cache[:, :, ids]))
    dst = torch.zeros_like(cache)
    kernels.scatter_blocks(dst, torch.tensor([0, 1, 9]), packed)
    assert torch.equal(_bytes(dst[:, :, [0, 1, 9]]), _bytes(packed))
    before = cache.clone()
    kernels.copy_blocks(cache, torch.tensor([7, 2]), torch.tensor([3, 4]))
    assert torch.equal(_bytes(cache[:, :, [3, 4]]), _bytes(before[:, :, [7, 2]]))
    assert torch.equal(_bytes(cache[:, :, [0, 1, 2, 5, 6, 7, 8, 9]]), _bytes(before[:, :, [0, 1, 2, 5, 6, 7, 8, 9]]))
