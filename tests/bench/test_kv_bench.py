"""``pdserve bench kv`` end to end on a small layout: every path moves the bytes and they arrive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.glibc_env import tuned_env
from ops.bench import kv_transfer_bench

SMALL = ["--num-tokens", "96", "--num-layers", "2", "--iters", "2", "--warmup", "0", "--cpu-iters", "1"]


@pytest.mark.parametrize("defaults", [False, True])
def test_every_path_moves_the_bytes_bit_exact(
    defaults: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    own = "glibc.malloc.arena_max=2"  # the user's own setting in this process
    monkeypatch.setenv("GLIBC_TUNABLES", own)
    report = kv_transfer_bench.run([*SMALL, *(["--glibc-defaults"] if defaults else [])])
    assert report["checksum_ok"] == {
        f"{t}/{p}": True for p in ("consecutive", "recycled", "scattered") for t in ("tcp", "ipc")
    }
    assert report["bytes"] == 6 * 2 * 2 * 16 * 3 * 64 * 4  # blocks, layers, K/V, block, heads, size, fp32
    assert set(report["rows"]) == {
        "kvtransfer tcp:// consec.",
        "kvtransfer ipc:// consec.",
        "kvtransfer tcp:// recycled",
        "kvtransfer ipc:// recycled",
        "kvtransfer tcp:// scatter",
        "kvtransfer ipc:// scatter",
        "zmq tcp:// wire only",
        "plain TCP socket",
        "memcpy (one process)",
    }
    assert all(row["gbps_median"] > 0 for row in report["rows"].values())
    # The receiving process reports what it was started with: glibc's defaults mean none at all.
    expected = "defaults" if defaults else tuned_env({"GLIBC_TUNABLES": own})["GLIBC_TUNABLES"]
    assert report["receiver_glibc_tunables"] == expected
    assert os.environ["GLIBC_TUNABLES"] == own  # this process's environment is as it was
    assert "vs plain" in capsys.readouterr().out


def test_pdserve_bench_kv_exits_0_and_prints_its_figures() -> None:
    """Through the command line, as users run it (it once printed its table, then failed on its own
    return value)."""
    pdserve = Path(sys.executable).with_name("pdserve")
    done = subprocess.run([str(pdserve), "bench", "kv", *SMALL, "--transports", "tcp", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["checksum_ok"] == {f"tcp/{p}": True for p in ("consecutive", "recycled", "scattered")}
