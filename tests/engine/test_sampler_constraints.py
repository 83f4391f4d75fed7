"""The sampler's constraints on hand-made logits: ``logit_bias``, grammar token masks,
``allowed_token_ids`` and bad words, and a row they leave without any token.

A masked token is never sampled, whatever the sampling parameters; a greedy row picks the best
allowed token; rows without a constraint sample as if the others had none; logprobs stay raw.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from common.engine.grammar import _masked_fill_torch, apply_token_bitmask
from common.engine.request import Request
from common.engine.sampler import Sampler
from common.sampling_params import SamplingParams

VOCAB = 1000  # not a multiple of 32: the bitmask's last word is partly padding


class AllowOnly:
    """Stands in for a request's ``GrammarState``: allows a fixed set of tokens."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed = allowed
        self.rejected = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bits = np.zeros(bitmask.shape[1] * 32, dtype=bool)
        bits[sorted(self.allowed)] = True
        bitmask[row] = torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32))

    def accept(self, token_id: int) -> bool:
        return token_id in self.allowed


def _request(params: SamplingParams, allowed: set[int] | None = None, output: list[int] | None = None) -> Request:
    req = Request("r", [1, 2, 3], params, block_size=16, model_id="m", output_token_ids=output)
    if allowed is not None:
        req.grammar = AllowOnly(allowed)  # type: ignore[assignment]
    return req


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=50, seed=3),
    SamplingParams(temperature=1.3, top_p=0.9, min_p=0.01),
    SamplingParams(temperature=1.0, seed=11, repetition_penalty=1.2, logprobs=2),
]


@pytest.mark.parametrize(("chunk_rows", "kernel_backend"), [(None, "torch"), (2, "torch"), (None, "triton")])
def test_masked_tokens_are_never_sampled_and_greedy_rows_pick_the_best_allowed(chunk_rows, kernel_backend, monkeypatch):  # type: ignore[no-untyped-def]
    """With the Triton backend (its interpreter here) too: its kernels, the greedy rows among the
    sampled ones, its logprob table."""
    if chunk_rows is not None:  # rows go through the sampler in chunks, each with its own bitmask rows
        monkeypatch.setattr("common.engine.sampler.CPU_CHUNK_BYTES", 4 * VOCAB * chunk_rows)
    gen = torch.Generator().manual_seed(1)
    sampler = Sampler(eos_token_ids=set(), kernel_backend=kernel_backend)
    for step in range(40 if kernel_backend == "torch" else 10):
        logits = _logits(2 * len(PARAMS), seed=step)
        allowed = [set(torch.randperm(VOCAB, generator=gen)[: 1 + step % 7 * 30].tolist()) for _ in PARAMS]
        allowed[0].add(VOCAB - 1)  # a token in the bitmask's padded last word
        # Every other row has no grammar: constrained and free rows share the batch.
        requests = [r for p, a in zip(PARAMS, allowed, strict=True) for r in (_request(p, a), _request(p))]
        before = logits.clone()
        result = sampler(logits, requests)
        assert torch.equal(logits, before), "the sampler must not write the model's logits"
        for row, (req, token) in enumerate(zip(requests, result.token_ids, strict=True)):
            if req.grammar is not None:
                assert token in req.grammar.allowed  # type: ignore[attr-defined]
            if req.sampling_params.greedy:
                pool = req.grammar.allowed if req.grammar is not None else range(VOCAB)  # type: ignore[attr-defined]
                assert token == max(pool, key=lambda t: logits[row, t].item())
        # Logprobs are the raw distribution's, mask or not.
        raw = torch.log_softmax(logits, dim=-1)
        for row in (8, 9):
            lp = result.logprobs[row]
            assert lp is not None and lp.logprob == pytest.approx(raw[row, lp.token_id].item(), abs=1e-5)


