"""Every Triton kernel against its torch reference, on the CPU under Triton's interpreter.

Data is random (never zeros), lengths are ragged and mostly not multiples of the block size, block
tables are shuffled with garbage in their unused entries, and outputs are poisoned with NaN first so
that an element the kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

import pdserve_kernels as kernels
from pdserve_kernels import reference, triton_decode, triton_kv, triton_ops, triton_prefill

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (atol, rtol) against the reference run in float32 on the same (already rounded) inputs: only the
# kernel's own rounding (P cast to the cache dtype, the output cast) is allowed for. The reference
# run in the half dtype rounds its scores too, so it gets twice that.
TOLERANCE = {F32: (2e-5, 2e-5), F16: (2e-3, 2e-3), BF16: (2e-2, 2e-2)}
GARBAGE_BLOCK_ID = 1 << 30  # unused table entries: reading one would fault or differ


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def paged_cache(
    context_lens: list[int], block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
    seed: int, table_width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``kv_layer`` and a shuffled block table covering ``context_lens`` (plus spare blocks)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [cdiv(n, block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    kv_layer = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    width = table_width or max(blocks_per_seq)
    block_tables = torch.full((len(context_lens), width), GARBAGE_BLOCK_ID, dtype=torch.int32)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return kv_layer, block_tables


def random_query(num_tokens: int, num_heads: int, head_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return (2 * torch.randn(num_tokens, num_heads, head_size, generator=gen)).to(dtype)


def assert_matches_reference(actual: torch.Tensor, run_reference, inputs: tuple, dtype: torch.dtype) -> None:
    """``run_reference(*inputs)`` in float32, and in ``dtype`` with twice the tolerance."""
    atol, rtol = TOLERANCE[dtype]
    assert not actual.isnan().any(), "kernel left NaN (an unwritten element?)"
    widened = tuple(x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)
    torch.testing.assert_close(actual.float(), run_reference(*widened), atol=atol, rtol=rtol)
    if dtype != F32:
        native = run_reference(*inputs).float()
        torch.testing.assert_close(actual.float(), native, atol=2 * atol, rtol=2 * rtol)


def test_kernels_run_under_the_interpreter() -> None:
    for kernel in (triton_decode._decode_kernel, triton_prefill._prefill_kernel, triton_kv._move_blocks_kernel):
        assert isinstance(kernel, InterpretedFunction)


def test_conftest_reinterprets_kernels_imported_before_it() -> None:
    """In a whole-suite run another module may import the kernels first; they must still interpret."""
    code = """
