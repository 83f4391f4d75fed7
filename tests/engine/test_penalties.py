"""The penalties' token store: rows that follow their requests as they grow, come and go, and the
penalties over them against a per-row reference."""

from __future__ import annotations

import random

import pytest
import torch

from common.engine.penalties import TokenRows, apply_output_penalties, apply_repetition_penalty, update_rows
from common.engine.request import Request
from common.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, repetition_penalty=1.3)


def _request(prompt: list[int]) -> Request:
    return Request("r", prompt, PARAMS, block_size=16, model_id="m")


def _check(rows: TokenRows, requests: list[Request]) -> None:
    ids = rows.padded(requests)
    counts = rows.view(requests)[1] if rows.counted else None
    for i, req in enumerate(requests):
        tokens = getattr(req, rows.source)
        distinct = list(dict.fromkeys(tokens))  # in the order they first came
        n = len(distinct)
        assert ids[i, :n].tolist() == distinct, i
        assert set(ids[i, n:].tolist()) <= {tokens[0] if tokens else 0}, "padding holds another token"
        if counts is not None:
            assert counts[i, :n].tolist() == [tokens.count(t) for t in distinct], i
            assert not counts[i, n:].any(), "padding counts a token"
    slots, lens, width = rows.rows(requests)
    assert lens.tolist() == [len(set(getattr(r, rows.source))) for r in requests] and width == ids.shape[1]
    assert torch.equal(rows.ids[slots, :width], ids)
    if counts is not None:
        assert torch.equal(rows.view(requests)[0], ids) and torch.equal(rows.counts[slots, :width], counts)


@pytest.mark.parametrize("source", ["all_token_ids", "output_token_ids"])
def test_rows_follow_requests_that_grow_come_and_go_past_the_store_s_rows_and_columns(source):
    rng = random.Random(0)
    rows = TokenRows(source, num_rows=4, num_cols=8)
    live = [_request([rng.randrange(1000) for _ in range(rng.randrange(1, 12))]) for _ in range(3)]
    for step in range(60):
        rows.begin_step()
        for req in live:  # a decode step: one token each, or now and then a long tail (a resumed request)
            for _ in range(1 if rng.random() < 0.9 else 70):
                req.append_output_token(rng.randrange(1000))
        _check(rows, live)
        if step % 3 == 0:  # one leaves, one or two arrive (the batch grows past the 4 rows)
            live.pop(rng.randrange(len(live)))
            live += [_request([rng.randrange(1000) for _ in range(rng.randrange(1, 300))])
                     for _ in range(rng.randrange(1, 3))]
            live = live[-9:]
    assert rows.ids.shape[0] >= 9 and rows.ids.shape[1] > 256  # more distinct tokens than its first width


def test_two_stores_updated_together_hold_what_each_holds_updated_alone():
    """``update_rows`` sends both stores' index lists in one copy: each store's rows, lengths and entries
    are those of its own ``rows`` call, step after step (taken rows, prompts, decode tokens, growth)."""
    rng = random.Random(3)
    together = [TokenRows("all_token_ids", num_rows=2, num_cols=4), TokenRows("output_token_ids", num_rows=2, num_cols=4)]
    alone = [TokenRows("all_token_ids", num_rows=2, num_cols=4), TokenRows("output_token_ids", num_rows=2, num_cols=4)]
    live = [_request([rng.randrange(50) for _ in range(rng.randrange(1, 90))]) for _ in range(3)]
    for step in range(12):
        for store in (*together, *alone):
            store.begin_step()
        for req in live:
            req.append_output_token(rng.randrange(50))
        subsets = (live, live[1:])  # the stores need not hold the same requests
        got = update_rows(list(zip(together, subsets, strict=True)))
        for store, mine, reqs, (slots, lens, width) in zip(alone, together, subsets, got, strict=True):
            want_slots, want_lens, want_width = store.rows(reqs)
            assert torch.equal(lens, want_lens) and width == want_width, step
            assert torch.equal(mine.ids[slots, :width], store.ids[want_slots, :width]), step
            if store.counted:
                assert torch.equal(mine.counts[slots, :width], store.counts[want_slots, :width]), step
        if step % 4 == 3:
            live.append(_request([rng.randrange(50) for _ in range(rng.randrange(1, 90))]))
    _check(together[0], live)
    _check(together[1], live[1:])


