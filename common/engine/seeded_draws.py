"""Seeded draws: the noise of a seeded request's exponential race, and the race itself.

A sampled row of a request with a seed draws its token by the exponential race, ``argmax(probs / E)``
with ``E ~ Exp(1)``, where the ``E`` of vocabulary entry ``t`` for the request's ``i``-th output token is
a fixed function of (seed, ``i``, ``t``) (``exponentials``: splitmix64 over a key made from the seed and
``i``, the entry's uniform at stream position ``t``). It is counter-based: a token depends on nothing
but the seed, the output position and the row's probabilities, whatever else shares the batch,
whatever ran before on whichever instance. So a request continued elsewhere (a migration, a decode
after its prefill, a recompute after preemption) draws the same tokens with no generator state to
carry or replay, and the noise can be computed where it is needed: with the Triton kernels (a GPU's
default) in one kernel that hashes, divides and picks each row's token in one pass over it
(``pdserve_kernels.triton_sampling``), on the CPU only over the entries of positive probability.
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.engine.host_tensors import long_tensor
from common.engine.row_ops import argmax_rows

# splitmix64 (Steele, Lea and Flood, 2014) in int64 tensor arithmetic: multiplications wrap modulo
# 2**64 and a right shift is made logical by masking the bits the sign extended into.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)


# The least noise: float32's smallest normal number, where ``u`` is 0 (once in 2**53 entries) and the
# logarithm gives 0. An entry of probability 0 then scores 0 / NOISE_MIN = 0, never 0 / 0 = NaN, which
# would win its row's ``argmax``: a token of probability zero is never drawn. One of positive
# probability p scores p / NOISE_MIN (about 8.5e37 p): above any score a nonzero noise allows (the
# least is 1.1e-16, so at most about 9e15) for any p above about 1.1e-22.
NOISE_MIN = float(torch.finfo(torch.float32).tiny)


def _mix64_(z: Tensor) -> Tensor:
    """splitmix64's output function on an int64 tensor, in place (``z`` is overwritten and returned):
    over a row's worth of entries, every temporary of the plain expression was a fresh allocation of
    its size (above glibc's mmap threshold on the CPU, so fresh pages each time); this takes one."""
    t = z >> 30
    z ^= t.bitwise_and_((1 << 34) - 1)
    z *= _MIX_1
    z ^= torch.bitwise_right_shift(z, 27, out=t).bitwise_and_((1 << 37) - 1)
    z *= _MIX_2
    z ^= torch.bitwise_right_shift(z, 31, out=t).bitwise_and_((1 << 33) - 1)
    return z


def seed_keys(seeds: list[int], device: torch.device | str = "cpu") -> Tensor:
    """int64 ``[rows]``: the part of ``draw_keys`` that depends on the seed alone."""
    signed = [(s & 0xFFFFFFFFFFFFFFFF) - ((s >> 63 & 1) << 64) for s in seeds]
    return _mix64_(long_tensor(signed, device))


def draw_keys(seeds: list[int], draw_indices: list[int], device: torch.device | str = "cpu") -> Tensor:
    """int64 ``[rows]``: per row, the key of draw ``draw_indices[i]`` (the output position) of a request
    seeded ``seeds[i]`` (any Python int; taken modulo 2**64)."""
    return keys_at(seed_keys(seeds, device), long_tensor(draw_indices, device))


def keys_at(seed_keys: Tensor, draw_indices: Tensor) -> Tensor:
    """``draw_keys`` from ``seed_keys`` of the seeds."""
    return _mix64_(seed_keys + draw_indices * _GOLDEN)


def exponentials(keys: Tensor, token_ids: Tensor) -> Tensor:
    """Exp(1) noise (float32) for entries ``token_ids`` of draws ``keys`` (int64, broadcast together):
    the uniform at position ``t`` of the splitmix64 stream from the key, to 53 bits, as
    ``float32(-log1p(-u))`` (the formula of the CPU's ``exponential_``), at least ``NOISE_MIN``."""
    z = _mix64_(torch.add(keys, (token_ids + 1).mul_(_GOLDEN)))
    u = z.bitwise_right_shift_(11).bitwise_and_((1 << 53) - 1).double().mul_(2.0**-53)
    return u.neg_().log1p_().neg_().float().clamp_(min=NOISE_MIN)


def exponential_race(sub: Tensor, keys: Tensor, whole_rows: bool = False) -> Tensor:
    """For each row of ``sub``, ``argmax(sub[i] / E)`` with ``E`` its draw's noise (``exponentials`` of
    ``keys[i]``); ties go to the lowest token id, as ``argmax``'s. Writes into ``sub``. (With the Triton
    backend the sampler races in one kernel instead, ``triton_sampling.seeded_race``: the same tokens.)

    On a GPU the noise is computed for whole rows in one batch, and so on the CPU for ``whole_rows``
    (rows that no filter thinned out: nearly every entry positive). Otherwise on the CPU the
    logarithms are most of a draw's cost and a token of probability zero cannot win, so they are
    taken only over the entries of positive probability (top-k, top-p and min-p leave a few hundred
    tokens, or fewer), for all the rows at once, and each score is written over its probability: the
    zeros left around them lose to any positive score, and ``argmax`` then makes of a row without one
    (all zeros, or NaNs) what it makes of the whole row's race. Both give the same token: a zero's
    score is zero either way.
    """
    num_rows, vocab = sub.shape
    if sub.device.type != "cpu" or whole_rows:
        noise = exponentials(keys.unsqueeze(1), torch.arange(vocab, device=sub.device).unsqueeze(0))
        return argmax_rows(sub.div_(noise))
    flat = sub.view(-1)  # ``sub`` is a fresh tensor: rows taken from ``probs``, or ``probs`` itself
    index = flat.nonzero().squeeze(1)
    r = index.div(vocab, rounding_mode="floor")
    t = index - r * vocab
    flat.index_copy_(0, index, flat.index_select(0, index).div_(exponentials(keys.index_select(0, r), t)))
    return argmax_rows(sub)


# On the CPU the seeded rows that no filter thins out race over whole rows from this vocabulary size
# (about 24 ns per entry of the row, against 42 per positive entry over the positive entries alone).
WHOLE_ROW_RACE_MIN_VOCAB = 1024
