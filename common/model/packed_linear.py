"""Projections whose weights stay quantized in memory: what a GPTQ, AWQ, compressed-tensors or block-wise FP8
checkpoint saves is saved in the engine too, where a backend multiplies them so (``PACKS_WEIGHTS``: the Triton
kernels, whose products widen each tile of weights as they read it).

Which layers stay packed is decided as the checkpoint loads (``packed_layers``), a layer (or a stack of them: q, k
and v; gate and up; a mixture's experts) at a time, before anything renames or stacks it: an attention's or an MLP's
projection (a shared expert's, an expert's) whose packed form the kernel reads (``int_kind``, ``fp8_kind``), alike
with the rest of its stack. Everything else is widened to the model's dtype as before: Multi-head Latent Attention's
projections (whose weights the attention reads), an output head a checkpoint quantized, a stack with a part left
unquantized or of another width, groups, order or blocks; experts whose groups are out of order (each expert's
own ``desc_act`` order), or whose checkpoint holds them input-major (Llama 4's, Qwen3-VL-MoE's); over
tensor-parallel ranks, integer layers whose inputs the ranks split and whose groups do not split evenly or are out
of order (``desc_act``); FP8 layers with a single scale or with blocks the ranks' shares would cut, on a GPU
without float8 conversions (before compute capability 8.9), or attention projections in a family whose q/k rows
the loader reorders or splits (interleaved RoPE, GPT-NeoX's fused q/k/v). A projection kept packed is an
``IntLinear`` or an ``Fp8Linear`` in the model, a mixture's experts hold theirs packed (``to_packed_layers``);
gpt-oss's MXFP4 experts too, which the loader keeps as they are (every expert alike).
"""

from __future__ import annotations

import re
from collections.abc import Hashable
from types import ModuleType

import torch
from torch import Tensor, nn

from common.model.llama import Experts, frozen_parameter
from common.model.quantization import IntValues

# The projections that may stay packed, as this model names them (``common.model.weights.model_name``), before
# their parts are stacked (``FUSED_PROJECTIONS``), or stacked in the checkpoint already (Phi-3's); a mixture's
# experts one at a time (``experts.<e>.gate_proj``), or stacked already (``experts.gate_up_proj``).
_PACKABLE = re.compile(r"\.(self_attn\.(q_proj|k_proj|v_proj|qkv_proj|o_proj|query_key_value|output_gate)|"
                       r"mlp(\.shared_expert)?\.(gate_proj|up_proj|gate_up_proj|down_proj)|"
                       r"mlp\.experts\.(\d+\.(gate_proj|up_proj)|(\d+\.)?(gate_up_proj|down_proj)))$")
# An expert's own projection: its stack holds every expert's.
_ONE_EXPERT = re.compile(r"^(?P<head>.+\.experts)\.\d+\.(?P<last>\w+)$")
# Those whose inputs tensor parallelism splits (``common.model.parallel.shard_rules``).
_SPLIT_INPUTS = re.compile(r"\.(o_proj|down_proj)$")
# The parts of a stack, by the name of their first part's projection (each stack must be packed alike).
_STACKS = {"q_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj")}


def int_kind(values: IntValues, model_name: str, tp_size: int) -> Hashable | None:
    """What an integer layer's packed form shares with the rest of its stack (its width, its groups, and where
    they are out of order, each input's group: a stack's parts read one input), or None where it cannot stay
    packed: values not whole words, or, over ``tp_size`` ranks, a projection whose inputs the ranks split
    (``o_proj``, ``down_proj``) whose groups and words do not split alike, or whose groups are out of order."""
    if not values.packable():
        return None
    words, groups = values.q.shape[1] * values.bits // 32, values.scales.shape[1]
    if _SPLIT_INPUTS.search(model_name) and tp_size > 1 and (
            groups % tp_size or words % tp_size or values.g_idx is not None):
        return None
    if ".experts." in model_name and values.g_idx is not None:  # each expert's own order: not stacked so
        return None
    order = None if values.g_idx is None else values.g_idx.to(torch.int32).numpy().tobytes()
    return ("int", values.bits, groups, order)


