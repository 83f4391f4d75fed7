"""``pdserve up`` with a stand-in service command: starts, serves, restarts what dies, gives up on crash loops."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import collect_lines, free_port
from tests.router.router_harness import wait_until

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tokenizer_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Tokenizer files plus a config.json: enough of a checkpoint folder for the router."""
    out = tmp_path_factory.mktemp("model")
    for item in tokenizer_dir.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, out / item.name)
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    return out


def _launch(
    model_dir: pathlib.Path, port: int, log_dir: pathlib.Path, env: dict[str, str], num_prefill: int = 1,
    max_restarts: int = 5,
) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "ops.launcher", "up", "--prefill", str(num_prefill), "--decode", "1"]
    argv += ["--model", str(model_dir), "--port", str(port), "--log-dir", str(log_dir), "--grace-period", "5"]
    argv += ["--service-command", f"{sys.executable} -m tests.router.fake_cli", "--ready-timeout", "60"]
    argv += ["--restart-delay", "0.05", "--max-restarts", str(max_restarts)]
    return subprocess.Popen(
        argv,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def launched(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = free_port()
    proc = _launch(model_dir, port, tmp_path, {})
    yield proc, port
    _kill(proc)


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _children_file(log_dir: pathlib.Path) -> dict[str, dict[str, Any]]:
    path = log_dir / "children.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _cmdline(pid: int) -> list[bytes]:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")


def _children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_up_serves_lists_its_children_then_sigterm_stops_every_child(
    launched: tuple[subprocess.Popen[str], int], tmp_path: pathlib.Path
) -> None:
    proc, port = launched
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    assert proc.stdout is not None
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
    assert wait_until(lambda: any("ready at" in line for line in lines), 60), lines
    assert _ready(url)
    for engine in ("prefill-0", "decode-0"):  # engine metrics are on, and where is said
        assert any(f"{engine} metrics at http://127.0.0.1:" in line for line in lines), lines
    children = _children_of(proc.pid)
    assert len(children) == 4  # redis, prefill-0, decode-0, router
    state = _children_file(tmp_path)
    assert {name: (entry["role"], entry["restarts"]) for name, entry in state.items()} == {
        "redis": ("redis", 0), "prefill-0": ("prefill", 0), "decode-0": ("decode", 0), "router": ("router", 0)
    }
    assert sorted(entry["pid"] for entry in state.values()) == sorted(children)
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=10)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
    # One scrape of the router shows every live instance's load, labelled as vLLM's dashboards expect.
    fleet = httpx.get(f"{url}/metrics", timeout=10).text
    for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
        for instance, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
            assert any(
                line.startswith(f"pdserve:{name}{{") and f'instance="{instance}"' in line and f'role="{role}"' in line
                and "model_name=" in line for line in fleet.splitlines()
            ), (name, instance)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert wait_until(lambda: not any(_alive(pid) for pid in children), 10)


