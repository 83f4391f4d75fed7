"""LoRA adapters in PEFT's format, served beside the base model, many in one batch.

Each adapted projection computes ``W x + B (A x) * scaling`` for the rows of a request that names an
adapter, as PEFT's ``LoraLayer`` does, and ``W x`` alone for the others. Every adapter stays resident:
its A and B are copied at start into a slot of two tensors laid out over all adapters (A's rows and B's
columns slot after slot, the rank padded with zeros to the largest served), so a step needs no copy.
Each step says which adapter each token has (``LoRABatch``); ``LoRALinear`` explains what a step of one
adapter and a step mixing them compute. The scaling is folded into B as it loads.

On the projections this model stacks (q, k and v; gate and up), each part adapted has a column range of
its own in the stacked ranks and writes only its own rows of the output. An adapter of a checkpoint that
stacks them already (Phi-3's ``qkv_proj``) adapts the whole product.

Refused by name (``UnsupportedAdapter``), never approximated: DoRA, trained biases, ``modules_to_save``,
per-module ranks or alphas, adapted embeddings or output head, experts of a mixture, Multi-head Latent
Attention's projections but its output (DeepSeek's q, latent and up-projections), modules this model does
not have, the q and k rows of a family whose checkpoints' rows are reordered as they load (interleaved
RoPE), pickled weights (``adapter_model.bin``), and any PEFT field outside those known not
to change the forward of a trained adapter.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from common.lora_modules import LoRAModule
from common.model.llama import FUSED_PROJECTIONS, MLP, Attention, LlamaForCausalLM
from common.model.mla import MLAttention
from common.model.packed_linear import Fp8Linear, IntLinear
from common.model.weights import model_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# PEFT fields that change a trained adapter's forward: built only at their do-nothing value.
_MUST_BE_UNSET = (
    "use_dora", "lora_bias", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern",
    "layer_replication", "trainable_token_indices", "alora_invocation_tokens", "target_parameters", "use_qalora",
    "use_bdlora", "megatron_config", "arrow_config", "kasa_config", "monteclora_config",
)
# Fields read here, or that only concern training and initialization.
_KNOWN = {
    "r", "lora_alpha", "use_rslora", "bias", "peft_type", "task_type", "target_modules", "exclude_modules",
    "lora_dropout", "init_lora_weights", "inference_mode", "base_model_name_or_path", "revision", "peft_version",
    "auto_mapping", "layers_to_transform", "layers_pattern", "loftq_config", "eva_config", "corda_config",
    "lora_ga_config", "megatron_core", "qalora_group_size", "ensure_weight_tying",
}
# The projections an adapter may adapt (this model's names, after the family's renames and stacking).
_ADAPTABLE = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.up_proj", "mlp.down_proj",
              "mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj")
# What an adapter may wrap: a projection, its weights widened or packed.
_PROJECTIONS = (nn.Linear, IntLinear, Fp8Linear)
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>A|B)\.weight$")


class UnsupportedAdapter(ValueError):
    """An adapter this engine does not implement, with the reason named."""


@dataclass
class _Target:
    """Where one adapted module of a checkpoint lands: a projection of this model, the part of it (its
    index among the stacked parts, 0 for the whole) and that part's rows of its output."""

    module: str
    part: int
    rows: slice


@dataclass
class LoRAAdapter:
    """One adapter, read and checked: per projection of this model, (part, rows, A, B * scaling)."""

    name: str
    rank: int
    weights: dict[str, list[tuple[int, slice, Tensor, Tensor]]] = field(default_factory=dict)


