"""The seeded race's Triton kernel against the torch race, on the CPU under Triton's interpreter.

The reference is the torch path over whole rows: ``argmax(probs / exponentials(key, token ids))``.
The kernel must pick the same token, and its noise must be the reference's bit for bit (probed with
rows whose probabilities are the reference noise itself, where every score is exactly 1 iff it is).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest
import torch

from common.engine.request import Request
from common.engine.sampler import Sampler
from common.engine.seeded_draws import NOISE_MIN, draw_keys, exponential_race, exponentials
from common.protocol import SamplingParams
from pdserve_kernels.triton_sampling import MAX_BLOCK, noise_probes, seeded_race
from tests.engine.splitmix import key_with_state

SEEDS = [0, 1, 42, -1, 2**63 + 5, 2**64 - 1, 123456789]


def _keys(num_rows: int, position: int = 3) -> torch.Tensor:
    seeds = [SEEDS[i % len(SEEDS)] + i // len(SEEDS) for i in range(num_rows)]
    return draw_keys(seeds, [position + i for i in range(num_rows)])


def _reference(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    noise = exponentials(keys.unsqueeze(1), torch.arange(probs.shape[1]).unsqueeze(0))
    return (probs / noise).argmax(dim=-1)


def _probs(num_rows: int, vocab: int, seed: int, zero_below: float) -> torch.Tensor:
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    probs = torch.softmax(logits, dim=-1)
    probs[probs < zero_below] = 0.0  # as top-k / top-p / min-p leave a row
    return probs


@pytest.mark.parametrize("vocab", [1, 37, MAX_BLOCK, MAX_BLOCK + 1, 3 * MAX_BLOCK - 5])
@pytest.mark.parametrize("zero_below", [0.0, 1e-3])
def test_the_kernel_draws_the_torch_race_token(vocab: int, zero_below: float) -> None:
    probs = _probs(9, vocab, seed=vocab, zero_below=zero_below)
    keys = _keys(9)
    expected = _reference(probs, keys)
    before = probs.clone()
    for num_splits in (None, 1, 2, 3, 7):  # ranges per row (more than blocks: as many as there are)
        assert seeded_race(probs, keys, num_splits).tolist() == expected.tolist(), num_splits
    assert torch.equal(probs, before), "the kernel only reads its rows"
    # The sampler's own race (the CPU's positive-entries path) agrees.
    assert exponential_race(probs.clone(), keys).tolist() == expected.tolist()


def test_rows_of_a_wider_tensor_are_read_with_its_row_stride() -> None:
    wide = _probs(6, 2500, seed=1, zero_below=0.0)
    keys = _keys(6)
    rows = wide[:, :2000]
    assert rows.stride(0) == 2500
    assert seeded_race(rows, keys).tolist() == _reference(rows, keys).tolist()


@pytest.mark.parametrize("vocab", [50, 2 * MAX_BLOCK + 7])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_the_noise_is_the_torch_noise_bit_for_bit(vocab: int, num_splits: int) -> None:
    keys = _keys(8, position=11)
    noise = exponentials(keys.unsqueeze(1), torch.arange(vocab).unsqueeze(0))
    for probe, token in noise_probes(noise):
        assert seeded_race(probe, keys, num_splits).tolist() == [token] * 8
    # The probes can fail: one entry's noise off by an ulp wins its row, the first id's too.
    for row, column in [(3, vocab - 2), (5, 0)]:
        nudged = noise.clone()
        nudged[row, column] = torch.nextafter(nudged[row, column], torch.tensor(float("inf")))
        results = [seeded_race(probe, keys, num_splits)[row].item() for probe, _ in noise_probes(nudged)]
        assert results != [0, 0, 1, 1], (row, column)


def test_ties_infinities_and_nans_rank_as_argmax_ranks_them() -> None:
    vocab = 2 * MAX_BLOCK + 3
    probs = torch.zeros(5, vocab)
    probs[1, [7, MAX_BLOCK + 9]] = float("inf")  # two infinite scores: the first
    probs[2, [5, MAX_BLOCK + 2, vocab - 1]] = float("nan")  # the first NaN, whatever else the row holds
    probs[2, 0] = float("inf")
    probs[3, MAX_BLOCK + 4] = float("nan")  # a NaN in a later block beats every earlier score
    probs[3, 10] = 0.9
    probs[4, :] = float("nan")
    keys = _keys(5)
    for num_splits in (1, 2, 3):
        got = seeded_race(probs, keys, num_splits).tolist()
        assert got == [0, 7, 5, MAX_BLOCK + 4, 0], num_splits  # an all-zero row: its first entry, as argmax
        assert got == _reference(probs, keys).tolist()


def test_where_the_uniform_is_zero_the_noise_is_the_least_normal_and_a_zero_probability_loses() -> None:
    """A key whose uniform at one token id is 0 (built through splitmix64's inverse): the kernel's noise
    there is the torch noise (float32's smallest normal, not 0), so a zero-probability entry scores 0
    and loses, as in the torch race, and a positive one wins."""
    vocab, token = MAX_BLOCK + 50, MAX_BLOCK + 3
    keys = torch.tensor([key_with_state(token, 0)] * 2)
    noise = exponentials(keys[:1], torch.arange(vocab))
    assert float(noise[token]) == NOISE_MIN
    probs = _probs(2, vocab, seed=5, zero_below=0.0)
    probs[0, token] = 0.0
    expected = _reference(probs, keys).tolist()
    assert expected[0] != token and expected[1] == token
    for num_splits in (1, 2):
        assert seeded_race(probs, keys, num_splits).tolist() == expected, num_splits


def test_small_batches_cut_their_rows_into_ranges_large_ones_do_not() -> None:
    from pdserve_kernels.triton_sampling import MAX_SPLITS, choose_num_splits

    assert choose_num_splits(1, 128256, MAX_BLOCK, 132) == MAX_SPLITS
    assert choose_num_splits(8, 128256, MAX_BLOCK, 132) == 33  # about two programs per SM
    assert choose_num_splits(264, 128256, MAX_BLOCK, 132) == 1
    assert choose_num_splits(1, 3000, MAX_BLOCK, 132) == 3  # never ranges shorter than a block
    assert choose_num_splits(0, 3000, MAX_BLOCK, 132) == 1


def test_empty_inputs_and_bad_arguments() -> None:
    assert seeded_race(torch.zeros(0, 10), torch.zeros(0, dtype=torch.long)).shape == (0,)
    assert seeded_race(torch.zeros(3, 0), _keys(3)).tolist() == [0, 0, 0]
    with pytest.raises(AssertionError, match="float32"):
        seeded_race(torch.zeros(2, 10, dtype=torch.float64), _keys(2))
    with pytest.raises(AssertionError, match="unit stride"):
        seeded_race(torch.zeros(10, 2).t(), _keys(2))
    with pytest.raises(AssertionError, match="entries"):
        seeded_race(torch.zeros(2, 10), _keys(3))
    with pytest.raises(AssertionError, match="int64"):
        seeded_race(torch.zeros(2, 10), _keys(2).int())


def test_a_sampler_on_the_triton_backend_races_in_the_kernel_and_draws_the_same_tokens(monkeypatch) -> None:
    vocab = 300
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(5)) * 2
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.8, top_k=20, seed=8), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.9, top_p=0.8, seed=9),
              SamplingParams(temperature=1.0, min_p=0.1, presence_penalty=0.5, seed=10)]

    def requests() -> list[Request]:
        reqs = []
        for i in range(12):
            req = Request(f"r{i}", [3, 4, 5], params[i % len(params)], block_size=16, model_id="m")
            for t in range(i % 3):
                req.append_output_token(t + 20)
            reqs.append(req)
        return reqs

    calls: list[int] = []
    real = seeded_race

    def spy(probs: torch.Tensor, keys: torch.Tensor, num_splits: int | None = None,
            positions: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(probs.shape[0])
        return real(probs, keys, num_splits, positions, out)

    import pdserve_kernels.triton_sampling as triton_sampling

    monkeypatch.setattr(triton_sampling, "seeded_race", spy)
    torch_ids = Sampler(set(), seed=1, kernel_backend="torch")(logits, requests()).token_ids
    assert calls == []
    triton_ids = Sampler(set(), seed=1, kernel_backend="triton")(logits, requests()).token_ids
    # Every row, seeded or not, races in one launch of the kernel: a greedy row too (then its argmax,
    # taken beside the race, replaces its draw).
    assert calls == [12]
    exact = [i for i in range(12) if params[i % len(params)].seed is not None or params[i % len(params)].greedy]
    assert [triton_ids[i] for i in exact] == [torch_ids[i] for i in exact]


def test_warming_up_runs_the_kernel_only_where_it_serves_the_race(monkeypatch) -> None:
    """An engine warms its sampler up at start: with the race's kernel, a launch of each variant (whole
    rows, rows in ranges: a kernel that cannot compile then stops the start, not a request); with the
    torch race, nothing."""
    import pdserve_kernels.triton_logprobs as triton_logprobs
    import pdserve_kernels.triton_nucleus as triton_nucleus
    import pdserve_kernels.triton_penalties as triton_penalties
    import pdserve_kernels.triton_sampling as triton_sampling

    calls: list[tuple[int, ...]] = []

    def spy(probs: torch.Tensor, keys: torch.Tensor, num_splits: int | None = None,
            positions: torch.Tensor | None = None) -> torch.Tensor:
        calls.append((*probs.shape, num_splits, positions is not None))
        return seeded_race(probs, keys, num_splits, positions)

    monkeypatch.setattr(triton_sampling, "seeded_race", spy)
    filtered: list[tuple[int, ...]] = []
    real_filter = triton_nucleus.nucleus_filter
    monkeypatch.setattr(triton_nucleus, "nucleus_filter",
                        lambda probs, *params: filtered.append(tuple(probs.shape)) or real_filter(probs, *params))
    penalised: list[tuple[bool, bool]] = []
    real_penalties = triton_penalties.apply_penalties
    monkeypatch.setattr(triton_penalties, "apply_penalties",
                        lambda x, rows, rep, out: penalised.append((rep is not None, out is not None))
                        or real_penalties(x, rows, rep, out))
    tabled: list[int] = []
    real_table = triton_logprobs.logprob_table
    monkeypatch.setattr(triton_logprobs, "logprob_table",
                        lambda logits, *args: tabled.append(logits.shape[1]) or real_table(logits, *args))
    Sampler(set(), kernel_backend="torch").warm_up(torch.device("cpu"), 5000)
    assert calls == [] and filtered == [] and penalised == [] and tabled == []
    Sampler(set(), kernel_backend="triton").warm_up(torch.device("cpu"), 5000)
    assert calls == [(1, 5000, 1, True), (1, 5000, None, True)]  # whole rows, and in ranges (5 here)
    assert filtered == [(1, 5000)] * 2  # and the top-k / top-p / min-p kernel, without top-k and with
    assert penalised == [(True, False), (False, True), (True, True)]  # and each variant of the penalties'
    assert tabled == [5000, 5000]  # and the logprob table's, up to 16 alternatives and more

    def broken(probs: torch.Tensor, keys: torch.Tensor, num_splits: int | None = None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError("ptxas failed")

    monkeypatch.setattr(triton_sampling, "seeded_race", broken)
    with pytest.raises(RuntimeError, match="ptxas"):
        Sampler(set(), kernel_backend="triton").warm_up(torch.device("cpu"), 5000)


def test_more_ranges_than_the_reduce_takes_are_capped_so_no_range_is_left_out() -> None:
    """The reduce kernel is built once, for ``MAX_SPLITS`` ranges (a variant per count would compile in
    the middle of serving): asked for more, a row is cut into at most that many, and a winner in the
    last of its blocks still wins."""
    from pdserve_kernels.triton_sampling import MAX_SPLITS

    vocab = (MAX_SPLITS + 6) * MAX_BLOCK
    probs = torch.full((2, vocab), 1e-9)
    probs[0, -1] = probs[1, -MAX_BLOCK - 3] = 1.0
    keys = _keys(2)
    assert seeded_race(probs, keys, MAX_SPLITS + 36).tolist() == [vocab - 1, vocab - MAX_BLOCK - 3]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_given_positions_the_kernel_derives_each_draws_key_as_keys_at_does(num_splits: int) -> None:
    """Seeds' keys and positions in, the kernel draws what it draws from ``keys_at`` of them: the
    sampler hands it every row's seed key and position, not the keys (a dozen operations fewer)."""
    from common.engine.seeded_draws import keys_at, seed_keys

    vocab = 700
    probs = torch.softmax(torch.randn(9, vocab, generator=torch.Generator().manual_seed(2)), dim=-1)
    seeds = seed_keys([3, -1, 2**64 - 5, 0, 7, 7, 11, 2**40, 5])
    positions = torch.tensor([0, 1, 2, 2**31, 9, 10, 0, 3, 2**62])
    expected = seeded_race(probs, keys_at(seeds, positions), num_splits)
    assert seeded_race(probs, seeds, num_splits, positions=positions).tolist() == expected.tolist()
    assert expected.tolist() == _reference(probs, keys_at(seeds, positions)).tolist()
    with pytest.raises(AssertionError, match="positions"):
        seeded_race(probs, seeds, positions=positions[:3])
