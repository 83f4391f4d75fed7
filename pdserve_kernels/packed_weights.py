"""A mixture's experts' weights as ``moe_experts`` takes them where they stay quantized in memory: stacked packed
integers (GPTQ, AWQ, compressed-tensors) or stacked block-wise FP8, one entry per expert along the first dimension.
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


ExpertWeights = Tensor | IntWeights | Fp8Weights


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
    return weights[expert]
