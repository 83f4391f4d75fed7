"""The KV cache layout both ends of a transfer must share, exchanged in the handshake.

Two services may only move blocks between each other when every field matches: a different
block size, head count or dtype would otherwise land as silently wrong attention, never an error.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

import msgspec
import torch
from torch import Tensor

from common.kvcache.hashing import HASH_SCHEME

# dtype names on the wire; anything else is refused rather than guessed.
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

_Count = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class KVLayout(msgspec.Struct, frozen=True):
    """Model identity and the shape of one KV block; equal layouts mean compatible caches."""

    model_id: _Name
    dtype: _Name
    num_layers: _Count
    num_kv_heads: _Count
    head_size: _Count
    block_size: _Count
    hash_scheme: _Name = HASH_SCHEME
    # The ranks of a tensor-parallel engine whose cache this is: ``num_layers`` counts each rank's layers
    # (rank after rank) and ``num_kv_heads`` is one rank's, so both ends must be split alike.
    tensor_parallel_size: _Count = 1

    @classmethod
    def from_kv_cache(cls, kv_cache: Tensor, model_id: str, tensor_parallel_size: int = 1) -> KVLayout:
        """Layout of ``kv_cache`` ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]`` (of a
        tensor-parallel engine: ``[ranks x layers, ...]`` of a rank's heads, ``ModelRunner.transfer_cache``)."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(
                "kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_size], "
                f"got {tuple(kv_cache.shape)}"
            )
        dtype = dtype_name(kv_cache.dtype)
        num_layers, _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        return cls(model_id, dtype, num_layers, num_kv_heads, head_size, block_size, HASH_SCHEME, tensor_parallel_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype named by ``dtype``; raises ``ValueError`` for an unknown name."""
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}") from None

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def bytes_per_block_layer(self) -> int:
        """Bytes of one block's K and V in one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.element_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block's K and V across all layers."""
        return self.num_layers * self.bytes_per_block_layer

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (the last one may be partial)."""
        return (num_tokens + self.block_size - 1) // self.block_size

    def frame_shape(self, num_layers: int, num_blocks: int) -> tuple[int, ...]:
        """Shape of a packed frame of ``num_layers`` layers and ``num_blocks`` blocks."""
        return (num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)

    def fingerprint(self) -> str:
        """A short name of this layout for the registry: its dtype, then a digest of every field (equal
        fingerprints, equal layouts)."""
        return f"{self.dtype}:{hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]}"

    def mismatch(self, other: KVLayout) -> str | None:
        """A readable list of the fields that differ from ``other``, or ``None`` when equal."""
        diffs = [
            f"{field}: {getattr(self, field)!r} != {getattr(other, field)!r}"
            for field in self.__struct_fields__
            if getattr(self, field) != getattr(other, field)
        ]
        return "; ".join(diffs) if diffs else None

    def check_kv_cache(self, kv_cache: Tensor) -> None:
        """Raise ``ValueError`` unless ``kv_cache`` has this layout (any number of blocks)."""
        actual = KVLayout.from_kv_cache(kv_cache, self.model_id, self.tensor_parallel_size)
        diff = msgspec.structs.replace(self, hash_scheme=actual.hash_scheme).mismatch(actual)
        if diff:
            raise ValueError(f"kv_cache does not match the layout: {diff}")


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; raises ``ValueError`` for dtypes the cache cannot use."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported KV dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return name
