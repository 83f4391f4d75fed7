"""The C-library settings for KV-receiving processes: glibc takes them, and the image sets them."""

from __future__ import annotations

import os
import pathlib
import platform
import re
import subprocess
import sys

import pytest

from common.glibc_env import TUNABLES, tuned_env

LOADER = pathlib.Path("/lib64/ld-linux-x86-64.so.2")


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
