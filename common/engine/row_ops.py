"""Per-row reductions over ``[rows, vocab]`` that the sampler takes many times a step: the first maximum
(``argmax_rows``, ``max_rows``) and the ``k`` largest (``topk_rows``). Each is the plain torch operation on a
GPU and over small rows; on the CPU over a vocabulary's rows it goes through block maxima with the
vectorised ``amax``, several times cheaper than the CPU's scalar ``argmax`` and ``topk`` loops, with
the same result.
"""

from __future__ import annotations

import torch
from torch import Tensor

# ``argmax_rows`` on the CPU: the width of the blocks it takes the maxima of, and the sizes from which
# that beats one ``argmax`` (below them, its few extra calls cost more than they save); ``topk_rows``
# takes its blocks from the same sizes on.
ARGMAX_BLOCK = 128
ARGMAX_BLOCKED_MIN_VOCAB = 1024
ARGMAX_BLOCKED_MIN_ENTRIES = 1 << 15


def blocks_pay(x: Tensor) -> bool:
    """Whether ``argmax_rows`` and ``topk_rows`` take block maxima over ``x`` (2-D): on the CPU, over rows
    and a batch large enough."""
    num_rows, vocab = x.shape
    return x.device.type == "cpu" and vocab >= ARGMAX_BLOCKED_MIN_VOCAB and num_rows * vocab >= ARGMAX_BLOCKED_MIN_ENTRIES


def argmax_rows(x: Tensor) -> Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor, the same index (the first maximum; the first NaN where a
    row has one), in about a tenth of the time on the CPU over a vocabulary's rows.

    The CPU's ``argmax`` is a scalar loop (about 2.2 ns per entry on the host it was measured on), its
    ``amax`` a vectorised one (about 0.2). So a row's maxima are taken per block of ``ARGMAX_BLOCK``
    entries with ``amax``; the first block holding the row's maximum is the ``argmax`` of those, and the
    ``argmax`` within that block alone gives the index. Elsewhere (a GPU's ``argmax`` is one kernel either
    way) and over small rows it is the plain ``argmax``.
    """
    vocab = x.shape[1]
    if not blocks_pay(x):
        return x.argmax(dim=-1)
    width = ARGMAX_BLOCK
    num_blocks, tail = divmod(vocab, width)
    block_max = x[:, : num_blocks * width].unflatten(1, (num_blocks, width)).amax(dim=-1)
    if tail:  # a last, shorter block
        block_max = torch.cat([block_max, x[:, num_blocks * width :].amax(dim=-1, keepdim=True)], dim=1)
    start = block_max.argmax(dim=-1, keepdim=True) * width
    # The winning block's entries; a last, shorter block is padded with copies of the row's last entry,
    # which come after it and so never come first.
    columns = (start + torch.arange(width, device=x.device)).clamp_(max=vocab - 1)
    return start.squeeze(1) + x.gather(1, columns).argmax(dim=-1)


# ``topk_rows`` on the CPU: the widest block it takes the maxima of, the narrowest worth it, and how many
# times ``k`` blocks' entries a row must hold at least for the blocks to be worth it.
TOPK_MAX_BLOCK = 128
TOPK_MIN_BLOCK = 8
TOPK_ROW_PER_CANDIDATE = 4


def topk_rows(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``x.topk(k, dim=-1)`` of a 2-D tensor as ``(values, indices)``: the same values, sorted from the
    largest (NaN first, as ``topk`` ranks it); where values tie, which of the tied entries come is
    unspecified, as it is for ``topk``. Several times cheaper on the CPU for a small ``k`` over a
    vocabulary's rows.

    The CPU's ``topk`` walks every entry in a scalar loop (about 2.5 ns per entry on the host it was
    measured on, for ``k`` 1 as for 100). So a row's maxima are taken per block of ``width`` entries with
    the vectorised ``amax``, and the ``k`` blocks of the largest maxima (with any entries past the last
    whole block) are the candidates: ``topk`` runs over them alone. They hold the row's top ``k``:
    any entry above the ``k``-th largest block maximum lies in a block whose maximum is above it too, so
    in a chosen block; and the chosen blocks' maxima are ``k`` entries at least as large as that
    maximum, so the ``k``-th largest value is never below it. The width is the largest power of two up to
    ``TOPK_MAX_BLOCK`` for which the candidates are at most a ``TOPK_ROW_PER_CANDIDATE``-th of the row.
    Where that width would be under ``TOPK_MIN_BLOCK`` (a large ``k``), on a GPU, and over small rows,
    it is the plain ``topk``.
    """
    num_rows, vocab = x.shape
    width = TOPK_MAX_BLOCK
    while width >= TOPK_MIN_BLOCK and width * k * TOPK_ROW_PER_CANDIDATE > vocab:
        width //= 2
    if width < TOPK_MIN_BLOCK or not blocks_pay(x):
        top = x.topk(k, dim=-1)
        return top.values, top.indices
    num_blocks = vocab // width
    body = num_blocks * width
    block_max = x[:, :body].unflatten(1, (num_blocks, width)).amax(dim=-1)
    blocks = block_max.topk(k, dim=-1, sorted=False).indices
    columns = (blocks.unsqueeze(2) * width + torch.arange(width, device=x.device)).flatten(1)
    if body < vocab:  # the entries past the last whole block are candidates as they are
        columns = torch.cat([columns, torch.arange(body, vocab, device=x.device).expand(num_rows, -1)], dim=1)
    top = x.gather(1, columns).topk(k, dim=-1)
    return top.values, columns.gather(1, top.indices)


def max_rows(x: Tensor, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``x.max(dim=-1)`` of a 2-D tensor as ``(values, indices)``: each row's first maximum, or its first
    NaN (its value NaN). One operation, or on the CPU over a vocabulary's rows ``argmax_rows`` and a
    gather of the values. ``out``: ``(values, indices)`` tensors to write them into, returned."""
    if blocks_pay(x):
        ids = argmax_rows(x)
        values = x.gather(1, ids.unsqueeze(1)).squeeze(1)
        if out is None:
            return values, ids
        out[0].copy_(values)
        out[1].copy_(ids)
        return out
    if out is not None:
        torch.max(x, dim=-1, out=out)
        return out
    top = x.max(dim=-1)
    return top.values, top.indices