@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
def test_a_single_allowed_token_is_sampled_by_every_kind_of_row(kernel_backend):
    logits = _logits(len(PARAMS))
    result = Sampler(set(), kernel_backend=kernel_backend)(logits, [_request(p, {VOCAB - 3}) for p in PARAMS])
    assert result.token_ids == [VOCAB - 3] * len(PARAMS)


def test_free_rows_sample_as_if_no_row_had_a_grammar():
    logits = _logits(6, seed=5)
    params = SamplingParams(temperature=0.9, seed=8)
    free = Sampler(set())(logits, [_request(params) for _ in range(6)]).token_ids
    mixed = Sampler(set())(logits, [_request(params, {1, 2}) if i % 2 else _request(params) for i in range(6)])
    assert [t for i, t in enumerate(mixed.token_ids) if i % 2 == 0] == free[0::2]


def test_a_large_negative_bias_on_the_greedy_token_gives_the_next_best():
    logits = _logits(3, seed=2)
    order = logits.argsort(dim=-1, descending=True)
    best, second = order[:, 0].tolist(), order[:, 1].tolist()
    requests = [
        _request(SamplingParams(temperature=0.0, logit_bias={best[0]: -100.0})),
        _request(SamplingParams(temperature=0.0)),  # no bias: unaffected by its neighbours'
        _request(SamplingParams(temperature=0.0, logit_bias={best[2]: -100.0, second[2]: -100.0})),
    ]
    assert Sampler(set())(logits, requests).token_ids == [second[0], best[1], order[2, 2].item()]


@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
def test_a_bias_of_plus_100_forces_a_token_greedy_or_sampled(kernel_backend):
    logits = _logits(4, seed=3)
    target = logits[0].argmin().item()
    requests = [_request(p, None) for p in (
        SamplingParams(temperature=0.0, logit_bias={target: 100.0}),
        SamplingParams(temperature=1.0, logit_bias={target: 100.0}),
        SamplingParams(temperature=1.0, seed=4, top_p=0.5, logit_bias={target: 100.0, 7: -3.0}),
        SamplingParams(temperature=0.0, logit_bias={target: 100.0}, logprobs=1),
    )]
    result = Sampler(set(), kernel_backend=kernel_backend)(logits, requests)
    assert result.token_ids == [target] * 4
    lp = result.logprobs[3]
    assert lp is not None and lp.logprob == pytest.approx(torch.log_softmax(logits[3], -1)[target].item(), abs=1e-5)


def test_bias_and_grammar_combine_the_bias_first():
    """A boosted token the grammar forbids stays forbidden; among allowed ones the bias decides."""
    logits = _logits(1, seed=9)
    order = logits[0].argsort(descending=True).tolist()
    worst_allowed, best = order[-1], order[0]
    params = SamplingParams(temperature=0.0, logit_bias={best: 100.0, worst_allowed: 50.0})
    result = Sampler(set())(logits, [_request(params, {worst_allowed, order[1]})])
    assert result.token_ids == [worst_allowed]