def test_a_request_that_comes_back_after_its_row_went_to_another_is_written_whole_again():
    rows = TokenRows("output_token_ids", num_rows=2, num_cols=4)
    a, b, c = (_request([1]) for _ in range(3))
    for req, t in ((a, 5), (b, 6), (c, 7)):
        req.append_output_token(t)
    rows.begin_step()
    _check(rows, [a, b])
    rows.begin_step()
    _check(rows, [c, b])  # c takes a's row
    a.append_output_token(8)
    rows.begin_step()
    _check(rows, [a, c])  # a comes back: b's row, written from a's tokens


def _reference(x: torch.Tensor, requests: list[Request], frequency: list[float], presence: list[float]) -> None:
    for row, req in enumerate(requests):
        seen = torch.tensor(sorted(set(req.all_token_ids)))
        vals = x[row, seen]
        x[row, seen] = torch.where(vals > 0, vals / 1.3, vals * 1.3)
        ids, counts = torch.unique(torch.tensor(req.output_token_ids), return_counts=True)
        x[row, ids] -= frequency[row] * counts.float() + presence[row]


def test_penalties_over_the_store_equal_a_per_row_reference_bit_for_bit():
    rng = random.Random(1)
    vocab = 50  # few tokens: many repeats
    requests = [_request([rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]) for _ in range(7)]
    for req in requests:
        for _ in range(rng.randrange(1, 30)):
            req.append_output_token(rng.randrange(vocab))
    frequency = [rng.uniform(-2, 2) for _ in requests]
    presence = [rng.uniform(-2, 2) for _ in requests]
    logits = torch.randn(len(requests) + 2, vocab, generator=torch.Generator().manual_seed(2))
    expected = logits.clone()
    _reference(expected[1:-1], requests, frequency, presence)
    got = logits.clone()
    all_rows, out_rows = TokenRows("all_token_ids"), TokenRows("output_token_ids")
    rows = torch.arange(1, len(requests) + 1)  # the requests' rows of the batch: not the first or last
    ids = all_rows.padded(requests)
    apply_repetition_penalty(got, rows, ids, torch.full((len(requests),), 1.3))
    ids, counts = out_rows.view(requests)
    apply_output_penalties(got, rows, ids, counts, torch.tensor(frequency), torch.tensor(presence))
    assert torch.equal(got, expected)


def test_the_rows_of_finished_requests_let_them_go_within_release_every_steps():
    """A row keeps its request between steps (a request that comes back finds it); a finished one's
    row lets it go within ``RELEASE_EVERY`` steps, its token lists with it, and is taken by the next
    request. A preempted request, which comes back, keeps its row."""
    import gc
    import weakref

    from common.engine.penalties import RELEASE_EVERY
    from common.engine.request import RequestStatus

    rows = TokenRows("all_token_ids", num_rows=2, num_cols=8)
    done, paused = _request([1, 2, 3]), _request([4, 5])
    rows.begin_step()
    _check(rows, [done, paused])
    done.status, paused.status = RequestStatus.FINISHED_STOPPED, RequestStatus.PREEMPTED
    gone = weakref.ref(done)
    del done
    for _ in range(RELEASE_EVERY):
        rows.begin_step()
    gc.collect()
    assert gone() is None, "the finished request's row still held it"
    assert rows.ids.shape[0] == 2 and len(rows._free) == 1  # the preempted one kept its row
    _check(rows, [paused, _request([6])])  # the new one takes the freed row: no growth
    assert rows.ids.shape[0] == 2


def test_a_request_with_no_output_yet_reads_zeros_not_its_row_s_last_holder_then_pads_with_its_first_token():
    """An output store's row taken by a request that has output nothing (the Triton path asks for every
    penalised row) holds no count of the request that held it before; once the request outputs, its
    padding is its first token."""
    rows = TokenRows("output_token_ids", num_rows=1, num_cols=4)
    old = _request([1])
    for t in (5, 5, 6):
        old.append_output_token(t)
    rows.begin_step()
    _check(rows, [old])
    new = _request([2])
    rows.begin_step()  # ``old`` did not come back: its row goes to ``new``
    slots, lens, _ = rows.rows([new])
    assert lens.tolist() == [0] and not rows.ids[slots].any() and not rows.counts[slots].any()
    new.append_output_token(7)
    rows.begin_step()
    _check(rows, [new])
    assert rows.ids[slots].tolist() == [[7, 7, 7, 7]] and rows.counts[slots].tolist() == [[1, 0, 0, 0]]
