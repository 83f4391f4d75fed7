"""Projections whose integer weights stay packed: what a GPTQ, AWQ or compressed-tensors checkpoint saves in memory
is saved in the engine's too, where a backend multiplies them so (``PACKS_INT_WEIGHTS``: the Triton kernels).

Which layers stay packed is decided as the checkpoint loads (``packed_layers``), a layer (or a stack of them, q, k
and v; gate and up) at a time, before anything renames or stacks it: an attention's or a dense MLP's projection (a
shared expert's too) whose groups of inputs are contiguous and whole words of values, with the same width and
groups as the rest of its stack. Everything else is widened as before: a mixture's experts (stacked tensors, not
products), Multi-head Latent Attention's projections (whose weights the attention reads), a layer whose
``desc_act`` reordered its groups, an output head a checkpoint quantized. A layer kept packed is an ``IntLinear``
in the model (``to_int_linears``), holding ``IntValues.pack``'s tensors; its products are ``int_linear``'s.
"""

from __future__ import annotations

import re
from types import ModuleType

import torch
from torch import Tensor, nn

from common.model.quantization import IntValues

# The projections that may stay packed, as this model names them (``common.model.weights.model_name``), before
# their parts are stacked (``FUSED_PROJECTIONS``), or stacked in the checkpoint already (Phi-3's).
_PACKABLE = re.compile(r"\.(self_attn\.(q_proj|k_proj|v_proj|qkv_proj|o_proj|query_key_value|output_gate)|"
                       r"mlp(\.shared_expert)?\.(gate_proj|up_proj|gate_up_proj|down_proj))$")
# Those whose inputs tensor parallelism splits (``common.model.parallel.shard_rules``).
_SPLIT_INPUTS = re.compile(r"\.(o_proj|down_proj)$")
# The parts of a stack, by the name of their first part's projection (each stack must be packed alike).
_STACKS = {"q_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj")}


def packed_layers(layers: dict[str, IntValues], model_names: dict[str, str], tp_size: int = 1,
                  unquantized: frozenset[str] = frozenset()) -> set[str]:
    """The checkpoint prefixes of ``layers`` (its integer layers, with ``model_names``, each prefix's name in this
    model) that stay packed: packable projections whose stack's parts are all packable, of one width and one
    group size. Where a part of the stack is among the ``unquantized`` modules (this model's names), none stays
    packed; a part in neither is not in the model (an ungated MLP's ``up_proj`` stands alone). Over ``tp_size``
    ranks, a projection whose inputs the ranks split (``o_proj``, ``down_proj``) stays packed only where its groups
    and words split alike."""
    by_model = {model_names[prefix]: prefix for prefix in layers}
    kept: set[str] = set()
    for name, prefix in by_model.items():
        values = layers[prefix]
        if not _PACKABLE.search(name) or not values.packable():
            continue
        if _SPLIT_INPUTS.search(name) and (values.scales.shape[1] % tp_size or
                                           values.q.shape[1] * values.bits // 32 % tp_size):
            continue
        head, _, last = name.rpartition(".")
        stack = next((parts for parts in _STACKS.values() if last in parts), (last,))
        if any(f"{head}.{part}" in unquantized for part in stack):
            continue
        parts = [layers[by_model[f"{head}.{part}"]] for part in stack if f"{head}.{part}" in by_model]
        if all(v.packable() for v in parts) and len({(v.bits, v.q.shape[1] // v.scales.shape[1]) for v in parts}) == 1:
            kept.add(prefix)
    return kept


class IntLinear(nn.Module):
    """``nn.Linear``'s product with packed integer weights (``pdserve_kernels.reference.int_linear``): ``qweight``
    ``[out, in * bits / 32]`` int32, ``qzeros`` and ``scales`` ``[out, groups]``, the scales in the checkpoint's
    dtype (which the weight's arithmetic is done in), and an optional bias in the model's. ``dtype`` is the
    model's, its activations'. The tensors are parameters without gradients, so that the loader checks them as it
    checks every weight."""

    def __init__(self, in_features: int, out_features: int, bits: int, groups: int, scales_dtype: torch.dtype,
                 bias: bool, dtype: torch.dtype, kernels: ModuleType) -> None:
        super().__init__()
        if bits not in (2, 4, 8) or in_features % (32 // bits) or in_features % groups:
            raise ValueError(f"{in_features} inputs are not whole words of {bits}-bit values in {groups} groups")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        self.dtype = dtype
        self.kernels = kernels

        def frozen(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.qweight = frozen(out_features, in_features * bits // 32, dtype=torch.int32)
        self.qzeros = frozen(out_features, groups, dtype=torch.uint8)
        self.scales = frozen(out_features, groups, dtype=scales_dtype)
        self.bias = frozen(out_features, dtype=dtype) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.kernels.int_linear(x, self.qweight, self.qzeros, self.scales, self.bits, self.bias)
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"groups={self.scales.shape[1]}")


def to_int_linears(model: nn.Module, state: dict[str, Tensor], kernels: ModuleType, dtype: torch.dtype) -> list[str]:
    """In place: each ``nn.Linear`` of ``model`` whose weights ``state`` holds packed (``<name>.qweight``, as its rank
    holds them) made an ``IntLinear`` of the same inputs and outputs (``model`` built on the meta device, its
    tensors assigned from ``state`` after); the names of those replaced. A packed weight for anything else is a
    checkpoint mismatch."""
    replaced = []
    for name in sorted(n.removesuffix(".qweight") for n in state if n.endswith(".qweight")):
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"checkpoint mismatch: packed weights for {name}, which is not a projection")
        words, groups = state[f"{name}.qweight"].shape[1], state[f"{name}.scales"].shape[1]
        bits = 32 * words // linear.in_features
        if bits * linear.in_features != 32 * words:
            raise ValueError(f"checkpoint mismatch: {name}'s {words} words do not hold {linear.in_features} values")
        with torch.device("meta"):
            packed = IntLinear(linear.in_features, linear.out_features, bits, groups, state[f"{name}.scales"].dtype,
                               linear.bias is not None, dtype, kernels)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, packed)
        replaced.append(name)
    return replaced


def pack_values(state: dict[str, Tensor], prefix: str, values: IntValues) -> None:
    """In place: ``values`` put in ``state`` as ``<prefix>.qweight``, ``.qzeros`` and ``.scales``."""
    for suffix, tensor in values.pack().items():
        state[f"{prefix}.{suffix}"] = tensor
