"""GPU telemetry from NVML on an engine's ``/metrics``: utilisation, memory, power, temperature,
clock throttle reasons, per GPU the engine runs on.

Read at scrape time (a Prometheus collector), so an idle engine costs nothing between scrapes and
the step loop never waits on the driver. Labelled like ``EngineMetrics`` (``model_name``, ``role``,
``instance``) plus ``gpu``, NVML's index of the device. Without NVML (no driver, no
``nvidia-ml-py``, a CPU host) nothing is registered and one line is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

PREFIX = "pdserve:"
_NVML_TEMPERATURE_GPU = 0  # pynvml.NVML_TEMPERATURE_GPU
# NVML's clock event ("throttle") reason bits (nvmlClocksEventReason*), stable across driver versions.
THROTTLE_REASONS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}


def load_nvml() -> ModuleType | None:
    """``pynvml`` initialised, or None (logged once by the caller) where NVML cannot start."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        logger.info("NVML unavailable (%s): no GPU telemetry on /metrics", exc)
        return None
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NvmlCollector(Collector):
    """Gauges for the given NVML device handles; a field the device cannot report is left out.

    ``collect`` runs on the scraping thread and only reads the driver.
    """

    def __init__(self, nvml: Any, handles: Sequence[Any], labels: dict[str, str]) -> None:
        self._nvml = nvml
        self._handles = list(handles)
        self._labels = labels

    def _read(self, fn_name: str, *args: Any) -> Any:
        try:
            return getattr(self._nvml, fn_name)(*args)
        except Exception:  # NVMLError_NotSupported on some boards, or a device that went away
            return None

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # collected per scrape; nothing to reserve

    def collect(self) -> Iterator[GaugeMetricFamily]:
        names = [*self._labels, "gpu"]
        fam = {
            "util": GaugeMetricFamily(PREFIX + "gpu_utilization_perc",
                                      "Fraction of the last sample period the GPU was busy (0-1)", labels=names),
            "used": GaugeMetricFamily(PREFIX + "gpu_memory_used_bytes", "GPU memory in use", labels=names),
            "total": GaugeMetricFamily(PREFIX + "gpu_memory_total_bytes", "GPU memory in all", labels=names),
            "power": GaugeMetricFamily(PREFIX + "gpu_power_watts", "GPU power draw", labels=names),
            "temp": GaugeMetricFamily(PREFIX + "gpu_temperature_celsius", "GPU core temperature", labels=names),
            "throttle": GaugeMetricFamily(
                PREFIX + "gpu_clock_throttled",
                "1 while NVML reports this reason for lowered clocks, else 0", labels=[*names, "reason"],
            ),
        }
        for handle in self._handles:
            index = self._read("nvmlDeviceGetIndex", handle)
            values = [*self._labels.values(), _text(index if index is not None else "?")]
            util = self._read("nvmlDeviceGetUtilizationRates", handle)
            if util is not None:
                fam["util"].add_metric(values, util.gpu / 100.0)
            memory = self._read("nvmlDeviceGetMemoryInfo", handle)
            if memory is not None:
                fam["used"].add_metric(values, float(memory.used))
                fam["total"].add_metric(values, float(memory.total))
            milliwatts = self._read("nvmlDeviceGetPowerUsage", handle)
            if milliwatts is not None:
                fam["power"].add_metric(values, milliwatts / 1000.0)
            celsius = self._read("nvmlDeviceGetTemperature", handle, _NVML_TEMPERATURE_GPU)
            if celsius is not None:
                fam["temp"].add_metric(values, float(celsius))
            reasons = self._read("nvmlDeviceGetCurrentClocksEventReasons", handle)
            if reasons is None:  # drivers before 535 name it "throttle"
                reasons = self._read("nvmlDeviceGetCurrentClocksThrottleReasons", handle)
            if reasons is not None:
                for reason, bit in THROTTLE_REASONS.items():
                    fam["throttle"].add_metric([*values, reason], 1.0 if int(reasons) & bit else 0.0)
        yield from fam.values()


def device_handles(nvml: Any, uuids: Sequence[str] = ()) -> list[Any]:
    """Handles for the GPUs with these UUIDs; with none given (or none found), every GPU NVML sees.

    In a container pinned to one GPU NVML sees only that one; on a shared host the engine's own
    device is found by the UUID torch reports for it.
    """
    handles = []
    for uuid in uuids:
        try:
            handles.append(nvml.nvmlDeviceGetHandleByUUID(uuid))
        except Exception:
            logger.info("NVML knows no GPU %s", uuid)
    if handles:
        return handles
    try:
        return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    except Exception as exc:
        logger.info("NVML cannot list GPUs (%s): no GPU telemetry on /metrics", exc)
        return []


def torch_device_uuids(device: Any) -> list[str]:
    """NVML's UUID (``GPU-...``) of a torch CUDA device, or [] where torch cannot say."""
    try:
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return []
    return [uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"]


def register_nvml_collector(
    registry: CollectorRegistry, labels: dict[str, str], uuids: Sequence[str] = (), nvml: Any = None
) -> NvmlCollector | None:
    """Add GPU gauges to ``registry``; None (and one log line) where NVML is not there or sees no GPU."""
    nvml = nvml if nvml is not None else load_nvml()
    if nvml is None:
        return None
    handles = device_handles(nvml, uuids)
    if not handles:
        return None
    collector = NvmlCollector(nvml, handles, labels)
    registry.register(collector)
    return collector
