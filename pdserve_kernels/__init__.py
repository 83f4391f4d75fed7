"""Attention and KV-movement kernels: Triton on CUDA, the torch reference elsewhere.

``get_kernels()`` returns a module-like object with ``store_kv``, ``paged_decode_attention``,
``paged_prefill_attention``, ``gather_blocks``, ``scatter_blocks`` and ``copy_blocks`` (signatures
in ``pdserve_kernels/reference.py``). The choice follows the device unless ``PDSERVE_KERNEL_BACKEND``
(``torch`` or ``triton``) or the ``backend`` argument overrides it.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

BACKENDS = ("torch", "triton")


def resolve_backend(device: torch.device | str, backend: str | None = None) -> str:
    choice = backend or os.environ.get("PDSERVE_KERNEL_BACKEND") or "auto"
    if choice == "auto":
        return "triton" if torch.device(device).type == "cuda" else "torch"
    if choice not in BACKENDS:
        raise ValueError(f"unknown kernel backend {choice!r}; expected one of {BACKENDS} or 'auto'")
    return choice


def get_kernels(device: torch.device | str = "cpu", backend: str | None = None) -> ModuleType:
    if resolve_backend(device, backend) == "triton":
        from pdserve_kernels import triton_ops

        return triton_ops
    from pdserve_kernels import reference

    return reference