def test_the_torch_mask_equals_xgrammar_s_cpu_kernel_on_random_bitmasks():
    """The mask off the CPU (one gather of bits, one masked fill) against xgrammar's CPU kernel."""
    gen = torch.Generator().manual_seed(0)
    logits = _logits(5, seed=4)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, -(-VOCAB // 32)), dtype=torch.int32, generator=gen)
    rows = [0, 2, 3]
    expected, actual = logits.clone(), logits.clone()
    apply_token_bitmask(expected, bitmask, rows)  # xgrammar's CPU kernel
    _masked_fill_torch(actual, bitmask, rows)
    assert torch.equal(expected, actual)
    assert torch.equal(actual[[1, 4]], logits[[1, 4]])
    assert torch.isinf(actual[rows]).any() and not torch.isinf(actual[rows]).all()


@pytest.mark.parametrize(("chunk_rows", "kernel_backend"), [(None, "torch"), (2, "torch"), (None, "triton")])
def test_allowed_token_ids_are_all_a_row_samples_and_free_rows_are_untouched(chunk_rows, kernel_backend, monkeypatch):  # type: ignore[no-untyped-def]
    if chunk_rows is not None:
        monkeypatch.setattr("common.engine.sampler.CPU_CHUNK_BYTES", 4 * VOCAB * chunk_rows)
    gen = torch.Generator().manual_seed(2)
    for step in range(20 if kernel_backend == "torch" else 5):
        logits = _logits(2 * len(PARAMS), seed=100 + step)
        allowed = [torch.randperm(VOCAB, generator=gen)[: 1 + step % 5 * 40].tolist() for _ in PARAMS]
        params = [msgspec.structs.replace(p, allowed_token_ids=a) for p, a in zip(PARAMS, allowed, strict=True)]
        requests = [r for p, q in zip(params, PARAMS, strict=True) for r in (_request(p), _request(q))]
        result = Sampler(set(), kernel_backend=kernel_backend)(logits, requests)
        free = Sampler(set(), kernel_backend=kernel_backend)(logits[1::2], requests[1::2])
        for row, (req, token) in enumerate(zip(requests, result.token_ids, strict=True)):
            ids = req.sampling_params.allowed_token_ids
            if ids is not None:
                assert token in ids
                if req.sampling_params.greedy:
                    assert token == max(ids, key=lambda t: logits[row, t].item())
        greedy_free = [t for t, p in zip(free.token_ids, PARAMS, strict=True) if p.greedy or p.seed is not None]
        assert greedy_free == [t for t, p in zip(result.token_ids[1::2], PARAMS, strict=True) if p.greedy or p.seed is not None]


@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
def test_a_bad_word_s_last_token_is_banned_only_after_the_rest_of_it(kernel_backend):
    logits = _logits(4, seed=21)
    best = logits.argmax(dim=-1).tolist()
    second = [int(logits[r].argsort(descending=True)[1]) for r in range(4)]
    greedy = SamplingParams(temperature=0.0)
    requests = [
        _request(msgspec.structs.replace(greedy, bad_words_token_ids=[[best[0]]])),  # one token: banned always
        _request(msgspec.structs.replace(greedy, bad_words_token_ids=[[5, 6, best[1]]]), output=[9, 5, 6]),
        _request(msgspec.structs.replace(greedy, bad_words_token_ids=[[5, 6, best[2]]]), output=[5, 6, 9]),
        _request(msgspec.structs.replace(SamplingParams(temperature=1.0, seed=3, top_k=2),
                                         bad_words_token_ids=[[best[3]], [7, second[3]]]), output=[7]),
    ]
    result = Sampler(set(), kernel_backend=kernel_backend)(logits, requests)
    assert result.token_ids[:3] == [second[0], second[1], best[2]]  # row 2: the output does not end with 5, 6
    assert result.token_ids[3] not in (best[3], second[3])  # both of its top two banned: top-k 2 draws a third


@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
def test_a_row_its_bans_leave_without_a_token_comes_back_as_minus_2_and_the_rest_sample(kernel_backend):
    """Bans that contradict each other (every allowed token a bad word; a grammar allowing only bad
    words; only stop tokens allowed while ``min_tokens`` bans them): no token, said so, instead of an
    argmax or a draw over nothing."""
    logits = _logits(5, seed=4)
    requests = [
        _request(SamplingParams(temperature=0.0, allowed_token_ids=[3, 4], bad_words_token_ids=[[3], [4]])),
        _request(SamplingParams(temperature=0.0)),
        _request(SamplingParams(temperature=1.0, seed=1, bad_words_token_ids=[[8], [9]]), allowed={8, 9}),
        _request(SamplingParams(temperature=0.8, allowed_token_ids=[2], min_tokens=3)),  # 2: the eos here
        _request(SamplingParams(temperature=0.0, allowed_token_ids=[2, 11], min_tokens=3)),
    ]
    result = Sampler({2}, kernel_backend=kernel_backend)(logits, requests)
    assert result.token_ids == [-2, int(logits[1].argmax()), -2, -2, 11]
