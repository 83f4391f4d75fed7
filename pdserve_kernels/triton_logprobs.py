"""A step's logprob table with one Triton kernel beside torch's ``topk``: for each row that asked for
logprobs, the sampled token's logprob and the row's ``k`` most likely tokens with theirs.

The sampler's torch path builds the table from a log-softmax over those rows, a gather of the sampled
tokens, a ``topk``, a conversion of its indices and a concatenation, with a copy of the rows first:
seven launches a step. Here the ``k`` largest come from ``topk`` over the rows' raw logits (the
log-softmax keeps their order: it subtracts the same number from each entry of a row), and one
program per row then reads the raw logits (any float dtype, widened to float32; the sampler never
writes into them) and writes its line of the table:

* a pass for the row's maximum ``m``, a pass for ``s``, the sum of ``exp(x - m)``; a logprob is
  ``(x - m) - log(s)``, the log-softmax's own formula;
* the sampled token's logprob (the token read from the step's ids on the device), the ``k`` largest
  values' logprobs and their ids.

Three launches (the rows' copy, ``topk``, the kernel), one where no row asks for alternatives. A row
is read twice by one program in blocks of ``BLOCK``; ``topk`` is torch's radix selection, which a
kernel of repeated passes for the ``k`` largest (tried first) would not match at ``k`` 20.

The line is ``[logprob of the token, k values, k ids]``, the ids as the table's floats (float32 holds
every id below 2**24 exactly; a larger vocabulary's table is float64), as the torch path lays it out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 4096  # entries of a row a program reads at once


# The counts and strides that move with the step's requests are not specialised on (as 1, or as
# multiples of 16): one compiled variant per ``K_BLOCK`` (16 or 32), warmed up at start.
@triton.jit(do_not_specialize=["stride_top", "stride_out", "k"])
def _logprobs_kernel(x_ptr, stride_x, rows_ptr, ids_ptr, top_v_ptr, top_i_ptr, stride_top, out_ptr, stride_out,
                     vocab, k, BLOCK: tl.constexpr, K_BLOCK: tl.constexpr):
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
    j = tl.arange(0, K_BLOCK)
    top = top_v_ptr + i.to(tl.int64) * stride_top + j
    v = tl.load(top, mask=j < k, other=0.0).to(tl.float32)
    idx = tl.load(top_i_ptr + i.to(tl.int64) * stride_top + j, mask=j < k, other=0)
    tl.store(out_row + 1 + j, (v - m) - lse, mask=j < k)
    tl.store(out_row + 1 + k + j, idx.to(out_ptr.dtype.element_ty), mask=j < k)


def logprob_table(logits: Tensor, rows: Tensor, token_ids: Tensor, k: int, dtype: torch.dtype,
                  out: Tensor | None = None) -> Tensor:
    """``[len(rows), 1 + 2k]`` of ``dtype`` (float32, or float64 for a vocabulary past 2**24): for each
    row ``rows[i]`` of ``logits`` ``[num_rows, vocab]`` (unit-strided rows), the logprob of token
    ``token_ids[rows[i]]``, then the ``k`` largest logprobs, then their ids. ``out``: a tensor of that
    shape and dtype (unit-strided rows) to write the table into, returned; by default a new one."""
    num_rows, vocab = logits.shape
    assert logits.stride(-1) == 1 and rows.dtype == torch.long and token_ids.dtype == torch.long, (
        logits.stride(), rows.dtype, token_ids.dtype)
    assert vocab < 2**31 and 0 <= k <= vocab, (vocab, k)
    if out is None:
        out = torch.empty((rows.shape[0], 1 + 2 * k), dtype=dtype, device=logits.device)
    assert out.shape == (rows.shape[0], 1 + 2 * k) and out.dtype == dtype and out.stride(-1) == 1, (
        out.shape, out.dtype, out.stride())
    if not rows.shape[0]:
        return out
    if k:
        top_v, top_i = logits.index_select(0, rows).topk(k, dim=-1)
    else:  # stand-ins, never read
        top_v, top_i = out, rows.unsqueeze(1)
    _logprobs_kernel[(rows.shape[0],)](logits, logits.stride(0), rows, token_ids, top_v, top_i, top_v.stride(0), out,
                                       out.stride(0), vocab, k, BLOCK=BLOCK,
                                       K_BLOCK=max(16, triton.next_power_of_2(k)), num_warps=8)
    return out
