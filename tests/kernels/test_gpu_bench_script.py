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


def test_gpu_benchmark_prints_and_keeps_nvml_readings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from tests.ops.test_nvml_metrics import fake_nvml

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(2))
    report = gpu_kernels.Report(tmp_path, {"device": "fake"})
    gpu_kernels.read_nvml(report, "before")
    out = capsys.readouterr().out
    assert "[nvml] before: gpu1 gpu_temperature_celsius = 61" in out
    assert "[nvml] before: gpu1 gpu_clock_throttled hw_thermal_slowdown = 1" in out
    assert "sw_thermal_slowdown" not in out  # only the reasons that are active
    assert report.meta["nvml_before"]["gpu0 gpu_memory_total_bytes"] == 80 * 2**30


def test_gpu_benchmark_says_so_when_nvml_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys
    import types

    broken = types.ModuleType("pynvml")
    broken.nvmlInit = lambda: (_ for _ in ()).throw(OSError("no driver"))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    report = gpu_kernels.Report(tmp_path, {"device": "fake"})
    gpu_kernels.read_nvml(report, "after")
    assert "[nvml] after: NVML unavailable" in capsys.readouterr().out
    assert "nvml_after" not in report.meta
