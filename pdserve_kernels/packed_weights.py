"""A mixture's experts' weights as ``moe_experts`` takes them where they stay quantized in memory: stacked packed
integers (GPTQ, AWQ, compressed-tensors), block-wise FP8 or MXFP4 (gpt-oss's), one entry per expert along the first
dimension.
A plain tensor ``[E, out, in]`` is the widened form. The widenings of each packed form (``unpack_int_weight``,
``widen_fp8``, ``widen_mxfp4``) are the checkpoints' dequantizations, which the loader, the torch reference and the
Triton kernels' checks share; ``expert_weight`` widens one expert's."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class IntWeights(NamedTuple):
    """Each expert's packed integer weights: ``qweight`` ``[E, out, in * bits / 32]`` int32 (``32 / bits`` values a word
    along the inputs, the lowest bits first), ``qzeros`` (uint8) and ``scales`` (the checkpoint's dtype) ``[E, out,
    groups]``, groups of ``in / groups`` contiguous inputs (``unpack_int_weight``)."""

    qweight: Tensor
    qzeros: Tensor
    scales: Tensor
    bits: int


class Fp8Weights(NamedTuple):
    """Each expert's block-wise FP8 weight: ``weight`` ``[E, out, in]`` e4m3 and ``scale_inv`` ``[E, out / m, in / n]``
    float32, a scale per ``m x n`` block (``widen_fp8``)."""

    weight: Tensor
    scale_inv: Tensor


class Mxfp4Weights(NamedTuple):
    """Each expert's MXFP4 weight (gpt-oss's experts as released): ``blocks`` ``[E, out, in / 2]`` bytes, two e2m1
    values each (the low four bits the first input), and ``scales`` ``[E, out, in / 32]`` bytes, each group of 32
    inputs' power of two (e8m0: ``2 ** (s - 127)``) (``widen_mxfp4``)."""

    blocks: Tensor
    scales: Tensor


ExpertWeights = Tensor | IntWeights | Fp8Weights | Mxfp4Weights

# MXFP4's four-bit values (e2m1), by code: the high bit the sign.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # inputs to a scale


def widen_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """MXFP4 weights ``[..., rows, in / 2]`` (bytes of two e2m1 values, the low four bits first) with their groups'
    exponents ``[..., rows, in / 32]`` widened to ``[..., rows, in]`` in ``dtype``: each value times its group's power
    of two in float32, rounded once (exact but at the ends of the exponents' range), as transformers widens them."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape[:-1] or \
            blocks.shape[-1] * 2 != scales.shape[-1] * MXFP4_GROUP:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not fit scales "
                         f"{tuple(scales.shape)} {scales.dtype}")
    values = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack(((blocks & 0x0F).long(), (blocks >> 4).long()), dim=-1).flatten(-2)
    powers = torch.exp2(scales.float() - 127).repeat_interleave(MXFP4_GROUP, dim=-1)
    return (values[codes] * powers).to(dtype)


def unpack_int_weight(qweight: Tensor, qzeros: Tensor, scales: Tensor, dtype: torch.dtype, bits: int,
                      g_idx: Tensor | None = None) -> Tensor:
    """The ``[out, in]`` weight in ``dtype`` that packed integer weights of ``bits`` per value stand for:
    ``qweight`` ``[out, in * bits / 32]`` int32 (each word ``32 / bits`` values along the inputs, the lowest bits
    first, unsigned), ``qzeros`` ``[out, groups]`` and ``scales`` ``[out, groups]``, input ``i`` in group ``g_idx[i]``
    (contiguous groups of ``in / groups`` where None): ``(q - z) * s``, the difference exact and the product rounded
    once in the scales' dtype, then to ``dtype``: the weight a checkpoint's widening gives
    (``common.model.quantization.IntValues.widen``)."""
    out = qweight.shape[0]
    if qweight.dtype != torch.int32 or qzeros.shape != scales.shape or scales.shape[0] != out:
        raise ValueError(f"packed weights {tuple(qweight.shape)} {qweight.dtype}, zero points {tuple(qzeros.shape)} "
                         f"and scales {tuple(scales.shape)} do not fit")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    q = ((qweight[..., None] >> shifts) & ((1 << bits) - 1)).reshape(out, -1)
    if g_idx is None:
        g_idx = torch.arange(q.shape[1], device=q.device) // (q.shape[1] // scales.shape[1])
    g_idx = g_idx.long()
    return ((q - qzeros.to(torch.int32)[:, g_idx]).to(scales.dtype) * scales[:, g_idx]).to(dtype)


def widen_fp8(weight: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    """An 8-bit weight ``[..., rows, cols]`` widened to ``dtype``: each block of it (the weight's shape over the
    scales' grid ``[..., rows / m, cols / n]``, or one scale for all) times its scale in float32, rounded once, as
    transformers dequantizes block-wise FP8 checkpoints. Shapes are the caller's to check."""
    rows, cols = weight.shape[-2:]
    grid = scale_inv.shape[-2:] if scale_inv.dim() >= 2 else (1, 1)
    blocks = weight.float().reshape(-1, grid[0], rows // grid[0], grid[1], cols // grid[1])
    scales = scale_inv.float().reshape(-1, grid[0], 1, grid[1], 1)
    return (blocks * scales).to(dtype).reshape(weight.shape)


def expert_count(weights: ExpertWeights) -> int:
    """How many experts ``weights`` stacks."""
    stacked = weights if isinstance(weights, Tensor) else weights[0]
    return int(stacked.shape[0])


def expert_weight(weights: ExpertWeights, expert: int, dtype: torch.dtype) -> Tensor:
    """Expert ``expert``'s weight ``[out, in]`` in ``dtype``: widened where it is packed (as the loader widens the
    checkpoint's), else as it is."""
    if isinstance(weights, IntWeights):
        return unpack_int_weight(weights.qweight[expert], weights.qzeros[expert], weights.scales[expert], dtype,
                                 weights.bits)
    if isinstance(weights, Fp8Weights):
        return widen_fp8(weights.weight[expert], weights.scale_inv[expert], dtype)
    if isinstance(weights, Mxfp4Weights):
        return widen_mxfp4(weights.blocks[expert], weights.scales[expert], dtype)
    return weights[expert]
