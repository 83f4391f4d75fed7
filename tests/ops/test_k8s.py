"""The Kubernetes manifests (no cluster here): each built-in object is valid against Kubernetes'
own OpenAPI schema (kubernetes-validate, strict: unknown fields fail), and the structure keeps what
matters: probes on every container, a hardened pod security context, GPUs for the engines, network
policies that keep the engines' ports to the routers and peer engines, secrets from a Secret, and
autoscalers that follow the rule ``ops.autoscale`` replays."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
from typing import Any

import kubernetes_validate
import pytest
import yaml

from ops.autoscale import DECODE_POLICY, PREFILL_POLICY, PoolPolicy

K8S = pathlib.Path(__file__).resolve().parents[2] / "ops" / "k8s"
KUBERNETES_VERSION = "1.30"
CRDS = {"PodMonitor", "ServiceMonitor"}  # the Prometheus Operator's; no schema ships for them
SECRET_KEYS = {"redis-password", "cluster-key", "api-keys"}


def load_docs() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [d for f in kustomization["resources"] for d in yaml.safe_load_all((K8S / f).read_text()) if d]


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return load_docs()


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    specs = {}
    for d in docs:
        if d["kind"] in ("Deployment", "Job"):
            specs[d["metadata"]["name"]] = d["spec"]["template"]["spec"]
    return specs


def test_every_file_in_the_folder_is_listed_in_the_kustomization() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {f.name for f in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_built_in_objects_are_valid_against_the_kubernetes_schema(docs: list[dict[str, Any]]) -> None:
    checked = 0
    for doc in docs:
        if doc["kind"] in CRDS:
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        checked += 1
    assert checked >= 12


def test_the_schema_check_catches_a_misspelt_probe(docs: list[dict[str, Any]]) -> None:
    deployment = yaml.safe_load(yaml.safe_dump(by_kind(docs, "Deployment")["pdserve-decode"]))
    probe = deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["periodSecond"] = probe.pop("periodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) is not installed")
def test_kustomize_builds_the_same_objects(docs: list[dict[str, Any]]) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], check=True, capture_output=True, text=True, timeout=60)
    built = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in built) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in docs
    )


def check_engine_pod(name: str, spec: dict[str, Any]) -> None:
    """What every engine pod must keep; the negative test below proves this fails when it does not."""
    container = spec["containers"][0]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert probe in container, f"{name}: no {probe}"
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "model load needs minutes"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert spec["terminationGracePeriodSeconds"] == 45  # --drain-timeout 30 s and margin


def test_engine_pools_are_separate_deployments_with_probes_gpus_and_time_to_drain(docs: list[dict[str, Any]]) -> None:
    deployments = by_kind(docs, "Deployment")
    assert set(deployments) == {"pdserve-redis", "pdserve-router", "pdserve-prefill", "pdserve-decode"}
    for role in ("prefill", "decode"):
        spec = deployments[f"pdserve-{role}"]["spec"]
        assert spec["template"]["spec"]["containers"][0]["args"][0] == role
        assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        check_engine_pod(role, spec["template"]["spec"])


@pytest.mark.parametrize("lose", ["readinessProbe", "startupProbe", "gpu", "grace"])
def test_the_engine_check_fails_when_a_probe_the_gpu_or_the_grace_period_is_lost(
    docs: list[dict[str, Any]], lose: str
) -> None:
    spec = yaml.safe_load(yaml.safe_dump(by_kind(docs, "Deployment")["pdserve-prefill"]["spec"]["template"]["spec"]))
    container = spec["containers"][0]
    if lose == "gpu":
        del container["resources"]["limits"]["nvidia.com/gpu"]
    elif lose == "grace":
        spec["terminationGracePeriodSeconds"] = 30
    else:
        del container[lose]
    with pytest.raises((AssertionError, KeyError)):
        check_engine_pod("prefill", spec)


def test_every_container_has_probes_and_every_pod_is_hardened(docs: list[dict[str, Any]]) -> None:
    for name, spec in pod_specs(docs).items():
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["runAsUser"] == (999 if name == "pdserve-redis" else 10001), name  # 10001: the image's user
        assert spec["automountServiceAccountToken"] is False
        for container in spec.get("initContainers", []) + spec["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, (name, container["name"])
            assert security["readOnlyRootFilesystem"] is True, (name, container["name"])
            assert security["capabilities"] == {"drop": ["ALL"]}, (name, container["name"])
            assert "memory" in container["resources"]["limits"], (name, container["name"])
            if name != "pdserve-model-init" and container not in spec.get("initContainers", []):
                assert "readinessProbe" in container and "livenessProbe" in container, (name, container["name"])


def test_secrets_come_from_one_secret_and_the_cluster_key_is_a_mounted_file(docs: list[dict[str, Any]]) -> None:
    assert not by_kind(docs, "Secret"), "no secret value is shipped; the README creates it"
    refs = set()
    for spec in pod_specs(docs).values():
        for container in spec["containers"]:
            env = {e["name"]: e for e in container.get("env", [])}
            for e in env.values():
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == "pdserve-secrets"
                    refs.add(ref["key"])
            if container["name"] in ("router", "prefill", "decode"):
                assert env["PDSERVE_CLUSTER_KEY_FILE"]["value"] == "/etc/pdserve/cluster-key"
                assert "--redis-url=redis://:$(REDIS_PASSWORD)@pdserve-redis:6379/0" in container["args"]
                assert "value" not in env["REDIS_PASSWORD"]
                volumes = {v["name"]: v for v in spec["volumes"]}
                mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/etc/pdserve")
                assert volumes[mount["name"]]["secret"]["secretName"] == "pdserve-secrets"
    assert refs <= SECRET_KEYS and {"redis-password"} <= refs


def test_the_model_volume_is_filled_by_a_job_and_mounted_read_only_elsewhere(docs: list[dict[str, Any]]) -> None:
    (claim,) = by_kind(docs, "PersistentVolumeClaim").values()
    (job,) = by_kind(docs, "Job").values()
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert "resolve_model_path" in script and "pdserve-model-ready" in script
    for name, spec in pod_specs(docs).items():
        claims = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
        if name in ("pdserve-redis",):
            assert not claims
            continue
        assert [v["persistentVolumeClaim"]["claimName"] for v in claims] == [claim["metadata"]["name"]]
        if name != job["metadata"]["name"]:
            assert claims[0]["persistentVolumeClaim"]["readOnly"] is True
            (wait,) = spec["initContainers"]
            assert "pdserve-model-ready" in " ".join(wait["command"])


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def pod_labels(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in docs if d["kind"] == "Deployment"}


def allowed_sources(docs: list[dict[str, Any]], target: str, port: str) -> set[str]:
    """Which Deployments' pods (or "monitoring", "anyone") the NetworkPolicies let reach ``target:port``."""
    labels = pod_labels(docs)
    sources: set[str] = set()
    for policy in by_kind(docs, "NetworkPolicy").values():
        if not selects(policy["spec"]["podSelector"], labels[target]):
            continue
        for rule in policy["spec"].get("ingress", []):
            if rule.get("ports") and port not in {p["port"] for p in rule["ports"]}:
                continue
            if "from" not in rule:
                sources.add("anyone")
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer:
                    sources.add("monitoring")
                else:
                    sources |= {name for name, lab in labels.items() if selects(peer["podSelector"], lab)}
    return sources


