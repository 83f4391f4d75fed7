"""The top-p / min-p kernel against a full sort, on the CPU under Triton's interpreter.

The reference sorts each row (stably: among equal values the lowest id first), keeps the prefix whose
mass before each entry is under ``top_p``, then zeroes what min-p drops. The kernel must leave the same
entries, bit for bit: it only zeroes, never rescales.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest
import torch

from common.engine.sampler import apply_top_p
from pdserve_kernels.triton_nucleus import MAX_BLOCK, nucleus_filter


def _reference(probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    out = probs.clone()
    for row in range(len(out)):
        if top_p[row] < 1.0:
            values, order = out[row].sort(descending=True, stable=True)
            before = values.cumsum(0) - values
            values[1:][before[1:] >= top_p[row]] = 0.0
            out[row] = torch.zeros_like(values).scatter_(0, order, values)
        if min_p[row] > 0.0:
            out[row][out[row] < min_p[row] * out[row].max()] = 0.0
    return out


def _rows(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(num_rows, vocab, generator=gen) * (1 + 3 * torch.rand(num_rows, 1, generator=gen)),
                          dim=-1)
    if vocab > 1:  # as top-k leaves a row: many zeros, the rest summing to 1 again
        probs[1::3, ::2] = 0.0
    return probs / probs.sum(dim=1, keepdim=True)


PARAMS = [(0.9, 0.0), (1.0, 0.05), (0.5, 0.0), (0.99, 0.1), (0.05, 0.0), (1.0, 0.0), (0.7, 0.02), (0.95, 0.0)]


@pytest.mark.parametrize("vocab", [1, 37, MAX_BLOCK, MAX_BLOCK + 1, 3 * MAX_BLOCK - 5])
def test_the_kernel_keeps_what_a_full_sort_keeps(vocab: int) -> None:
    probs = _rows(len(PARAMS), vocab, seed=vocab)
    top_p = torch.tensor([p for p, _ in PARAMS])
    min_p = torch.tensor([m for _, m in PARAMS])
    expected = _reference(probs, top_p, min_p)
    got = probs.clone()
    nucleus_filter(got, top_p, min_p)
    assert torch.equal(got, expected), [((got[r] > 0).sum().item(), (expected[r] > 0).sum().item()) for r in range(8)]
    if vocab > 100:  # the rows were worth testing: every parameter thinned its row
        kept = (got > 0).sum(dim=1)
        assert all(0 < int(kept[r]) < int((probs[r] > 0).sum()) for r in range(len(PARAMS)) if PARAMS[r] != (1.0, 0.0))
    # The sampler's CPU path keeps the same nucleus.
    rows = [r for r, (p, _) in enumerate(PARAMS) if p < 1.0]
    sub = probs[rows].clone()
    apply_top_p(sub, top_p[rows].unsqueeze(1), 64)
    assert torch.equal(sub, _reference(probs[rows], top_p[rows], torch.zeros(len(rows))))


def test_of_equal_values_at_the_cut_as_many_stay_as_a_sort_keeps_the_first_ids() -> None:
    """Exact binary fractions, so that the masses are exact: the i-th entry equal to the smallest value
    kept stays while the mass before it is under top_p."""
    probs = torch.tensor([
        [0.25, 0.25, 0.25, 0.25, 0.0, 0.0, 0.0, 0.0],  # 0.5: two of four
        [0.125, 0.5, 0.125, 0.0, 0.125, 0.125, 0.0, 0.0],  # 0.7: the half, then two of the four eighths
        [0.125, 0.5, 0.125, 0.0, 0.125, 0.125, 0.0, 0.0],  # 0.75: the mass before the third eighth is 0.75
        [0.125] * 8,  # 0.01: one
        [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0],  # 0.5: the one entry
        [0.25, 0.0, 0.5, 0.0, 0.0, 0.25, 0.0, 0.0],  # 0.5: the half alone (the mass before a quarter is 0.5)
    ])
    top_p = torch.tensor([0.5, 0.7, 0.75, 0.01, 0.5, 0.5])
    got = probs.clone()
    nucleus_filter(got, top_p, torch.zeros(6))
    assert (got > 0).int().tolist() == [
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0, 0, 0],
    ]
    assert torch.equal(got, _reference(probs, top_p, torch.zeros(6)))


def test_rows_without_top_p_or_min_p_are_left_alone_and_odd_rows_end() -> None:
    probs = _rows(4, 300, seed=3)
    probs[0, 5] = float("nan")  # a neutral row is not even read: its NaN stays, nothing else changes
    probs[2] = float("nan")  # a broken row with top-p: the search ends (the sampler flags the row)
    probs[3, :200] = 1e-42  # subnormal values, their mass under top-p: every one stays
    probs[3, 200:] = 0.0
    probs[3, 7] = 1e-40
    top_p = torch.tensor([1.0, 0.8, 0.9, 0.5])
    min_p = torch.tensor([0.0, 0.0, 0.1, 0.0])
    got = probs.clone()
    nucleus_filter(got, top_p, min_p)
    torch.testing.assert_close(got[0], probs[0], rtol=0, atol=0, equal_nan=True)
    expected = _reference(probs, top_p, min_p)
    assert torch.equal(got[[1, 3]], expected[[1, 3]])
    assert int((got[3] > 0).sum()) == 200


def test_rows_of_a_wider_tensor_are_read_and_written_with_its_row_stride() -> None:
    wide = _rows(5, 2500, seed=1)
    view = wide[:, 100:1600]
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.3, 0.95])
    min_p = torch.tensor([0.0, 0.01, 0.02, 0.0, 0.0])
    expected = _reference(view.contiguous(), top_p, min_p)
    before = wide.clone()
    nucleus_filter(view, top_p, min_p)
    assert torch.equal(view, expected)
    assert torch.equal(wide[:, :100], before[:, :100]) and torch.equal(wide[:, 1600:], before[:, 1600:])


def test_bad_arguments_are_refused_by_name() -> None:
    probs = torch.rand(2, 10)
    with pytest.raises(AssertionError, match="float32"):
        nucleus_filter(probs.double(), torch.ones(2), torch.zeros(2))
    with pytest.raises(AssertionError, match="top_p"):
        nucleus_filter(probs, torch.ones(3), torch.zeros(2))
    with pytest.raises(AssertionError, match="min_p"):
        nucleus_filter(probs, torch.ones(2), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(AssertionError, match="unit stride"):
        nucleus_filter(probs.t(), torch.ones(10), torch.zeros(10))


def _reference_with_top_k(probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                          top_k: torch.Tensor) -> torch.Tensor:
    """Top-k (every entry at least the k-th largest stays), then top-p over what stays, its mass taken
    relative to theirs (as the sort over the renormalised probabilities of the torch path), then
    min-p. Sums in float64: exact over the binary fractions of the tests."""
    out = probs.clone()
    for row in range(len(out)):
        k = int(top_k[row])
        if 0 < k < out.shape[1]:
            kth = out[row].sort(descending=True).values[k - 1]
            out[row][out[row] < kth] = 0.0
        if top_p[row] < 1.0:
            values, order = out[row].sort(descending=True, stable=True)
            before = values.double().cumsum(0) - values.double()
            values[1:][before[1:] >= float(top_p[row]) * float(values.double().sum())] = 0.0
            out[row] = torch.zeros_like(values).scatter_(0, order, values)
        if min_p[row] > 0.0:
            out[row][out[row] < min_p[row] * out[row].max()] = 0.0
    return out


@pytest.mark.parametrize("vocab", [37, MAX_BLOCK + 1, 3 * MAX_BLOCK - 5])
def test_top_k_then_top_p_of_what_stays_then_min_p_as_the_sort_keeps_them(vocab: int) -> None:
    """Rows of binary fractions (integers over 2**16, summing to 1: every mass exact, many equal values),
    with top-k alone, with top-p and min-p over what it keeps, and without it; a k of 1, a k the row's
    nonzero entries do not reach, and a k past the vocabulary (none)."""
    gen = torch.Generator().manual_seed(vocab)
    num_rows = 10
    weights = torch.randint(0, 40, (num_rows, vocab), generator=gen).double()
    weights[3, vocab // 2 :] = 0.0  # fewer nonzero entries than its k
    probs = torch.floor(weights / weights.sum(dim=1, keepdim=True) * 2**16)
    probs[:, 0] += 2**16 - probs.sum(dim=1)  # the rest on the first entry: sums of exactly 1
    probs = (probs / 2**16).float()
    top_k = torch.tensor([5, 20, 1, vocab - 2, 0, 30, vocab, 7, 12, 3], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.75, 0.625, 1.0, 0.5, 0.25, 0.875, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.25, 0.0, 0.0, 0.125, 0.5])
    expected = _reference_with_top_k(probs, top_p, min_p, top_k)
    got = probs.clone()
    nucleus_filter(got, top_p, min_p, top_k)
    assert torch.equal(got, expected), [((got[r] > 0).sum().item(), (expected[r] > 0).sum().item())
                                        for r in range(num_rows)]
    kept = (got > 0).sum(dim=1)
    assert int(kept[2]) == 1 and int(kept[0]) >= 5  # k of 1; a k of 5 keeps the ties at its 5th value
    if vocab > 100:  # the rows were worth testing: top-p thinned what top-k kept
        assert int(kept[1]) < int((_reference_with_top_k(probs, torch.ones(10), torch.zeros(10), top_k)[1] > 0).sum())
    # Without top-k the same call is the plain kernel's.
    plain = probs.clone()
    nucleus_filter(plain, top_p, min_p, torch.zeros(num_rows, dtype=torch.int32))
    assert torch.equal(plain, _reference(probs, top_p, min_p))
