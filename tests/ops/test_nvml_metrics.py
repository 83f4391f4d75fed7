"""NVML telemetry on an engine's /metrics, against a stand-in pynvml module (no GPU here)."""

from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.metrics import EngineMetrics
from common.nvml_metrics import register_nvml_collector


class NotSupported(Exception):
    pass


def fake_nvml(num_gpus: int = 2, *, power_supported: bool = True, new_api: bool = True) -> types.ModuleType:
    """A pynvml with ``num_gpus`` devices whose readings depend on the index (so mix-ups show)."""
    nvml = types.ModuleType("pynvml")
    nvml.inits = 0  # type: ignore[attr-defined]

    def init() -> None:
        nvml.inits += 1  # type: ignore[attr-defined]

    def power(handle: int) -> int:
        if not power_supported:
            raise NotSupported("power")
        return 250_000 + handle * 1000  # milliwatts

    def by_uuid(uuid: str) -> int:
        if not uuid.startswith("GPU-fake-"):
            raise NotSupported(uuid)
        return int(uuid.rsplit("-", 1)[1])

    functions: dict[str, Any] = {
        "nvmlInit": init,
        "nvmlDeviceGetCount": lambda: num_gpus,
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetHandleByUUID": by_uuid,
        "nvmlDeviceGetIndex": lambda h: h,
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=40 + h, memory=10),
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(used=(h + 1) * 2**30, total=80 * 2**30, free=0),
        "nvmlDeviceGetPowerUsage": power,
        "nvmlDeviceGetTemperature": lambda h, sensor: 60 + h,
    }
    reasons = "nvmlDeviceGetCurrentClocksEventReasons" if new_api else "nvmlDeviceGetCurrentClocksThrottleReasons"
    functions[reasons] = lambda h: 0x4 | 0x40 if h == 1 else 0x1  # gpu 1: power cap + hw thermal
    for name, fn in functions.items():
        setattr(nvml, name, fn)
    return nvml


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect() for s in family.samples
    }


LABELS = {"model_name": "m", "role": "decode", "instance": "decode-0"}


def key(name: str, gpu: str, **extra: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return ("pdserve:" + name, tuple(sorted({**LABELS, "gpu": gpu, **extra}.items())))


def test_every_gpu_reports_utilisation_memory_power_temperature_and_throttle_reasons() -> None:
    registry = CollectorRegistry()
    assert register_nvml_collector(registry, LABELS, nvml=fake_nvml(2)) is not None
    got = samples(registry)
    assert got[key("gpu_utilization_perc", "1")] == pytest.approx(0.41)
    assert got[key("gpu_memory_used_bytes", "1")] == 2 * 2**30
    assert got[key("gpu_memory_total_bytes", "0")] == 80 * 2**30
    assert got[key("gpu_power_watts", "1")] == pytest.approx(251.0)
    assert got[key("gpu_temperature_celsius", "0")] == 60
    assert got[key("gpu_clock_throttled", "1", reason="sw_power_cap")] == 1
    assert got[key("gpu_clock_throttled", "1", reason="hw_thermal_slowdown")] == 1
    assert got[key("gpu_clock_throttled", "1", reason="gpu_idle")] == 0
    assert got[key("gpu_clock_throttled", "0", reason="gpu_idle")] == 1


def test_only_the_engines_own_gpu_is_reported_when_its_uuid_is_known() -> None:
    registry = CollectorRegistry()
    register_nvml_collector(registry, LABELS, uuids=["GPU-fake-1"], nvml=fake_nvml(4))
    gpus = {dict(labels)["gpu"] for (name, labels) in samples(registry) if name.endswith("power_watts")}
    assert gpus == {"1"}


def test_a_field_the_board_cannot_report_is_left_out_and_old_drivers_still_give_throttle_reasons() -> None:
    registry = CollectorRegistry()
    register_nvml_collector(registry, LABELS, nvml=fake_nvml(1, power_supported=False, new_api=False))
    got = samples(registry)
    assert not any(name.endswith("gpu_power_watts") for name, _ in got)
    assert got[key("gpu_clock_throttled", "0", reason="gpu_idle")] == 1


def test_readings_are_taken_at_scrape_time_on_the_engines_metrics_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_nvml(1)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    metrics = EngineMetrics("prefill", "prefill-0", "m")
    assert metrics.watch_gpus() is True
    assert nvml.inits == 1  # type: ignore[attr-defined]
    text = generate_latest(metrics.registry).decode()
    assert 'pdserve:gpu_temperature_celsius{gpu="0",instance="prefill-0",model_name="m",role="prefill"} 60.0' in text
    nvml.nvmlDeviceGetTemperature = lambda h, sensor: 75  # type: ignore[attr-defined]
    assert "role=\"prefill\"} 75.0" in generate_latest(metrics.registry).decode()


def test_without_nvml_nothing_is_reported_and_one_line_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    broken = types.ModuleType("pynvml")

    def no_driver() -> None:
        raise OSError("NVML Shared Library Not Found")

    broken.nvmlInit = no_driver  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    metrics = EngineMetrics("prefill", "prefill-0", "m")
    before = generate_latest(metrics.registry)
    with caplog.at_level(logging.INFO, logger="common.nvml_metrics"):
        assert metrics.watch_gpus() is False
    assert [r.getMessage() for r in caplog.records if "NVML" in r.getMessage()] == [
        "NVML unavailable (NVML Shared Library Not Found): no GPU telemetry on /metrics"
    ]
    assert generate_latest(metrics.registry) == before
