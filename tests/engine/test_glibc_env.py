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

# A process that sets malloc's thresholds (argv[1] "set") or keeps glibc's ("defaults"), then prints
# whether they were set, the state, the MiB that malloc holds in mappings of their own (``mallinfo2``'s
# ``hblkhd``; -1 where this glibc lacks it) while a 24 MiB buffer lives, and the minor page faults per
# "step" over ten steps that allocate and free what an engine step on the CPU might (24 MiB of logits,
# 6 MiB of a sampling temporary, a small tensor), after ten such steps.
STEPS = """
import ctypes, resource, sys, torch
from common.glibc_env import keep_malloc_defaults, malloc_thresholds_state, set_malloc_thresholds
done = set_malloc_thresholds() if sys.argv[1] == "set" else not keep_malloc_defaults()
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
mallinfo2 = getattr(ctypes.CDLL(None), "mallinfo2", None)
a = torch.empty(24 << 20, dtype=torch.uint8).fill_(1)
mapped = -1
if mallinfo2 is not None:
    mallinfo2.restype = Mallinfo2
    mapped = mallinfo2().hblkhd >> 20
del a
def step():
    a = torch.empty(24 << 20, dtype=torch.uint8).fill_(1)
    b = torch.empty(6 << 20, dtype=torch.uint8).fill_(1)
    c = torch.empty(100)
    del a, b, c
for _ in range(10):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(done, malloc_thresholds_state(), mapped, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10,
      sep=",")
"""


def _steps(mode: str, **env: str) -> tuple[bool, str, int, float]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    out = subprocess.run([sys.executable, "-c", STEPS, mode], env={**base, **env}, cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    done, state, mapped, faults = out.split(",")
    if int(mapped) < 0:
        pytest.skip("this glibc has no mallinfo2 (glibc < 2.33)")
    return done == "True", state, int(mapped), float(faults)


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
def test_malloc_thresholds_set_in_process_keep_a_steps_buffers_on_the_heap() -> None:
    done, state, mapped, faults = _steps("set")
    assert (done, state) == (True, "set in process")
    assert mapped < 24  # the 24 MiB buffer came from the heap
    assert faults < 100  # and the steps reuse its pages (7,680 a step if every one were new)
    # glibc's own mmap threshold starts at 128 KiB: the first 24 MiB buffer is a mapping of its own.
    done, state, mapped, faults = _steps("defaults")
    assert (done, state) == (False, "glibc defaults")
    assert mapped >= 24


@glibc_only
def test_malloc_thresholds_the_process_was_started_with_are_left_alone() -> None:
    for env in ({"MALLOC_TRIM_THRESHOLD_": "4096"}, {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096"}):
        done, state, mapped, faults = _steps("set", **env)
        assert (done, state) == (False, "environment")
        # Their fixed thresholds (4 KiB, or glibc's first 128 KiB) are in force: every step's buffers
        # are mappings of their own, faulted in afresh.
        assert mapped >= 24
        assert faults > 5_000


@glibc_only
def test_an_engine_sets_malloc_thresholds_once_its_model_is_loaded() -> None:
    if malloc_thresholds_state() == "environment":
        pytest.skip("this test process was started with malloc thresholds set")
    make_engine(num_blocks=16)
    assert malloc_thresholds_state() == "set in process"
