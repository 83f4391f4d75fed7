"""The gated MLP's activation kernel (``silu(gate) * up``) against the torch reference, under the
interpreter: every dtype, 3-D inputs, widths that are no power of two or wider than one pass, rows of
a wider tensor."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see conftest.py)

import pytest
import torch

from pdserve_kernels import reference, triton_act

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in units in the last place of the output's dtype."""
    ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp(min=torch.finfo(want.dtype).tiny)
    return float(((got.float() - want.float()).abs() / ulp).max())


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("shape", [(7, 2 * 1536), (3, 5, 2 * 80), (2, 2 * (triton_act.MAX_BLOCK + 3))])
def test_the_kernel_computes_the_reference_formula(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gate_up = (4 * torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1]))).to(dtype)
    got, want = triton_act.silu_mul(gate_up), reference.silu_mul(gate_up)
    assert got.shape == want.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    # Rounded to the dtype after each operation, as the reference: at most the exponential's last bit
    # of float32 apart before that (the CPU's vectorised exponential is not numpy's), which a rounding
    # to 16 bits lets through now and then, and the product carries (two units). The interpreter casts
    # float32 to bfloat16 by truncation where a GPU rounds to nearest: there bfloat16 differs more often.
    assert _ulps(got, want) <= (4.0 if dtype == F32 else 2.0)
    exact = float((got == want).float().mean())
    assert exact > {F32: 0.5, F16: 0.99, BF16: 0.2}[dtype], f"only {exact:.1%} of entries equal the reference's"


def test_rows_of_a_wider_tensor_and_bad_shapes() -> None:
    wide = torch.randn(6, 500, generator=torch.Generator().manual_seed(1))
    gate_up = wide[:, 100:300]  # rows of a wider tensor: row stride 500
    torch.testing.assert_close(triton_act.silu_mul(gate_up), reference.silu_mul(gate_up.contiguous()))
    assert triton_act.silu_mul(gate_up[:0]).shape == (0, 100)
    with pytest.raises(AssertionError, match="even"):
        triton_act.silu_mul(torch.randn(2, 7))
    with pytest.raises(AssertionError, match="unit stride"):
        triton_act.silu_mul(torch.randn(8, 4).t())
