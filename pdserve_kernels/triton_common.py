"""What the attention kernels share: their matrix product and its operand handling, launch options.

Float32 caches use exact ("ieee") products rather than TF32, so they match the reference closely;
half-precision caches use the tensor cores' default. Triton's CPU interpreter multiplies bfloat16
operands as their raw 16-bit integers, so on the CPU bfloat16 operands are widened to float32
first: widening is exact and the tensor cores accumulate in float32 too, so the products agree.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from pdserve_kernels.reference import FP8_CACHES
from pdserve_kernels.triton_checks import check_block_n

FULL_WINDOW = 1 << 30  # the sliding window passed for full attention: longer than any context


@triton.jit
def dot(a, b, WIDEN: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` accumulated in float32."""
    if WIDEN:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def soft_cap_scores(s, soft_cap):
    """``soft_cap * tanh(s / soft_cap)``; tanh as ``2 * sigmoid(2x) - 1``, which the interpreter runs too."""
    return soft_cap * (2.0 * tl.sigmoid(2.0 * (s / soft_cap)) - 1.0)


@triton.jit
def load_kv(ptrs, mask, dtype, KV_FP8: tl.constexpr):
    """A K or V tile, an 8-bit cache's widened to ``dtype`` (exact; via float32, which the interpreter converts right)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if KV_FP8:
        x = x.to(tl.float32).to(dtype)
    return x


@triton.jit
def tile_scores(q, q_hi, k_ptrs, v_ptrs, kv_mask, LATENT: tl.constexpr, KV_FP8: tl.constexpr, WIDEN_DOT: tl.constexpr,
                DOT_PRECISION: tl.constexpr):
    """A key tile's unscaled scores against the queries, its K tile and, with ``LATENT`` (each key one vector split
    across the K and V slots), its V tile, the keys' second halves, which the queries' second halves ``q_hi`` meet."""
    k = load_kv(k_ptrs, kv_mask, q.dtype, KV_FP8)
    s = dot(q, tl.trans(k), WIDEN_DOT, DOT_PRECISION)
    v_hi = k
    if LATENT:
        v_hi = load_kv(v_ptrs, kv_mask, q.dtype, KV_FP8)
        s += dot(q_hi, tl.trans(v_hi), WIDEN_DOT, DOT_PRECISION)
    return s, k, v_hi


@triton.jit
def attend(acc, acc_hi, alpha, p, k, v_hi, v_ptrs, kv_mask, LATENT: tl.constexpr, KV_FP8: tl.constexpr,
           WIDEN_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The accumulators rescaled by ``alpha`` plus a tile's weights ``p`` times its values: the V tile, or with
    ``LATENT`` the keys themselves, their K halves into ``acc`` and their V halves (``v_hi``) into ``acc_hi``."""
    if LATENT:
        acc = acc * alpha[:, None] + dot(p.to(k.dtype), k, WIDEN_DOT, DOT_PRECISION)
        acc_hi = acc_hi * alpha[:, None] + dot(p.to(v_hi.dtype), v_hi, WIDEN_DOT, DOT_PRECISION)
    else:
        v = load_kv(v_ptrs, kv_mask, k.dtype, KV_FP8)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, WIDEN_DOT, DOT_PRECISION)
    return acc, acc_hi


def score_args(scale: float, soft_cap: float | None, log2e: float) -> dict[str, object]:
    """The ``qk_scale``, ``soft_cap`` and ``SOFT_CAP`` launch arguments of the attention kernels.

    Without capping the scale folds in ``log2e`` (one multiply); with it, scores are capped in natural
    units and converted after.
    """
    if soft_cap:
        return {"qk_scale": scale, "soft_cap": float(soft_cap), "SOFT_CAP": True}
    return {"qk_scale": scale * log2e, "soft_cap": 1.0, "SOFT_CAP": False}