def test_up_without_prefill_instances_serves_from_decode(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    port = free_port()
    proc = _launch(model_dir, port, tmp_path, {}, num_prefill=0)
    try:
        lines: list[str] = []
        assert proc.stdout is not None
        threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()  # type: ignore[arg-type]
        assert wait_until(lambda: any("ready at" in line for line in lines), 60), lines
        assert len(_children_of(proc.pid)) == 3  # redis, decode-0, router
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "Hi", "max_tokens": 3},
                              timeout=10)
        assert response.status_code == 200, response.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_an_engine_that_never_comes_up_fails_start_up_with_its_name_and_log(
    model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    proc = _launch(model_dir, free_port(), tmp_path, {"FAKE_CLI_EXIT": "decode-0"}, max_restarts=2)
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        _kill(proc)
    assert proc.returncode == 3, stderr
    assert stderr.count("decode-0 restarted") == 2
    assert "decode-0 died 3 times in a row" in stderr and "(last: code 3)" in stderr
    assert "fake_cli: decode-0 was told to exit" in stderr  # its log's tail
    assert _processes_mentioning(str(model_dir)) == []  # the router, prefill-0 and redis were stopped


def test_an_engine_killed_with_sigkill_is_restarted_with_the_same_argv(
    model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    port = free_port()
    proc = _launch(model_dir, port, tmp_path, {})
    try:
        stdout, stderr = collect_lines(proc.stdout), collect_lines(proc.stderr)
        assert wait_until(lambda: any("ready at" in line for line in stdout), 60), stderr
        old_pid = _children_file(tmp_path)["prefill-0"]["pid"]
        old_argv = _cmdline(old_pid)
        assert b"--instance-id" in old_argv and b"--kv-port" in old_argv
        os.kill(old_pid, signal.SIGKILL)

        def restarted() -> bool:
            entry = _children_file(tmp_path)["prefill-0"]
            return bool(entry["pid"] != old_pid and _alive(entry["pid"]))

        assert wait_until(restarted, 60), stderr
        state = _children_file(tmp_path)
        assert state["prefill-0"]["restarts"] == 1
        assert all(state[name]["restarts"] == 0 for name in ("redis", "decode-0", "router"))
        assert _cmdline(state["prefill-0"]["pid"]) == old_argv  # same instance id and ports
        assert proc.poll() is None
        # The launcher logs before it rewrites children.json, but the reader thread may lag behind.
        died = f"prefill-0 (pid {old_pid}) died with signal SIGKILL; restart 1 in"
        assert wait_until(lambda: any(died in line for line in stderr), 10), stderr
        assert wait_until(lambda: any("prefill-0 restarted (restart 1, pid" in line for line in stderr), 10), stderr

        def serves() -> bool:
            body = {"prompt": "Hi", "max_tokens": 3}
            with contextlib.suppress(httpx.HTTPError):
                return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=10).status_code == 200
            return False

        assert wait_until(serves, 60, interval_s=0.2), stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        _kill(proc)


def test_engines_restart_for_ever_after_ready_but_a_crash_looping_router_stops_the_stack(
    model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    exit_file = tmp_path / "exit-names"
    log_dir = tmp_path / "logs"
    proc = _launch(model_dir, free_port(), log_dir, {"FAKE_CLI_EXIT_FILE": str(exit_file)}, max_restarts=2)
    try:
        stdout, stderr = collect_lines(proc.stdout), collect_lines(proc.stderr)
        assert wait_until(lambda: any("ready at" in line for line in stdout), 60), stderr
        exit_file.write_text("decode-0\n")
        os.kill(_children_file(log_dir)["decode-0"]["pid"], signal.SIGKILL)
        # Past --max-restarts deaths in a row: an engine is still restarted once the stack was ready.
        assert wait_until(lambda: _children_file(log_dir)["decode-0"]["restarts"] >= 4, 90), stderr
        assert proc.poll() is None

        exit_file.write_text("decode-0\nrouter\n")
        os.kill(_children_file(log_dir)["router"]["pid"], signal.SIGKILL)
        assert proc.wait(timeout=90) != 0
    finally:
        _kill(proc)
    assert wait_until(lambda: any("stopping everything" in line for line in stderr), 10), stderr
    assert sum("router restarted" in line for line in stderr) == 2
    assert any("router died 3 times in a row" in line and "stopping everything" in line for line in stderr)
    assert _processes_mentioning(str(model_dir)) == []


def _processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if text in line and not line.lstrip().startswith("Z")]


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = pathlib.Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split()[2] != "Z"


def test_engines_share_the_cores_unless_threads_are_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    from ops.launcher import Launcher, build_parser

    def launcher(*argv: str) -> Launcher:
        args, extra = build_parser().parse_known_args(["--log-dir", str(tmp_path), *argv])
        return Launcher(args, extra)

    def threads(*argv: str) -> str | None:
        return launcher(*argv).engine_env().get("OMP_NUM_THREADS")

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)))
    assert threads("--prefill", "1", "--decode", "1") == "4"
    assert threads("--prefill", "2", "--decode", "3") == "1"
    assert threads("--threads-per-engine", "3") == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads() is None  # the user's setting reaches the engines as it is
    child = launcher().spawn("probe", ["sh", "-c", "echo threads=$OMP_NUM_THREADS"], {"OMP_NUM_THREADS": "5"})
    child.popen.wait(timeout=10)
    assert (tmp_path / "probe.log").read_text().strip() == "threads=5"


