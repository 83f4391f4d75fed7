"""The cluster key: where it is read from, what `pdserve up` hands its children, when a service
refuses to start without one, and which addresses an engine may connect to."""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import subprocess
import sys

import pytest
import zmq
import zmq.auth

from common import cluster_key as ck
from common.cluster_key import ENV_KEY, ENV_KEY_FILE, ClusterKey, cluster_key_from_args
from common.endpoints import check_endpoint, is_loopback_host
from common.service import add_service_args
from ops.launcher import Launcher, build_parser, cluster_env
from router.main import build_parser as router_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _secret() -> str:
    return zmq.curve_keypair()[1].decode()


def test_the_key_loads_from_the_flag_file_then_the_env_then_the_env_file(tmp_path: pathlib.Path) -> None:
    flag, env_key, env_file = _secret(), _secret(), _secret()
    (tmp_path / "flag").write_text(flag + "\n")
    (tmp_path / "envfile").write_text(env_file)
    both = {ENV_KEY: env_key, ENV_KEY_FILE: str(tmp_path / "envfile")}
    assert ClusterKey.load(str(tmp_path / "flag"), both).secret_text == flag  # type: ignore[union-attr]
    assert ClusterKey.load(None, both).secret_text == env_key  # type: ignore[union-attr]
    assert ClusterKey.load(None, {ENV_KEY_FILE: str(tmp_path / "envfile")}).secret_text == env_file  # type: ignore[union-attr]
    assert ClusterKey.load(None, {}) is None
    key = ClusterKey(flag)
    assert key.public_key == zmq.curve_public(flag.encode()) and flag not in repr(key)


def test_a_zmq_certificate_file_is_a_key_file_but_a_public_one_is_refused(tmp_path: pathlib.Path) -> None:
    public_file, secret_file = zmq.auth.create_certificates(tmp_path, "cluster")
    secret = zmq.auth.load_certificate(secret_file)[1]
    assert ClusterKey.load(str(secret_file), {}).secret_text == secret.decode()  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="public certificate"):
        ClusterKey.load(str(public_file), {})


@pytest.mark.parametrize("bad", ["short", ";" * 40, ""])
def test_a_configured_key_that_is_not_a_key_is_an_error_never_no_key(bad: str, tmp_path: pathlib.Path) -> None:
    if bad:
        with pytest.raises(ValueError, match=ENV_KEY):
            ClusterKey.load(None, {ENV_KEY: bad})
    path = tmp_path / "key"
    path.write_text(bad)
    with pytest.raises(ValueError):
        ClusterKey.load(str(path), {})
    with pytest.raises(ValueError, match="cannot read"):
        ClusterKey.load(str(tmp_path / "missing"), {})


def test_registry_macs_depend_on_the_secret_and_the_message() -> None:
    a, b = ClusterKey(_secret()), ClusterKey(_secret())
    mac = a.sign(b"entry")
    assert a.verify(b"entry", mac)
    assert not a.verify(b"entrY", mac) and not b.verify(b"entry", mac) and not a.verify(b"entry", "00")


# ---------------------------------------------------------------- pdserve up
def test_pdserve_up_hands_one_fresh_key_to_the_router_and_every_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KEY, raising=False)
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    args, extra = build_parser().parse_known_args(["--redis-url", "redis://127.0.0.1:1/0"])
    first, second = Launcher(args, extra), Launcher(args, extra)
    key = first.cluster_env[ENV_KEY]
    assert ClusterKey(key).secret_text == key  # a valid z85 CURVE secret
    assert second.cluster_env[ENV_KEY] != key, "every run makes its own key"
    spawned: dict[str, dict[str, str]] = {}
    monkeypatch.setattr(first, "spawn", lambda name, argv, env=None: spawned.setdefault(name, env or {}))
    first.start_all("model-dir")
    assert {name: env.get(ENV_KEY) for name, env in spawned.items()} == {
        "prefill-0": key, "decode-0": key, "router": key,
    }


def test_pdserve_up_keeps_a_key_the_environment_already_names(tmp_path: pathlib.Path) -> None:
    secret = _secret()
    assert cluster_env({ENV_KEY: secret}) == ({}, "the cluster key from the environment")
    (tmp_path / "key").write_text(secret)
    assert cluster_env({ENV_KEY_FILE: str(tmp_path / "key")})[0] == {}
    with pytest.raises(SystemExit, match="bad cluster key"):
        cluster_env({ENV_KEY: "nonsense"})


