"""The torch reference kernels (the CPU path) against attention written out per sequence in float64."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve_kernels import reference

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 6, 2, 16


def _cache_and_tables(context_lens: list[int], block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    kv_layer = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)  # scattered, not consecutive, block ids
    width = max(blocks_per_seq)
    tables = torch.randint(0, 10**6, (len(context_lens), width), generator=gen, dtype=torch.int32)  # junk tails
    used = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = order[used : used + n]
        used += n
    return kv_layer, tables


def _naive(query: torch.Tensor, kv_layer: torch.Tensor, table: torch.Tensor, ctx: int, scale: float) -> torch.Tensor:
    """Attention of ``query`` [q_len, heads, size], the last ``q_len`` of ``ctx`` positions, causal."""
    block_size = kv_layer.shape[2]
    q_len = query.shape[0]
    slots = [int(table[p // block_size]) * block_size + p % block_size for p in range(ctx)]
    k = kv_layer[0].reshape(-1, NUM_KV_HEADS, HEAD_SIZE)[slots].double()
    v = kv_layer[1].reshape(-1, NUM_KV_HEADS, HEAD_SIZE)[slots].double()
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.empty(q_len, NUM_HEADS, HEAD_SIZE, dtype=torch.float64)
    for i in range(q_len):
        visible = ctx - q_len + i + 1
        for h in range(NUM_HEADS):
            scores = (k[:visible, h // group] @ query[i, h].double()) * scale
            out[i, h] = torch.softmax(scores, 0) @ v[:visible, h // group]
    return out


@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_attention_over_lengths_that_span_several_groups(block_size: int) -> None:
    context_lens = [1, 3, 15, 16, 17, 33, 97, 250, 700, 64, 2]
    kv_layer, tables = _cache_and_tables(context_lens, block_size, seed=block_size)
    query = torch.randn(len(context_lens), NUM_HEADS, HEAD_SIZE, generator=torch.Generator().manual_seed(1))
    scale = HEAD_SIZE**-0.5
    out = reference.paged_decode_attention(
        query, kv_layer, tables, torch.tensor(context_lens, dtype=torch.int32), scale
    )
    for s, ctx in enumerate(context_lens):
        expected = _naive(query[s : s + 1], kv_layer, tables[s], ctx, scale)[0]
        torch.testing.assert_close(out[s].double(), expected, rtol=1e-5, atol=1e-5, msg=f"sequence {s} ({ctx})")


def test_decode_attention_fills_out_and_handles_no_sequences() -> None:
    kv_layer, tables = _cache_and_tables([5, 40], 4, seed=0)
    query = torch.randn(2, NUM_HEADS, HEAD_SIZE)
    lens = torch.tensor([5, 40], dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    returned = reference.paged_decode_attention(query, kv_layer, tables, lens, 0.25, out=out)
    assert returned is out
    torch.testing.assert_close(out, reference.paged_decode_attention(query, kv_layer, tables, lens, 0.25))
    empty = reference.paged_decode_attention(query[:0], kv_layer, tables[:0], lens[:0], 0.25)
    assert empty.shape == (0, NUM_HEADS, HEAD_SIZE)


def test_prefill_attention_mixes_chunks_after_cached_context_with_single_tokens() -> None:
    block_size = 8
    q_lens = [5, 1, 12, 1, 3]
    context_lens = [5, 30, 40, 9, 19]  # a first chunk, decodes, chunks after cached context
    kv_layer, tables = _cache_and_tables(context_lens, block_size, seed=3)
    query = torch.randn(sum(q_lens), NUM_HEADS, HEAD_SIZE, generator=torch.Generator().manual_seed(4))
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    scale = HEAD_SIZE**-0.5
    out = reference.paged_prefill_attention(
        query, kv_layer, tables, torch.tensor(starts, dtype=torch.int32),
        torch.tensor(context_lens, dtype=torch.int32), scale,
    )
    for s, ctx in enumerate(context_lens):
        expected = _naive(query[starts[s] : starts[s + 1]], kv_layer, tables[s], ctx, scale)
        torch.testing.assert_close(out[starts[s] : starts[s + 1]].double(), expected, rtol=1e-5, atol=1e-5)
