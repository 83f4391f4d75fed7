"""The Triton backend: the same names and signatures as ``pdserve_kernels.reference``, run as Triton kernels.

Attention lives in ``triton_decode`` / ``triton_prefill``, KV movement in ``triton_kv``, RMSNorm in
``triton_norm``, rotary embedding in ``triton_rope``, the gated MLP's activation in ``triton_act``, a mixture's experts in ``triton_moe``,
products with packed integer and FP8 weights in ``triton_packed_linear`` (which is why this backend keeps them packed).
"""

from __future__ import annotations

from pdserve_kernels.triton_act import silu_mul
from pdserve_kernels.triton_decode import paged_decode_attention
from pdserve_kernels.triton_kv import copy_blocks, gather_blocks, scatter_blocks, store_kv
from pdserve_kernels.triton_moe import moe_experts
from pdserve_kernels.triton_norm import add_rms_norm, rms_norm
from pdserve_kernels.triton_packed_linear import fp8_linear, int_linear
from pdserve_kernels.triton_prefill import paged_prefill_attention
from pdserve_kernels.triton_rope import rope, rope_and_store

# A checkpoint's integer and FP8 weights stay packed (``common.model.packed_linear``), multiplied by ``int_linear`` and
# ``fp8_linear``.
PACKS_WEIGHTS = True

__all__ = [
    "PACKS_WEIGHTS",
    "add_rms_norm",
    "copy_blocks",
    "fp8_linear",
    "gather_blocks",
    "int_linear",
    "moe_experts",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rope",
    "rope_and_store",
    "scatter_blocks",
    "silu_mul",
    "store_kv",
]
