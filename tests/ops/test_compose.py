"""The compose file users run (no Docker engine here): it parses, it is valid against the Compose
Specification's JSON schema (as vendored by check-jsonschema), and its structure keeps what
matters: every engine pinned to its own GPU with a health check, services started in order,
secrets from .env and nowhere in the file."""

from __future__ import annotations

import json
import pathlib
import re
from importlib import resources
from typing import Any

import jsonschema
import pytest
import yaml

from ops.compose_gen import render, render_override

ROOT = pathlib.Path(__file__).resolve().parents[2]
ENV_REF = re.compile(r"\$\{([A-Z0-9_]+)(?:(:-|:\?)([^}]*))?\}")
REQUIRED = {"REDIS_PASSWORD"}  # no default: the stack refuses to start without it


def interpolate(text: str, env: dict[str, str]) -> str:
    """As Compose would with ``env`` set and everything else unset (``$$`` is a literal ``$``)."""

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.groups()
        if name in env:
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return arg or ""

    return ENV_REF.sub(one, text).replace("$$", "$")


@pytest.fixture(scope="module")
def schema_validator() -> jsonschema.protocols.Validator:
    text = resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    schema = json.loads(text)
    return jsonschema.validators.validator_for(schema)(schema)


def load(text: str) -> dict[str, Any]:
    return yaml.safe_load(interpolate(text, {"REDIS_PASSWORD": "pw"}))


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load((ROOT / "docker-compose.yml").read_text())


def engines(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in compose["services"].items() if svc.get("command", [""])[0] in ("prefill", "decode")}


def gpu_ids(service: dict[str, Any]) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert all("gpu" in d["capabilities"] for d in devices)
    return [gpu for device in devices for gpu in device["device_ids"]]


def flags(service: dict[str, Any]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in service["command"][1:] if "=" in arg)


def check_engines_pinned_and_probed(compose: dict[str, Any]) -> None:
    """What every engine must have; the negative tests below prove this fails when one is lost."""
    pool = engines(compose)
    assert pool
    pins = []
    for name, svc in pool.items():
        ids = gpu_ids(svc)
        assert len(ids) == 1, f"{name} must be pinned to exactly one GPU"
        pins.append(ids[0])
        test = svc["healthcheck"]["test"]
        port = flags(svc)["--metrics-port"]
        assert test == ["CMD", "curl", "-fsS", f"http://{name}:{port}/ready"], f"{name}: no readiness health check"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert svc["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    assert len(set(pins)) == len(pins), f"two engines share a GPU: {pins}"


def test_compose_file_at_the_root_is_the_generators_output() -> None:
    assert (ROOT / "docker-compose.yml").read_text() == render(1, 1)
    assert not (ROOT / "ops" / "docker-compose.yml").exists()


@pytest.mark.parametrize("text", [render(1, 1), render(3, 4), render_override(2, 3), render_override(1, 1)],
                         ids=["shipped", "3+4", "override-2+3", "override-empty"])
def test_compose_files_are_valid_against_the_compose_specification(
    text: str, schema_validator: jsonschema.protocols.Validator
) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in schema_validator.iter_errors(load(text))]
    assert not errors, errors


def test_the_schema_check_catches_a_misspelt_key(
    compose: dict[str, Any], schema_validator: jsonschema.protocols.Validator
) -> None:
    broken = yaml.safe_load(yaml.safe_dump(compose))
    broken["services"]["decode-0"]["healthcheck"]["intervall"] = "5s"
    assert not schema_validator.is_valid(broken)


def test_every_engine_is_pinned_to_its_own_gpu_and_health_checked(compose: dict[str, Any]) -> None:
    check_engines_pinned_and_probed(compose)
    assert sorted(svc["command"][0] for svc in engines(compose).values()) == ["decode", "prefill"]