def test_engines_get_the_c_library_settings_and_keep_the_users(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    from common.glibc_env import TUNABLES
    from ops.launcher import Launcher, build_parser

    args, extra = build_parser().parse_known_args(["--log-dir", str(tmp_path)])
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=4096:glibc.malloc.arena_max=2")
    tunables = Launcher(args, extra).engine_env()["GLIBC_TUNABLES"].split(":")
    assert tunables[:2] == ["glibc.malloc.mmap_threshold=4096", "glibc.malloc.arena_max=2"]
    assert sorted(tunables[2:]) == sorted(
        f"{name}={value}" for name, value in TUNABLES.items() if name != "glibc.malloc.mmap_threshold"
    )


def _spawned(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, *flags: str) -> dict[str, list[str]]:
    """The argv of every child ``pdserve up`` with ``flags`` starts (none is run)."""
    from ops.launcher import Launcher, build_parser

    args, extra = build_parser().parse_known_args(
        ["--log-dir", str(tmp_path), "--redis-url", "redis://127.0.0.1:1/0", *flags]
    )
    launcher = Launcher(args, extra)
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(launcher, "spawn", lambda name, argv, env=None: spawned.setdefault(name, argv))
    launcher.start_all("model-dir")
    return spawned


def test_up_gives_the_router_the_generation_config_and_image_limit_and_checks_them(
        monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    from ops.launcher import build_parser

    spawned = _spawned(monkeypatch, tmp_path, "--generation-config", "vllm", "--override-generation-config",
                       '{"temperature": 0.5}', "--limit-mm-per-prompt", '{"image": 2}',
                       "--allowed-media-domains", "images.example.com", "cdn.example.com", "--media-fetch-timeout", "2",
                       "--mm-processor-cache-gb", "0.5", "--mm-processor-kwargs", '{"max_pixels": 1003520}')
    router = spawned["router"]
    assert json.loads(router[router.index("--mm-processor-kwargs") + 1]) == {"max_pixels": 1003520}
    assert "--mm-processor-kwargs" not in spawned["decode-0"]
    assert router[router.index("--generation-config") + 1] == "vllm"
    assert json.loads(router[router.index("--override-generation-config") + 1]) == {"temperature": 0.5}
    assert json.loads(router[router.index("--limit-mm-per-prompt") + 1]) == {"image": 2}
    at = router.index("--allowed-media-domains")
    assert router[at + 1:at + 3] == ["images.example.com", "cdn.example.com"]
    assert router[router.index("--media-fetch-timeout") + 1] == "2.0"
    assert router[router.index("--mm-processor-cache-gb") + 1] == "0.5"
    assert "--mm-processor-cache-gb" not in spawned["decode-0"]
    assert "--generation-config" not in spawned["decode-0"] and "--limit-mm-per-prompt" not in spawned["decode-0"]
    for bad in (["--override-generation-config", "[1]"], ["--limit-mm-per-prompt", '{"audio": 1}'],
                ["--media-fetch-timeout", "0"], ["--mm-processor-cache-gb", "-1"], ["--mm-processor-kwargs", "[1]"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(bad)


def test_up_gives_every_engine_the_quantization_to_check(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: pathlib.Path) -> None:
    spawned = _spawned(monkeypatch, tmp_path, "-q", "awq")
    for name in ("prefill-0", "decode-0"):
        assert spawned[name][spawned[name].index("--quantization") + 1] == "awq", name
    assert "--quantization" not in spawned["router"]


def test_the_stream_interval_goes_to_the_decode_instances_only_and_must_be_positive(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    import argparse

    from common.service import add_service_args

    spawned = _spawned(monkeypatch, tmp_path, "--stream-interval", "4")
    assert spawned["decode-0"][spawned["decode-0"].index("--stream-interval") + 1] == "4"
    assert "--stream-interval" not in spawned["prefill-0"] and "--stream-interval" not in spawned["router"]
    parser = argparse.ArgumentParser()
    add_service_args(parser, "decode")
    assert parser.parse_args([]).stream_interval == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--stream-interval", "0"])


def test_the_speculative_config_goes_to_the_decode_instances_only_and_is_checked_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    from ops.launcher import main

    config = '{"method": "ngram", "num_speculative_tokens": 3}'
    spawned = _spawned(monkeypatch, tmp_path, "--speculative-config", config)
    assert spawned["decode-0"][spawned["decode-0"].index("--speculative-config") + 1] == config
    assert "--speculative-config" not in spawned["prefill-0"] and "--speculative-config" not in spawned["router"]
    with pytest.raises(SystemExit, match="'eagle' is not implemented"):
        main(["up", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 3}'])


def test_hf_overrides_go_to_the_router_and_every_engine_and_are_checked_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    import json

    from ops.launcher import main

    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}
    spawned = _spawned(monkeypatch, tmp_path, "--hf-overrides", json.dumps(overrides))
    for name in ("prefill-0", "decode-0", "router"):
        assert json.loads(spawned[name][spawned[name].index("--hf-overrides") + 1]) == overrides, name
    with pytest.raises(SystemExit):  # argparse's exit 2, naming the flag
        main(["up", "--hf-overrides", "[1, 2]"])


def test_engine_flags_are_handed_on_and_what_an_engine_would_refuse_stops_up_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Engine flags ``pdserve up`` does not know go to every engine; a value an engine would refuse stops it before
    the model is resolved or anything starts, naming the flag, rather than every engine's crash loop."""
    import ops.launcher
    from ops.launcher import main

    spawned = _spawned(monkeypatch, tmp_path, "--kv-offloading-size", "0.5")
    for name in ("prefill-0", "decode-0"):
        assert spawned[name][spawned[name].index("--kv-offloading-size") + 1] == "0.5", name
    assert "--kv-offloading-size" not in spawned["router"]
    monkeypatch.setattr(ops.launcher, "_resolve_model", lambda model: pytest.fail("resolved the model"))
    with pytest.raises(SystemExit, match="needs prefix caching"):
        main(["up", "--kv-offloading-size", "0.5", "--no-enable-prefix-caching"])
    with pytest.raises(SystemExit) as exit_info:
        main(["up", "--kv-offloading-backend", "lmcache"])
    assert exit_info.value.code == 2 and "--kv-offloading-backend: invalid choice: 'lmcache'" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="max_num_seqs must be at least 1"):
        main(["up", "--max-num-seqs", "0"])


def test_restart_delays_double_up_to_the_cap_and_reset_after_a_stable_run() -> None:
    from ops.supervisor import RestartPolicy, RestartTracker

    policy = RestartPolicy(initial_delay_s=1, max_delay_s=30, window_s=60, max_restarts=100)
    tracker = RestartTracker(policy, now=0)
    now, delays = 0.0, []
    for _ in range(7):
        now += 5  # up for 5 s, well inside the window
        delays.append(tracker.died(now))
        now += delays[-1]
        tracker.restarted(now)
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    assert tracker.num_restarts == 7
    assert tracker.died(now + 60) == 1  # up for the whole window: back to the first delay
    assert tracker.num_deaths_in_a_row == 1


def test_a_crash_loop_is_more_than_max_restarts_quick_deaths_in_a_row() -> None:
    from ops.supervisor import RestartPolicy, RestartTracker

    policy = RestartPolicy(initial_delay_s=1, window_s=60, max_restarts=5)
    tracker = RestartTracker(policy, now=0)
    now = 0.0
    for _ in range(5):
        now += 2
        now += tracker.died(now)
        assert not tracker.crash_looping
        tracker.restarted(now)
    tracker.died(now + 59)  # still within the window of this run's start
    assert tracker.crash_looping and tracker.num_deaths_in_a_row == 6

    steady = RestartTracker(policy, now=0)
    now = 0.0
    for i in range(12):
        now += 61 if i % 3 == 2 else 1  # every third run stays up past the window
        now += steady.died(now)
        assert not steady.crash_looping
        steady.restarted(now)
    assert steady.num_restarts == 12


def test_child_ports_come_from_below_the_ephemeral_range_and_skip_ports_in_use(tmp_path: pathlib.Path) -> None:
    import random
    import socket

    from ops.launcher import PORT_FLOOR, ephemeral_ports, free_port

    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("40000\t60999\n")
    assert ephemeral_ports(str(range_file)) == (40000, 60999)
    assert ephemeral_ports(str(tmp_path / "missing")) == (32768, 60999)
    low = ephemeral_ports()[0]
    ports = {free_port() for _ in range(50)}
    assert all(PORT_FLOOR <= port < low for port in ports), sorted(ports)
    # The first port drawn, taken by a listener, is passed over for the second.
    draws = random.Random(7)
    first, second = draws.randrange(PORT_FLOOR, 40000), draws.randrange(PORT_FLOOR, 40000)
    with socket.create_server(("127.0.0.1", first)):
        assert free_port(random.Random(7), ephemeral=(40000, 60999)) == second
    assert free_port(random.Random(7), ephemeral=(40000, 60999)) == first


def test_visible_gpus_read_cuda_visible_devices_as_cuda_does_else_count_the_driver_s() -> None:
    from ops.launcher import visible_gpus

    def never() -> int:
        raise AssertionError("the driver was asked though CUDA_VISIBLE_DEVICES was set")

    assert visible_gpus({}, lambda: 3) == ["0", "1", "2"]
    assert visible_gpus({}, lambda: 0) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}, never) == ["2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-abc,GPU-def"}, never) == ["GPU-abc", "GPU-def"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, never) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, never) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,-1,3"}, never) == ["1"]  # CUDA stops at an invalid entry


