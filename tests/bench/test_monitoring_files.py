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
    from router.metrics import RouterMetrics

    return exported_names(EngineMetrics("prefill", "p0").registry) | exported_names(RouterMetrics().registry)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads((MONITORING / "grafana" / "dashboards" / "pdserve.json").read_text())


def exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_scrape_config_covers_the_router_and_every_engine_of_the_compose_stack() -> None:
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    compose = yaml.safe_load((OPS / "docker-compose.yml").read_text())
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
