"""The gated MLP's activation in Triton: ``silu(gate) * up`` over the stacked gate/up product in one
kernel, where torch takes two (the activation, then the product) and a temporary between them, on
every layer of a forward that runs eagerly.

The arithmetic is the reference's (``pdserve_kernels.reference.silu_mul``): ``gate / (1 + exp(-gate))``
in float32, rounded to the input's dtype, then the product with ``up`` in float32, rounded again.
The division is correctly rounded (``div_rn``); the exponential is Triton's, which may differ from
the C library's in the last bit of float32: a difference the rounding to 16 bits seldom lets through.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_BLOCK = 4096  # entries of a row's half a program holds at once; wider rows go in several passes


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x_row, stride_o_row, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x_row
    o_row = out_ptr + row * stride_o_row
    offs = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        mask = cols < n_cols
        gate = tl.load(x_row + cols, mask=mask, other=0.0)
        up = tl.load(x_row + n_cols + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)  # rounded as torch's silu rounds it
        y = act.to(tl.float32) * up.to(tl.float32)
        tl.store(o_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``pdserve_kernels.reference.silu_mul`` in one kernel: ``gate_up`` ``[..., 2 * n]`` (gate, then
    up; rows with unit stride), returns ``[..., n]``."""
    width = gate_up.shape[-1]
    assert width % 2 == 0, f"gate_up's last dimension must be even (gate, then up), got {width}"
    assert gate_up.stride(-1) == 1 or width <= 1, f"rows must have unit stride; got strides {gate_up.stride()}"
    n = width // 2
    rows = gate_up.reshape(-1, width)
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and n:
        block = min(MAX_BLOCK, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows.shape[0],)](rows, out, rows.stride(0), out.stride(0), n, BLOCK=block,
                                           num_warps=min(16, max(1, block // 256)))
    return out.view(*gate_up.shape[:-1], n)
