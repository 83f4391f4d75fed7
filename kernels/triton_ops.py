"""The Triton backend: the same names and signatures as ``kernels.reference``, run as Triton kernels.

Attention lives in ``triton_decode`` / ``triton_prefill``, KV movement in ``triton_kv``.
"""

from __future__ import annotations

from kernels.triton_decode import paged_decode_attention
from kernels.triton_kv import copy_blocks, gather_blocks, scatter_blocks, store_kv
from kernels.triton_prefill import paged_prefill_attention

__all__ = [
    "copy_blocks",
    "gather_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "scatter_blocks",
    "store_kv",
]