def test_network_policies_keep_engine_ports_to_routers_and_peer_engines(docs: list[dict[str, Any]]) -> None:
    peers = {"pdserve-router", "pdserve-prefill", "pdserve-decode"}
    for engine in ("pdserve-prefill", "pdserve-decode"):
        assert allowed_sources(docs, engine, "control") == peers
        assert allowed_sources(docs, engine, "kv") == peers
        assert allowed_sources(docs, engine, "metrics") == {"monitoring"}
    assert allowed_sources(docs, "pdserve-router", "http") == {"anyone"}
    assert allowed_sources(docs, "pdserve-router", "replies") == {"pdserve-prefill", "pdserve-decode"}
    assert allowed_sources(docs, "pdserve-redis", "redis") == peers
    deny = by_kind(docs, "NetworkPolicy")["pdserve-default-deny"]["spec"]
    assert "ingress" not in deny and all(selects(deny["podSelector"], lab) for lab in pod_labels(docs).values())
    for policy in by_kind(docs, "NetworkPolicy").values():  # named ports exist on the pods they select
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                selected = [d for d in by_kind(docs, "Deployment").values()
                            if selects(policy["spec"]["podSelector"], d["spec"]["template"]["metadata"]["labels"])]
                for d in selected:
                    names = {p["name"] for c in d["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
                    assert port["port"] in names, (policy["metadata"]["name"], d["metadata"]["name"], port)


def test_every_component_is_scraped(docs: list[dict[str, Any]]) -> None:
    labels = pod_labels(docs)
    scraped = set()
    for monitor in by_kind(docs, "PodMonitor").values():
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        for name, lab in labels.items():
            if selects(monitor["spec"]["selector"], lab):
                scraped.add(name)
                ports = {p["name"] for c in by_kind(docs, "Deployment")[name]["spec"]["template"]["spec"]["containers"]
                         for p in c.get("ports", [])}
                assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports
    for monitor in by_kind(docs, "ServiceMonitor").values():
        for service in by_kind(docs, "Service").values():
            if selects(monitor["spec"]["selector"], service["metadata"]["labels"]):
                assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
                scraped |= {n for n, lab in labels.items() if selects({"matchLabels": service["spec"]["selector"]}, lab)}
    assert scraped == set(labels)
    engines = by_kind(docs, "PodMonitor")["pdserve-engines"]["spec"]["podMetricsEndpoints"]
    assert all(e["honorLabels"] for e in engines)  # the engines' own instance ids


def policy_of(hpa: dict[str, Any]) -> dict[str, Any]:
    behavior = hpa["spec"]["behavior"]
    up = {p["type"]: p for p in behavior["scaleUp"]["policies"]}
    down = {p["type"]: p for p in behavior["scaleDown"]["policies"]}
    return {
        "min_replicas": hpa["spec"]["minReplicas"], "max_replicas": hpa["spec"]["maxReplicas"],
        "scale_up_window_s": behavior["scaleUp"]["stabilizationWindowSeconds"],
        "scale_down_window_s": behavior["scaleDown"]["stabilizationWindowSeconds"],
        "period_s": down["Pods"]["periodSeconds"], "scale_up_max_pods": up["Pods"]["value"],
        "scale_down_max_pods": down["Pods"]["value"],
    }


@pytest.mark.parametrize(("role", "policy"), [("prefill", PREFILL_POLICY), ("decode", DECODE_POLICY)])
def test_autoscalers_apply_the_replayed_rule_to_the_engines_signals(
    docs: list[dict[str, Any]], role: str, policy: PoolPolicy
) -> None:
    hpa = by_kind(docs, "HorizontalPodAutoscaler")[f"pdserve-{role}"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"pdserve-{role}"}
    assert policy_of(hpa) == {k: getattr(policy, k) for k in policy_of(hpa)}
    up = {p["type"]: p for p in hpa["spec"]["behavior"]["scaleUp"]["policies"]}
    assert up["Percent"]["value"] == 100 and hpa["spec"]["behavior"]["scaleUp"]["selectPolicy"] == "Max"
    targets = {s.name: s.target for s in policy.signals}
    for metric in hpa["spec"]["metrics"]:
        spec = metric[metric["type"].lower()]
        name = spec["metric"]["name"].removeprefix("pdserve_")
        if name == "ttft_p90_seconds":
            assert metric["type"] == "External" and float(spec["target"]["value"]) == targets[name]
        else:
            quantity = spec["target"]["averageValue"]
            value = int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)
            assert metric["type"] == "Pods" and value == targets[name], name
    adapter = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())["rules"]
    served = {r["name"]["as"] for r in adapter["external"]}
    for rule in adapter["custom"]:
        names = rule["seriesQuery"].split("(", 1)[1].split(")", 1)[0].split("|")
        served |= {"pdserve_" + n for n in names}
    assert {m[m["type"].lower()]["metric"]["name"] for m in hpa["spec"]["metrics"]} <= served
