"""The C-library settings for engine processes: glibc takes them from the environment, the image sets
them, and an engine in a process started without them sets malloc's thresholds itself."""

from __future__ import annotations

import os
import pathlib
import platform
import re
import subprocess
import sys

import pytest

from common.glibc_env import TUNABLES, malloc_thresholds_state, tuned_env
from tests.engine.conftest import make_engine

LOADER = pathlib.Path("/lib64/ld-linux-x86-64.so.2")
ROOT = pathlib.Path(__file__).parents[2]
glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# A process that sets malloc's thresholds (argv[1] "set") or keeps glibc's ("defaults"), then runs ten
# "steps" allocating and freeing what an engine step on the CPU might (50 MB of logits, 6 MB of a
# sampling temporary, a small tensor in between), then prints whether they were set, the state, and the
# minor page faults per step over ten more.
STEPS = """
import resource, sys, torch
from common.glibc_env import keep_malloc_defaults, malloc_thresholds_state, set_malloc_thresholds
done = set_malloc_thresholds() if sys.argv[1] == "set" else not keep_malloc_defaults()
def step():
    a = torch.empty(50 << 20, dtype=torch.uint8).fill_(1)
    b = torch.empty(6 << 20, dtype=torch.uint8).fill_(1)
    c = torch.empty(100)
    del a, b, c
for _ in range(10):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(done, malloc_thresholds_state(), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10, sep=",")
"""


def _steps(mode: str, **env: str) -> tuple[bool, str, float]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    out = subprocess.run([sys.executable, "-c", STEPS, mode], env={**base, **env}, cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    done, state, faults = out.split(",")
    return done == "True", state, float(faults)


@pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or not LOADER.exists(), reason="glibc's x86-64 dynamic loader only"
)
def test_glibc_reads_every_setting_in_a_child_started_with_them() -> None:
    def effective(env: dict[str, str]) -> dict[str, int]:
        listed = subprocess.run([str(LOADER), "--list-tunables"], env=env, capture_output=True, text=True)
        if listed.returncode != 0:
            pytest.skip("this glibc's loader cannot list tunables (glibc < 2.33)")
        out = listed.stdout
        values = dict(re.findall(r"^(glibc\.[\w.]+): (\w+)", out, re.M))
        return {name: int(values[name], 0) for name in TUNABLES}

    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    tuned = effective({**plain, **tuned_env(plain)})
    assert tuned == {name: int(value, 0) for name, value in TUNABLES.items()}
    assert effective(plain) != tuned  # the defaults differ: the settings change something


def test_the_users_own_tunables_come_first_and_win() -> None:
    env = tuned_env({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=7"})["GLIBC_TUNABLES"]
    assert env.startswith("glibc.malloc.trim_threshold=7:")
    assert env.count("glibc.malloc.trim_threshold") == 1
    # Set through glibc's older variables: left alone too (the tunable would override them).
    env = tuned_env({"MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_TRIM_THRESHOLD_": "7"})["GLIBC_TUNABLES"]
    assert env == "glibc.cpu.x86_non_temporal_threshold=" + TUNABLES["glibc.cpu.x86_non_temporal_threshold"]
    assert tuned_env({}) == {"GLIBC_TUNABLES": ":".join(f"{k}={v}" for k, v in TUNABLES.items())}


def test_the_module_prints_the_value_to_export() -> None:
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    out = subprocess.run(
        [sys.executable, "-m", "common.glibc_env"], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == tuned_env(env)["GLIBC_TUNABLES"]
    assert out.startswith("glibc.malloc.arena_max=2:")


def test_the_container_image_sets_the_same_settings() -> None:
    dockerfile = (pathlib.Path(__file__).parents[2] / "ops" / "Dockerfile").read_text()
    assert f"GLIBC_TUNABLES={tuned_env({})['GLIBC_TUNABLES']}" in dockerfile


@glibc_only
def test_malloc_thresholds_set_in_process_keep_a_steps_buffers_off_fresh_pages() -> None:
    assert _steps("set")[:2] == (True, "set in process")
    done, state, faults = _steps("defaults")
    assert (done, state) == (False, "glibc defaults")
    # glibc's own thresholds map the 50 MB afresh every step: 12,800 pages.
    assert faults > 10_000
    assert _steps("set")[2] < faults / 100


@glibc_only
def test_malloc_thresholds_the_process_was_started_with_are_left_alone() -> None:
    for env in ({"MALLOC_TRIM_THRESHOLD_": "4096"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}):
        done, state, faults = _steps("set", **env)
        assert (done, state) == (False, "environment")
        assert faults > 10_000  # the 4 KiB setting is in force: every step's buffers are mapped afresh


@glibc_only
def test_an_engine_sets_malloc_thresholds_once_its_model_is_loaded() -> None:
    if malloc_thresholds_state() == "environment":
        pytest.skip("this test process was started with malloc thresholds set")
    make_engine(num_blocks=16)
    assert malloc_thresholds_state() == "set in process"
