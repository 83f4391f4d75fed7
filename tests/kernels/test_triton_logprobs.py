"""The logprob table's kernel against the torch path (log-softmax, gather, ``topk``), on the CPU under
Triton's interpreter, and the sampler's logprobs with it against the sampler's torch path."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest
import torch

from common.engine.request import Request
from common.engine.sampler import Sampler
from common.sampling_params import MAX_LOGPROBS, SamplingParams
from pdserve_kernels.triton_logprobs import BLOCK, logprob_table


def _torch_table(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    raw = torch.log_softmax(logits[rows].float(), dim=-1)
    values, ids = raw.topk(k, dim=-1)
    return torch.cat([raw.gather(1, token_ids[rows].unsqueeze(1)), values, ids.double()], dim=1)


@pytest.mark.parametrize(("vocab", "k"), [(2 * BLOCK + 37, MAX_LOGPROBS), (300, 3), (50, 0), (40, 17)])
def test_the_table_holds_the_torch_paths_logprobs_and_ids_for_the_rows_asked(vocab, k):
    """Rows over more than one block (the last one short), a few of the batch's rows in another order;
    random logits, so no ties: the very ids of ``topk``, the logprobs to float32's rounding of the sum."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=gen) * 4
    token_ids = torch.randint(0, vocab, (7,), generator=gen)
    rows = torch.tensor([5, 0, 3])
    got = logprob_table(logits, rows, token_ids, k, torch.float32)
    want = _torch_table(logits, rows, token_ids, k)
    assert got.shape == (3, 1 + 2 * k) and got.dtype == torch.float32
    assert torch.equal(got[:, 1 + k :].long(), want[:, 1 + k :].long())
    torch.testing.assert_close(got[:, : 1 + k], want[:, : 1 + k].float(), rtol=0, atol=2e-6)


def test_tied_and_masked_rows_and_a_float64_table_hold_the_logprobs_of_the_ids_they_name():
    """A row of equal values, a row with a tie across blocks, a row of few finite entries (the rest -inf,
    a grammar's mask, say); float64 for a table of ids past float32's exact range. Which of tied entries
    come is ``topk``'s to say; each id comes once, with its own logprob."""
    vocab = BLOCK + 100
    logits = torch.zeros(3, vocab)
    logits[1, [7, BLOCK + 3, 40]] = 2.0  # tied, the largest; one in the second block
    logits[1, 9] = 1.0
    logits[2] = float("-inf")
    logits[2, [BLOCK + 50, 11]] = torch.tensor([0.5, 1.5])
    got = logprob_table(logits, torch.arange(3), torch.tensor([0, 9, 11]), 5, torch.float64)
    assert got.dtype == torch.float64
    ids = got[:, 6:].long().tolist()
    assert all(len(set(row)) == 5 for row in ids)
    assert set(ids[1][:3]) == {7, 40, BLOCK + 3} and ids[1][3] == 9
    assert ids[2][:2] == [11, BLOCK + 50]
    want = torch.log_softmax(logits.double(), dim=-1)
    torch.testing.assert_close(got[:, 1:6], want.gather(1, got[:, 6:].long()), rtol=0, atol=1e-6)
    torch.testing.assert_close(got[:, 0], want[torch.arange(3), torch.tensor([0, 9, 11])], rtol=0, atol=1e-6)
    assert got[2, 3:6].eq(float("-inf")).all()


def test_a_sampler_on_the_triton_backend_reports_the_torch_paths_logprobs():
    """The sampler's table from the kernel, through its result: the torch path's top ids and logprobs
    for every row that asked (greedy and sampled rows, a penalty beside), none for the others."""
    vocab = 600
    gen = torch.Generator().manual_seed(2)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.8, seed=4, logprobs=0),
              SamplingParams(temperature=1.0, top_k=10, seed=5), SamplingParams(temperature=0.0, logprobs=MAX_LOGPROBS,
                                                                                repetition_penalty=1.3)]
    logits = torch.randn(8, vocab, generator=gen) * 3

    def run(backend: str):
        reqs = [Request(f"r{i}", [1, 2, 3], params[i % 4], block_size=16, model_id="m") for i in range(8)]
        return Sampler({0}, seed=1, kernel_backend=backend)(logits, reqs)

    torch_result, triton_result = run("torch"), run("triton")
    assert triton_result.token_ids == torch_result.token_ids  # greedy and seeded rows only: exact
    for row, (got, want) in enumerate(zip(triton_result.logprobs, torch_result.logprobs, strict=True)):
        if params[row % 4].logprobs is None:
            assert got is None and want is None
            continue
        assert got is not None and want is not None
        assert got.token_id == want.token_id and [t.token_id for t in got.top] == [t.token_id for t in want.top]
        assert len(got.top) == params[row % 4].logprobs
        assert got.logprob == pytest.approx(want.logprob, abs=2e-6)
        assert [t.logprob for t in got.top] == pytest.approx([t.logprob for t in want.top], abs=2e-6)
