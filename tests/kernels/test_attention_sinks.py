"""Attention sinks (gpt-oss): a logit per query head that joins every softmax and carries no value. The
torch reference against transformers' own formula, and the Triton decode (whole and split) and prefill
kernels against the reference, under the interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest
import torch

from pdserve_kernels import reference, triton_decode, triton_prefill
from tests.kernels.test_triton_kernels import TOLERANCE, paged_cache, random_query

F32, BF16 = torch.float32, torch.bfloat16


def _sinks(num_heads: int, seed: int) -> torch.Tensor:
    return 3 * torch.randn(num_heads, generator=torch.Generator().manual_seed(seed))


def test_the_reference_is_transformers_formula_and_the_sinks_matter() -> None:
    """gpt-oss's eager attention, written out: scores, the sink column, a softmax, the sink dropped."""
    lens = [13, 30]
    kv_layer, tables = paged_cache(lens, 8, 2, 16, F32, seed=1)
    q = random_query(2, 4, 16, F32, seed=1)
    sinks = _sinks(4, 1)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    got = reference.paged_decode_attention(q, kv_layer, tables, lens_t, 0.25, sinks=sinks)
    for s, n in enumerate(lens):
        ids = tables[s, : -(-n // 8)].long()
        k = kv_layer[0, ids].reshape(-1, 2, 16)[:n].repeat_interleave(2, dim=1).transpose(0, 1)  # [heads, n, d]
        v = kv_layer[1, ids].reshape(-1, 2, 16)[:n].repeat_interleave(2, dim=1).transpose(0, 1)
        scores = torch.einsum("hd,hnd->hn", q[s], k) * 0.25
        combined = torch.cat((scores, sinks[:, None]), dim=-1)
        probs = (combined - combined.max(-1, keepdim=True).values).softmax(-1)[:, :-1]
        torch.testing.assert_close(got[s], torch.einsum("hn,hnd->hd", probs, v), atol=1e-6, rtol=1e-6)
    plain = reference.paged_decode_attention(q, kv_layer, tables, lens_t, 0.25)
    assert (got - plain).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_with_sinks_matches_the_reference(dtype: torch.dtype, num_splits: int) -> None:
    lens = [0, 1, 9, 40, 70]  # an empty context: the sink takes all the weight, the output is 0
    kv_layer, tables = paged_cache(lens, 16, 2, 32, dtype, seed=2)
    q = random_query(5, 8, 32, dtype, seed=2)
    sinks = _sinks(8, 2).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    got = triton_decode.run_paged_decode(q, kv_layer, tables, lens_t, 0.2, num_splits=num_splits, sliding_window=33,
                                         sinks=sinks)
    want = reference.paged_decode_attention(q.float(), kv_layer.float(), tables, lens_t, 0.2, sliding_window=33,
                                            sinks=sinks.float())
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)
    assert torch.equal(got[0], torch.zeros_like(got[0]))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_triton_prefill_with_sinks_matches_the_reference(dtype: torch.dtype) -> None:
    lens, q_lens = [20, 37, 9], [6, 37, 1]
    kv_layer, tables = paged_cache(lens, 8, 2, 32, dtype, seed=3)
    q = random_query(sum(q_lens), 4, 32, dtype, seed=3)
    sinks = _sinks(4, 3).to(dtype)
    starts = torch.tensor([0, 6, 43, 44], dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    got = triton_prefill.paged_prefill_attention(q, kv_layer, tables, starts, lens_t, 0.2, sliding_window=11,
                                                 sinks=sinks)
    want = reference.paged_prefill_attention(q.float(), kv_layer.float(), tables, starts, lens_t, 0.2,
                                             sliding_window=11, sinks=sinks.float())
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


def test_bad_sinks_are_refused() -> None:
    kv_layer, tables = paged_cache([5], 8, 2, 16, F32, seed=4)
    q = random_query(1, 4, 16, F32, seed=4)
    with pytest.raises(AssertionError, match="one logit per query head"):
        triton_decode.run_paged_decode(q, kv_layer, tables, torch.tensor([5], dtype=torch.int32), 0.2,
                                       sinks=torch.zeros(2))
