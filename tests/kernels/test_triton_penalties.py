"""The penalties kernel against the torch penalties and a per-row reference, on the CPU under Triton's
interpreter: the same logits, bit for bit."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import random

import pytest
import torch

from common.engine.penalties import TokenRows, apply_output_penalties, apply_repetition_penalty
from common.engine.request import Request
from common.sampling_params import SamplingParams
from pdserve_kernels.triton_penalties import BLOCK, apply_penalties

PARAMS = SamplingParams(temperature=0.0)


def _reference(x: torch.Tensor, req: Request, rep: float | None, frequency: float, presence: float | None) -> None:
    """One row, from the request's token lists: transformers' repetition penalty, then OpenAI's."""
    if rep is not None:
        seen = torch.tensor(sorted(set(req.all_token_ids)))
        vals = x[seen]
        x[seen] = torch.where(vals > 0, vals / torch.tensor(rep), vals * torch.tensor(rep))
    if presence is not None and req.output_token_ids:
        ids, counts = torch.unique(torch.tensor(req.output_token_ids), return_counts=True)
        x[ids] -= torch.tensor(frequency) * counts.float() + torch.tensor(presence)


@pytest.mark.parametrize(("vocab", "prompt_max", "seed"), [(40, 30, 0), (1000, 3 * BLOCK, 1)])
def test_the_kernel_penalises_as_the_torch_penalties_and_a_per_row_reference_step_after_step(vocab, prompt_max, seed):
    """Rows with the repetition penalty, with presence and frequency, with both, and with neither, in a
    batch whose penalised rows are not its first ones; some have output nothing yet. Few distinct tokens
    (many repeats) and, in the other case, rows of more distinct tokens than a program reads at once."""
    rng = random.Random(seed)
    num_rows = 12
    reqs = [Request(f"r{i}", [rng.randrange(vocab) for _ in range(rng.randrange(1, prompt_max))], PARAMS,
                    block_size=16, model_id="m") for i in range(num_rows)]
    kinds = ["rep", "out", "both", "none"]
    rep_rows = [i for i in range(num_rows) if kinds[i % 4] in ("rep", "both")]
    out_rows = [i for i in range(num_rows) if kinds[i % 4] in ("out", "both")]
    rep_penalty = torch.tensor([rng.uniform(0.5, 2.0) for _ in rep_rows])
    frequency = torch.tensor([rng.uniform(-2, 2) for _ in out_rows])
    presence = torch.tensor([rng.uniform(-2, 2) for _ in out_rows])
    programs = sorted(set(rep_rows) | set(out_rows))
    rows = torch.tensor(programs)
    rep_k = torch.tensor([rep_rows.index(r) if r in rep_rows else -1 for r in programs], dtype=torch.int32)
    out_k = torch.tensor([out_rows.index(r) if r in out_rows else -1 for r in programs], dtype=torch.int32)
    all_store, out_store = TokenRows("all_token_ids", num_rows=4, num_cols=8), TokenRows("output_token_ids")
    gen = torch.Generator().manual_seed(seed)
    for step in range(6):
        all_store.begin_step()
        out_store.begin_step()
        logits = torch.randn(num_rows, vocab, generator=gen) * 3
        logits[0, 0] = 0.0  # a zero logit: multiplied, not divided
        expected = logits.clone()
        for row, req in enumerate(reqs):
            rep = float(rep_penalty[rep_rows.index(row)]) if row in rep_rows else None
            k = out_rows.index(row) if row in out_rows else None
            _reference(expected[row], req, rep, float(frequency[k]) if k is not None else 0.0,
                       float(presence[k]) if k is not None else None)
        got = logits.clone()
        slots, lens, _ = all_store.rows([reqs[r] for r in rep_rows])
        rep = (rep_k, all_store.ids, slots, lens, rep_penalty)
        slots, lens, _ = out_store.rows([reqs[r] for r in out_rows])
        assert (lens == 0).any() == (step == 0), "a row with no output yet, at the first step only"
        out = (out_k, out_store.ids, out_store.counts, slots, lens, frequency, presence)
        apply_penalties(got, rows, rep, out)
        assert torch.equal(got, expected), step
        torch_path = logits.clone()
        apply_repetition_penalty(torch_path, torch.tensor(rep_rows), all_store.padded([reqs[r] for r in rep_rows]),
                                 rep_penalty)
        if step:
            ids, counts = out_store.view([reqs[r] for r in out_rows])
            apply_output_penalties(torch_path, torch.tensor(out_rows), ids, counts, frequency, presence)
        assert torch.equal(torch_path, expected), step
        for req in reqs:  # a decode step; now and then a longer tail (a resumed request), repeats in it
            for _ in range(1 if rng.random() < 0.8 else 40):
                req.append_output_token(rng.randrange(vocab))
    assert max(len(set(r.all_token_ids)) for r in reqs) > (BLOCK if vocab > BLOCK else 0)


def test_one_penalty_alone_and_no_rows_at_all():
    """Only the repetition penalty, only the output penalties, or no penalised row: each launches (or
    not) without the other's arguments."""
    req = Request("r", [3, 1, 3], PARAMS, block_size=16, model_id="m")
    req.append_output_token(1)
    req.append_output_token(1)
    logits = torch.tensor([[0.5, 2.0, -1.0, 4.0, -3.0]])
    all_store, out_store = TokenRows("all_token_ids"), TokenRows("output_token_ids")
    slots, lens, _ = all_store.rows([req])
    got = logits.clone()
    k = torch.tensor([0], dtype=torch.int32)
    apply_penalties(got, torch.tensor([0]), (k, all_store.ids, slots, lens, torch.tensor([2.0])), None)
    assert got.tolist() == [[0.5, 1.0, -1.0, 2.0, -3.0]]
    slots, lens, _ = out_store.rows([req])
    got = logits.clone()
    apply_penalties(got, torch.tensor([0]), None,
                    (k, out_store.ids, out_store.counts, slots, lens, torch.tensor([0.5]), torch.tensor([0.25])))
    assert got.tolist() == [[0.5, 2.0 - 1.25, -1.0, 4.0, -3.0]]
    got = logits.clone()
    apply_penalties(got, torch.tensor([], dtype=torch.long), None, None)
    assert torch.equal(got, logits)


def test_a_sampler_on_the_triton_backend_bans_with_min_tokens_where_no_row_has_a_penalty() -> None:
    """``min_tokens`` alone (no penalty in the batch) goes through the bans, and no penalty store or
    kernel: the banned stop and EOS tokens are never drawn while the minimum is not reached."""
    from common.engine.sampler import Sampler

    logits = torch.zeros(4, 60)
    logits[:, [0, 7]] = 50.0  # EOS and a stop token, far the most likely
    params = [SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[7], seed=i) for i in range(3)]
    reqs = [Request(f"r{i}", [1, 2, 3], p, block_size=16, model_id="m") for i, p in enumerate(params)]
    reqs.append(Request("g", [1, 2, 3], SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7]),
                        block_size=16, model_id="m"))
    tokens = Sampler({0}, kernel_backend="triton")(logits, reqs).token_ids
    assert not {0, 7} & set(tokens), tokens
