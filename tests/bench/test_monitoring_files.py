"""ops/monitoring: the scrape config covers the compose stack and the dashboard queries real metric names."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

OPS = pathlib.Path(__file__).resolve().parents[2] / "ops"
MONITORING = OPS / "monitoring"
METRIC_NAME = re.compile(r"pdserve:[a-z0-9_]+")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Sample names a registry exports (counters as ``*_total``, histograms as buckets, sum, count)."""
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES.get(family.type, ("",))}


@pytest.fixture(scope="module")
def metric_names() -> set[str]:
    from common.metrics import EngineMetrics
    from common.nvml_metrics import register_nvml_collector
    from router.metrics import RouterMetrics
    from tests.ops.test_nvml_metrics import fake_nvml

    engine = EngineMetrics("prefill", "p0")
    register_nvml_collector(engine.registry, engine.labels, nvml=fake_nvml(1))  # what a GPU engine adds
    return exported_names(engine.registry) | exported_names(RouterMetrics().registry)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads((MONITORING / "grafana" / "dashboards" / "pdserve.json").read_text())


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_scrape_config_covers_the_router_and_every_engine_of_the_compose_stack() -> None:
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]}
    mounts = yaml.safe_load((MONITORING / "docker-compose.monitoring.yml").read_text())["services"]["prometheus"]["volumes"]
    for job in config["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            for pattern in sd["files"]:  # the file the container sees, back to the one in the repository
                folder, glob = pattern.rsplit("/", 1)
                (host,) = [m.split(":")[0] for m in mounts if m.split(":")[1] == folder]
                for f in (OPS.parent / host).glob(glob):
                    targets |= {t for group in json.loads(f.read_text()) for t in group["targets"]}
    compose = yaml.safe_load((OPS.parent / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        flags = [f for f in service.get("command", []) if isinstance(f, str)]
        if name == "router":
            port = next(f.split("=", 1)[1] for f in flags if f.startswith("--port="))
            assert f"router:{port}" in targets
        elif flags[:1] in (["prefill"], ["decode"]):
            port = next(f for f in flags if f.startswith("--metrics-port="))
            default = re.search(r":-(\d+)", port)
            assert default is not None and f"{name}:{default.group(1)}" in targets
    assert all(job["honor_labels"] for job in config["scrape_configs"])  # keep the engines' instance ids


def test_dashboard_queries_only_metrics_the_services_export(dashboard: dict[str, Any], metric_names: set[str]) -> None:
    used = {name for expr in exprs(dashboard) for name in METRIC_NAME.findall(expr)}
    assert used and used <= metric_names, used - metric_names


def test_dashboard_shows_latency_load_cache_and_transfer_panels(dashboard: dict[str, Any]) -> None:
    text = "\n".join(exprs(dashboard))
    for quantile_of in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert re.search(rf"histogram_quantile\(0\.99, sum by \(le\) \(rate\(pdserve:{quantile_of}_bucket", text)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits_total",
                 "prefix_cache_queries_total", "num_preemptions_total", "kv_transfer_bytes_total",
                 "kv_transfer_failures_total"):
        assert f"pdserve:{name}" in text
    router = "\n".join(t["expr"] for p in panels_under(dashboard, "Router") for t in p["targets"])
    assert "pdserve:router_gc_pause_seconds_bucket" in router and "pdserve:router_outputs_inline_total" in router
    assert "pdserve:router_engine_message_seconds_bucket" in router
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_provisioning_points_grafana_at_the_prometheus_and_dashboards_it_mounts(dashboard: dict[str, Any]) -> None:
    provisioning = MONITORING / "grafana" / "provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    uids = {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p}
    assert uids == {source["uid"]}
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "pdserve.yml").read_text())["providers"]
    compose = yaml.safe_load((MONITORING / "docker-compose.monitoring.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.endswith(":" + provider["options"]["path"] + ":ro") for m in mounts)
    assert source["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]


def panels_under(dashboard: dict[str, Any], row_prefix: str) -> list[dict[str, Any]]:
    """The panels between the row whose title starts with ``row_prefix`` and the next row."""
    out: list[dict[str, Any]] = []
    inside = False
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            inside = panel["title"].startswith(row_prefix)
        elif inside:
            out.append(panel)
    return out


def test_dashboard_shows_each_pools_autoscaling_signals_against_the_autoscalers_targets(
    dashboard: dict[str, Any]
) -> None:
    from ops.autoscale import DECODE_POLICY, PREFILL_POLICY

    for role, policy in (("prefill", PREFILL_POLICY), ("decode", DECODE_POLICY)):
        panels = panels_under(dashboard, f"{role.capitalize()} pool")
        text = "\n".join(t["expr"] for p in panels for t in p["targets"])
        assert f'role="{role}"' in text
        for signal in policy.signals:
            metric = "time_to_first_token_seconds_bucket" if signal.name == "ttft_p90_seconds" else signal.name
            assert f"pdserve:{metric}" in text, (role, signal.name)
            assert f"vector({signal.target:g})" in text, (role, signal.name)  # the target drawn beside it
        assert any("replicas" in p["title"] for p in panels)


def test_dashboard_shows_gpu_telemetry_and_its_grid_does_not_overlap(dashboard: dict[str, Any]) -> None:
    text = "\n".join(t["expr"] for p in panels_under(dashboard, "GPUs") for t in p["targets"])
    for name in ("gpu_utilization_perc", "gpu_memory_used_bytes", "gpu_memory_total_bytes", "gpu_power_watts",
                 "gpu_temperature_celsius", "gpu_clock_throttled"):
        assert f"pdserve:{name}" in text
    cells = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))


def test_engine_queries_match_the_compose_job_and_the_kubernetes_pod_monitor(dashboard: dict[str, Any]) -> None:
    # The Prometheus Operator names a PodMonitor's job "<namespace>/<name>": an exact job="pdserve-engines"
    # would show nothing on Kubernetes.
    assert 'job="pdserve-engines"' not in "\n".join(exprs(dashboard))
    assert 'job=~".*pdserve-engines"' in "\n".join(exprs(dashboard))


def test_compose_gen_writes_the_shipped_targets_file_and_targets_for_larger_pools() -> None:
    from ops.compose_gen import render_prometheus_targets

    assert (MONITORING / "targets" / "engines.json").read_text() == render_prometheus_targets(1, 1)
    (group,) = json.loads(render_prometheus_targets(2, 3))
    assert sorted(group["targets"]) == sorted(
        f"{n}:9100" for n in ("prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2")
    )