def test_engines_get_a_gpu_each_while_there_are_enough_and_split_a_shared_one_s_memory() -> None:
    from ops.launcher import place_engines

    names = ["prefill-0", "decode-0", "decode-1"]
    assert place_engines(names, []) == {}
    assert place_engines(names, ["0", "1", "2", "3"]) == {
        "prefill-0": ("0", 0.9), "decode-0": ("1", 0.9), "decode-1": ("2", 0.9)}
    assert place_engines(names, ["4", "7"]) == {
        "prefill-0": ("4", 0.45), "decode-0": ("7", 0.9), "decode-1": ("4", 0.45)}
    assert place_engines(names, ["0"]) == {name: ("0", 0.3) for name in names}


def test_tensor_parallel_engines_take_consecutive_gpus_each_and_share_the_groups_out() -> None:
    from ops.launcher import place_engines

    names = ["prefill-0", "decode-0", "decode-1"]
    assert place_engines(names, ["0", "1", "2", "3", "4", "5"], per_engine=2) == {
        "prefill-0": ("0,1", 0.9), "decode-0": ("2,3", 0.9), "decode-1": ("4,5", 0.9)}
    assert place_engines(names, ["0", "1", "2", "3", "4"], per_engine=2) == {  # the fifth GPU takes no engine
        "prefill-0": ("0,1", 0.45), "decode-0": ("2,3", 0.9), "decode-1": ("0,1", 0.45)}
    with pytest.raises(ValueError, match="--tensor-parallel-size 4 needs 4 GPUs per engine; 2 visible"):
        place_engines(names, ["0", "1"], per_engine=4)


