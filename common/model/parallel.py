"""Tensor parallelism as the model sees it: which rank of how many it is, and the sum across ranks.

A model built with a ``TensorParallel`` of ``size`` > 1 holds one rank's share of each layer (Megatron's
split, as vLLM's): its attention heads and the KV heads they read, its columns of the MLP's (and each
expert's) gate and up, the matching rows of the output projections, whose partial products are summed
across ranks (``all_reduce``) before the residual stream reads them. Embeddings, norms and the output
head are whole on every rank, so every rank ends a forward with the same hidden states.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (``rank`` of ``size``) and the torch.distributed
    process group the model's sums run over (None only where ``size`` is 1)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed.ProcessGroup

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is not a rank of the group")
        if self.size > 1 and self.group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs its process group")

    def all_reduce(self, x: Tensor) -> Tensor:
        """``x`` summed over the group's ranks, in place (returned); ``x`` itself for one rank."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: Tensor, src: int = 0) -> Tensor:
        """``x`` of rank ``src`` written into every rank's ``x`` (returned)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = src  # the group's own rank (a group built outside ``init_process_group``)
        self.group.broadcast([x], options).wait()
        return x


SINGLE = TensorParallel()


@dataclass(frozen=True)
class Shard:
    """How one parameter divides among the ranks: along ``dim``, each of its stacked ``parts`` (that many
    equal ones, or parts of these widths) cut into ``size`` equal blocks, rank r keeping block r of each, in
    the parts' order (q, k, v stacked stay [q_r; k_r; v_r]). ``once``: the bias of a row-parallel product,
    whose partial sums ``all_reduce`` adds: whole on rank 0 and zeros elsewhere, so the sum adds it once."""

    dim: int = 0
    parts: int | tuple[int, ...] = 1
    once: bool = False
    # Per part, the blocks it is cut into where fewer than the ranks (KV heads fewer than ranks): rank r keeps
    # block r * blocks // ranks, each block shared by ranks / blocks ranks. None (or a None entry): one a rank.
    blocks: tuple[int | None, ...] | None = None

    def of(self, full: Tensor, tp: TensorParallel) -> Tensor:
        """Rank ``tp.rank``'s share of the whole tensor ``full``."""
        if self.once:
            return full if tp.rank == 0 else torch.zeros_like(full)
        length = full.shape[self.dim]
        widths = self.parts if isinstance(self.parts, tuple) else (length // self.parts,) * self.parts
        counts = [n or tp.size for n in (self.blocks or (None,) * len(widths))]
        if sum(widths) != length or any(w % n or tp.size % n for w, n in zip(widths, counts, strict=True)):
            raise ValueError(f"checkpoint mismatch: {tuple(full.shape)} does not divide along dimension {self.dim} "
                             f"into parts {widths} of {counts} equal blocks each")
        return torch.cat([part.chunk(n, self.dim)[tp.rank * n // tp.size]
                          for part, n in zip(full.split(widths, self.dim), counts, strict=True)],
                         self.dim).contiguous()

    def by_blocks(self, block: int) -> Shard:
        """The same cut of a tensor with one entry per ``block`` of this one's along ``dim`` (a weight's scales)."""
        parts = tuple(width // block for width in self.parts) if isinstance(self.parts, tuple) else self.parts
        return Shard(self.dim, parts, self.once, self.blocks)

    def full_shape(self, shape: Sequence[int], size: int) -> tuple[int, ...]:
        """The whole tensor's shape, from a rank's share's."""
        if self.once:
            return tuple(shape)
        whole = sum(self.parts) if isinstance(self.parts, tuple) else None  # stacked parts of known widths
        blocks = self.blocks[0] if self.blocks and len(self.blocks) == 1 else None  # one part, fewer blocks
        return tuple((whole or n * (blocks or size)) if i == self.dim else n for i, n in enumerate(shape))


_ONCE = Shard(once=True)
_ROWS, _COLUMNS = Shard(0), Shard(1)  # a column-parallel product's output rows; a row-parallel one's input columns


def shard_rules(num_heads: int, num_kv_heads: int, head_size: int,
                per_head_norms: bool, mla: bool = False, size: int = 1) -> tuple[tuple[re.Pattern[str], Shard], ...]:
    """Each sharded parameter's rule, by the end of its name (``LlamaForCausalLM``'s names, once the
    checkpoint's projections and experts are stacked), for a model of ``num_heads`` query heads and
    ``num_kv_heads`` KV heads in all; ``per_head_norms``: q and k norms with a weight per head (Cohere's,
    StableLM's, ``[heads, width]``), split by head; ``mla``: Multi-head Latent Attention's per-head projections
    (``common.model.mla``: q's, and the latent's up-projections to each head's k and v) split by head, its
    down-projections to the latent whole. A name no rule matches is whole on every rank: the embeddings,
    every norm of a width (the layers', a head's), the routers and the output head."""
    q, kv = num_heads * head_size, num_kv_heads * head_size
    # KV heads fewer than the ranks (``size``): each KV head whole on the ranks whose query heads read it.
    replicated = num_kv_heads if size > num_kv_heads else None
    # A product's weight: widened, or packed (``common.model.packed_linear.IntLinear``: its values, zero points and
    # scales, each a row per output and split along the inputs by words and by groups alike).
    weight = r"(weight|qweight|qzeros|scales)"
    rules = {
        # this rank's heads' rows of each
        rf"\.self_attn\.qkv_proj\.({weight}|bias)": Shard(0, (q, kv, kv), blocks=(None, replicated, replicated)),
        rf"\.self_attn\.(output_gate\.{weight}|sinks)": _ROWS,  # AFMoE's gate and gpt-oss's sinks: per query head
        rf"\.self_attn\.o_proj\.{weight}": _COLUMNS,
        rf"\.mlp(\.shared_expert)?\.gate_up_proj\.({weight}|bias)": Shard(0, 2),  # [gate_r; up_r]
        rf"\.mlp(\.shared_expert)?\.up_proj\.({weight}|bias)": _ROWS,  # an ungated MLP's
        rf"\.mlp(\.shared_expert)?\.down_proj\.{weight}": _COLUMNS,
        r"\.(self_attn\.o_proj|mlp(\.shared_expert)?\.down_proj)\.bias": _ONCE,
        # [E, 2I, H], [E, 2I]: each expert's [gate_r; up_r]; packed ([E, 2I, words or bytes], [E, 2I, groups]) alike
        r"\.mlp\.experts\.gate_up_proj(_bias|_qweight|_qzeros|_scales|_blocks)?": Shard(1, 2),
        # [E, H, I]; packed, [E, H, words, bytes or groups]
        r"\.mlp\.experts\.down_proj(_qweight|_qzeros|_scales|_blocks)?": Shard(2),
        r"\.mlp\.experts\.down_proj_bias": _ONCE,
        **({r"\.self_attn\.q_norm\.(weight|bias)": _ROWS,
            r"\.self_attn\.k_norm\.(weight|bias)": Shard(0, blocks=(replicated,))} if per_head_norms else {}),
        **({r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj)\.weight": _ROWS} if mla else {}),
    }
    return tuple((re.compile(pattern + "$"), shard) for pattern, shard in rules.items())


def shard_of(rules: tuple[tuple[re.Pattern[str], Shard], ...], name: str) -> Shard | None:
    """The rule for parameter ``name``; None: whole on every rank."""
    return next((shard for pattern, shard in rules if pattern.search(name)), None)


def shard_state(state: dict[str, Tensor], rules: tuple[tuple[re.Pattern[str], Shard], ...],
                tp: TensorParallel) -> None:
    """In place: each whole tensor of ``state`` replaced by rank ``tp.rank``'s share of it. A block-wise FP8 weight's
    scales (``<weight>_scale_inv``, one per block of it) are cut as the weight is, by blocks: each rank keeps the
    scales of the blocks it keeps (the loader keeps FP8 weights packed only where the shares are whole blocks)."""
    whole = dict(state)
    for name, full in whole.items():
        shard = shard_of(rules, name)
        if shard is None and name.endswith("_scale_inv") and name.removesuffix("_scale_inv") in whole:
            weight = name.removesuffix("_scale_inv")
            shard = shard_of(rules, weight)
            if shard is not None:
                shard = shard.by_blocks(whole[weight].shape[shard.dim] // full.shape[shard.dim])
        if shard is not None:
            state[name] = shard.of(full, tp)
