"""Run every Triton kernel in these tests on the CPU through Triton's interpreter.

``triton.jit`` picks the interpreter when a kernel is *decorated*, so the variable must be set before
the kernel modules are imported. When the whole suite runs in one process another test module may
have imported them first; those modules are then reloaded so that their kernels are re-decorated.
"""

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

KERNEL_MODULES = (
    "pdserve_kernels.triton_common",
    "pdserve_kernels.triton_decode", "pdserve_kernels.triton_prefill", "pdserve_kernels.triton_kv",
    "pdserve_kernels.triton_act", "pdserve_kernels.triton_moe", "pdserve_kernels.triton_packed_linear",
    "pdserve_kernels.triton_ops",
)

for _name in KERNEL_MODULES:
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])