@pytest.mark.parametrize("lose", ["gpu pin", "healthcheck", "shared gpu"])
def test_the_structural_check_fails_when_an_engine_loses_its_pin_or_health_check(
    compose: dict[str, Any], lose: str
) -> None:
    broken = yaml.safe_load(yaml.safe_dump(compose))
    decode = broken["services"]["decode-0"]
    if lose == "gpu pin":
        del decode["deploy"]
    elif lose == "healthcheck":
        del decode["healthcheck"]
    else:
        decode["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] = ["0"]
    with pytest.raises((AssertionError, KeyError)):
        check_engines_pinned_and_probed(broken)


@pytest.mark.parametrize(("num_prefill", "num_decode"), [(1, 1), (3, 2)])
def test_each_engine_gets_its_own_gpu_and_variable(num_prefill: int, num_decode: int) -> None:
    raw = yaml.safe_load(render(num_prefill, num_decode))  # before interpolation: the variables
    variables = {ENV_REF.match(gpu).group(1) for svc in engines(raw).values() for gpu in gpu_ids(svc)}  # type: ignore[union-attr]
    assert len(variables) == num_prefill + num_decode  # each GPU can be moved on its own
    compose = load(render(num_prefill, num_decode))
    check_engines_pinned_and_probed(compose)
    pins = sorted((gpu for svc in engines(compose).values() for gpu in gpu_ids(svc)), key=int)
    assert pins == [str(i) for i in range(num_prefill + num_decode)]
    for name, svc in engines(compose).items():
        assert flags(svc)["--instance-id"] == name and flags(svc)["--host"] == name == svc["hostname"]


def test_override_adds_only_the_engines_beyond_the_first_of_each_pool_on_gpus_of_their_own() -> None:
    base, override = load(render(1, 1)), load(render_override(2, 3))
    assert set(override["services"]) == {"prefill-1", "decode-1", "decode-2"}
    check_engines_pinned_and_probed(override)
    merged = {**engines(base), **engines(override)}
    pins = sorted((gpu for svc in merged.values() for gpu in gpu_ids(svc)), key=int)
    assert pins == ["0", "1", "2", "3", "4"]  # the shipped engines keep GPUs 0 and 1
    assert override["secrets"] == base["secrets"]


def test_services_start_in_order_redis_then_model_then_engines_then_router(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["redis"]["healthcheck"]["test"][0] == "CMD-SHELL"
    assert services["model-init"]["restart"] == "no"
    router = services["router"]
    assert router["depends_on"] == {
        "redis": {"condition": "service_healthy"},
        "model-init": {"condition": "service_completed_successfully"},
        "prefill-0": {"condition": "service_healthy"},
        "decode-0": {"condition": "service_healthy"},
    }
    assert router["healthcheck"]["test"] == ["CMD", "curl", "-fsS", "http://127.0.0.1:8000/ready"]
    for name, svc in services.items():
        assert "healthcheck" in svc or name == "model-init", f"{name} has no health check"


def test_secrets_come_from_env_and_reach_every_pdserve_service(compose: dict[str, Any]) -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    assert compose["secrets"]["cluster_key"] == {"environment": "PDSERVE_CLUSTER_KEY"}
    for name, svc in compose["services"].items():
        if name == "redis":
            assert svc["environment"]["REDIS_PASSWORD"] == "pw"
            continue
        assert svc["secrets"] == ["cluster_key"]
        assert svc["environment"]["PDSERVE_CLUSTER_KEY_FILE"] == "/run/secrets/cluster_key"
        if name != "model-init":
            assert flags(svc)["--redis-url"] == "redis://:pw@redis:6379/0"
    for ref in ENV_REF.finditer(text):  # everything else has a default; the secrets have none
        assert ref.group(2) == (":?" if ref.group(1) in REQUIRED else ":-"), ref.group(0)
    with pytest.raises(KeyError, match="REDIS_PASSWORD"):
        interpolate(text, {})
    example = dict(
        line.split("=", 1) for line in (ROOT / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert example["REDIS_PASSWORD"] == "" and example["PDSERVE_CLUSTER_KEY"] == ""  # never a shipped secret
    used = {m.group(1) for m in ENV_REF.finditer(text)} | {"PDSERVE_CLUSTER_KEY"}
    assert set(example) <= used, set(example) - used


def test_containers_are_hardened_and_engines_get_time_to_drain(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        assert svc["cap_drop"] == ["ALL"] and "no-new-privileges:true" in svc["security_opt"], name
        if name != "redis":
            assert svc["read_only"] is True and "/home/pdserve" in svc["tmpfs"]
    for svc in engines(compose).values():
        assert svc["stop_grace_period"] == "45s"


def test_the_model_volume_is_filled_once_and_a_checkpoint_folder_can_be_mounted(compose: dict[str, Any]) -> None:
    init = compose["services"]["model-init"]
    assert "resolve_model_path" in " ".join(init["entrypoint"])
    assert (ROOT / init["build"]["context"] / init["build"]["dockerfile"]).is_file()
    assert [name for name, svc in compose["services"].items() if "build" in svc] == ["model-init"]
    assert init["environment"]["PDSERVE_MODEL"] == "SmolLM2-135M-Instruct"
    for svc in compose["services"].values():
        if svc.get("image", "").startswith("pdserve"):
            assert "models:/models" in svc["volumes"] and "checkpoints:/checkpoints:ro" in svc["volumes"]
    assert set(compose["volumes"]) == {"models", "checkpoints"}


def test_ports_and_sizes_come_from_the_environment() -> None:
    raw = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert all(ENV_REF.search(p) for p in raw["services"]["router"]["ports"])
    for svc in engines(raw).values():
        for flag in ("--port", "--kv-port", "--metrics-port", "--block-size", "--max-num-seqs"):
            assert ENV_REF.fullmatch(flags(svc)[flag]), flag