import os
os.environ.pop("TRITON_INTERPRET", None)
import torch
import pdserve_kernels.triton_kv as kv
import pdserve_kernels.triton_ops as ops
from triton.runtime.interpreter import InterpretedFunction
assert not isinstance(kv._store_kv_kernel, InterpretedFunction)
import tests.kernels.conftest
assert isinstance(kv._store_kv_kernel, InterpretedFunction)
cache = torch.randn(2, 2, 16, 1, 16)
key = torch.randn(3, 1, 16)
ops.store_kv(key, key, cache, torch.tensor([0, -1, 17]))
assert torch.equal(cache[0, 1, 1], key[2]) and torch.equal(cache[1, 0, 0], key[0])
"""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    result = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr


# (block_size, gqa ratio, head_size, dtype, num_splits: None = heuristic, block_n)
DECODE_CASES = [
    (16, 1, 64, F32, 1, 16),
    (32, 3, 128, F32, 1, 64),
    (16, 8, 64, F32, 4, 16),
    (32, 1, 128, F32, 3, 32),
    (16, 3, 64, F16, 2, 16),
    (32, 8, 128, F16, None, 64),
    (16, 1, 128, BF16, 3, 32),
    (32, 8, 64, BF16, 1, 64),
    (16, 3, 80, F32, 2, 32),  # a head size that is not a power of two
]


@pytest.mark.parametrize(("block_size", "group", "head_size", "dtype", "num_splits", "block_n"), DECODE_CASES)
def test_paged_decode_matches_reference_on_ragged_contexts(
    block_size: int, group: int, head_size: int, dtype: torch.dtype, num_splits: int | None, block_n: int
) -> None:
    num_kv_heads = 2
    context_lens = [1, 15, 33, 97]
    kv_layer, block_tables = paged_cache(context_lens, block_size, num_kv_heads, head_size, dtype, seed=block_size)
    query = random_query(len(context_lens), num_kv_heads * group, head_size, dtype, seed=group)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_size**-0.5
    before = kv_layer.clone()

    out = torch.full_like(query, float("nan"))
    got = triton_decode.run_paged_decode(
        query, kv_layer, block_tables, lens, scale, out=out, num_splits=num_splits, block_n=block_n
    )
    assert got is out
    inputs = (query, kv_layer, block_tables, lens, scale)
    assert_matches_reference(out, reference.paged_decode_attention, inputs, dtype)
    assert torch.equal(kv_layer, before)


def test_decode_long_context_over_many_splits() -> None:
    """Eight splits over a 700-token context next to a 3-token one (whose other splits are empty)."""
    context_lens = [700, 3]
    kv_layer, block_tables = paged_cache(context_lens, 16, 2, 64, F32, seed=11)
    query = random_query(2, 6, 64, F32, seed=11)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    triton_decode.run_paged_decode(query, kv_layer, block_tables, lens, 0.125, out=out, num_splits=8, block_n=32)
    inputs = (query, kv_layer, block_tables, lens, 0.125)
    assert_matches_reference(out, reference.paged_decode_attention, inputs, F32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_of_an_empty_context_is_zero_not_nan(num_splits: int) -> None:
    """A padding sequence with no context yields zeros (the reference's softmax would give NaN)."""
    kv_layer, block_tables = paged_cache([40, 40], 16, 1, 64, F32, seed=2)
    query = random_query(2, 2, 64, F32, seed=2)
    lens = torch.tensor([0, 40], dtype=torch.int32)
    out = triton_decode.run_paged_decode(query, kv_layer, block_tables, lens, 0.125, num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    expected = reference.paged_decode_attention(query[1:], kv_layer, block_tables[1:], lens[1:], 0.125)
    torch.testing.assert_close(out[1:], expected, atol=2e-5, rtol=2e-5)


def test_split_heuristic_paths() -> None:
    choose = triton_decode.choose_num_splits
    assert choose(64, 8, 4096, 132) == 1  # 512 programs already fill the GPU
    assert choose(2, 8, 4096, 132) == 16  # few programs, long context: split to fill the SMs
    assert choose(1, 1, 128 * 1024, 132) == triton_decode.MAX_SPLITS
    assert choose(2, 8, 256, 132) == 1  # too short to be worth a second pass
    assert choose(2, 8, 1024, 132) == 1024 // triton_decode.MIN_TOKENS_PER_SPLIT
    assert choose(0, 8, 4096, 132) == 1


@pytest.mark.parametrize(("num_seqs", "table_width", "expect_split"), [(3, 40, True), (8, 8, False)])
def test_public_decode_takes_both_heuristic_paths(num_seqs: int, table_width: int, expect_split: bool) -> None:
    """The public wrapper (heuristic split count) matches the reference whichever path it picks.

    A wide table with short contexts also means most splits are empty, which must weigh nothing.
    """
    block_size, num_kv_heads, group, head_size = 16, 2, 3, 64
    num_splits = triton_decode.choose_num_splits(
        num_seqs, num_kv_heads, table_width * block_size, triton_decode.num_sms(torch.device("cpu"))
    )
    assert (num_splits > 1) == expect_split
    context_lens = [(7 + 29 * s) % 90 + 1 for s in range(num_seqs)]
    kv_layer, block_tables = paged_cache(context_lens, block_size, num_kv_heads, head_size, F32, 3, table_width)
    query = random_query(num_seqs, num_kv_heads * group, head_size, F32, seed=5)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    got = triton_ops.paged_decode_attention(query, kv_layer, block_tables, lens, 0.125)
    assert got.dtype == query.dtype
    inputs = (query, kv_layer, block_tables, lens, 0.125)
    assert_matches_reference(got, reference.paged_decode_attention, inputs, F32)


# (block_size, gqa ratio, head_size, dtype)
PREFILL_CASES = [
    (16, 1, 64, F32),
    (32, 3, 64, F32),
    (16, 8, 128, F32),
    (32, 1, 128, F32),
    (16, 3, 128, F16),
    (32, 8, 64, BF16),
    (16, 3, 80, F32),  # a head size that is not a power of two
]


@pytest.mark.parametrize(("block_size", "group", "head_size", "dtype"), PREFILL_CASES)
def test_paged_prefill_matches_reference_on_varlen_chunks(
    block_size: int, group: int, head_size: int, dtype: torch.dtype
) -> None:
    num_kv_heads = 2
    # A chunk with a cached prefix, a whole prompt, a single token (decode-like), an empty chunk,
    # and a long chunk spanning several query tiles.
    q_lens = [9, 19, 1, 0, 70]
    context_lens = [41, 19, 50, 12, 75]
    kv_layer, block_tables = paged_cache(context_lens, block_size, num_kv_heads, head_size, dtype, seed=group)
    query = random_query(sum(q_lens), num_kv_heads * group, head_size, dtype, seed=head_size)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_size**-0.5
    before = kv_layer.clone()

    out = torch.full_like(query, float("nan"))
    got = triton_prefill.run_paged_prefill(
        query, kv_layer, block_tables, starts, lens, scale, out=out, block_n=16 if dtype == F32 else 64
    )
    assert got is out
    inputs = (query, kv_layer, block_tables, starts, lens, scale)
    assert_matches_reference(out, reference.paged_prefill_attention, inputs, dtype)
    assert torch.equal(kv_layer, before)


def test_prefill_finds_each_programs_sequence_past_one_chunk_of_sequences(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program finds its sequence over the step's sequences ``SEQ_CHUNK`` at a time: with 16 to a
    chunk, 37 sequences (ragged, one of them empty) take three passes, and every token still attends
    to its own sequence's cache."""
    monkeypatch.setattr(triton_prefill, "SEQ_CHUNK", 16)
    q_lens = [(i * 7) % 5 for i in range(37)]
    context_lens = [q + (i % 4) * 3 + 1 for i, q in enumerate(q_lens)]
    kv_layer, block_tables = paged_cache(context_lens, 16, 1, 64, F32, seed=11)
    query = random_query(sum(q_lens), 2, 64, F32, seed=12)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = triton_prefill.run_paged_prefill(query, kv_layer, block_tables, starts, lens, 0.125, block_n=16)
    assert_matches_reference(out, reference.paged_prefill_attention, (query, kv_layer, block_tables, starts, lens, 0.125),
                             F32)


def _limits(q_lens: list[int], context_lens: list[int], groups: list[tuple[int, int, int]]) -> torch.Tensor:
    """Each query token's last visible key: its own position, or, inside a group ``(seq, first, end)`` of a
    chunk's tokens (an image's, attending to each other both ways), the group's last position."""
    limits: list[int] = []
    for s, (q_len, ctx) in enumerate(zip(q_lens, context_lens, strict=True)):
        own = list(range(ctx - q_len, ctx))
        for seq, first, end in groups:
            if seq == s:
                own[first:end] = [ctx - q_len + end - 1] * (end - first)
        limits += own
    return torch.tensor(limits, dtype=torch.int32)


@pytest.mark.parametrize("window", [None, 9])
def test_paged_prefill_key_limits_let_a_span_attend_both_ways(window: int | None) -> None:
    """Tokens of a span see every key up to the span's end (Gemma 3's image tokens), in the reference and the
    kernel: the span crosses the kernel's query tiles (32 tokens of a group of 2), and a window still counts back
    from each token's own position. The reference agrees with the mask written out over the gathered keys."""
    q_lens, context_lens = [45, 19, 1], [60, 19, 50]
    groups = [(0, 5, 37), (1, 0, 10)]
    kv_layer, block_tables = paged_cache(context_lens, 16, 2, 32, F32, seed=5)
    query = random_query(sum(q_lens), 4, 32, F32, seed=6)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    limits = _limits(q_lens, context_lens, groups)
    want = reference.paged_prefill_attention(query, kv_layer, block_tables, starts, lens, 0.2, sliding_window=window,
                                             key_limits=limits)
    causal = reference.paged_prefill_attention(query, kv_layer, block_tables, starts, lens, 0.2, sliding_window=window)
    assert not torch.allclose(want, causal, atol=1e-3)
    for s, (q_len, ctx) in enumerate(zip(q_lens, context_lens, strict=True)):  # written out
        keys = kv_layer[:, block_tables[s, :cdiv(ctx, 16)].long()].reshape(2, -1, 2, 32)[:, :ctx]
        k, v = keys[0].repeat_interleave(2, dim=1), keys[1].repeat_interleave(2, dim=1)  # [ctx, heads, size]
        rows = slice(int(starts[s]), int(starts[s + 1]))
        pos = torch.arange(ctx - q_len, ctx)
        visible = torch.arange(ctx)[None, :] <= limits[rows, None]
        if window:
            visible &= torch.arange(ctx)[None, :] > pos[:, None] - window
        scores = torch.einsum("qhd,khd->hqk", query[rows], k) * 0.2
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        torch.testing.assert_close(want[rows], torch.einsum("hqk,khd->qhd", probs, v), atol=2e-5, rtol=2e-5)
    got = triton_prefill.run_paged_prefill(query, kv_layer, block_tables, starts, lens, 0.2, block_n=16,
                                           sliding_window=window, key_limits=limits)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def _joined(kv_layer: torch.Tensor) -> torch.Tensor:
    """A cache whose K and V both hold each token's two latent halves joined: what ``latent`` reads."""
    joined = torch.cat((kv_layer[0], kv_layer[1]), dim=-1)
    return torch.stack((joined, joined))


def test_latent_attention_is_attention_over_the_halves_joined_as_key_and_value() -> None:
    """Multi-head Latent Attention's cache: the reference's ``latent`` mode equals plain attention over a cache
    holding the joined vector as both K and V (decode, and prefill chunks with a cached prefix)."""
    context_lens, q_lens = [5, 23, 40], [5, 1, 17]
    kv_layer, block_tables = paged_cache(context_lens, 8, 1, 20, F32, seed=3)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    query = random_query(sum(q_lens), 16, 40, F32, seed=5)
    got = reference.paged_prefill_attention(query, kv_layer, block_tables, starts, lens, 0.2, latent=True)
    expected = reference.paged_prefill_attention(query, _joined(kv_layer), block_tables, starts, lens, 0.2)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    decoded = reference.paged_decode_attention(query[:3], kv_layer, block_tables, lens, 0.2, latent=True)
    torch.testing.assert_close(decoded, reference.paged_decode_attention(query[:3], _joined(kv_layer), block_tables,
                                                                         lens, 0.2), atol=1e-6, rtol=1e-6)
    # Not the K slot's halves alone attended twice: the V slot's half of each key counts in the scores.
    assert not torch.allclose(got, reference.paged_prefill_attention(
        query, torch.stack((kv_layer[0], kv_layer[0])), block_tables, starts, lens, 0.2, latent=True))


# (cache head_size: each half, KV heads, query heads reading each, dtype, decode splits); past 16 heads a KV
# head, a program takes 16 of them (``LATENT_HEADS_PER_PROGRAM``), the last tile part empty where 40 are.
LATENT_CASES = [(20, 1, 16, F32, 1), (20, 1, 40, F32, 3), (32, 1, 16, BF16, 2), (40, 2, 40, F16, None),
                (24, 2, 8, F32, 1), (24, 2, 40, F32, 2)]


@pytest.mark.parametrize(("head_size", "kv_heads", "group", "dtype", "num_splits"), LATENT_CASES)
def test_latent_decode_and_prefill_match_the_reference(head_size: int, kv_heads: int, group: int, dtype: torch.dtype,
                                                       num_splits: int | None) -> None:
    context_lens, q_lens = [1, 15, 70, 33], [1, 15, 1, 20]
    heads = kv_heads * group
    kv_layer, block_tables = paged_cache(context_lens, 16, kv_heads, head_size, dtype, seed=head_size)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = (2 * head_size) ** -0.5
    query = random_query(len(context_lens), heads, 2 * head_size, dtype, seed=7)
    out = torch.full_like(query, float("nan"))
    triton_decode.run_paged_decode(query, kv_layer, block_tables, lens, scale, out=out, num_splits=num_splits,
                                   block_n=16, latent=True)
    assert_matches_reference(out, lambda *a: reference.paged_decode_attention(*a, latent=True),
                             (query, kv_layer, block_tables, lens, scale), dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = random_query(sum(q_lens), heads, 2 * head_size, dtype, seed=8)
    out = torch.full_like(query, float("nan"))
    triton_prefill.run_paged_prefill(query, kv_layer, block_tables, starts, lens, scale, out=out, block_n=16,
                                     latent=True)
    assert_matches_reference(out, lambda *a: reference.paged_prefill_attention(*a, latent=True),
                             (query, kv_layer, block_tables, starts, lens, scale), dtype)
    with pytest.raises(AssertionError, match="latent"):  # queries as wide as one half: not the latent's
        triton_decode.run_paged_decode(query[:4, :, :head_size], kv_layer, block_tables, lens, scale, latent=True)


def test_public_prefill_allocates_output_in_query_dtype() -> None:
    kv_layer, block_tables = paged_cache([20, 33], 16, 1, 64, F32, seed=7)
    query = random_query(12, 3, 64, F32, seed=7)
    starts = torch.tensor([0, 5, 12], dtype=torch.int32)
    lens = torch.tensor([20, 33], dtype=torch.int32)
    got = triton_ops.paged_prefill_attention(query, kv_layer, block_tables, starts, lens, 0.1)
    assert got.dtype == query.dtype
    inputs = (query, kv_layer, block_tables, starts, lens, 0.1)
    assert_matches_reference(got, reference.paged_prefill_attention, inputs, F32)


# (block_size, num_kv_heads, head_size, key dtype, cache dtype)
STORE_CASES = [
    (16, 2, 64, F32, F32),
    (32, 3, 128, F32, BF16),
    (16, 8, 64, F16, F16),
    (32, 1, 128, BF16, BF16),
]


@pytest.mark.parametrize(("block_size", "num_kv_heads", "head_size", "key_dtype", "cache_dtype"), STORE_CASES)
def test_store_kv_writes_only_mapped_slots(
    block_size: int, num_kv_heads: int, head_size: int, key_dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(block_size + num_kv_heads)
    num_blocks, num_tokens = 5, 21
    kv_layer = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(cache_dtype)
    # K and V as strided views of one fused projection, as a model produces them.
    # Values exact in the cache dtype: the interpreter truncates float32 -> bfloat16 where GPUs and
    # torch round to nearest, and the comparison is exact.
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_size, generator=gen).to(cache_dtype).to(key_dtype)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 11, 17]] = -1
    expected = kv_layer.clone()
    reference.store_kv(key, value, expected, slots)

    triton_ops.store_kv(key, value, kv_layer, slots.to(torch.int32))
    assert torch.equal(kv_layer, expected)


@pytest.mark.parametrize(("block_size", "head_size", "dtype"), [(16, 64, F32), (32, 128, BF16)])
def test_gather_then_scatter_round_trips_blocks(block_size: int, head_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(block_size)
    kv_cache = torch.randn(3, 2, 9, block_size, 3, head_size, generator=gen).to(dtype)
    layers = kv_cache[1:3]  # a slice of layers, as a per-layer-group transfer sends
    block_ids = torch.tensor([7, 2, 5, 0], dtype=torch.int32)

    expected = reference.gather_blocks(layers, block_ids)
    packed = torch.full_like(expected, float("nan"))
    assert triton_ops.gather_blocks(layers, block_ids, out=packed) is packed
    assert torch.equal(packed, expected)
    assert torch.equal(triton_ops.gather_blocks(layers, block_ids.long()), expected)

    dst_cache = torch.randn(2, 2, 11, block_size, 3, head_size, generator=gen).to(dtype)
    dst_ids = torch.tensor([10, 3, 4, 1], dtype=torch.int64)
    want = dst_cache.clone()
    reference.scatter_blocks(want, dst_ids, packed.float())
    triton_ops.scatter_blocks(dst_cache, dst_ids, packed.float())  # another dtype on the way in
    assert torch.equal(dst_cache, want)


@pytest.mark.parametrize(("block_size", "head_size", "dtype"), [(16, 128, F16), (32, 64, F32)])
def test_copy_blocks_copies_every_layer_and_leaves_others(block_size: int, head_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(head_size)
    kv_cache = torch.randn(2, 2, 8, block_size, 2, head_size, generator=gen).to(dtype)
    src = torch.tensor([1, 6, 3], dtype=torch.int32)
    dst = torch.tensor([4, 0, 3], dtype=torch.int32)  # 3 -> 3 is a harmless self-copy
    expected = kv_cache.clone()
    reference.copy_blocks(expected, src, dst)
    triton_ops.copy_blocks(kv_cache, src, dst)
    assert torch.equal(kv_cache, expected)


def test_copy_blocks_rejects_a_destination_that_is_also_a_source() -> None:
    kv_cache = torch.randn(1, 2, 4, 16, 1, 64)
    with pytest.raises(AssertionError, match="also sources"):
        triton_ops.copy_blocks(kv_cache, torch.tensor([1, 2]), torch.tensor([2, 3]))


def test_wrappers_reject_mismatched_shapes_before_launch() -> None:
    kv_layer, block_tables = paged_cache([20], 16, 2, 64, F32, seed=1)
    lens = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(AssertionError, match="head_size"):
        triton_ops.paged_decode_attention(torch.randn(1, 4, 32), kv_layer, block_tables, lens, 0.1)
    with pytest.raises(AssertionError, match="multiple"):
        triton_ops.paged_decode_attention(torch.randn(1, 3, 64), kv_layer, block_tables, lens, 0.1)
    with pytest.raises(AssertionError, match="contiguous"):
        triton_ops.gather_blocks(torch.randn(1, 2, 4, 16, 2, 16)[..., ::2], torch.tensor([0]))
    with pytest.raises(AssertionError, match="key must be"):
        triton_ops.store_kv(torch.randn(3, 2, 32), torch.randn(3, 2, 32), kv_layer, torch.arange(3))


def test_triton_module_exposes_the_reference_signatures() -> None:
    import inspect

    for name in ("store_kv", "paged_decode_attention", "paged_prefill_attention", "gather_blocks",
                 "scatter_blocks", "copy_blocks"):
        assert inspect.signature(getattr(triton_ops, name)) == inspect.signature(getattr(reference, name)), name


def test_dispatch_returns_triton_module_and_honours_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_KERNEL_BACKEND", raising=False)
    assert kernels.get_kernels("cpu", backend="triton") is triton_ops
    assert kernels.get_kernels("cpu") is reference
    assert kernels.resolve_backend("cuda") == "triton"
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "triton")
    assert kernels.resolve_backend("cpu") == "triton"
    assert kernels.get_kernels("cpu") is triton_ops
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "torch")
    assert kernels.resolve_backend("cuda") == "torch"
    assert kernels.resolve_backend("cuda", backend="triton") == "triton"  # the argument wins
    monkeypatch.setenv("PDSERVE_KERNEL_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels.resolve_backend("cpu")


class _SharedMemoryLimit:
    """A kernel whose launches Triton refuses above ``widest`` key tiles, as on a GPU whose shared memory
    cannot hold the tile; logs the BLOCK_N of every launch tried."""

    def __init__(self, kernel, widest: int) -> None:  # type: ignore[no-untyped-def]
        self.kernel, self.widest, self.tiles = kernel, widest, []

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        from triton.runtime.errors import OutOfResources

        def launch(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.tiles.append(kwargs["BLOCK_N"])
            if kwargs["BLOCK_N"] > self.widest:
                raise OutOfResources(kwargs["BLOCK_N"] * 2048, self.widest * 2048, "shared memory")
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize("kind", ["prefill", "decode", "decode split"])
def test_a_tile_the_gpu_cannot_hold_is_halved_once_per_variant_and_an_explicit_one_is_not(monkeypatch, kind) -> None:
    """A 256-wide head at 16 bits needs more shared memory per program than an sm86/sm89 GPU has at the
    default 64-key tile (Triton refuses the launch): the attention kernels go down to the widest tile
    that launches, give the reference's output, and remember it for the next call. A tile asked for
    explicitly (the benchmark's sweeps) fails as Triton failed; none below 16 is tried."""
    from triton.runtime.errors import OutOfResources

    from pdserve_kernels import triton_common

    monkeypatch.setattr(triton_common, "_FITTED_BLOCK_N", {})
    module = triton_prefill if kind == "prefill" else triton_decode
    name = "_prefill_kernel" if kind == "prefill" else "_decode_kernel"
    limit = _SharedMemoryLimit(getattr(module, name), widest=32)
    monkeypatch.setattr(module, name, limit)
    context_lens = [41, 19, 70]
    kv_layer, block_tables = paged_cache(context_lens, 16, 2, 64, F32, seed=3)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    if kind == "prefill":
        q_lens = [9, 19, 1]
        query = random_query(sum(q_lens), 4, 64, F32, seed=3)
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        inputs, ref = (query, kv_layer, block_tables, starts, lens, 0.125), reference.paged_prefill_attention

        def run(**kw):  # type: ignore[no-untyped-def]
            return triton_prefill.run_paged_prefill(*inputs, **kw)
    else:
        query = random_query(3, 4, 64, F32, seed=3)
        inputs, ref = (query, kv_layer, block_tables, lens, 0.125), reference.paged_decode_attention
        splits = 1 if kind == "decode" else 3

        def run(**kw):  # type: ignore[no-untyped-def]
            return triton_decode.run_paged_decode(*inputs, num_splits=splits, **kw)

    assert_matches_reference(run(), ref, inputs, F32)
    assert limit.tiles == [64, 32]
    limit.tiles.clear()
    assert_matches_reference(run(), ref, inputs, F32)
    assert limit.tiles == [32]  # remembered
    limit.tiles.clear()
    with pytest.raises(OutOfResources):
        run(block_n=64)
    assert limit.tiles == [64]
    with pytest.raises(AssertionError, match="power of two >= 16"):
        run(block_n=48)
    monkeypatch.setattr(triton_common, "_FITTED_BLOCK_N", {})
    limit.widest, limit.tiles = 8, []
    with pytest.raises(OutOfResources):
        run()
    assert limit.tiles == [64, 32, 16]