def dot_constexprs(cache_dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    """The ``WIDEN_DOT`` and ``DOT_PRECISION`` launch arguments of the attention kernels."""
    return {
        "WIDEN_DOT": cache_dtype == torch.bfloat16 and device.type == "cpu",
        "DOT_PRECISION": "ieee" if cache_dtype == torch.float32 else "tf32",
    }


def kv_constexprs(kv_dtype: torch.dtype, query_dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    """The attention kernels' ``KV_FP8``, ``WIDEN_DOT`` and ``DOT_PRECISION``: an 8-bit cache's K and V
    are widened to the queries' dtype as they are loaded, and the products run in that dtype; any
    other cache's queries are narrowed to the cache's dtype, as before."""
    fp8 = kv_dtype in FP8_CACHES
    return {"KV_FP8": fp8, **dot_constexprs(query_dtype if fp8 else kv_dtype, device)}


@triton.jit
def to_cache(x, dtype: tl.constexpr, SATURATE: tl.constexpr):
    """``x`` as the cache stores it: an 8-bit cache's entries rounded to float8 (e4m3, or e5m2 where ``dtype`` is)
    and saturated at its largest finite value (+-448, +-57344: never NaN or infinite) first, as
    ``pdserve_kernels.reference.to_cache`` stores them."""
    if SATURATE:
        if dtype == tl.float8e5:  # 2 mantissa bits, normal exponents from -14, largest 57344
            x = fp8_grid(x.to(tl.float32), 2, -14, 57344.0)
        else:  # e4m3: 3 mantissa bits, normal exponents from -6, largest 448
            x = fp8_grid(x.to(tl.float32), 3, -6, 448.0)
    return x.to(dtype)


@triton.jit
def fp8_grid(x, MANTISSA: tl.constexpr, MIN_EXPONENT: tl.constexpr, LARGEST: tl.constexpr):
    """``x`` (float32) rounded to the nearest value of a float8 format (``MANTISSA`` bits, normal exponents from
    ``MIN_EXPONENT``), ties to even, saturated at its ``LARGEST`` finite value, still in float32: its conversion
    to 8 bits is then exact. Done in arithmetic rather than left to the conversion, which Triton's CPU interpreter
    gets wrong where rounding carries into the exponent (7.9 became 4.0 in e4m3); a GPU's conversion agrees with
    this one."""
    bits = x.to(tl.int32, bitcast=True)
    ax = tl.minimum(tl.abs(x), LARGEST)
    # The binade's exponent (subnormals share the smallest normal one's), and its step.
    exponent = tl.maximum(((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXPONENT)
    step = ((exponent - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)
    v = ax / step  # exact: a power of two
    r = tl.floor(v)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    r = tl.where((v - r > 0.5) | ((v - r == 0.5) & odd), r + 1.0, r)
    rounded = (r * step).to(tl.int32, bitcast=True) | ((bits >> 31) << 31)  # x's sign back, -0 too
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def rounded_to(x, dtype: tl.constexpr):
    """``x`` (float32) rounded to ``dtype``, to the nearest value, ties to even. bfloat16 is rounded in arithmetic on
    the bits first (its conversion then exact), as a GPU's conversion rounds: Triton's CPU interpreter truncates."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def launch_options(num_warps: int | None, num_stages: int | None) -> dict[str, int]:
    """Launch options to pass on; ``None`` keeps Triton's default."""
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return {k: v for k, v in options.items() if v is not None}


# Per kernel variant and device, the key-tile width it launches with where the default's did not fit.
_FITTED_BLOCK_N: dict[Hashable, int] = {}


def launch_fitting(key: Hashable, block_n: int, launch: Callable[[int], None], requested: int | None = None) -> None:
    """``launch(block_n)``, or, where the GPU cannot give one program the shared memory that tile needs
    (Triton refuses the launch: a 256-wide head at 16 bits on an sm86/sm89 GPU, which allow a program
    99 KiB, or a float32 cache at 128 there), with half the tile, down to 16. The width that fits is
    remembered per ``key`` (the kernel, its other tile sizes, the cache's dtype, the device), so a
    variant searches once, at its first launch (the engine warms its kernels up before it serves).
    A ``requested`` width (a caller's explicit tile) is checked and launched as it is, never changed."""
    if requested is not None:
        check_block_n(requested)
        launch(requested)
        return
    block_n = _FITTED_BLOCK_N.get(key, block_n)
    while True:
        try:
            launch(block_n)
            return
        except OutOfResources:
            if block_n <= 16:
                raise
            block_n //= 2
            _FITTED_BLOCK_N[key] = block_n
