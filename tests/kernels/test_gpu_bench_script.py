"""The GPU benchmark script refuses cleanly, with a clear message, where there is no CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ops.bench import gpu_kernels


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run for real")
def test_gpu_benchmark_exits_with_a_message_without_cuda(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_kernels.main(["--out-dir", str(tmp_path)]) == 1
    assert "no CUDA device" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
