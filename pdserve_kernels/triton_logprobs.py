"""A step's logprob table in one Triton kernel: for each row that asked for logprobs, the sampled
token's logprob and the row's ``k`` most likely tokens with theirs.

The sampler's torch path builds the table from a log-softmax over those rows, a gather of the sampled
tokens, a ``topk``, a conversion of its indices and a concatenation, with a copy of the rows first:
seven launches a step. Here one program per row reads the model's raw logits (any float dtype, widened
to float32; the sampler never writes into them) and writes its line of the table:

* a pass for the row's maximum ``m``, a pass for ``s``, the sum of ``exp(x - m)``; a logprob is
  ``(x - m) - log(s)``, the log-softmax's own formula;
* the sampled token's logprob (the token read from the step's ids on the device);
* the ``k`` largest entries by repeated passes, each taking the largest below the last one taken in
  the order (value descending, index ascending): ties come lowest index first, and each entry once.
  ``k`` is at most ``MAX_LOGPROBS`` (20), so a row is read ``k + 2`` times; on a GPU it stays in the
  cache between passes. A NaN is never taken (its row's logprobs are NaN and its id -1 anyway).

The line is ``[logprob of the token, k values, k ids]``, the ids as the table's floats (float32 holds
every id below 2**24 exactly; a larger vocabulary's table is float64), as the torch path lays it out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024  # entries of a row a program reads at once


@triton.jit
def _logprobs_kernel(x_ptr, stride_x, rows_ptr, ids_ptr, out_ptr, stride_out, vocab, k,
                     BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + i.to(tl.int64) * stride_out
    offs = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        x = tl.load(x_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(x, axis=0))
    s = tl.zeros((), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        x = tl.load(x_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        s += tl.sum(tl.exp(x - m), axis=0)
    lse = tl.log(s)
    token = tl.load(ids_ptr + row)
    x_token = tl.load(x_row + token).to(tl.float32)
    tl.store(out_row, (x_token - m) - lse)
    last_v = tl.full((), float("inf"), tl.float32)
    last_i = tl.full((), -1, tl.int32)
    for j in range(0, k):
        best_v = tl.full((), float("-inf"), tl.float32)
        best_i = tl.full((), 2147483647, tl.int32)
        for start in range(0, vocab, BLOCK):
            cols = start + offs
            x = tl.load(x_row + cols, mask=cols < vocab, other=float("nan")).to(tl.float32)
            # Below the last taken in (value descending, index ascending); a NaN compares false, never taken.
            below = (x < last_v) | ((x == last_v) & (cols > last_i))
            v = tl.where(below, x, float("-inf"))
            block_v = tl.max(v, axis=0)
            block_i = tl.min(tl.where(below & (v == block_v), cols, 2147483647), axis=0)
            better = (block_v > best_v) | ((block_v == best_v) & (block_i < best_i))
            best_v = tl.where(better, block_v, best_v)
            best_i = tl.where(better, block_i, best_i)
        tl.store(out_row + 1 + j, (best_v - m) - lse)
        tl.store(out_row + 1 + k + j, best_i.to(out_ptr.dtype.element_ty))
        last_v, last_i = best_v, best_i


def logprob_table(logits: Tensor, rows: Tensor, token_ids: Tensor, k: int, dtype: torch.dtype) -> Tensor:
    """``[len(rows), 1 + 2k]`` of ``dtype`` (float32, or float64 for a vocabulary past 2**24): for each
    row ``rows[i]`` of ``logits`` ``[num_rows, vocab]`` (unit-strided rows), the logprob of token
    ``token_ids[rows[i]]``, then the ``k`` largest logprobs, then their ids."""
    num_rows, vocab = logits.shape
    assert logits.stride(-1) == 1 and rows.dtype == torch.long and token_ids.dtype == torch.long, (
        logits.stride(), rows.dtype, token_ids.dtype)
    assert vocab < 2**31 and k >= 0, (vocab, k)
    out = torch.empty((rows.shape[0], 1 + 2 * k), dtype=dtype, device=logits.device)
    if rows.shape[0]:
        _logprobs_kernel[(rows.shape[0],)](logits, logits.stride(0), rows, token_ids, out, out.stride(0), vocab, k,
                                           BLOCK=BLOCK, num_warps=4)
    return out
