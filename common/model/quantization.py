"""Quantized checkpoints, read as they load: widened to the model's dtype, or (integer and FP8 weights, with the
Triton kernels) kept packed.

A quantized checkpoint is served as released and computed as transformers computes its dequantized
model: every quantized weight becomes the weight its quantization stands for, once, before anything
renames, splits or stacks it (``common.model.weights``), or, where a backend multiplies them packed
(``common.model.packed_linear``), stays packed (integer weights in a layout of this project's, ``IntValues.pack``;
FP8 and MXFP4 ones as released) and the product widens each value by the same arithmetic. FP8 tensor-core
products are not built. ``common.model.arch`` reads the config (``ModelArch.quantization``, ``fp8_weights`` and, for
integer weights, ``ModelArch.int_weights``) and refuses what this module does not read.

- ``QUANT_FP8``: block-wise e4m3 weights, a scale per block (``weight_scale_inv``); compressed-tensors' 8-bit float
  weights (per channel, tensor or block) are read into the same form (``compressed_fp8_scales``).
- ``QUANT_MXFP4``: gpt-oss's experts, four-bit e2m1 values and a power of two per 32 inputs.
- Integer weights of 2, 4 or 8 bits packed into int32 words, each group of inputs of a row with a
  scale and a zero point: ``w = (q - z) * s``, the difference exact and the product rounded once in the
  scales' dtype, as GPTQModel's, AutoAWQ's and compressed-tensors' dequantizations compute it. Their
  layouts differ (``_gptq``, ``_awq``, ``_compressed_tensors``), each read into ``IntValues``; the arithmetic
  is ``IntValues.widen``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pdserve_kernels.packed_weights import widen_fp8, widen_mxfp4

QUANT_MXFP4 = "mxfp4"
QUANT_FP8 = "fp8"
QUANT_GPTQ = "gptq"
QUANT_AWQ = "awq"
QUANT_COMPRESSED_TENSORS = "compressed-tensors"


# vLLM's ``--quantization`` names for its kernels of a checkpoint format: here the same checkpoints.
_METHOD_ALIASES = {"gptq_marlin": QUANT_GPTQ, "awq_marlin": QUANT_AWQ, "compressed_tensors": QUANT_COMPRESSED_TENSORS}


def quantization_fields(config: Any) -> tuple[str | None, dict[str, Any]]:
    """The checkpoint's ``quantization_config``: its ``quant_method`` (None: not quantized) and its fields,
    whether transformers left it a dict or made it an object."""
    quantization = getattr(config, "quantization_config", None) or {}
    fields = quantization if isinstance(quantization, dict) else vars(quantization)
    method = fields.get("quant_method")
    return getattr(method, "value", method), fields  # transformers' QuantizationMethod is a str enum


def check_quantization(flag: str | None, config: Any) -> None:
    """vLLM's ``--quantization`` against the checkpoint's config: the method its ``quantization_config``
    names (or one of vLLM's kernel names for it), else an error naming both; for a checkpoint without one,
    an error (vLLM quantizes such a model as it loads; that is not implemented)."""
    if flag is None:
        return
    method, _ = quantization_fields(config)
    if method is None:
        raise ValueError(f"--quantization {flag}: the checkpoint is not quantized, and quantizing a model as it "
                         "loads is not implemented (serve a quantized checkpoint, or leave the flag out)")
    if _METHOD_ALIASES.get(flag, flag) != method:
        raise ValueError(f"--quantization {flag}: the checkpoint's quantization_config says {method}")


@dataclass(frozen=True)
class IntWeights:
    """How a checkpoint of integer weights stores them (read from its ``quantization_config``)."""

    method: str  # QUANT_GPTQ, QUANT_AWQ or QUANT_COMPRESSED_TENSORS
    bits: tuple[int, ...]  # the widths its weights may have (compressed-tensors' groups may mix 4 and 8)
    # GPTQ's original format ("gptq", v1) stores each zero point minus one; "gptq_v2" stores it as it is.
    zeros_minus_one: bool = False


# Each method's tensors beside a layer's ``<prefix>.weight``, the first of each the packed weights.
_TENSORS = {
    QUANT_GPTQ: ("qweight", "qzeros", "scales", "g_idx"),
    QUANT_AWQ: ("qweight", "qzeros", "scales"),
    QUANT_COMPRESSED_TENSORS: ("weight_packed", "weight_zero_point", "weight_scale", "weight_g_idx", "weight_shape"),
}
# AutoAWQ's GEMM layout packs a word's eight 4-bit columns in this order: the value of column 8j + c is
# in the word's nibble _AWQ_NIBBLE[c].
_AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class IntValues:
    """One layer's integer weights as its checkpoint's layout reads: unsigned values ``q`` ``[out, in]`` (int32),
    each group's zero point ``zeros`` ``[out, groups]`` (int32) and scale ``scales`` ``[out, groups]``, and
    ``g_idx`` ``[in]``, each input's group (contiguous groups of ``in / groups`` where None)."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None
    bits: int

    def checked(self) -> IntValues:
        """Itself, its shapes and dtypes checked; ``g_idx`` None where it names contiguous groups."""
        out, inputs = self.q.shape
        groups = self.scales.shape[1]
        if self.scales.shape[0] != out or self.zeros.shape != self.scales.shape:
            raise ValueError(f"values {tuple(self.q.shape)}, zero points {tuple(self.zeros.shape)} and scales "
                             f"{tuple(self.scales.shape)} do not fit")
        if not self.scales.is_floating_point():
            raise ValueError(f"scales must be floating point, got {self.scales.dtype}")
        g_idx = self.g_idx
        if g_idx is None:
            if inputs % groups:
                raise ValueError(f"{inputs} inputs do not split into {groups} groups")
        elif g_idx.shape != (inputs,) or g_idx.min() < 0 or g_idx.max() >= groups:
            raise ValueError(f"group index {tuple(g_idx.shape)} does not give each of {inputs} inputs one of "
                             f"{groups} groups")
        elif inputs % groups == 0 and torch.equal(g_idx.long(), torch.arange(inputs) // (inputs // groups)):
            g_idx = None  # activation order that kept the groups in order: contiguous
        return IntValues(self.q, self.zeros, self.scales, g_idx, self.bits)

    def widen(self) -> torch.Tensor:
        """``[out, in]`` weights: ``(q - z) * s``, the difference exact and the product rounded once in the
        scales' dtype."""
        inputs, groups = self.q.shape[1], self.scales.shape[1]
        g_idx = (torch.arange(inputs) // (inputs // groups) if self.g_idx is None else self.g_idx).long()
        difference = self.q.to(torch.int32) - self.zeros.to(torch.int32)[:, g_idx]  # at most 255 apart: exact
        return difference.to(self.scales.dtype) * self.scales[:, g_idx]

    def packable(self) -> bool:
        """Whether ``pack`` keeps it: whole words of values along the inputs."""
        return self.q.shape[1] % (32 // self.bits) == 0

    def pack(self) -> dict[str, torch.Tensor]:
        """The form ``IntLinear`` holds (``pdserve_kernels.reference.int_linear``): ``qweight`` ``[out, in * bits /
        32]`` int32, the values packed along the inputs, the lowest bits first; ``qzeros`` ``[out, groups]`` uint8;
        ``scales`` ``[out, groups]`` in their own dtype; and where the groups are out of order (``desc_act``),
        ``g_idx`` ``[in]`` int32, each input's group."""
        packed = {"qweight": pack_words(self.q, self.bits).contiguous(),
                  "qzeros": self.zeros.to(torch.uint8).contiguous(), "scales": self.scales.contiguous()}
        if self.g_idx is not None:
            packed["g_idx"] = self.g_idx.to(torch.int32).contiguous()
        return packed


def int_weight_layers(state: dict[str, torch.Tensor], spec: IntWeights) -> dict[str, IntValues]:
    """In place: every packed layer's tensors of ``state`` (one layer's tensors, or those of no layer) taken out
    and read, by layer prefix; a scale, zero point or group index left without its weights is a checkpoint
    mismatch, and so is a layer that also holds a ``weight``. Weights the checkpoint left unquantized (an output
    head, a router) stay."""
    names = _TENSORS[spec.method]
    layers: dict[str, IntValues] = {}
    for packed in [n for n in state if n.endswith("." + names[0])]:
        prefix = packed.removesuffix("." + names[0])
        if prefix + ".weight" in state:
            raise ValueError(f"checkpoint mismatch: {prefix} holds both {names[0]} and weight")
        weights = state.pop(packed)
        parts = {name: state.pop(f"{prefix}.{name}", None) for name in names[1:]}
        try:
            layers[prefix] = _READ[spec.method](weights, parts, spec).checked()
        except ValueError as e:
            raise ValueError(f"checkpoint mismatch: {prefix}: {e}") from None
    stray = [n for n in state if n.rpartition(".")[2] in names[1:]]
    if stray:
        raise ValueError(f"checkpoint mismatch: {stray[:3]} without their {names[0]}")
    return layers


def pack_words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``values`` ``[..., n]`` (``n`` whole words of them) packed along the last dimension into int32 words
    of ``32 / bits`` each, the lowest bits first: ``_unpack``'s inverse."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    words = (values.to(torch.int64).reshape(*values.shape[:-1], -1, per_word) << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # the high bit is the sign


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words ``[..., n]`` to their ``32 / bits`` values each ``[..., n * 32 / bits]``, the lowest bits
    first, each unsigned."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed values must be int32, got {words.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*words.shape[:-1], -1)


def _gptq(qweight: torch.Tensor, parts: dict[str, torch.Tensor | None], spec: IntWeights) -> IntValues:
    """GPTQ: ``qweight`` ``[in * bits / 32, out]`` packed along the inputs, ``qzeros`` ``[groups, out * bits /
    32]`` along the outputs, ``scales`` ``[groups, out]``, ``g_idx`` ``[in]`` (the inputs' groups, in any
    order under ``desc_act``)."""
    qzeros, scales = parts["qzeros"], parts["scales"]
    if qzeros is None or scales is None:
        raise ValueError("qweight without qzeros and scales")
    bits = spec.bits[0]
    out = scales.shape[-1]
    q = _unpack(qweight.T.contiguous(), bits)
    # Read as AutoGPTQ and GPTQModel read the original format: one added to each field, within its bits.
    zeros = (_unpack(qzeros, bits)[:, :out] + int(spec.zeros_minus_one)) & ((1 << bits) - 1)
    if q.shape[0] != out:
        raise ValueError(f"qweight {tuple(qweight.shape)} does not fit scales {tuple(scales.shape)}")
    return IntValues(q, zeros.T, scales.T, parts["g_idx"], bits)


def _awq(qweight: torch.Tensor, parts: dict[str, torch.Tensor | None], spec: IntWeights) -> IntValues:
    """AutoAWQ's GEMM layout: ``qweight`` ``[in, out / 8]`` and ``qzeros`` ``[groups, out / 8]``, both packed
    along the outputs in ``_AWQ_NIBBLE``'s order; ``scales`` ``[groups, out]``; groups contiguous."""
    qzeros, scales = parts["qzeros"], parts["scales"]
    if qzeros is None or scales is None:
        raise ValueError("qweight without qzeros and scales")
    bits = spec.bits[0]
    order = (torch.arange(qweight.shape[1] * 8).reshape(-1, 8)[:, list(_AWQ_NIBBLE)]).reshape(-1)
    q = _unpack(qweight, bits)[:, order]
    if q.shape[1] != scales.shape[1]:
        raise ValueError(f"qweight {tuple(qweight.shape)} does not fit scales {tuple(scales.shape)}")
    return IntValues(q.T, _unpack(qzeros, bits)[:, order].T, scales.T, None, bits)


def _compressed_tensors(packed: torch.Tensor, parts: dict[str, torch.Tensor | None], spec: IntWeights) -> IntValues:
    """compressed-tensors' ``pack-quantized``: ``weight_packed`` ``[out, in * bits / 32]`` packed along the
    inputs, each value stored plus 2**(bits - 1); ``weight_shape`` ``[out, in]``; ``weight_scale`` ``[out,
    groups]`` (one group: a scale per channel); ``weight_zero_point`` (asymmetric only) packed along the
    outputs ``[out * bits / 32, groups]``; ``weight_g_idx`` ``[in]`` with activation ordering by groups. Its
    width is the one of ``spec.bits`` the packed shape fits."""
    scales, shape = parts["weight_scale"], parts["weight_shape"]
    if scales is None or shape is None:
        raise ValueError("weight_packed without weight_scale and weight_shape")
    out, inputs = (int(n) for n in shape.tolist())
    fits = [b for b in spec.bits if packed.shape == (out, -(-inputs * b // 32))]
    if len(fits) != 1:
        raise ValueError(f"weight_packed {tuple(packed.shape)} is not {out} x {inputs} values of "
                         f"{' or '.join(map(str, spec.bits))} bits")
    bits = fits[0]
    q = _unpack(packed, bits)[:, :inputs]
    scales = scales.reshape(out, -1)
    zero_point = parts["weight_zero_point"]
    if zero_point is None:
        zeros = torch.full(scales.shape, 1 << (bits - 1), dtype=torch.int32)
    elif zero_point.dtype == torch.int32 and zero_point.shape == (-(-out * bits // 32), scales.shape[1]):
        zeros = _unpack(zero_point.T.contiguous(), bits)[:, :out].T
    elif zero_point.numel() == scales.numel() and not zero_point.is_floating_point():  # unpacked, signed
        zeros = zero_point.reshape(scales.shape).to(torch.int32) + (1 << (bits - 1))
    else:
        raise ValueError(f"weight_zero_point {tuple(zero_point.shape)} {zero_point.dtype} does not fit "
                         f"weight_scale {tuple(scales.shape)}")
    return IntValues(q, zeros, scales, parts["weight_g_idx"], bits)


# Each method's reading of a layer's tensors into its values.
_READ = {QUANT_GPTQ: _gptq, QUANT_AWQ: _awq, QUANT_COMPRESSED_TENSORS: _compressed_tensors}


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An 8-bit weight ``[..., rows, cols]`` (e4m3) widened to ``dtype``: each block of it (the weight's
    shape over the scales' grid) times its scale (``weight_scale_inv`` ``[..., rows / m, cols / n]``) in
    float32, rounded once, as transformers dequantizes it."""
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"an FP8 checkpoint's weight must be float8; got {weight.dtype}")
    rows, cols = weight.shape[-2:]
    grid = scale_inv.shape[-2:] if scale_inv.dim() >= 2 else (1, 1)
    if scale_inv.numel() != weight[..., :1, :1].numel() * grid[0] * grid[1] or rows % grid[0] or cols % grid[1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not split into the scales' {tuple(grid)} blocks")
    return widen_fp8(weight, scale_inv, dtype)


def compressed_fp8_scales(state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """In place: compressed-tensors' 8-bit float weights (``float-quantized``: ``<layer>.weight`` e4m3 beside its
    ``weight_scale``, ``[out, 1]`` per channel, one number per tensor, or a grid of blocks) read as block-wise FP8
    checkpoints hold them (``weight_scale_inv`` over a grid, in float32). compressed-tensors widens a value in its
    scale's dtype, then to the model's (``_dequantize``): the same as rounding once where the scale is in float32 or
    in the model's dtype; a layer whose scale is in another (bfloat16 beside a float32 model) is widened here, so."""
    for name in [n for n in state if n.endswith(".weight_scale")]:
        prefix = name.removesuffix(".weight_scale")
        weight = state.get(prefix + ".weight")
        if weight is None or weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"checkpoint mismatch: {name} without an e4m3 {prefix}.weight")
        scale = state.pop(name)
        grid = scale.reshape(1, 1) if scale.dim() < 2 and scale.numel() == 1 else scale
        if grid.dim() != 2:
            raise ValueError(f"checkpoint mismatch: {name} {tuple(scale.shape)} is no grid over {tuple(weight.shape)}")
        if scale.dtype in (torch.float32, dtype):
            state[prefix + ".weight_scale_inv"] = grid.float()
        else:
            state[prefix + ".weight"] = dequantize_fp8(weight, grid, scale.dtype).to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """gpt-oss's MXFP4 experts widened to ``dtype``: ``blocks`` ``[E, rows, groups, 16]`` bytes, each two
    e2m1 values (the low four bits first), ``scales`` ``[E, rows, groups]``, each group's power of two
    (e8m0: 2 ** (s - 127)). Returns ``[E, groups * 32, rows]``, the layout of gpt-oss's unquantized
    checkpoints (input-major). Every value is a small integer over a power of two, exact in float32 and
    in bfloat16, so the widening is exact, as transformers' own (``pdserve_kernels.packed_weights.widen_mxfp4``);
    one expert at a time, to bound the temporaries of a large checkpoint."""
    if blocks.dim() != 4 or blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not fit scales "
                         f"{tuple(scales.shape)} {scales.dtype}")
    num_experts, rows, groups, num_bytes = blocks.shape
    out = torch.empty(num_experts, rows, groups * 2 * num_bytes, dtype=dtype)
    for e in range(num_experts):
        out[e] = widen_mxfp4(blocks[e].reshape(rows, -1), scales[e], dtype)
    return out.transpose(1, 2)