def test_up_gives_every_engine_the_tensor_parallel_size_and_refuses_what_cannot_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    import ops.launcher as launcher_module
    from common.cli import main

    spawned = _spawned(monkeypatch, tmp_path, "--tensor-parallel-size", "2", "--decode", "2")
    for name in ("prefill-0", "decode-0", "decode-1"):
        argv = spawned[name]
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2", name
    assert "--tensor-parallel-size" not in spawned["router"]
    with pytest.raises(SystemExit, match="--enable-lora with --tensor-parallel-size"):
        main(["up", "--enable-lora", "-tp", "2"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(launcher_module, "nvml_gpu_count", lambda: 1)
    monkeypatch.setattr(launcher_module, "_resolve_model", lambda model: "model-dir")
    with pytest.raises(SystemExit, match="needs 2 GPUs per engine; 1 visible"):
        main(["up", "-tp", "2", "--log-dir", str(tmp_path)])


def test_up_on_a_gpu_host_pins_each_engine_to_its_gpu_and_passes_its_share(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pdserve up` on a one-GPU host (the default: one prefill, one decode): both engines on it, each
    told half of the default share, so the second one's KV cache fits beside the first's. A user's
    --gpu-memory-utilization is passed as it is; --device (say, cpu) turns the placement off."""
    import ops.launcher as launcher_module
    from ops.launcher import Launcher, build_parser

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(launcher_module, "nvml_gpu_count", lambda: 1)

    def start(*argv: str) -> dict[str, tuple[list[str], dict[str, str]]]:
        args, extra = build_parser().parse_known_args(
            ["--log-dir", str(tmp_path), "--redis-url", "redis://127.0.0.1:1/0", *argv])
        launcher = Launcher(args, extra)
        spawned: dict[str, tuple[list[str], dict[str, str]]] = {}
        monkeypatch.setattr(launcher, "spawn", lambda name, argv, env=None: spawned.setdefault(name, (argv, env or {})))
        launcher.start_all("model-dir")
        return spawned

    def share(argv: list[str]) -> str:
        return argv[argv.index("--gpu-memory-utilization") + 1]

    spawned = start()
    for name in ("prefill-0", "decode-0"):
        argv, env = spawned[name]
        assert env["CUDA_VISIBLE_DEVICES"] == "0" and share(argv) == "0.45", name
    assert "CUDA_VISIBLE_DEVICES" not in spawned["router"][1] and "--gpu-memory-utilization" not in spawned["router"][0]
    assert "pdserve: decode-0 on GPU 0, 0.45 of its memory" in capsys.readouterr().err

    spawned = start("--gpu-memory-utilization", "0.4")
    assert [share(spawned[n][0]) for n in ("prefill-0", "decode-0")] == ["0.4", "0.4"]
    assert all(spawned[n][0].count("--gpu-memory-utilization") == 1 for n in ("prefill-0", "decode-0"))
    assert spawned["decode-0"][1]["CUDA_VISIBLE_DEVICES"] == "0"

    spawned = start("--device", "cpu")
    assert "CUDA_VISIBLE_DEVICES" not in spawned["decode-0"][1]
    assert spawned["decode-0"][0].count("--gpu-memory-utilization") == 0

    monkeypatch.setattr(launcher_module, "nvml_gpu_count", lambda: 0)  # a CPU host: nothing changes
    spawned = start()
    assert "CUDA_VISIBLE_DEVICES" not in spawned["decode-0"][1] and "--gpu-memory-utilization" not in spawned["decode-0"][0]


def test_up_hands_the_chat_template_and_parsers_to_the_router_and_the_router_takes_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    from router.main import build_parser as router_parser

    spawned = _spawned(monkeypatch, tmp_path, "--chat-template", "chatml-tools", "--tool-call-parser", "hermes",
                       "--reasoning-parser", "qwen3")
    router = spawned["router"]
    assert router[router.index("--chat-template") + 1] == "chatml-tools"
    assert router[router.index("--tool-call-parser") + 1] == "hermes"
    assert "--chat-template" not in spawned["decode-0"]
    parsed = router_parser().parse_args(router[router.index("--chat-template"):router.index("--reasoning-parser") + 2])
    assert (parsed.chat_template, parsed.tool_call_parser, parsed.reasoning_parser) == ("chatml-tools", "hermes", "qwen3")


def test_up_hands_the_response_ttl_to_the_router_and_the_router_takes_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    from router.main import build_parser as router_parser

    router = _spawned(monkeypatch, tmp_path)["router"]
    assert "--response-ttl" not in router  # the router's own default
    router = _spawned(monkeypatch, tmp_path, "--response-ttl", "0")["router"]
    at = router.index("--response-ttl")
    assert router_parser().parse_args(router[at:at + 2]).response_ttl == 0


def test_up_hands_the_scheduling_policy_to_every_engine_and_the_router(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    import argparse

    from common.service import add_service_args
    from router.main import build_parser as router_parser

    spawned = _spawned(monkeypatch, tmp_path, "--scheduling-policy", "priority")
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        argv = spawned[name]
        parser = argparse.ArgumentParser()
        add_service_args(parser, role)
        flag = argv.index("--scheduling-policy")
        assert parser.parse_known_args(argv[flag:flag + 2])[0].scheduling_policy == "priority"
    router = spawned["router"]
    flag = router.index("--scheduling-policy")
    assert router_parser().parse_args(router[flag:flag + 2]).scheduling_policy == "priority"


def test_lora_adapters_go_to_every_engine_and_their_names_to_the_router_and_are_checked_first(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    import json

    from common.lora_modules import LoRAModule
    from ops.launcher import main

    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    spawned = _spawned(monkeypatch, tmp_path, "--enable-lora", "--lora-modules", f"sql={adapter}", "--max-loras", "2")
    for name in ("prefill-0", "decode-0"):
        argv = spawned[name]
        assert "--enable-lora" in argv and argv[argv.index("--max-loras") + 1] == "2"
        assert LoRAModule.parse(argv[argv.index("--lora-modules") + 1]) == LoRAModule("sql", str(adapter.resolve()))
    router = spawned["router"]
    assert LoRAModule.parse(router[router.index("--lora-modules") + 1]).name == "sql"
    assert "--enable-lora" not in router and "--max-loras" not in router
    with pytest.raises(SystemExit, match="--lora-modules needs --enable-lora"):
        main(["up", "--lora-modules", f"sql={adapter}"])
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                             "use_dora": True}))
    with pytest.raises(SystemExit, match="use_dora = True is not implemented"):
        main(["up", "--enable-lora", "--lora-modules", f"sql={adapter}"])


def test_up_hands_the_http_front_door_to_the_router_only(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path,
                                                         ) -> None:
    from router.main import build_parser as router_parser

    (tmp_path / "k.pem").write_text("key")
    (tmp_path / "c.pem").write_text("cert")
    monkeypatch.chdir(tmp_path)  # files named relative to where up runs reach the router as absolute paths
    spawned = _spawned(monkeypatch, tmp_path, "--allowed-origins", '["https://app.example"]', "--allow-credentials",
                       "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--enable-request-id-headers",
                       "--root-path", "/llm", "--enable-auto-tool-choice")
    router = spawned["router"]
    at = router.index("--enable-auto-tool-choice")
    parsed = router_parser().parse_args(router[at:])
    assert parsed.allowed_origins == ["https://app.example"] and parsed.allow_credentials
    assert (parsed.ssl_keyfile, parsed.ssl_certfile) == (str(tmp_path / "k.pem"), str(tmp_path / "c.pem"))
    assert parsed.enable_request_id_headers and parsed.enable_auto_tool_choice and parsed.root_path == "/llm"
    for engine in ("prefill-0", "decode-0"):
        assert not {"--allowed-origins", "--ssl-keyfile", "--enable-request-id-headers"} & set(spawned[engine])
    assert "--ssl-keyfile" not in _spawned(monkeypatch, tmp_path)["router"]


def test_up_refuses_https_flags_that_do_not_fit_before_starting_anything(
        model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ops.launcher", "up", "--model", str(model_dir), "--ssl-keyfile",
                           str(tmp_path / "k.pem")], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--ssl-keyfile and --ssl-certfile go together" in proc.stderr
    assert "resolving the model" not in proc.stdout


def test_up_serves_https_and_waits_for_it(model_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """With a certificate, the stack is ready over HTTPS and says so; CORS and request ids reach its router."""
    from tests.router.test_http_options import _self_signed

    key, cert = _self_signed(tmp_path)
    port = free_port()
    argv = [sys.executable, "-m", "ops.launcher", "up", "--prefill", "1", "--decode", "1", "--model", str(model_dir),
            "--port", str(port), "--log-dir", str(tmp_path), "--grace-period", "5", "--ready-timeout", "60",
            "--service-command", f"{sys.executable} -m tests.router.fake_cli", "--ssl-keyfile", key,
            "--ssl-certfile", cert, "--allowed-origins", '["https://app.example"]', "--enable-request-id-headers"]
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = collect_lines(proc.stdout)
        assert wait_until(lambda: any("ready at" in line for line in lines) or proc.poll() is not None, 90), lines
        url = f"https://127.0.0.1:{port}"
        assert any(f"ready at {url}" in line for line in lines), lines
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, verify=cert, timeout=10,
                              headers={"Origin": "https://app.example", "X-Request-Id": "up-1"})
        assert response.status_code == 200, response.text
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        assert response.headers["x-request-id"] == "up-1"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        _kill(proc)
