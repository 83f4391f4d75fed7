"""Sliding-window attention, chunked attention and score soft-capping: the reference against a plain dense
computation, the Triton kernels (under the CPU interpreter) against the reference, on ragged contexts and
windows or chunks that end inside blocks, tiles and splits."""

from __future__ import annotations

import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest
import torch

from pdserve_kernels import reference, triton_decode, triton_prefill
from tests.kernels.test_triton_kernels import F32, assert_matches_reference, paged_cache, random_query


def _dense_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                            window: int, scale: float, soft_cap: float | None = None,
                            chunk: int | None = None) -> torch.Tensor:
    """Softmax attention written out: ``q`` ``[n, heads, d]`` at ``q_pos``, ``k``/``v`` ``[ctx, kv_heads, d]``;
    ``chunk``: a key only where it is in the query's chunk of positions (the same ``position // chunk``)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,khd->hnk", q, k) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    key_pos = torch.arange(k.shape[0])
    visible = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] > q_pos[:, None] - window)
    if chunk is not None:
        visible &= key_pos[None, :] // chunk == q_pos[:, None] // chunk
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnk,khd->nhd", scores.softmax(-1), v)


def _contiguous_kv(kv_layer: torch.Tensor, block_tables: torch.Tensor, s: int, ctx: int) -> tuple:
    blocks = kv_layer[:, block_tables[s, : -(-ctx // kv_layer.shape[2])].long()]
    flat = blocks.reshape(2, -1, *kv_layer.shape[3:])[:, :ctx]
    return flat[0], flat[1]


@pytest.mark.parametrize(("window", "chunk"), [(1, None), (5, None), (16, None), (37, None), (10_000, 1),
                                             (10_000, 5), (10_000, 16), (7, 12)])
def test_reference_windows_and_chunks_equal_dense_masked_attention(window: int, chunk: int | None) -> None:
    q_lens, context_lens = [9, 1, 23], [41, 30, 23]
    seed = window % 1000 + (chunk or 0)
    kv_layer, block_tables = paged_cache(context_lens, 16, 2, 32, F32, seed=seed)
    query = random_query(sum(q_lens), 4, 32, F32, seed=seed)
    starts = torch.tensor([0, 9, 10, 33], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    got = reference.paged_prefill_attention(query, kv_layer, block_tables, starts, lens, 0.2, sliding_window=window,
                                            attention_chunk=chunk)
    for s, (q_len, ctx) in enumerate(zip(q_lens, context_lens, strict=True)):
        k, v = _contiguous_kv(kv_layer, block_tables, s, ctx)
        q_pos = torch.arange(ctx - q_len, ctx)
        expected = _dense_window_attention(query[starts[s] : starts[s + 1]], k, v, q_pos, window, 0.2, chunk=chunk)
        torch.testing.assert_close(got[starts[s] : starts[s + 1]], expected, atol=1e-5, rtol=1e-5)
    # The mask changes the answer, and a window and a chunk at least as long as every context are full attention.
    full = reference.paged_prefill_attention(query, kv_layer, block_tables, starts, lens, 0.2)
    assert not torch.allclose(got, full, atol=1e-3)
    wide = reference.paged_prefill_attention(query, kv_layer, block_tables, starts, lens, 0.2, sliding_window=64,
                                             attention_chunk=64)
    torch.testing.assert_close(wide, full, atol=0, rtol=0)


# Windows, chunks (contexts that end on a chunk's first position, inside one and on its last), and both.
DECODE_MASKS = [({"sliding_window": 1}, 1, 16), ({"sliding_window": 7}, 1, 16), ({"sliding_window": 20}, 3, 16),
                ({"sliding_window": 50}, 2, 32), ({"attention_chunk": 1}, 1, 16), ({"attention_chunk": 16}, 2, 16),
                ({"attention_chunk": 20}, 3, 16), ({"attention_chunk": 33, "sliding_window": 20}, 1, 16)]
PREFILL_MASKS = [({"sliding_window": 1}, 16), ({"sliding_window": 6}, 16), ({"sliding_window": 24}, 16),
                 ({"sliding_window": 40}, 32), ({"attention_chunk": 6}, 16), ({"attention_chunk": 24}, 16),
                 ({"attention_chunk": 20, "sliding_window": 9}, 16)]


def _ids(masks: list[tuple]) -> list[str]:
    return ["-".join(f"{k.split('_')[-1]}{v}" for k, v in mask.items()) for mask, *_ in masks]


@pytest.mark.parametrize(("mask", "num_splits", "block_n"), DECODE_MASKS, ids=_ids(DECODE_MASKS))
def test_triton_decode_window_and_chunks_match_reference(mask: dict[str, int], num_splits: int, block_n: int) -> None:
    context_lens = [1, 16, 33, 97]
    seed = sum(mask.values())
    kv_layer, block_tables = paged_cache(context_lens, 16, 2, 64, F32, seed=seed)
    query = random_query(len(context_lens), 6, 64, F32, seed=seed)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    triton_decode.run_paged_decode(query, kv_layer, block_tables, lens, 0.125, out=out, num_splits=num_splits,
                                   block_n=block_n, **mask)
    run_reference = functools.partial(reference.paged_decode_attention, **mask)
    assert_matches_reference(out, run_reference, (query, kv_layer, block_tables, lens, 0.125), F32)


@pytest.mark.parametrize(("mask", "block_n"), PREFILL_MASKS, ids=_ids(PREFILL_MASKS))
def test_triton_prefill_window_and_chunks_match_reference(mask: dict[str, int], block_n: int) -> None:
    # A chunk after a cached prefix, a whole prompt, a single token and a chunk over several tiles.
    q_lens, context_lens = [9, 19, 1, 70], [41, 19, 50, 75]
    seed = sum(mask.values())
    kv_layer, block_tables = paged_cache(context_lens, 16, 2, 64, F32, seed=seed)
    query = random_query(sum(q_lens), 6, 64, F32, seed=seed + 1)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    triton_prefill.run_paged_prefill(query, kv_layer, block_tables, starts, lens, 0.125, out=out, block_n=block_n,
                                     **mask)
    run_reference = functools.partial(reference.paged_prefill_attention, **mask)
    assert_matches_reference(out, run_reference, (query, kv_layer, block_tables, starts, lens, 0.125), F32)


@pytest.mark.parametrize(("window", "soft_cap"), [(1000, 5.0), (7, 2.0)])
def test_reference_soft_cap_equals_dense_capped_attention(window: int, soft_cap: float) -> None:
    q_lens, context_lens = [9, 1, 23], [41, 30, 23]
    kv_layer, block_tables = paged_cache(context_lens, 16, 2, 32, F32, seed=3)
    query = 4 * random_query(sum(q_lens), 4, 32, F32, seed=3)  # large scores, so the cap bites
    starts = torch.tensor([0, 9, 10, 33], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    got = reference.paged_prefill_attention(query, kv_layer, block_tables, starts, lens, 0.2,
                                            sliding_window=window, soft_cap=soft_cap)
    uncapped = reference.paged_prefill_attention(query, kv_layer, block_tables, starts, lens, 0.2,
                                                 sliding_window=window)
    assert not torch.allclose(got, uncapped, atol=1e-3)
    for s, (q_len, ctx) in enumerate(zip(q_lens, context_lens, strict=True)):
        k, v = _contiguous_kv(kv_layer, block_tables, s, ctx)
        q_pos = torch.arange(ctx - q_len, ctx)
        expected = _dense_window_attention(query[starts[s] : starts[s + 1]], k, v, q_pos, window, 0.2, soft_cap)
        torch.testing.assert_close(got[starts[s] : starts[s + 1]], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "num_splits"), [(None, 1), (20, 3)])
def test_triton_decode_soft_cap_matches_reference(window: int | None, num_splits: int) -> None:
    context_lens = [1, 15, 33, 97]
    kv_layer, block_tables = paged_cache(context_lens, 16, 2, 64, F32, seed=4)
    query = 4 * random_query(len(context_lens), 6, 64, F32, seed=4)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    triton_decode.run_paged_decode(query, kv_layer, block_tables, lens, 0.125, out=out, num_splits=num_splits,
                                   block_n=16, sliding_window=window, soft_cap=3.0)
    run_reference = functools.partial(reference.paged_decode_attention, sliding_window=window, soft_cap=3.0)
    assert_matches_reference(out, run_reference, (query, kv_layer, block_tables, lens, 0.125), F32)


@pytest.mark.parametrize("window", [None, 24])
def test_triton_prefill_soft_cap_matches_reference(window: int | None) -> None:
    q_lens, context_lens = [9, 19, 1, 70], [41, 19, 50, 75]
    kv_layer, block_tables = paged_cache(context_lens, 16, 2, 64, F32, seed=5)
    query = 4 * random_query(sum(q_lens), 6, 64, F32, seed=5)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    triton_prefill.run_paged_prefill(query, kv_layer, block_tables, starts, lens, 0.125, out=out, block_n=16,
                                     sliding_window=window, soft_cap=3.0)
    run_reference = functools.partial(reference.paged_prefill_attention, sliding_window=window, soft_cap=3.0)
    assert_matches_reference(out, run_reference, (query, kv_layer, block_tables, starts, lens, 0.125), F32)
