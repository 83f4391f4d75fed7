"""``pdserve bench overhead`` on tiny sizes: every case and phase is measured, for both samplers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ops.bench import overhead


def test_every_case_reports_every_phase_as_positive_milliseconds_for_both_samplers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "overhead.json"
    argv = ["--batch-sizes", "1,4", "--num-steps", "3", "--warmup", "1", "--prompt-len", "40", "--json", str(out)]
    assert overhead.main(argv) == 0
    report = json.loads(out.read_text())
    measured = {(r["case"], r["batch_size"], r["sampler"] + ("-host" if r.get("host_share") else "")): r
                for r in report["results"]}
    samplers = (*overhead.SAMPLERS, "batched-host", "gpu-path-host")
    assert set(measured) == {(c, b, s) for c in overhead.CASES for b in (1, 4) for s in samplers}
    # The host's share runs over --host-vocab logits; the others over the model's whole vocabulary.
    assert {r["vocab"] for r in report["results"] if r.get("host_share")} == {1024}
    assert {r["vocab"] for r in report["results"] if not r.get("host_share")} == {report["vocab_size"]} != {1024}
    for key, result in measured.items():
        assert result["num_steps"] == 3
        assert set(result["phases_ms"]) == {*overhead.PHASES, "total"}, key
        for phase, summary in result["phases_ms"].items():
            for stat in ("median", "p90"):
                value = summary[stat]
                assert isinstance(value, float) and 0 < value < 60_000, (key, phase, stat, value)
            assert summary["median"] <= summary["p90"]
        # Each step's total spans each of its phases, so no phase's median exceeds the total's (their
        # medians need not add up to it over 3 steps on a loaded host).
        total = result["phases_ms"]["total"]["median"]
        assert all(result["phases_ms"][p]["median"] <= total * 1.001 for p in overhead.PHASES), key
        assert 0 < result["torch_ops"]["sample"] < result["torch_ops"]["step"], key
    # Counted, not timed: an all-greedy batch's sampler is one argmax, whatever its size (over a whole
    # vocabulary on the CPU, the blocked argmax's fixed handful: a GPU's would be the one); mixed
    # parameters (4 rows: greedy, top-p, top-k with a seed, top-k/top-p/min-p with logprobs) take more.
    greedy = [measured["greedy", b, "batched-host"]["torch_ops"]["sample"] for b in (1, 4)]
    assert greedy == [1, 1] and measured["mixed", 4, "batched-host"]["torch_ops"]["sample"] > 10
    # On a GPU's branches (its Triton kernels recorded): the draw and the nucleus are kernels, in place of
    # the CPU's torch operations; an all-greedy batch launches none.
    gpu = measured["mixed", 4, "gpu-path-host"]["torch_ops"]
    assert gpu["triton_launches"] >= 2 and gpu["sample"] < measured["mixed", 4, "batched-host"]["torch_ops"]["sample"]
    # An all-greedy step is the one argmax on either path; on a GPU's, into the step's output buffer, whose
    # allocation this count includes (it launches nothing).
    greedy_ops = measured["greedy", 4, "batched-host"]["torch_ops"]
    assert measured["greedy", 4, "gpu-path-host"]["torch_ops"] == {
        "step": greedy_ops["step"] + 1, "sample": greedy_ops["sample"] + 1, "triton_launches": 0}
    blocked = [measured["greedy", b, "batched"]["torch_ops"]["sample"] for b in (1, 4)]
    assert blocked[0] == blocked[1] <= 10
    # The prefill case's admission (add_request, outside the step), per request: timed, and only there.
    admits = {key: r["admit_us_per_request"] for key, r in measured.items() if "admit_us_per_request" in r}
    assert {key[0] for key in admits} == {"prefill"} and len(admits) == 2 * len(samplers)
    assert all(0 < us < 60e6 for us in admits.values())
    assert set(report["floor_ms"]) == {"1", "4"} and all(v > 0 for v in report["floor_ms"].values())
    assert report["machine"]["torch_threads"] == 1
    # The host's speed, before the cases and after them, measured: reports of other days compare by it.
    assert len(report["host_speed"]) == 2
    assert all(s["python_loop_us"] > 0 and s["torch_op_us"] > 0 for s in report["host_speed"])
    if sys.platform == "linux":  # the hypervisor's share over the cases, read from /proc/stat
        assert 0.0 <= report["host_steal"]["cpu"]["share"] <= 1.0
    table = capsys.readouterr().out
    assert f"{'mixed':<8}{4:>6}  {'gpu-path':<8}{1024:>7}" in table
    assert table.count("host speed now: python loop") == 2
    assert "target greedy, batch 256: <= 2 ms: not measured in this run" in table
    assert f"{'greedy':<8}{4:>6}  {'batched':<8}{1024:>7}" in table
    assert all(f"{case:<8}{4:>6}  per-row" in table for case in overhead.CASES)
    assert table.count("admission, prefill batch") == len(admits) and "us per request of 40 tokens" in table
    if overhead.write_plot(report, tmp_path / "probe.png"):
        assert out.with_suffix(".png").stat().st_size > 0


def test_a_target_is_reported_met_only_when_the_measured_median_is_within_it() -> None:
    def result(sampler: str, total: float) -> dict[str, object]:
        phases = {p: {"median": total / 5, "p90": total / 5} for p in overhead.PHASES}
        return {"case": "greedy", "batch_size": 64, "sampler": sampler, "num_steps": 1,
                "phases_ms": {**phases, "total": {"median": total, "p90": total}}}

    def line(batched_ms: float) -> str:
        report = {"machine": {"torch_threads": 1, "device": "cpu"}, "floor_ms": {"64": 0.5},
                  "results": [result("batched", batched_ms), result("per-row", 9.0)]}
        return next(x for x in overhead.format_report(report).splitlines() if x.startswith("target greedy, batch 64"))

    assert line(0.9) == ("target greedy, batch 64: <= 1 ms: measured 0.90 ms (met); per-row sampler 9.00 ms; "
                         "without sampling 0.54 ms")
    assert line(1.2) == ("target greedy, batch 64: <= 1 ms: measured 1.20 ms (NOT met); per-row sampler 9.00 ms; "
                         "without sampling 0.72 ms")


def test_a_baseline_run_is_printed_beside_this_run_with_its_speedup() -> None:
    def result(total: float) -> dict[str, object]:
        phases = {p: {"median": total / 5, "p90": total / 5} for p in overhead.PHASES}
        return {"case": "greedy", "batch_size": 64, "sampler": "batched", "num_steps": 1,
                "phases_ms": {**phases, "total": {"median": total, "p90": total}}}

    report = {"machine": {"torch_threads": 1, "device": "cpu"}, "floor_ms": {"64": 0.5}, "results": [result(2.0)],
              "baseline": {"path": "before.json", "clock": "wall", "results": [result(8.0)]}}
    lines = overhead.format_report(report).splitlines()
    row = next(x for x in lines if x.startswith("greedy      64  batched") and "->" in x)
    assert row.split()[3:6] == ["8.00", "->", "2.00"] and "(4.0x)" in row
    target = next(x for x in lines if x.startswith("target greedy, batch 64"))
    assert target.endswith("; baseline 8.00 ms, without sampling 4.80 ms")


def test_overlap_runs_each_case_synchronously_and_async_beside_a_simulated_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "overlap.json"
    argv = ["overlap", "--batch-sizes", "4", "--device-ms", "15", "--num-steps", "4", "--warmup", "1",
            "--prompt-len", "40", "--host-vocab", "128", "--json", str(out)]
    assert overhead.main(argv) == 0
    report = json.loads(out.read_text())
    runs = {(r["case"], r["async_scheduling"]): r for r in report["results"]}
    assert set(runs) == {(c, a) for c in ("greedy", "mixed") for a in (False, True)}
    for key, r in runs.items():
        assert r["batch_size"] == 4 and r["device_ms"] == 15 and r["vocab"] == 128, key
        # Every decode step waits for one step of device time. Synchronous, each step waits for its own.
        # Async, the device's steps run back to back and a step ends when the host wakes for the one
        # before: a step the host was late to end (a loaded host) makes the next one short by as much,
        # so only the steps together are bound: the last one's device step was queued at least
        # num_steps device steps after the one that ended the step before the first, less how late
        # the host was to start the first.
        if key[1]:
            assert r["total_ms"] >= (r["num_steps"] - 1) * 15, key
        else:
            assert r["step_ms"]["median"] >= 15 * 0.95, key
        assert 0 < r["host_ms"] < r["step_ms"]["median"], key
        assert 0 < r["device_busy"] <= 1, key
    table = capsys.readouterr().out
    assert f"{'greedy':<8}{4:>6}{15:>11}" in table and "x" in table.splitlines()[3]


@pytest.mark.parametrize("device, message", [
    ("cuda", "--device cuda: no CUDA device is available"),
    ("mps", "--device mps: cpu or cuda[:N]"),
    ("gpu0", "--device gpu0: cpu or cuda[:N]"),
])
def test_a_device_that_is_not_there_or_not_supported_is_refused_by_name(device: str, message: str) -> None:
    if device == "cuda" and overhead.torch.cuda.is_available():
        pytest.skip("a GPU is here: --device cuda runs")
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        overhead.main(["--device", device, "--batch-sizes", "1", "--num-steps", "1", "--no-plot"])


def test_profiled_steps_list_each_decode_cases_operations_by_host_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profiled.json"
    argv = ["--batch-sizes", "4", "--cases", "greedy,mixed,prefill", "--samplers", "batched", "--host-vocab", "0",
            "--num-steps", "2", "--warmup", "1", "--prompt-len", "20", "--profile-steps", "2", "--json", str(out),
            "--no-plot"]
    assert overhead.main(argv) == 0
    results = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    assert "profile" not in results["prefill"], "prefill steps add requests between them: not profiled"
    for case in ("greedy", "mixed"):
        rows = results[case]["profile"]
        assert 0 < len(rows) <= overhead.PROFILE_TOP
        hosts = [row["self_host_us"] for row in rows]
        assert hosts == sorted(hosts, reverse=True) and hosts[0] > 0
        assert all(row["calls"] > 0 and row["name"] for row in rows)
    # The mixed batch's sampler runs operations the greedy one does not (top-k's topk, top-p's sort).
    assert {"aten::topk", "aten::sort"} & {row["name"] for row in results["mixed"]["profile"]}
    table = capsys.readouterr().out
    assert "profile, greedy batch 4" in table and "profile, mixed batch 4" in table and "profile, prefill" not in table


def test_the_forward_count_runs_both_backends_and_the_triton_one_launches_fewer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pdserve bench overhead forward`` on a tiny Llama: every case with each backend. The Triton one
    records its kernels' launches (each replacing several torch operations), so it dispatches fewer
    in all; the reference one launches none."""
    from ops.bench import forward_ops
    from tests.engine.tiny_models import build_checkpoint, family_configs

    folder = build_checkpoint(family_configs()["llama-bias"], tmp_path / "llama")
    out = tmp_path / "forward.json"
    assert overhead.main(["forward", "--model", str(folder), "--batch", "8", "--context", "20", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    got = {(r["case"], r["backend"]): r for r in report["results"]}
    assert set(got) == {(c, b) for c in ("decode", "prefill", "sample") for b in forward_ops.BACKENDS}
    for case in ("decode", "prefill"):
        torch_run, triton_run = got[case, "torch"], got[case, "triton"]
        assert torch_run["triton_launches"] == 0 and triton_run["triton_launches"] > 0
        assert triton_run["total"] < torch_run["total"]
        assert triton_run["launches"]["_rms_norm_kernel"] >= 2  # the layers' norms (with the residual sums) and the last
        assert triton_run["total"] == triton_run["torch_ops"] + triton_run["triton_launches"]
    # The sampler's mixed step (8 rows: each of MIXED once): on the GPU's branches its kernels, each
    # once over every row, greedy or sampled (no copy of a group's rows in or out of the batch), and its
    # copies to and from the device too.
    torch_run, triton_run = got["sample", "torch"], got["sample", "triton"]
    assert triton_run["launches"] == {"_penalties_kernel": 1, "_nucleus_kernel": 1, "_seeded_race_kernel": 1,
                                      "_logprobs_kernel": 1}
    # The ids, the row maxima and the logprob table cross to the host in one copy of one buffer.
    assert triton_run["uploads"] > 0 and triton_run["downloads"] == 1
    assert triton_run["total"] == triton_run["torch_ops"] + 4 + triton_run["uploads"] + 1 < torch_run["total"]
    assert "aten.sort.default" not in triton_run["ops"] and torch_run["triton_launches"] == 0
    for op in ("index_copy_", "_log_softmax", "cat"):  # no group's rows moved; the table is the kernel's
        assert f"aten.{op}.default" not in triton_run["ops"], op
    assert triton_run["ops"]["aten.topk.default"] == 1  # beside it, torch's topk for the alternatives
    assert "per layer" in capsys.readouterr().out


def test_the_forward_count_with_lora_adapters_adds_their_products_per_adapted_projection(tmp_path: Path) -> None:
    """``--lora-rank``: every projection of a tiny Llama adapted (its q/k/v and gate/up stacked: 4 adapted
    products a layer). One adapter for the whole step: its two operations on each (the product with A,
    the one with B added in place); a mixed step one more (the mask); an idle step none."""
    from tests.engine.tiny_models import build_checkpoint, family_configs

    folder = build_checkpoint(family_configs()["llama-bias"], tmp_path / "llama")
    out = tmp_path / "forward.json"
    assert overhead.main(["forward", "--model", str(folder), "--batch", "6", "--context", "20", "--backends", "triton",
                          "--cases", "decode,decode-lora,decode-lora-mixed", "--lora-rank", "4", "--json", str(out)]) == 0
    got = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    plain = overhead.main(["forward", "--model", str(folder), "--batch", "6", "--context", "20", "--backends", "triton",
                           "--cases", "decode", "--json", str(tmp_path / "plain.json")])
    assert plain == 0
    (without,) = json.loads((tmp_path / "plain.json").read_text())["results"]
    layers = family_configs()["llama-bias"].num_hidden_layers
    assert got["decode"]["total"] == without["total"]
    assert got["decode-lora"]["total"] - got["decode"]["total"] == 4 * layers * 2
    assert got["decode-lora-mixed"]["total"] - got["decode"]["total"] == 4 * layers * 3
    with pytest.raises(SystemExit, match="need --lora-rank"):
        overhead.main(["forward", "--model", str(folder), "--cases", "decode-lora"])