def _config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except FileNotFoundError:
        raise UnsupportedAdapter(f"{folder}: no {ADAPTER_CONFIG} (a PEFT LoRA adapter's folder)") from None
    except json.JSONDecodeError as e:
        raise UnsupportedAdapter(f"{folder / ADAPTER_CONFIG}: not JSON: {e}") from None
    if not isinstance(config, dict):
        raise UnsupportedAdapter(f"{folder / ADAPTER_CONFIG}: not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise UnsupportedAdapter(f"{folder}: peft_type {config['peft_type']!r} is not implemented (LORA only)")
    if config.get("bias", "none") != "none":
        raise UnsupportedAdapter(f"{folder}: bias {config['bias']!r} (trained biases) is not implemented")
    for name in _MUST_BE_UNSET:
        if config.get(name):
            raise UnsupportedAdapter(f"{folder}: {name} = {config[name]!r} is not implemented")
    unknown = sorted(k for k, v in config.items() if k not in _KNOWN and k not in _MUST_BE_UNSET and v)
    if unknown:
        raise UnsupportedAdapter(f"{folder}: adapter config field(s) {', '.join(unknown)} not implemented")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise UnsupportedAdapter(f"{folder}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise UnsupportedAdapter(f"{folder}: lora_alpha must be a number, got {alpha!r}")
    return config


def _part_rows(parent: nn.Module) -> list[int]:
    """The output rows of each part of a stacked projection: q, k, v's, or gate and up's."""
    if isinstance(parent, Attention):
        return [parent.q_size, parent.kv_size, parent.kv_size]
    assert isinstance(parent, MLP)
    return [parent.inter, parent.inter]


def _linear(module: nn.Module | None) -> nn.Module | None:
    """A projection, the one a ``LoRALinear`` wraps for one that is wrapped."""
    return module.base if isinstance(module, LoRALinear) else module


def _target(modules: dict[str, nn.Module], module: str) -> _Target:
    """Where an adapted module (this model's name for it) lands among the model's ``modules``, or
    ``UnsupportedAdapter``."""
    prefix, _, last = module.rpartition(".")
    own = _linear(modules.get(module))
    if isinstance(own, _PROJECTIONS) and module.endswith(_ADAPTABLE):
        return _Target(module, 0, slice(0, own.out_features))
    for fused, parts in FUSED_PROJECTIONS.items():
        stacked = _linear(modules.get(f"{prefix}.{fused}"))
        if last in parts and isinstance(stacked, _PROJECTIONS) and f"{prefix}.{fused}".endswith(_ADAPTABLE):
            index = parts.index(last)
            sizes = _part_rows(modules[prefix])
            start = sum(sizes[:index])
            return _Target(f"{prefix}.{fused}", index, slice(start, start + sizes[index]))
    if ".experts." in module:
        raise UnsupportedAdapter(f"LoRA on a mixture's experts ({module}) is not implemented")
    if isinstance(modules.get(prefix), MLAttention):  # its output projection alone is a plain one (taken above)
        raise UnsupportedAdapter(f"LoRA on {module} is not implemented: of Multi-head Latent Attention's projections "
                                 "(DeepSeek's), o_proj only")
    raise UnsupportedAdapter(f"LoRA on {module} is not implemented: the attention's and the MLP's projections "
                             "of the layers only")


def check_adapter_folder(spec: LoRAModule) -> tuple[dict[str, Any], Path]:
    """The adapter's config, checked, and its weights file; ``UnsupportedAdapter`` naming what is not
    built (what needs the model, its modules and shapes, ``load_adapter`` checks)."""
    folder = Path(spec.path).expanduser()
    config = _config(folder)
    file = folder / ADAPTER_WEIGHTS
    if not file.exists():
        pickled = " (adapter_model.bin is a pickle, which is never loaded: save it with safetensors)"
        raise UnsupportedAdapter(f"{folder}: no {ADAPTER_WEIGHTS}{pickled if (folder / 'adapter_model.bin').exists() else ''}")
    return config, file


def load_adapter(spec: LoRAModule, model: LlamaForCausalLM, max_rank: int) -> LoRAAdapter:
    """Read and check the adapter at ``spec.path`` against ``model`` (on the CPU, in float32)."""
    from safetensors import safe_open

    config, file = check_adapter_folder(spec)
    rank = int(config["r"])
    if rank > max_rank:
        raise UnsupportedAdapter(f"adapter {spec.name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    scaling = float(config["lora_alpha"]) / (math.sqrt(rank) if config.get("use_rslora") else rank)
    pairs: dict[str, dict[str, Tensor]] = {}
    with safe_open(str(file), framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            match = _KEY.match(key)
            if match is None:
                raise UnsupportedAdapter(f"adapter {spec.name!r}: weight {key} is not implemented (LoRA A and B of "
                                         "linear projections only)")
            pairs.setdefault(match["module"], {})[match["which"]] = f.get_tensor(key)
    if not pairs:
        raise UnsupportedAdapter(f"adapter {spec.name!r}: {file} holds no LoRA weights")
    arch = model.arch
    modules = dict(model.named_modules())
    adapter = LoRAAdapter(spec.name, rank)
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise UnsupportedAdapter(f"adapter {spec.name!r}: {module} without lora_{'B' if 'A' in ab else 'A'}")
        ours = model_name(module + ".weight", arch.model_type).removesuffix(".weight")
        target = _target(modules, ours)
        if arch.rope_interleaved and target.module.endswith("qkv_proj") and target.rows.start < _q_and_k_rows(model, target):
            raise UnsupportedAdapter(f"LoRA on the queries and keys of {arch.model_type} (interleaved RoPE, its q and k "
                                     "rows reordered as the checkpoint loads) is not implemented")
        linear = _linear(modules[target.module])
        assert isinstance(linear, _PROJECTIONS)
        a, b = ab["A"], ab["B"]
        rows = target.rows.stop - target.rows.start
        if a.shape != (rank, linear.in_features) or b.shape != (rows, rank):
            raise UnsupportedAdapter(
                f"adapter {spec.name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; this model's "
                f"projection takes {linear.in_features} inputs to {rows} outputs at rank {rank} (another base model?)")
        entries = adapter.weights.setdefault(target.module, [])
        whole = slice(0, linear.out_features)
        if any(part == target.part or whole in (rows_, target.rows) for part, rows_, _, _ in entries):
            raise UnsupportedAdapter(f"adapter {spec.name!r}: {target.module} adapted twice ({module})")
        entries.append((target.part, target.rows, a.float(), b.float() * scaling))
    return adapter


def _q_and_k_rows(model: LlamaForCausalLM, target: _Target) -> int:
    """The rows of q and k in an attention's stacked projection (those a reordering touches)."""
    attn = model.get_submodule(target.module.rpartition(".")[0])
    assert isinstance(attn, Attention)
    return attn.q_size + attn.kv_size


class LoRABatch:
    """This step's tokens by adapter, set before each forward (``LoRAManager.set_batch``): ``whole``, the
    slot every token's request names (None where they differ or there is none); ``select``, where they
    differ, ``[tokens, slots, 1]``: 1 at each token's slot, 0 elsewhere (a token of the base model: 0s)."""

    def __init__(self) -> None:
        self.whole: int | None = None
        self.select: Tensor | None = None


class LoRALinear(nn.Module):
    """A projection with every adapter's A and B beside it; adds, to each token's output, its adapter's
    ``B (A x)``. ``weight`` and ``bias`` are the projection's own.

    A step of one adapter computes it with that slot's A and B. A step that mixes adapters (or has the
    base model's tokens beside them) computes every token against all slots' A at once (one product of
    ``slots x ranks`` columns), zeroes the columns of the slots that are not its own, and takes one
    product with all slots' B side by side, added in place: three operations however many adapters the
    step mixes, and no data-dependent shape (where a loop over the step's adapters of a gather, two
    products and a scatter each cost about 10 operations an adapter per projection)."""

    def __init__(self, base: nn.Linear | IntLinear | Fp8Linear, num_slots: int, num_parts: int, rank: int,
                 batch: LoRABatch) -> None:
        super().__init__()
        self.base = base
        self.rank = rank
        self.batch = batch
        # The activations' dtype (a packed projection's weights are not in it), and the projection's device.
        dtype = base.weight.dtype if isinstance(base, nn.Linear) else base.dtype
        device = next(base.parameters()).device
        width = num_parts * rank
        self.lora_a: Tensor  # [slots * width, in]: slot s's rows s * width ...
        self.lora_b: Tensor  # [out, slots * width]: slot s's columns s * width ...
        self.register_buffer("lora_a", torch.zeros(num_slots * width, base.in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(base.out_features, num_slots * width, dtype=dtype, device=device),
                             persistent=False)
        self.width = width

    @property
    def weight(self) -> Tensor:
        assert isinstance(self.base, nn.Linear), "packed weights have no widened weight"
        return self.base.weight

    @property
    def bias(self) -> Tensor | None:
        return self.base.bias

    def set_slot(self, slot: int, entries: list[tuple[int, slice, Tensor, Tensor]]) -> None:
        """Slot ``slot`` holds these (part, rows, A, B) and nothing else."""
        own = slice(slot * self.width, (slot + 1) * self.width)
        self.lora_a[own] = 0
        self.lora_b[:, own] = 0
        for part, rows, a, b in entries:
            cols = slice(own.start + part * self.rank, own.start + part * self.rank + a.shape[0])
            self.lora_a[cols] = a.to(self.lora_a.dtype)
            self.lora_b[rows, cols] = b.to(self.lora_b.dtype)

    def forward(self, x: Tensor) -> Tensor:
        y: Tensor = self.base(x)
        batch = self.batch
        if batch.whole is not None:  # the product with B added in place: two operations
            own = slice(batch.whole * self.width, (batch.whole + 1) * self.width)
            y.addmm_(F.linear(x, self.lora_a[own]), self.lora_b[:, own].t())
        elif batch.select is not None:  # three
            xa = F.linear(x, self.lora_a).view(x.shape[0], batch.select.shape[1], self.width)
            y.addmm_((xa * batch.select).view(x.shape[0], -1), self.lora_b.t())
        return y


class LoRAManager:
    """The adapters an engine serves: those of ``--lora-modules`` in slots 0, 1, ... in their order, and
    those loaded at run time (``load``) in the slots left (``--max-loras`` in all); and the step's
    grouping of tokens by adapter.

    With no slot left for run time, only the projections the adapters adapt are wrapped, at their largest
    rank; with slots left, every projection an adapter may adapt is, at ``--max-lora-rank``."""

    def __init__(self, model: LlamaForCausalLM, modules: tuple[LoRAModule, ...], max_rank: int,
                 num_slots: int | None = None) -> None:
        self.model = model
        self.max_rank = max_rank
        loaded = [load_adapter(spec, model, max_rank) for spec in modules]
        num_slots = max(len(loaded), num_slots or 0, 1)
        self.adapters: list[LoRAAdapter | None] = [*loaded, *[None] * (num_slots - len(loaded))]
        self.slots = {a.name: i for i, a in enumerate(loaded)}
        self.batch = LoRABatch()
        self.dtype = model.model.embed_tokens.weight.dtype
        runtime = num_slots > len(loaded)
        rank = max_rank if runtime else max((a.rank for a in loaded), default=1)
        self.rank = rank  # every wrapped projection's rank per part
        if runtime:
            targeted = sorted(name for name, m in model.named_modules()
                              if isinstance(m, _PROJECTIONS) and name.endswith(_ADAPTABLE))
        else:
            targeted = sorted({module for a in loaded for module in a.weights})
        self.layers: dict[str, LoRALinear] = {}
        for module in targeted:
            parent_name, _, attr = module.rpartition(".")
            base = model.get_submodule(module)
            assert isinstance(base, _PROJECTIONS)
            parts = len(FUSED_PROJECTIONS.get(attr, (attr,)))
            wrapped = LoRALinear(base, num_slots, parts, rank, self.batch)
            for slot, adapter in enumerate(loaded):
                wrapped.set_slot(slot, adapter.weights.get(module, []))
            setattr(model.get_submodule(parent_name), attr, wrapped)
            self.layers[module] = wrapped

    def load(self, spec: LoRAModule) -> int:
        """Load an adapter into a free slot (at run time); its slot. ``ValueError`` (nothing changed) for a
        name in use, no slot left, or an adapter that is not built (``UnsupportedAdapter``)."""
        if spec.name in self.slots:
            raise ValueError(f"LoRA adapter {spec.name!r} is already loaded")
        free = [i for i, a in enumerate(self.adapters) if a is None]
        if not free:
            raise ValueError(f"no free LoRA slot: all {len(self.adapters)} of --max-loras hold adapters "
                             f"({', '.join(self.slots)}); unload one first")
        adapter = load_adapter(spec, self.model, self.max_rank)
        if adapter.rank > self.rank:  # only where every slot was taken at start: the ranks are the largest then
            raise UnsupportedAdapter(f"adapter {spec.name!r} has rank {adapter.rank}, above the {self.rank} of the "
                                     "adapters loaded at start (start with --max-loras above the --lora-modules to "
                                     "load adapters later)")
        missing = sorted(set(adapter.weights) - set(self.layers))
        if missing:  # only where every slot was taken at start: nothing is wrapped beyond them
            raise UnsupportedAdapter(f"adapter {spec.name!r} adapts {missing[0]}, which no adapter loaded at start "
                                     "adapts (start with --max-loras above the --lora-modules to load adapters later)")
        slot = free[0]
        for module, layer in self.layers.items():
            layer.set_slot(slot, adapter.weights.get(module, []))
        self.adapters[slot] = adapter
        self.slots[spec.name] = slot
        return slot

    def unload(self, name: str) -> None:
        """Free an adapter's slot (its weights zeroed); ``ValueError`` for a name not loaded."""
        slot = self.slot(name)
        for layer in self.layers.values():
            layer.set_slot(slot, [])
        del self.slots[name]
        self.adapters[slot] = None

    def slot(self, name: str) -> int:
        """An adapter's slot; ``ValueError`` naming the adapters served for any other name."""
        slot = self.slots.get(name)
        if slot is None:
            served = ", ".join(self.slots) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (served here: {served})")
        return slot

    def set_batch(self, slots: list[int], query_start: Tensor, device: torch.device, one_hot: bool = False) -> bool:
        """Say which adapter each of the step's tokens has: ``slots`` per scheduled request in order (-1:
        none), the step's query starts (host, ``[requests + 1]``). True when some token has one.
        ``one_hot``: the tokens' one-hot even where they all have one adapter (a CUDA graph's replay reads it)."""
        batch = self.batch
        batch.whole, batch.select = None, None
        used = set(slots)
        if used == {-1} or not used:
            return False
        if len(used) == 1 and not one_hot:
            batch.whole = slots[0]
            return True
        counts = (query_start[1:] - query_start[:-1]).long()
        token_slots = torch.repeat_interleave(torch.tensor(slots) + 1, counts)
        select = F.one_hot(token_slots, len(self.adapters) + 1)[:, 1:, None]
        batch.select = select.to(device=device, dtype=self.dtype, non_blocking=True)
        return True