def fp8_kind(weight: Tensor, scale_inv: Tensor, model_name: str = "", tp_size: int = 1) -> Hashable | None:
    """What an FP8 layer's packed form shares with the rest of its stack (its block's shape), or None where it
    cannot stay packed: not e4m3, one scale for the whole weight, blocks that do not tile it (which widening names
    as a broken checkpoint), or over ``tp_size`` ranks, blocks that the ranks' shares would cut (each rank keeps
    whole blocks of rows, or of columns where the ranks split the inputs: ``o_proj``, ``down_proj``)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() not in (2, 3) or scale_inv.dim() != weight.dim() or \
            weight.shape[:-2] != scale_inv.shape[:-2]:  # 3: a mixture's experts stacked, a grid each
        return None
    (rows, cols), (grid_rows, grid_cols) = weight.shape[-2:], scale_inv.shape[-2:]
    if rows % grid_rows or cols % grid_cols:
        return None
    if (grid_cols if _SPLIT_INPUTS.search(model_name) else grid_rows) % tp_size:
        return None
    return ("fp8", rows // grid_rows, cols // grid_cols)


def _stack(name: str) -> tuple[str, tuple[str, ...]]:
    """The stack a projection (this model's name) is multiplied in: its module and its parts' last names (an
    expert's: the mixture's experts, each expert's parts)."""
    one_expert = _ONE_EXPERT.match(name)
    head, last = (one_expert["head"], one_expert["last"]) if one_expert else name.rpartition(".")[::2]
    return head, next((parts for parts in _STACKS.values() if last in parts), (last,))


def packed_layers(kinds: dict[str, Hashable | None], model_names: dict[str, str],
                  unquantized: frozenset[str] = frozenset()) -> set[str]:
    """The checkpoint prefixes of quantized layers (``kinds``: each one's packed kind, None where it cannot stay
    packed; ``model_names``: each one's name in this model) that stay packed: projections whose stack's parts all
    have one kind (a mixture's experts': every expert's). Where a part of the stack is among the ``unquantized``
    modules (this model's names), none stays packed; a part in neither is not in the model (an ungated MLP's
    ``up_proj`` stands alone)."""
    stacks: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for prefix in kinds:
        if _PACKABLE.search(model_names[prefix]):
            stacks.setdefault(_stack(model_names[prefix]), []).append(prefix)
    left_wide = {_stack(name) for name in unquantized if _PACKABLE.search(name)}
    kept: set[str] = set()
    for stack, prefixes in stacks.items():
        stack_kinds = {kinds[prefix] for prefix in prefixes}
        if stack not in left_wide and len(stack_kinds) == 1 and None not in stack_kinds:
            kept.update(prefixes)
    return kept


class IntLinear(nn.Module):
    """``nn.Linear``'s product with packed integer weights (``pdserve_kernels.reference.int_linear``): ``qweight``
    ``[out, in * bits / 32]`` int32, ``qzeros`` and ``scales`` ``[out, groups]``, the scales in the checkpoint's
    dtype (which the weight's arithmetic is done in), with ``act_order`` each input's group ``g_idx``, and an
    optional bias in the model's. ``dtype`` is the model's, its activations'."""

    def __init__(self, in_features: int, out_features: int, bits: int, groups: int, scales_dtype: torch.dtype,
                 bias: bool, dtype: torch.dtype, kernels: ModuleType, act_order: bool = False) -> None:
        super().__init__()
        if bits not in (2, 4, 8) or in_features % (32 // bits) or (in_features % groups and not act_order):
            raise ValueError(f"{in_features} inputs are not whole words of {bits}-bit values in {groups} groups")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.dtype = dtype
        self.kernels = kernels
        self.qweight = frozen_parameter(out_features, in_features * bits // 32, dtype=torch.int32)
        self.qzeros = frozen_parameter(out_features, groups, dtype=torch.uint8)
        self.scales = frozen_parameter(out_features, groups, dtype=scales_dtype)
        self.bias = frozen_parameter(out_features, dtype=dtype) if bias else None
        # Each input's group where they are out of order (GPTQ's ``desc_act``); None: contiguous groups.
        self.g_idx = frozen_parameter(in_features, dtype=torch.int32) if act_order else None

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.kernels.int_linear(x, self.qweight, self.qzeros, self.scales, self.bits, self.bias,
                                              self.g_idx)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"groups={self.scales.shape[1]}")


class Fp8Linear(nn.Module):
    """``nn.Linear``'s product with a block-wise FP8 weight (``pdserve_kernels.reference.fp8_linear``): ``weight``
    ``[out, in]`` e4m3, held as its bytes (so that casting the model to its dtype leaves it alone, rather than
    widening it on the device first), and ``weight_scale_inv`` ``[out / m, in / n]`` float32, one scale per ``m x n``
    block, as the checkpoint holds them; an optional bias in the model's dtype, ``dtype``, its activations'."""

    def __init__(self, in_features: int, out_features: int, grid: tuple[int, int], bias: bool, dtype: torch.dtype,
                 kernels: ModuleType) -> None:
        super().__init__()
        if out_features % grid[0] or in_features % grid[1]:
            raise ValueError(f"a {out_features} x {in_features} weight does not split into {grid[0]} x {grid[1]} blocks")
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype
        self.kernels = kernels
        self.weight = frozen_parameter(out_features, in_features, dtype=torch.uint8)
        self.weight_scale_inv = frozen_parameter(*grid, dtype=torch.float32)
        self.bias = frozen_parameter(out_features, dtype=dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.kernels.fp8_linear(x, self.weight.view(torch.float8_e4m3fn), self.weight_scale_inv, self.bias)
        return out

    def extra_repr(self) -> str:
        rows, cols = self.weight_scale_inv.shape
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"blocks={self.out_features // rows}x{self.in_features // cols}")


# A projection kept packed: its floating-point tensors whose dtype is the checkpoint's (restored after the model is
# cast to its dtype).
_CHECKPOINT_DTYPE = {IntLinear: ("scales",), Fp8Linear: ("weight_scale_inv",)}
# A mixture's experts' packed weights, stacked: their values (integers) or their blocks' scales (FP8).
_PACKED_EXPERTS = re.compile(r"^(?P<module>.+\.experts)\.(?P<projection>gate_up_proj|down_proj)_"
                             r"(?P<kind>qweight|scale_inv|blocks)$")


def to_packed_layers(model: nn.Module, state: dict[str, Tensor], kernels: ModuleType, dtype: torch.dtype) -> list[str]:
    """In place: each ``nn.Linear`` of ``model`` whose weights ``state`` holds packed (``<name>.qweight``, or
    ``<name>.weight_scale_inv`` beside an 8-bit ``<name>.weight``, as its rank holds them) made an ``IntLinear`` or
    ``Fp8Linear`` of the same inputs and outputs, and each mixture's experts whose stacked weights it holds packed
    (``<experts>.<projection>_qweight``, ``_scale_inv`` beside 8-bit weights, or MXFP4's ``_blocks``) made to hold
    them so (``Experts``: ``hold_int``, ``hold_fp8``, ``hold_mxfp4``); ``model`` is built on the meta device, its
    tensors assigned from ``state`` after. Returns the names of the packed weights' floating-point scales, which keep
    the checkpoint's dtype when the model is cast to its own (MXFP4's exponents are bytes). Packed weights for
    anything else are a checkpoint mismatch."""
    kept_dtype = []
    names = sorted({n.removesuffix(".qweight") for n in state if n.endswith(".qweight")} |
                   {n.removesuffix(".weight_scale_inv") for n in state if n.endswith(".weight_scale_inv")})
    for name in names:
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"checkpoint mismatch: packed weights for {name}, which is not a projection")
        packed: nn.Module
        with torch.device("meta"):
            if f"{name}.qweight" in state:
                words, groups = state[f"{name}.qweight"].shape[1], state[f"{name}.scales"].shape[1]
                packed = IntLinear(linear.in_features, linear.out_features, _bits(name, words, linear.in_features),
                                   groups, state[f"{name}.scales"].dtype, linear.bias is not None, dtype, kernels,
                                   act_order=f"{name}.g_idx" in state)
            else:
                state[f"{name}.weight"] = state[f"{name}.weight"].view(torch.uint8)  # see Fp8Linear
                grid = tuple(state[f"{name}.weight_scale_inv"].shape)
                packed = Fp8Linear(linear.in_features, linear.out_features, (grid[0], grid[1]), linear.bias is not None,
                                   dtype, kernels)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, packed)
        kept_dtype += [f"{name}.{tensor}" for tensor in _CHECKPOINT_DTYPE[type(packed)]]
    for match in sorted(filter(None, map(_PACKED_EXPERTS.match, state)), key=lambda m: m[0]):
        experts, projection = model.get_submodule(match["module"]), match["projection"]
        if not isinstance(experts, Experts):
            raise ValueError(f"checkpoint mismatch: packed weights for {match['module']}, which are not experts")
        with torch.device("meta"):
            if match["kind"] == "blocks":
                experts.hold_mxfp4(projection)
            elif match["kind"] == "qweight":
                words, scales = state[match[0]].shape[2], state[f"{match['module']}.{projection}_scales"]
                inputs = getattr(experts, projection).shape[2]
                experts.hold_int(projection, _bits(f"{match['module']}.{projection}", words, inputs), scales.shape[2],
                                 scales.dtype)
                kept_dtype.append(f"{match['module']}.{projection}_scales")
            else:
                weight = f"{match['module']}.{projection}"
                state[weight] = state[weight].view(torch.uint8)  # see Experts.hold_fp8
                grid = state[match[0]].shape[1:]
                experts.hold_fp8(projection, (grid[0], grid[1]))
                kept_dtype.append(match[0])
    return kept_dtype


def _bits(name: str, words: int, inputs: int) -> int:
    """The bits a value of packed weights whose rows are ``words`` int32 words for ``inputs`` values."""
    bits = 32 * words // inputs
    if bits * inputs != 32 * words:
        raise ValueError(f"checkpoint mismatch: {name}'s {words} words do not hold {inputs} values")
    return bits


def pack_values(state: dict[str, Tensor], prefix: str, values: IntValues) -> None:
    """In place: ``values`` put in ``state`` as ``<prefix>.qweight``, ``.qzeros`` and ``.scales`` (and ``.g_idx``)."""
    for suffix, tensor in values.pack().items():
        state[f"{prefix}.{suffix}"] = tensor