# ---------------------------------------------------------------- start-up policy
def _engine_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_service_args(parser, "decode")
    return parser.parse_args(list(argv))


@pytest.fixture
def no_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KEY, raising=False)
    monkeypatch.delenv(ENV_KEY_FILE, raising=False)
    monkeypatch.setattr(ck, "_warned_open", False)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "decode-0.pdserve.svc", "::"])
def test_a_non_loopback_bind_without_a_key_refuses_to_start(host: str, no_key_env: None) -> None:
    with pytest.raises(SystemExit, match="refusing to expose the internal ZeroMQ planes.*PDSERVE_CLUSTER_KEY"):
        cluster_key_from_args(_engine_args("--host", host), host, "decode")
    router_args = router_parser().parse_args(["--reply-host", host])
    with pytest.raises(SystemExit, match="--insecure"):
        cluster_key_from_args(router_args, router_args.reply_host, "router")


def test_insecure_allows_a_non_loopback_bind_with_a_warning(no_key_env: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="common.cluster_key"):
        assert cluster_key_from_args(_engine_args("--host", "0.0.0.0", "--insecure"), "0.0.0.0", "decode") is None
    assert "UNAUTHENTICATED" in caplog.text


def test_loopback_without_a_key_is_allowed_and_warned_once(no_key_env: None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="common.cluster_key"):
        for host in ("127.0.0.1", "localhost", "::1"):
            assert cluster_key_from_args(_engine_args("--host", host), host, "decode") is None
    assert caplog.text.count("unauthenticated") == 1


def test_a_key_from_the_flag_allows_any_bind(tmp_path: pathlib.Path, no_key_env: None) -> None:
    secret = _secret()
    (tmp_path / "key").write_text(secret)
    key = cluster_key_from_args(_engine_args("--host", "0.0.0.0", "--cluster-key-file", str(tmp_path / "key")),
                                "0.0.0.0", "decode")
    assert key is not None and key.secret_text == secret
    with pytest.raises(SystemExit, match="bad cluster key"):
        cluster_key_from_args(_engine_args("--cluster-key-file", str(tmp_path / "none")), "127.0.0.1", "decode")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("role, flag", [("router", "--reply-host"), ("decode", "--host")])
def test_the_commands_exit_at_once_with_the_reason(role: str, flag: str) -> None:
    """Before a model loads: the model path here does not even exist."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV_KEY, ENV_KEY_FILE)}
    argv = [sys.executable, "-m", "common.cli", role, flag, "0.0.0.0", "--model", "/nonexistent-model"]
    done = subprocess.run(argv, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=150)
    assert done.returncode != 0
    assert "refusing to expose the internal ZeroMQ planes" in done.stderr, done.stderr[-2000:]


# ---------------------------------------------------------------- endpoints in messages
@pytest.mark.parametrize("address", [
    "tcp://127.0.0.1:5555", "tcp://decode-0.pdserve.svc:7000", "tcp://[::1]:5555", "ipc:///tmp/pdserve.sock",
])
def test_connectable_endpoints_pass(address: str) -> None:
    assert check_endpoint(address, "reply_to") == address


@pytest.mark.parametrize("address, rule", [
    ("", "empty"), ("x", "tcp:// or ipc://"), ("inproc://router", "tcp:// or ipc://"),
    ("epgm://eth0;239.1.1.1:5555", "tcp:// or ipc://"), ("tcp://127.0.0.1", "port"),
    ("tcp://127.0.0.1:0", "port"), ("tcp://127.0.0.1:70000", "port"), ("tcp://*:5555", "no valid host"),
    ("tcp://0.0.0.0:5555", "no valid host"), ("tcp://:5555", "no valid host"), ("tcp://a b:1", "spaces"),
    ("tcp://evil;host:1", "no valid host"), ("ipc://", "no socket path"), ("tcp://h:1" + "0" * 600, "too long"),
])
def test_unusable_endpoints_fail_with_the_rule_they_break(address: str, rule: str) -> None:
    with pytest.raises(ValueError, match=rule):
        check_endpoint(address, "reply_to")


def test_loopback_hosts() -> None:
    assert all(map(is_loopback_host, ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST"]))
    assert not any(map(is_loopback_host, ["0.0.0.0", "::", "", "*", "10.0.0.1", "router", "auto"]))
