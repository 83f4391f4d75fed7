"""The Triton kernels lower to a cubin for real NVIDIA GPUs (compiled ahead of time, no GPU needed).

The interpreter tests check the kernels' arithmetic; this checks that the same launches compile for
Ampere and Hopper. It runs in a fresh process because this one interprets the kernels.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def nvidia_backend_available() -> bool:
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        return False
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not nvidia_backend_available(), reason="triton's NVIDIA backend (ptxas) is not installed")
@pytest.mark.parametrize("arch", [80, 89, 90])
def test_every_kernel_compiles_for_nvidia_gpus(arch: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run(
        [sys.executable, "-m", "tests.kernels.gpu_compile", "--arch", str(arch)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") >= 14, result.stdout
