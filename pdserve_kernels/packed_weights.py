"""A mixture's experts' weights as ``moe_experts`` takes them where they stay quantized in memory: stacked packed
integers (GPTQ, AWQ, compressed-tensors), block-wise FP8 or MXFP4 (gpt-oss's), one entry per expert along the first
dimension.
A plain tensor ``[E, out, in]`` is the widened form. ``expert_weight`` widens one expert's as the checkpoint's
dequantization does (the torch reference's way, and the Triton kernel's reference)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class IntWeights(NamedTuple):
    """Each expert's packed integer weights: ``qweight`` ``[E, out, in * bits / 32]`` int32 (``32 / bits`` values a word
    along the inputs, the lowest bits first), ``qzeros`` (uint8) and ``scales`` (the checkpoint's dtype) ``[E, out,
    groups]``, groups of ``in / groups`` contiguous inputs (``pdserve_kernels.reference.unpack_int_weight``)."""

    qweight: Tensor
    qzeros: Tensor
    scales: Tensor
    bits: int


class Fp8Weights(NamedTuple):
    """Each expert's block-wise FP8 weight: ``weight`` ``[E, out, in]`` e4m3 and ``scale_inv`` ``[E, out / m, in / n]``
    float32, a scale per ``m x n`` block (``pdserve_kernels.reference.widen_fp8``)."""

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


def expert_count(weights: ExpertWeights) -> int:
    """How many experts ``weights`` stacks."""
    stacked = weights if isinstance(weights, Tensor) else weights[0]
    return int(stacked.shape[0])


def expert_weight(weights: ExpertWeights, expert: int, dtype: torch.dtype) -> Tensor:
    """Expert ``expert``'s weight ``[out, in]`` in ``dtype``: widened where it is packed (as the loader widens the
    checkpoint's), else as it is."""
    from pdserve_kernels.reference import unpack_int_weight, widen_fp8

    if isinstance(weights, IntWeights):
        return unpack_int_weight(weights.qweight[expert], weights.qzeros[expert], weights.scales[expert], dtype,
                                 weights.bits)
    if isinstance(weights, Fp8Weights):
        return widen_fp8(weights.weight[expert], weights.scale_inv[expert], dtype)
    if isinstance(weights, Mxfp4Weights):
        return widen_mxfp4(weights.blocks[expert], weights.scales[expert], dtype)
    return weights[expert]
