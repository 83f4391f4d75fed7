"""Check every Triton kernel against its torch reference on a CUDA GPU, then time it; then the engine
with CUDA graphs off and on (equal greedy outputs, decode step time side by side).

    python -m ops.bench.gpu_kernels [--batch 64 --context-len 4096 ...]

Timings are medians over many runs (CUDA events, L2 flushed between runs). Each kernel's achieved
GB/s stands next to a device-to-device ``Tensor.copy_`` moving the same number of bytes (read +
write) in the same run; paged decode attention also stands next to torch SDPA over contiguous K/V
of the same shapes. NVML's readings (utilisation, memory, power, temperature, throttle reasons)
are printed and kept before and after the kernels. A failing check or a failing timing is
recorded and the run goes on; the table is written (Markdown + JSON) to
``ops/bench/results/gpu_kernels-<date>-<card>.{md,json}`` after every section, so a crash late in
the run keeps what came before.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import functools
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # atol = rtol vs fp32 reference


class Report:
    """Collects check and timing rows, and rewrites the Markdown and JSON files on every ``save``."""

    def __init__(self, out_dir: Path, meta: dict[str, Any]) -> None:
        card = re.sub(r"[^A-Za-z0-9]+", "-", meta["device"]).strip("-") or "gpu"
        stem = f"gpu_kernels-{dt.date.today().isoformat()}-{card}"
        out_dir.mkdir(parents=True, exist_ok=True)
        self.md_path, self.json_path = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
        self.meta = meta
        self.checks: list[dict[str, Any]] = []
        self.timings: list[dict[str, Any]] = []
        self.group = ""  # rows of one group share their copy_ baseline

    def check(self, name: str, run: Callable[[], tuple[float, float]]) -> None:
        """``run`` returns (max abs error, allowed); an exception is a failed check, not a crash."""
        try:
            err, tol = run()
            synchronize()
            row = {"check": name, "ok": bool(err <= tol), "max_abs_err": err, "tolerance": tol, "error": ""}
        except Exception as exc:
            row = {"check": name, "ok": False, "max_abs_err": None, "tolerance": None, "error": _short(exc)}
        self.checks.append(row)
        print(f"[check] {'ok  ' if row['ok'] else 'FAIL'} {name} err={row['max_abs_err']} {row['error']}")

    def time(self, name: str, shape: str, fn: Callable[[], Any], num_bytes: float = 0.0,
             flops: float = 0.0) -> float | None:
        try:
            ms = median_ms(fn)
        except Exception as exc:
            self.timings.append({"name": name, "shape": shape, "group": self.group, "error": _short(exc)})
            print(f"[time] FAIL {name}: {_short(exc)}")
            return None
        row = {"name": name, "shape": shape, "median_us": ms * 1e3, "bytes": num_bytes,
               "gb_per_s": num_bytes / ms / 1e6 if num_bytes else None,
               "tflop_per_s": flops / ms / 1e9 if flops else None, "group": self.group}
        self.timings.append(row)
        extra = f" {row['gb_per_s']:.0f} GB/s" if num_bytes else ""
        extra += f" {row['tflop_per_s']:.1f} TFLOP/s" if flops else ""
        print(f"[time] {name} [{shape}] {ms * 1e3:.1f} us{extra}")
        return ms

    def save(self) -> None:
        copy_gbs = {t["group"]: t["gb_per_s"] for t in self.timings if t["name"].startswith("copy_") and "error" not in t}
        for t in self.timings:
            base = copy_gbs.get(t["group"])
            t["of_copy"] = t["gb_per_s"] / base if base and t.get("gb_per_s") else None
        failed = [c["check"] for c in self.checks if not c["ok"]]
        self.json_path.write_text(json.dumps(
            {"meta": self.meta, "checks": self.checks, "timings": self.timings, "failed_checks": failed},
            indent=2))
        lines = [f"# Triton kernels on {self.meta['device']}", ""]
        lines += [f"- {k}: {v}" for k, v in self.meta.items()]
        lines += ["", "## Correctness against the torch reference", "",
                  "| check | ok | max abs err | tolerance | error |", "|---|---|---|---|---|"]
        lines += [f"| {c['check']} | {'yes' if c['ok'] else '**NO**'} | {_fmt(c['max_abs_err'])} | "
                  f"{_fmt(c['tolerance'])} | {c['error']} |" for c in self.checks]
        lines += ["", "## Timings (median)", "",
                  "GB/s counts bytes read + written. Each group ends with a device-to-device `copy_` moving as",
                  "many bytes as its kernel; `of copy_` is a row's GB/s over that copy's.", "",
                  "| group | kernel | shape | median (us) | GB/s | of copy_ | TFLOP/s |", "|---|---|---|---|---|---|---|"]
        for t in self.timings:
            if "error" in t:
                lines.append(f"| {t['group']} | {t['name']} | {t['shape']} | error: {t['error']} | | | |")
                continue
            lines.append(f"| {t['group']} | {t['name']} | {t['shape']} | {t['median_us']:.1f} | "
                         f"{_fmt(t['gb_per_s'], '.0f')} | {_fmt(t['of_copy'], '.0%')} | {_fmt(t['tflop_per_s'], '.1f')} |")
        self.md_path.write_text("\n".join(lines) + "\n")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _short(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    loc = f" ({Path(where[0].filename).name}:{where[0].lineno})" if where else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}{loc}".replace("|", "/")


def _fmt(value: Any, spec: str = ".2e") -> str:
    return "" if value is None else format(value, spec)


_FLUSH: torch.Tensor | None = None


def median_ms(fn: Callable[[], Any], budget_ms: float = 150.0, max_iters: int = 200) -> float:
    """Median of CUDA-event timings, with L2 flushed before each run; about ``budget_ms`` of runs."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=DEVICE)
    fn()  # compile / warm up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    estimate_ms = max((time.perf_counter() - t0) * 1e3 / 3, 1e-3)
    iters = int(min(max_iters, max(10, budget_ms / estimate_ms)))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        _FLUSH.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def time_copy(report: Report, num_bytes: float, dtype: torch.dtype) -> None:
    """``Tensor.copy_`` of a buffer whose read + write equals ``num_bytes``."""
    numel = max(1, int(num_bytes / 2 / torch.tensor([], dtype=dtype).element_size()))
    src = torch.randn(numel, device=DEVICE).to(dtype)
    dst = torch.empty_like(src)
    moved = 2 * numel * src.element_size()
    report.time("copy_ (device to device)", f"{moved / 2**20:.1f} MiB moved", lambda: dst.copy_(src), moved)


def max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max())


def paged_layout(k: torch.Tensor, v: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A shuffled paged ``kv_layer`` holding contiguous ``[batch, kv_heads, seq, head]`` K/V, and its table."""
    batch, num_kv_heads, seq_len, head_size = k.shape
    num_blocks_per_seq = -(-seq_len // block_size)
    padded = num_blocks_per_seq * block_size
    num_blocks = batch * num_blocks_per_seq + 1
    tables = torch.randperm(num_blocks, device=k.device)[: batch * num_blocks_per_seq].view(batch, -1)
    kv_layer = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, device=k.device).to(k.dtype)
    for i, src in enumerate((k, v)):
        src = F.pad(src, (0, 0, 0, padded - seq_len))
        blocks = src.view(batch, num_kv_heads, num_blocks_per_seq, block_size, head_size).permute(0, 2, 3, 1, 4)
        kv_layer[i][tables.flatten()] = blocks.reshape(-1, block_size, num_kv_heads, head_size)
    return kv_layer, tables.to(torch.int32).contiguous()


def run_checks(report: Report, ops: Any, ref: Any) -> None:
    """Small ragged cases per kernel against the reference (in float32 for attention)."""
    from pdserve_kernels.triton_decode import run_paged_decode

    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE, generator=gen).to(dtype)

    def attention_case(dtype: torch.dtype, group: int, head_size: int, block_size: int, q_lens: list[int],
                       ctx_lens: list[int]) -> tuple[torch.Tensor, ...]:
        width = max(-(-c // block_size) for c in ctx_lens)
        num_blocks = len(ctx_lens) * width + 2
        kv_layer = randn(2, num_blocks, block_size, 4, head_size, dtype=dtype)
        tables = torch.randperm(num_blocks, device=DEVICE, generator=gen)[: len(ctx_lens) * width]
        tables = tables.view(len(ctx_lens), width).to(torch.int32)
        query = 2 * randn(sum(q_lens), 4 * group, head_size, dtype=dtype)
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        return query, kv_layer, tables, starts, torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE)

    def widen(*xs: Any) -> list[Any]:
        return [x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in xs]

    for dtype, group, head_size, block_size, splits in [
        (torch.bfloat16, 4, 128, 16, None), (torch.bfloat16, 4, 128, 16, 1), (torch.bfloat16, 8, 128, 16, 6),
        (torch.float16, 3, 64, 32, 4), (torch.float32, 1, 128, 32, None), (torch.float16, 8, 80, 16, 1),
    ]:
        def decode(dtype=dtype, group=group, head_size=head_size, block_size=block_size, splits=splits):
            ctx = [1, 17, 300, 1000, 2049, 77]
            q, kv, tables, _, lens = attention_case(dtype, group, head_size, block_size, [1] * len(ctx), ctx)
            out = torch.full_like(q, float("nan"))
            run_paged_decode(q, kv, tables, lens, head_size**-0.5, out=out, num_splits=splits)
            expected = ref.paged_decode_attention(*widen(q, kv, tables, lens, head_size**-0.5))
            return max_err(out, expected), TOLERANCE[dtype]

        report.check(f"paged_decode_attention {str(dtype)[6:]} gqa{group} d{head_size} bs{block_size} "
                     f"splits={splits or 'auto'}", decode)

    for dtype, group, head_size, block_size in [(torch.bfloat16, 4, 128, 16), (torch.float16, 3, 64, 32),
                                                (torch.float32, 8, 128, 16)]:
        def prefill(dtype=dtype, group=group, head_size=head_size, block_size=block_size):
            q_lens, ctx = [1, 200, 37, 513, 0], [90, 200, 1000, 700, 5]
            q, kv, tables, starts, lens = attention_case(dtype, group, head_size, block_size, q_lens, ctx)
            out = torch.full_like(q, float("nan"))
            ops.paged_prefill_attention(q, kv, tables, starts, lens, head_size**-0.5, out=out)
            expected = ref.paged_prefill_attention(*widen(q, kv, tables, starts, lens, head_size**-0.5))
            return max_err(out, expected), TOLERANCE[dtype]

        report.check(f"paged_prefill_attention {str(dtype)[6:]} gqa{group} d{head_size} bs{block_size}", prefill)

    def store() -> tuple[float, float]:
        kv = randn(2, 40, 16, 8, 128, dtype=torch.bfloat16)
        key, value = randn(300, 8, 128), randn(300, 8, 128)
        slots = torch.randperm(40 * 16, device=DEVICE, generator=gen)[:300]
        slots[::7] = -1
        expected = kv.clone()
        ref.store_kv(key, value, expected, slots)
        ops.store_kv(key, value, kv, slots)
        return max_err(kv, expected), 0.0

    report.check("store_kv fp32 -> bf16 cache, skipped slots", store)

    def fp8_store(fp8: torch.dtype) -> tuple[float, float]:
        """Entries of an 8-bit cache whose byte differs from torch's saturated conversion (0 allowed)."""
        kv = torch.zeros(2, 40, 16, 8, 128, dtype=fp8, device=DEVICE)
        largest = float(torch.finfo(fp8).max)  # some keys past it
        key, value = largest / 1.5 * randn(300, 8, 128, dtype=torch.bfloat16), randn(300, 8, 128) / 100
        slots = torch.randperm(40 * 16, device=DEVICE, generator=gen)[:300]
        expected = kv.clone()
        ref.store_kv(key, value, expected, slots)
        ops.store_kv(key, value, kv, slots)
        return float((kv.view(torch.uint8) != expected.view(torch.uint8)).sum()), 0.0

    def fp8_attention(kind: str, fp8: torch.dtype) -> tuple[float, float]:
        q_lens, ctx = ([1] * 4, [17, 300, 2049, 77]) if kind == "decode" else ([1, 200, 37], [90, 200, 1000])
        q, kv, tables, starts, lens = attention_case(torch.bfloat16, 4, 128, 16, q_lens, ctx)
        kv = kv.to(fp8)
        if kind == "decode":
            out = ops.paged_decode_attention(q, kv, tables, lens, 128**-0.5)
            expected = ref.paged_decode_attention(q.float(), kv.float(), tables, lens, 128**-0.5)
        else:
            out = ops.paged_prefill_attention(q, kv, tables, starts, lens, 128**-0.5)
            expected = ref.paged_prefill_attention(q.float(), kv.float(), tables, starts, lens, 128**-0.5)
        return max_err(out, expected), TOLERANCE[torch.bfloat16]

    def sinks_attention(kind: str) -> tuple[float, float]:
        """gpt-oss's attention sinks, with its 128-token window, against the float32 reference."""
        q_lens, ctx = ([1] * 4, [17, 300, 2049, 77]) if kind == "decode" else ([1, 200, 37], [90, 200, 1000])
        q, kv, tables, starts, lens = attention_case(torch.bfloat16, 8, 64, 16, q_lens, ctx)
        sinks = 3 * randn(q.shape[1], dtype=torch.bfloat16)
        if kind == "decode":
            out = ops.paged_decode_attention(q, kv, tables, lens, 0.125, sliding_window=128, sinks=sinks)
            expected = ref.paged_decode_attention(*widen(q, kv, tables, lens, 0.125), sliding_window=128,
                                                  sinks=sinks.float())
        else:
            out = ops.paged_prefill_attention(q, kv, tables, starts, lens, 0.125, sliding_window=128, sinks=sinks)
            expected = ref.paged_prefill_attention(*widen(q, kv, tables, starts, lens, 0.125), sliding_window=128,
                                                   sinks=sinks.float())
        return max_err(out, expected), TOLERANCE[torch.bfloat16]

    def chunked_attention(kind: str) -> tuple[float, float]:
        """Llama 4's chunked local attention (chunks of 256 here, contexts across several) against the float32
        reference."""
        q_lens, ctx = ([1] * 4, [17, 256, 2049, 777]) if kind == "decode" else ([1, 300, 37], [90, 300, 1000])
        q, kv, tables, starts, lens = attention_case(torch.bfloat16, 5, 128, 16, q_lens, ctx)
        if kind == "decode":
            out = ops.paged_decode_attention(q, kv, tables, lens, 128**-0.5, attention_chunk=256)
            expected = ref.paged_decode_attention(*widen(q, kv, tables, lens, 128**-0.5), attention_chunk=256)
        else:
            out = ops.paged_prefill_attention(q, kv, tables, starts, lens, 128**-0.5, attention_chunk=256)
            expected = ref.paged_prefill_attention(*widen(q, kv, tables, starts, lens, 128**-0.5), attention_chunk=256)
        return max_err(out, expected), TOLERANCE[torch.bfloat16]

    for kind in ("decode", "prefill"):
        report.check(f"paged_{kind}_attention bf16 with attention sinks, window 128 (gpt-oss)",
                     functools.partial(sinks_attention, kind))
        report.check(f"paged_{kind}_attention bf16 in chunks of 256 (Llama 4)", functools.partial(chunked_attention, kind))

    if torch.cuda.get_device_capability() >= (8, 9):  # float8 conversions (the engine refuses fp8 below)
        for fp8, form in ((torch.float8_e4m3fn, "fp8"), (torch.float8_e5m2, "fp8_e5m2")):
            report.check(f"store_kv bf16/fp32 -> {form} cache (entries whose byte differs from torch's)",
                         functools.partial(fp8_store, fp8))
            for kind in ("decode", "prefill"):
                report.check(f"paged_{kind}_attention bf16 over an {form} cache (vs float32 over the same values)",
                             functools.partial(fp8_attention, kind, fp8))

    def blocks() -> tuple[float, float]:
        cache = randn(4, 2, 64, 16, 8, 128, dtype=torch.bfloat16)
        ids = torch.randperm(64, device=DEVICE, generator=gen)[:20]
        packed = ops.gather_blocks(cache, ids)
        err = max_err(packed, ref.gather_blocks(cache, ids))
        dst, want = cache.clone(), cache.clone()
        new_ids = torch.randperm(64, device=DEVICE, generator=gen)[:20]
        ops.scatter_blocks(dst, new_ids, packed)
        ref.scatter_blocks(want, new_ids, packed)
        err = max(err, max_err(dst, want))
        src_ids, dst_ids = torch.arange(0, 10, device=DEVICE), torch.arange(30, 40, device=DEVICE)
        ops.copy_blocks(dst, src_ids, dst_ids)
        ref.copy_blocks(want, src_ids, dst_ids)
        return max(err, max_err(dst, want)), 0.0

    report.check("gather_blocks / scatter_blocks / copy_blocks bf16", blocks)

    def ulps(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
        """The largest difference in units in the last place of ``want``'s dtype, and what is allowed: 2
        at 16 bits, 4 in float32 (where a scale's own rounding carries into every entry)."""
        ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp(min=torch.finfo(want.dtype).tiny)
        return float(((got.float() - want.float()).abs() / ulp).max()), 4.0 if want.dtype == torch.float32 else 2.0

    def norm(dtype: torch.dtype, width: int, form: int) -> tuple[float, float]:
        """Units in the last place of the output's dtype (the sum of squares' order may move the last bit)."""
        x, weight = 3 * randn(300, width, dtype=dtype), (1 + 0.5 * randn(width)).to(dtype)
        return ulps(ops.rms_norm(x, weight, 1e-6, form), ref.rms_norm(x, weight, 1e-6, form))

    def add_norm(dtype: torch.dtype, width: int, form: int) -> tuple[float, float]:
        """The residual sum, which must equal torch's addition (entries that differ, counted as units in
        the last place beyond the norm's), and the norm of it, as ``norm``."""
        x, residual = 3 * randn(300, width, dtype=dtype), 10 * randn(300, width, dtype=dtype)
        weight = (1 + 0.5 * randn(width)).to(dtype)
        (normed, summed), (want_normed, want_summed) = (
            ops.add_rms_norm(x, residual, weight, 1e-6, form), ref.add_rms_norm(x, residual, weight, 1e-6, form))
        err, tol = ulps(normed, want_normed)
        return err + tol * float((summed != want_summed).sum()), tol

    form_names = {ref.NORM_LLAMA: "", ref.NORM_GEMMA: ", Gemma", ref.NORM_OLMO: ", OLMo",
                  ref.NORM_LAYER: ", Cohere's LayerNorm"}
    for dtype, width, form in [(torch.bfloat16, 4096, ref.NORM_LLAMA), (torch.bfloat16, 576, ref.NORM_GEMMA),
                               (torch.bfloat16, 2048, ref.NORM_OLMO), (torch.bfloat16, 8192, ref.NORM_LAYER),
                               (torch.float16, 8192, ref.NORM_LLAMA),
                               (torch.float32, 4096, ref.NORM_LLAMA)]:
        report.check(f"rms_norm {str(dtype)[6:]} width {width}{form_names[form]} (err in units in the "
                     f"last place)", functools.partial(norm, dtype, width, form))
        report.check(f"add_rms_norm {str(dtype)[6:]} width {width}{form_names[form]} (err in units in the "
                     f"last place; the sum exact)", functools.partial(add_norm, dtype, width, form))

    def rope(dtype: torch.dtype, tables: torch.dtype | None = None) -> tuple[float, float]:
        """Entries that differ from the torch formula's (the same roundings in turn: none); ``tables``
        float32: rotated in float32, rounded once (ERNIE 4.5, Cohere)."""
        q, k = randn(300, 32, 128, dtype=dtype), randn(300, 8, 128, dtype=dtype)
        angles = torch.rand(300, 1, 128, device=DEVICE, generator=gen) * 1000
        cos, sin = angles.cos().to(tables or dtype), angles.sin().to(tables or dtype)
        (gq, gk), (wq, wk) = ops.rope(q, k, cos, sin), ref.rope(q, k, cos, sin)
        return float((gq != wq).sum() + (gk != wk).sum()), 0.0

    def rope_and_store(dtype: torch.dtype) -> tuple[float, float]:
        """Entries of the rotated queries and of the cache that differ from ``rope`` then ``store_kv``."""
        q, k, v = randn(300, 32, 128, dtype=dtype), randn(300, 8, 128, dtype=dtype), randn(300, 8, 128, dtype=dtype)
        angles = torch.rand(300, 1, 128, device=DEVICE, generator=gen) * 1000
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        slots = torch.randperm(640, device=DEVICE, generator=gen)[:300]
        slots[::7] = -1  # skipped
        got_cache = torch.zeros(2, 40, 16, 8, 128, dtype=dtype, device=DEVICE)
        want_cache = got_cache.clone()
        got_q = ops.rope_and_store(q, k, v, cos, sin, got_cache, slots)
        want_q = ref.rope_and_store(q, k, v, cos, sin, want_cache, slots)
        return float((got_q != want_q).sum() + (got_cache != want_cache).sum()), 0.0

    def layer_norm_bias(width: int) -> tuple[float, float]:
        """StarCoder2's LayerNorm (the LayerNorm form with a bias), bf16, alone and after a residual sum: units
        in the last place of the output or, where the bias cancels most of it, of the entry before the bias,
        plus those of the mean it subtracted (whose last bits depend on the order of the sum)."""
        x, residual = 3 * randn(300, width, dtype=torch.bfloat16) + 2, 10 * randn(300, width, dtype=torch.bfloat16)
        weight, bias = (1 + 0.5 * randn(width)).to(torch.bfloat16), randn(width, dtype=torch.bfloat16)
        worst = 0.0
        for rows, got, want in ((x, ops.rms_norm(x, weight, 1e-5, ref.NORM_LAYER, bias),
                                 ref.rms_norm(x, weight, 1e-5, ref.NORM_LAYER, bias)),
                                ((x + residual), ops.add_rms_norm(x, residual, weight, 1e-5, ref.NORM_LAYER, bias)[0],
                                 ref.add_rms_norm(x, residual, weight, 1e-5, ref.NORM_LAYER, bias)[0])):
            h = rows.float()
            mean = h.mean(-1, keepdim=True)
            scale = torch.maximum(want.float().abs(), (want.float() - bias.float()).abs()) + (
                mean * torch.rsqrt((h - mean).pow(2).mean(-1, keepdim=True)) * weight.float()).abs()
            ulp = torch.finfo(torch.bfloat16).eps * scale.clamp(min=torch.finfo(torch.bfloat16).tiny)
            worst = max(worst, float(((got.float() - want.float()).abs() / ulp).max()))
        return worst, 2.0

    report.check("rms_norm / add_rms_norm bf16 width 6144, LayerNorm with a bias (StarCoder2; err in units in the "
                 "last place)", functools.partial(layer_norm_bias, 6144))

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        report.check(f"rope {str(dtype)[6:]} 32/8 heads d128 (entries that differ)", functools.partial(rope, dtype))
        report.check(f"rope_and_store {str(dtype)[6:]} 32/8 heads d128, block 16 (entries that differ)",
                     functools.partial(rope_and_store, dtype))
    report.check("rope bf16 32/8 heads d128, float32 tables (entries that differ)",
                 functools.partial(rope, torch.bfloat16, torch.float32))

    def silu_mul(dtype: torch.dtype, inter: int) -> tuple[float, float]:
        """Units in the last place of the output's dtype: the exponential may differ in float32's last
        bit, which a rounding to 16 bits lets through now and then and the product carries."""
        gate_up = 4 * randn(300, 2 * inter, dtype=dtype)
        return ulps(ops.silu_mul(gate_up), ref.silu_mul(gate_up))

    for dtype, inter in [(torch.bfloat16, 1536), (torch.bfloat16, 14336), (torch.float16, 1536), (torch.float32, 1536)]:
        report.check(f"silu_mul {str(dtype)[6:]} intermediate {inter} (err in units in the last place)",
                     functools.partial(silu_mul, dtype, inter))


def bench_decode(report: Report, args: argparse.Namespace, batch: int, sweep: bool) -> None:
    from pdserve_kernels.triton_decode import choose_num_splits, num_sms, run_paged_decode

    dtype, h, kvh, d, ctx = DTYPES[args.dtype], args.num_heads, args.num_kv_heads, args.head_size, args.context_len
    scale = d**-0.5
    k = torch.randn(batch, kvh, ctx, d, device=DEVICE).to(dtype)
    v = torch.randn(batch, kvh, ctx, d, device=DEVICE).to(dtype)
    kv_layer, tables = paged_layout(k, v, args.block_size)
    q = torch.randn(batch, h, d, device=DEVICE).to(dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    q_sdpa = q.view(batch, kvh, h // kvh, d)  # a KV head's query heads act as its query rows
    splits = choose_num_splits(batch, kvh, tables.shape[1] * args.block_size, num_sms(q.device))
    shape = f"batch {batch}, ctx {ctx}, {h}/{kvh} heads, d{d}, {args.dtype}, bs{args.block_size}"

    def against_sdpa() -> tuple[float, float]:
        run_paged_decode(q, kv_layer, tables, lens, scale, out=out)
        expected = F.scaled_dot_product_attention(q_sdpa.float(), k.float(), v.float(), scale=scale)
        return max_err(out, expected.reshape(batch, h, d)), TOLERANCE[dtype]

    report.group = f"decode batch {batch}"
    report.check(f"paged_decode_attention vs SDPA at bench shape (batch {batch})", against_sdpa)
    kv_bytes = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()
    report.time(f"paged_decode_attention (auto: {splits} split{'s' * (splits > 1)})", shape,
                lambda: run_paged_decode(q, kv_layer, tables, lens, scale, out=out), kv_bytes)
    other = 1 if splits > 1 else 4  # the path the heuristic did not take
    report.time(f"paged_decode_attention (forced {other} split{'s' * (other > 1)})", shape,
                lambda: run_paged_decode(q, kv_layer, tables, lens, scale, out=out, num_splits=other), kv_bytes)
    report.time("torch SDPA (baseline), contiguous K/V", shape,
                lambda: F.scaled_dot_product_attention(q_sdpa, k, v, scale=scale), kv_bytes)
    time_copy(report, kv_bytes, dtype)
    if sweep:
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                tiled = functools.partial(run_paged_decode, q, kv_layer, tables, lens, scale, out=out,
                                          block_n=block_n, num_warps=warps)
                report.time(f"paged_decode_attention tile sweep: BLOCK_N={block_n} num_warps={warps}", shape,
                            tiled, kv_bytes)


def bench_prefill(report: Report, args: argparse.Namespace, ops: Any) -> None:
    dtype, h, kvh, d, ctx = DTYPES[args.dtype], args.num_heads, args.num_kv_heads, args.head_size, args.context_len
    num_seqs, chunk = 4, min(1024, ctx)
    k = torch.randn(num_seqs, kvh, ctx, d, device=DEVICE).to(dtype)
    v = torch.randn(num_seqs, kvh, ctx, d, device=DEVICE).to(dtype)
    kv_layer, tables = paged_layout(k, v, args.block_size)
    q = torch.randn(num_seqs * chunk, h, d, device=DEVICE).to(dtype)
    starts = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=DEVICE) * chunk
    lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    prefix = ctx - chunk
    flops = 4.0 * num_seqs * h * d * sum(prefix + i + 1 for i in range(chunk))
    shape = f"{num_seqs} x chunk {chunk} at ctx {ctx}, {h}/{kvh} heads, d{d}, {args.dtype}"
    report.group = "prefill"
    report.time("paged_prefill_attention", shape,
                lambda: ops.paged_prefill_attention(q, kv_layer, tables, starts, lens, d**-0.5, out=out), flops=flops)
    try:
        from torch.nn.attention.bias import causal_lower_right

        q_sdpa = q.view(num_seqs, chunk, h, d).transpose(1, 2)
        k_full, v_full = k.repeat_interleave(h // kvh, dim=1), v.repeat_interleave(h // kvh, dim=1)
        mask = causal_lower_right(chunk, ctx)
        report.time("torch SDPA (baseline), contiguous K/V, lower-right causal", shape,
                    lambda: F.scaled_dot_product_attention(q_sdpa, k_full, v_full, attn_mask=mask, scale=d**-0.5),
                    flops=flops)
    except Exception as exc:
        report.timings.append({"name": "torch SDPA prefill baseline", "shape": shape, "group": report.group,
                               "error": _short(exc)})


def bench_latent(report: Report, args: argparse.Namespace, ops: Any, ref: Any) -> None:
    """DeepSeek-V3's latent attention (``common.model.mla``): the kernels' ``latent`` mode (576 entries a token,
    288 in each slot, every query head reading them) against the torch reference, then timed: decode at 16
    query heads (128 over 8 ranks) and 128, against SDPA over the joined latent; a prefill chunk absorbed,
    against the expanded form's SDPA (what the engine runs for a prompt's chunk)."""
    from pdserve_kernels.triton_decode import run_paged_decode

    dtype, ctx, rope, rank, nope, v_dim = DTYPES[args.dtype], min(args.context_len, 4096), 64, 512, 128, 128
    scale = (nope + rope) ** -0.5
    report.group = "latent attention (DeepSeek-V3)"
    for heads, batch in ((16, args.batch), (128, args.small_batch)):
        joined = torch.randn(batch, 1, ctx, rope + rank, device=DEVICE).to(dtype)
        kv_layer, tables = paged_layout(joined[..., :288].contiguous(), joined[..., 288:].contiguous(),
                                        args.block_size)
        q = torch.randn(batch, heads, rope + rank, device=DEVICE).to(dtype)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
        out = torch.empty_like(q)
        shape = f"batch {batch}, ctx {ctx}, {heads} heads on the latent, {args.dtype}"

        def against_reference(q: torch.Tensor = q, kv: torch.Tensor = kv_layer, t: torch.Tensor = tables,
                              n: torch.Tensor = lens, o: torch.Tensor = out) -> tuple[float, float]:
            run_paged_decode(q, kv, t, n, scale, out=o, latent=True)
            expected = ref.paged_decode_attention(q.float(), kv.float(), t, n, scale, latent=True)
            return max_err(o, expected), TOLERANCE[dtype]

        report.check(f"latent decode vs the torch reference ({heads} heads)", against_reference)
        kv_bytes = joined.numel() * joined.element_size() + 2 * q.numel() * q.element_size()
        report.time(f"paged_decode_attention latent ({heads} heads)", shape,
                    functools.partial(run_paged_decode, q, kv_layer, tables, lens, scale, out=out, latent=True),
                    kv_bytes)
        report.time(f"torch SDPA over the joined latent (baseline, {heads} heads)", shape,
                    functools.partial(F.scaled_dot_product_attention, q[:, None], joined, joined, scale=scale),
                    kv_bytes)
        time_copy(report, kv_bytes, dtype)
    heads, chunk = 16, min(1024, ctx)
    joined = torch.randn(1, 1, chunk, rope + rank, device=DEVICE).to(dtype)
    kv_layer, tables = paged_layout(joined[..., :288].contiguous(), joined[..., 288:].contiguous(), args.block_size)
    q = torch.randn(chunk, heads, rope + rank, device=DEVICE).to(dtype)
    starts = torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([chunk], dtype=torch.int32, device=DEVICE)
    pairs = chunk * (chunk + 1) / 2
    shape = f"one prompt of {chunk}, {heads} heads, {args.dtype}"
    report.time("paged_prefill_attention latent (absorbed)", shape,
                lambda: ops.paged_prefill_attention(q, kv_layer, tables, starts, lens, scale, latent=True),
                flops=2.0 * heads * pairs * (rope + 2 * rank))
    q_full = torch.randn(heads, chunk, nope + rope, device=DEVICE).to(dtype)
    k_full = torch.randn(heads, chunk, nope + rope, device=DEVICE).to(dtype)
    v_full = torch.randn(heads, chunk, v_dim, device=DEVICE).to(dtype)
    report.time("torch SDPA, keys and values expanded per head (the engine's prefill form)", shape,
                lambda: F.scaled_dot_product_attention(q_full, k_full, v_full, is_causal=True, scale=scale),
                flops=2.0 * heads * pairs * (nope + rope + v_dim))


def bench_kv(report: Report, args: argparse.Namespace, ops: Any) -> None:
    dtype, kvh, d, bs = DTYPES[args.dtype], args.num_kv_heads, args.head_size, args.block_size
    elem = torch.tensor([], dtype=dtype).element_size()
    for num_tokens in (args.batch, args.store_tokens):
        kv_layer = torch.randn(2, num_tokens // bs + 64, bs, kvh, d, device=DEVICE).to(dtype)
        key = torch.randn(num_tokens, kvh, d, device=DEVICE).to(dtype)
        value = torch.randn_like(key)
        slots = torch.randperm(kv_layer.shape[1] * bs, device=DEVICE)[:num_tokens]
        moved = 2 * 2 * key.numel() * elem + slots.numel() * 8
        report.group = f"store_kv {num_tokens}"
        report.time("store_kv", f"{num_tokens} tokens, {kvh} kv heads, d{d}, {args.dtype}",
                    functools.partial(ops.store_kv, key, value, kv_layer, slots), moved)
        time_copy(report, moved, dtype)
        del kv_layer, key, value

    num_layers, num_blocks, count = args.num_layers, args.kv_blocks, args.transfer_blocks
    cache = torch.empty(num_layers, 2, num_blocks, bs, kvh, d, device=DEVICE, dtype=dtype).normal_()
    ids = torch.randperm(num_blocks, device=DEVICE)[:count]
    packed = ops.gather_blocks(cache, ids)
    moved = 2 * packed.numel() * elem
    shape = f"{count} blocks x {num_layers} layers (of {num_blocks}), bs{bs}, {kvh} kv heads, d{d}"
    report.group = "block transfer"
    report.time("gather_blocks", shape, lambda: ops.gather_blocks(cache, ids, out=packed), moved)
    report.time("scatter_blocks", shape, lambda: ops.scatter_blocks(cache, ids, packed), moved)
    src, dst = ids[: count // 2], ids[count // 2 :]
    report.time("copy_blocks", f"{count // 2} pairs x {num_layers} layers, bs{bs}",
                lambda: ops.copy_blocks(cache, src, dst), moved / 2)
    time_copy(report, moved, dtype)


# Mixtures of experts the MoE section runs: (name, hidden, expert width, experts, experts per token).
MOE_SHAPES = (("Qwen3-30B-A3B", 2048, 768, 128, 8), ("Mixtral-8x7B", 4096, 14336, 8, 2))


def packed_experts(w: torch.Tensor, form: str, group: int, gen: torch.Generator) -> Any:
    """Random packed weights of ``w``'s shape ``[E, out, in]`` in ``form`` ("gptq-4": 4-bit values, a float16 scale
    and zero point per ``group`` inputs; "fp8": e4m3, a float32 scale per ``group x group`` block; "mxfp4": e2m1
    values, a power of two per 32 inputs), or ``w`` itself ("bf16"); the values are random, not ``w``'s (the product
    is checked against its own widened weights)."""
    from pdserve_kernels.packed_weights import MXFP4_GROUP, Fp8Weights, IntWeights, Mxfp4Weights

    experts, out, inputs = w.shape
    device = w.device
    if form == "gptq-4":
        qweight = torch.randint(-2**31, 2**31 - 1, (experts, out, inputs // 8), device=device, generator=gen,
                                dtype=torch.int32)
        qzeros = torch.randint(6, 10, (experts, out, inputs // group), device=device, generator=gen,
                               dtype=torch.int32).to(torch.uint8)  # about the middle, as a trained weight's
        scales = ((torch.rand(experts, out, inputs // group, device=device, generator=gen) + 0.5) * 0.2
                  / inputs**0.5).to(torch.float16)
        return IntWeights(qweight, qzeros, scales, 4)
    if form == "fp8":
        weight = (100 * torch.randn(experts, out, inputs, device=device, generator=gen)).to(torch.float8_e4m3fn)
        scale_inv = (torch.rand(experts, out // group, inputs // group, device=device, generator=gen) + 0.5) * 0.01 \
            / inputs**0.5
        return Fp8Weights(weight, scale_inv)
    if form == "mxfp4":  # values of about 2 times 2 ** (-log2(in) / 2 - 2): 1 / sqrt(in), as trained weights'
        blocks = torch.randint(0, 256, (experts, out, inputs // 2), device=device, generator=gen,
                               dtype=torch.int32).to(torch.uint8)
        exponent = 127 - 2 - round(math.log2(inputs) / 2)
        scales = torch.randint(exponent - 1, exponent + 2, (experts, out, inputs // MXFP4_GROUP), device=device,
                               generator=gen, dtype=torch.int32).to(torch.uint8)
        return Mxfp4Weights(blocks, scales)
    return w


def _expert_bytes(w: Any) -> int:
    """The bytes one expert's weights take, as they are held."""
    tensors = [w] if isinstance(w, torch.Tensor) else [t for t in w if isinstance(t, torch.Tensor)]
    return sum(t[0].numel() * t.element_size() for t in tensors)


def bench_moe(report: Report, ops: Any, ref: Any, shapes: tuple[tuple[str, int, int, int, int], ...] = MOE_SHAPES,
              token_counts: tuple[int, ...] = (1, 64, 2048), device: str = DEVICE, time_it: bool = True,
              forms: tuple[str, ...] = ("bf16", "gptq-4", "fp8", "mxfp4"), group: int = 128) -> None:
    """A mixture's experts (``moe_experts``): the Triton grouped products against the torch loop over the
    experts hit, checked against a float32 reference of the same weights, then both timed at decode and
    prefill token counts, beside a copy of the bytes of the experts a step reads. Each weights' ``forms``: bf16,
    and kept packed as GPTQ's 4-bit values in groups of ``group`` inputs, FP8 in ``group x group`` blocks or MXFP4
    (gpt-oss's; groups of 32) (the Triton kernel widens each tile as it reads it; the reference widens each expert
    hit)."""
    from pdserve_kernels.packed_weights import expert_count, expert_weight

    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16
    for name, hidden, inter, num_experts, top_k in shapes:
        plain13 = (torch.randn(num_experts, 2 * inter, hidden, device=device, generator=gen) / hidden**0.5).to(dtype)
        plain2 = (torch.randn(num_experts, hidden, inter, device=device, generator=gen) / inter**0.5).to(dtype)
        for form in forms:
            w13, w2 = packed_experts(plain13, form, group, gen), packed_experts(plain2, form, group, gen)
            # The weights the products multiply by: widened to bf16, as the kernel widens each tile.
            wide13, wide2 = (torch.stack([expert_weight(w, e, dtype) for e in range(expert_count(w))]).float()
                             for w in (w13, w2))
            for tokens in token_counts:
                x = torch.randn(tokens, hidden, device=device, generator=gen).to(dtype)
                logits = torch.randn(tokens, num_experts, device=device, generator=gen)
                weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
                shape = f"{name}: {tokens} tokens, {top_k} of {num_experts} experts, {hidden} -> {inter}, {form}"

                def close(x: torch.Tensor = x, ids: torch.Tensor = ids, weights: torch.Tensor = weights, w13: Any = w13,
                          w2: Any = w2, wide13: torch.Tensor = wide13, wide2: torch.Tensor = wide2) -> tuple[float, float]:
                    want = ref.moe_experts(x.float(), ids, weights, wide13, wide2)
                    got = ops.moe_experts(x, ids, weights, w13, w2)
                    return max_err(got, want), TOLERANCE[dtype] * max(1.0, float(want.abs().max()))

                report.check(f"moe_experts bf16, {shape} (vs float32)", close)

                def same(x: torch.Tensor = x, ids: torch.Tensor = ids, weights: torch.Tensor = weights, w13: Any = w13,
                         w2: Any = w2, wide13: torch.Tensor = wide13, wide2: torch.Tensor = wide2) -> tuple[float, float]:
                    packed = ops.moe_experts(x, ids, weights, w13, w2)
                    return max_err(packed, ops.moe_experts(x, ids, weights, wide13.to(dtype), wide2.to(dtype))), 0.0

                if form != "bf16":  # widened tile by tile as the loader widens the weights: the very same products
                    report.check(f"moe_experts, {shape}: equal to the products over its weights widened", same)
                if not time_it:
                    continue
                hit = int(torch.unique(ids).numel())
                num_bytes = hit * (_expert_bytes(w13) + _expert_bytes(w2))
                flops = 2.0 * tokens * top_k * 3 * hidden * inter
                report.group = f"moe {name} {tokens} {form}"
                report.time("moe_experts (Triton)", shape, functools.partial(ops.moe_experts, x, ids, weights, w13, w2),
                            num_bytes, flops)
                report.time("moe_experts (torch loop over the experts hit)", shape,
                            functools.partial(ref.moe_experts, x, ids, weights, w13, w2), num_bytes, flops)
                time_copy(report, num_bytes, torch.uint8)
            del wide13, wide2


# Packed integer weights (GPTQ / AWQ, 4 bits, groups of 128, float16 scales): Llama-3-8B's projections.
INT_SHAPES = (("Llama-3-8B qkv", 4096, 6144), ("Llama-3-8B gate/up", 4096, 28672), ("Llama-3-8B down", 14336, 4096))


def _bench_widening_product(report: Report, kernel: str, shapes: tuple[tuple[str, int, int], ...],
                            token_counts: tuple[int, ...], device: str, time_it: bool,
                            make: Callable[[torch.Generator, int, int, torch.dtype],
                                           tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, int, str]]) -> None:
    """A product whose weights stay quantized (``kernel``): for each shape, ``make`` gives the product, the weight it
    stands for (widened to bfloat16), the quantized bytes it reads and their form. The product is checked against
    a float32 one with the widened weight, then timed at each token count beside ``F.linear`` with the widened
    weight (what the torch backend holds) and a copy of the quantized bytes."""
    import torch.nn.functional as F

    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16
    for name, inputs, outputs in shapes:
        product, widened, num_bytes, form = make(gen, inputs, outputs, dtype)
        for tokens in token_counts:
            x = torch.randn(tokens, inputs, device=device, generator=gen).to(dtype)
            shape = f"{name}: {tokens} tokens, {inputs} -> {outputs}, {form}"

            def close(x: torch.Tensor = x, product: Callable[[torch.Tensor], torch.Tensor] = product,
                      widened: torch.Tensor = widened) -> tuple[float, float]:
                want = F.linear(x.float(), widened.float())
                return max_err(product(x), want), TOLERANCE[dtype] * max(1.0, float(want.abs().max()))

            report.check(f"{kernel} bf16, {shape} (vs float32)", close)
            if not time_it:
                continue
            flops = 2.0 * tokens * inputs * outputs
            report.group = f"{kernel} {name} {tokens}"
            report.time(f"{kernel} (Triton)", shape, functools.partial(product, x), num_bytes, flops)
            report.time("F.linear (widened to bf16)", shape, functools.partial(F.linear, x, widened),
                        widened.numel() * widened.element_size(), flops)
            time_copy(report, num_bytes, torch.uint8)


def bench_int_linear(report: Report, ops: Any, ref: Any, shapes: tuple[tuple[str, int, int], ...] = INT_SHAPES,
                     token_counts: tuple[int, ...] = (1, 16, 64, 512), bits: int = 4, group: int = 128,
                     device: str = DEVICE, time_it: bool = True) -> None:
    """Products with packed integer weights (``int_linear``, ``bits`` a value, a scale and zero point per ``group``
    inputs), as ``_bench_widening_product`` checks and times them."""

    def make(gen: torch.Generator, inputs: int, outputs: int,
             dtype: torch.dtype) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, int, str]:
        qweight = torch.randint(-2**31, 2**31 - 1, (outputs, inputs * bits // 32), device=device, generator=gen,
                                dtype=torch.int32)
        qzeros = torch.randint(0, 1 << bits, (outputs, inputs // group), device=device, generator=gen,
                               dtype=torch.int32).to(torch.uint8)
        scales = (torch.rand(outputs, inputs // group, device=device, generator=gen) * 2e-3 + 1e-4).to(torch.float16)
        return (lambda x: ops.int_linear(x, qweight, qzeros, scales, bits),
                ref.unpack_int_weight(qweight, qzeros, scales, dtype, bits),
                qweight.numel() * 4 + qzeros.numel() + scales.numel() * 2, f"{bits}-bit groups of {group}")

    _bench_widening_product(report, "int_linear", shapes, token_counts, device, time_it, make)


def bench_fp8_linear(report: Report, ops: Any, ref: Any, shapes: tuple[tuple[str, int, int], ...] = INT_SHAPES,
                     token_counts: tuple[int, ...] = (1, 16, 64, 512), block: int = 128, device: str = DEVICE,
                     time_it: bool = True) -> None:
    """Products with block-wise FP8 weights (``fp8_linear``, a scale per ``block x block``), as
    ``_bench_widening_product`` checks and times them."""

    def make(gen: torch.Generator, inputs: int, outputs: int,
             dtype: torch.dtype) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, int, str]:
        weight = (100 * torch.randn(outputs, inputs, device=device, generator=gen)).to(torch.float8_e4m3fn)
        scale_inv = torch.rand(outputs // block, inputs // block, device=device, generator=gen) * 1e-4 + 1e-6
        return (lambda x: ops.fp8_linear(x, weight, scale_inv),
                ref.widen_fp8(weight, scale_inv, dtype), weight.numel() + scale_inv.numel() * 4,
                f"FP8 blocks of {block} x {block}")

    _bench_widening_product(report, "fp8_linear", shapes, token_counts, device, time_it, make)


def bench_seeded_race(report: Report, args: argparse.Namespace) -> None:
    """The seeded rows' race: the Triton kernel against the torch path it replaces on a GPU (whole rows:
    the noise, the division, ``argmax``), checked for equal tokens and equal noise, then both timed."""
    from common.engine.seeded_draws import draw_keys, exponential_race, exponentials
    from pdserve_kernels.triton_sampling import noise_probes, seeded_race

    gen = torch.Generator(device=DEVICE).manual_seed(0)

    def rows(num_rows: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(3 * torch.randn(num_rows, vocab, device=DEVICE, generator=gen), dim=-1)
        probs[:: 2][probs[:: 2] < 1e-5] = 0.0  # every other row thinned, as top-k / top-p leave one
        keys = draw_keys([i * 7919 for i in range(num_rows)], [i % 50 for i in range(num_rows)], DEVICE)
        return probs, keys

    def same_tokens() -> tuple[float, float]:
        probs, keys = rows(256, args.vocab)
        differ = int((seeded_race(probs, keys) != exponential_race(probs.clone(), keys)).sum())
        return _exact(differ)

    def same_noise() -> tuple[float, float]:
        # The CPU's noise as probabilities (``noise_probes``): each probe draws its token iff the GPU
        # kernel's noise is the same, bit for bit. Whole rows and rows in ranges.
        keys = draw_keys(list(range(8)), [3] * 8)
        noise = exponentials(keys.unsqueeze(1), torch.arange(args.vocab).unsqueeze(0))
        keys = keys.to(DEVICE)
        return _exact(sum(int((seeded_race(probe.to(DEVICE), keys, splits) != token).sum())
                          for probe, token in noise_probes(noise) for splits in (1, 16)))

    report.check(f"seeded race kernel = torch race, 256 rows x {args.vocab} (rows whose token differs)", same_tokens)
    report.check(f"seeded race noise = the CPU's, 8 rows x {args.vocab}, 4 probes, whole and in ranges "
                 f"(rows that differ)", same_noise)
    for num_rows in sorted({1, args.batch, 256}):
        probs, keys = rows(num_rows, args.vocab)
        shape = f"{num_rows} rows x {args.vocab}"
        report.group = f"seeded race {num_rows}"
        report.time("seeded_race (Triton)", shape, functools.partial(seeded_race, probs, keys), probs.numel() * 4)

        def torch_race(probs: torch.Tensor = probs, keys: torch.Tensor = keys) -> torch.Tensor:
            return exponential_race(probs.clone(), keys)

        report.time("torch race (noise, divide, argmax; with the copy it writes into)", shape, torch_race,
                    probs.numel() * 4)
        time_copy(report, probs.numel() * 4, torch.float32)
        del probs, keys


def bench_nucleus(report: Report, args: argparse.Namespace, vocabs: tuple[int, ...] | None = None,
                  batch: int = 256) -> None:
    """Top-p and min-p: the Triton kernel (no sort) against the torch path it replaces on a GPU (a sort of
    each whole row, its cumulative sum, the scatter back; min-p's maximum and mask), checked for the same
    entries kept, then both timed from the same rows (each run first copies them in: both write in place).
    ``vocabs``: the default model's and ``--vocab``; ``batch`` rows, and 1 and ``--batch`` of the last."""
    from common.engine.sampler import apply_top_p
    from pdserve_kernels.triton_nucleus import nucleus_filter

    gen = torch.Generator(device=DEVICE).manual_seed(1)

    def rows(num_rows: int, vocab: int, top_k_in_kernel: bool = False) -> tuple[torch.Tensor, ...]:
        """Rows of the bench's mixed step: Gaussian logits (std 3) at temperatures 0.6 to 1, every other
        row thinned by a top-k of 40 first; top-p 0.8 to 0.95 on three rows of four, min-p on one of four.
        Returns their probabilities, top-p, min-p, the logits (before top-k) and top-k (int32, 0: none).
        ``top_k_in_kernel``: the probabilities are those of the whole rows, for the kernel's top-k (the
        sampler's Triton path), else those after top-k (the torch path's)."""
        temperature = 0.6 + 0.4 * torch.rand(num_rows, 1, device=DEVICE, generator=gen)
        logits = 3 * torch.randn(num_rows, vocab, device=DEVICE, generator=gen) / temperature
        index = torch.arange(num_rows, device=DEVICE)
        top_p = torch.where(index % 4 != 3, 0.8 + 0.05 * (index % 4), 1.0).float()
        min_p = torch.where(index % 4 == 1, 0.05, 0.0).float()
        top_k = torch.where(index % 2 == 0, 40, 0).int()
        return torch.softmax(logits if top_k_in_kernel else top_k_masked(logits), dim=-1), top_p, min_p, logits, top_k

    def top_k_masked(logits: torch.Tensor) -> torch.Tensor:
        """The torch path's top-k (of 40, every other row): the row's 40th largest, each smaller at -inf."""
        k_rows = torch.arange(0, logits.shape[0], 2, device=logits.device)
        kth = logits.index_select(0, k_rows).topk(min(40, logits.shape[1]), dim=-1).values[:, -1:]
        kth = logits.new_full((logits.shape[0], 1), float("-inf")).index_copy_(0, k_rows, kth)
        return logits.masked_fill(logits < kth, float("-inf"))

    def torch_path(probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> None:
        """The sampler's GPU path without the kernel: top-p over the rows that have it, then min-p."""
        rows_p, rows_m = (top_p < 1).nonzero()[:, 0], (min_p > 0).nonzero()[:, 0]
        sub = probs.index_select(0, rows_p)
        apply_top_p(sub, top_p[rows_p].unsqueeze(1), probs.shape[1])
        probs.index_copy_(0, rows_p, sub)
        sub = probs.index_select(0, rows_m)
        sub.masked_fill_(sub < min_p[rows_m].unsqueeze(1) * sub.amax(dim=-1, keepdim=True), 0.0)
        probs.index_copy_(0, rows_m, sub)

    def same_entries(vocab: int, top_k_in_kernel: bool = False) -> tuple[float, float]:
        # The kernel's masses are summed in another order than the sort's cumulative sum: where a row's
        # mass at its cut lies within a rounding of top-p, the two may keep one entry more or less.
        # Rows that differ by more than that one entry at the cut are errors. With the kernel's top-k,
        # its probabilities are the whole rows' (what top-k keeps is not normalised again).
        probs, top_p, min_p, logits, top_k = rows(batch, vocab, top_k_in_kernel)
        ours = probs.clone()
        nucleus_filter(ours, top_p, min_p, top_k if top_k_in_kernel else None)
        theirs = torch.softmax(top_k_masked(logits), dim=-1) if top_k_in_kernel else probs.clone()
        torch_path(theirs, top_p, min_p)
        differ = (ours > 0) != (theirs > 0)
        # The smallest logit either keeps: the one entry where they differ must be it.
        smallest = logits.masked_fill((ours == 0) & (theirs == 0), float("inf")).amin(dim=1)
        at_cut = (differ.sum(dim=1) == 1) & (logits.masked_fill(~differ, float("inf")).amin(dim=1) == smallest)
        what = "top-k / top-p / min-p" if top_k_in_kernel else "top-p / min-p"
        print(f"{what}, {batch} rows x {vocab}: {int(differ.any(dim=1).sum())} rows differ, "
              f"{int(at_cut.sum())} of them by the one entry at the cut")
        return _exact(int((differ.any(dim=1) & ~at_cut).sum()))

    def ties() -> tuple[float, float]:
        probs = torch.tensor([[0.125, 0.5, 0.125, 0.0, 0.125, 0.125], [0.25, 0.0, 0.5, 0.0, 0.0, 0.25]], device=DEVICE)
        nucleus_filter(probs, torch.tensor([0.7, 0.5], device=DEVICE), torch.zeros(2, device=DEVICE))
        expected = [[1, 1, 1, 0, 0, 0], [0, 0, 1, 0, 0, 0]]
        return _exact(sum(a != b for x, y in zip((probs > 0).int().tolist(), expected, strict=True)
                          for a, b in zip(x, y, strict=True)))

    vocabs = tuple(sorted(vocabs or {STAND_IN_DIMS["vocab_size"], args.vocab}))
    for vocab in vocabs:
        report.check(f"top-p / min-p kernel = the sort's nucleus, {batch} rows x {vocab} (rows that differ but "
                     f"by one entry at the cut)",
                     functools.partial(same_entries, vocab))
        report.check(f"top-k / top-p / min-p kernel (whole rows' probabilities) = top-k on the logits, then the "
                     f"sort's nucleus, {batch} rows x {vocab} (rows that differ but by one entry at the cut)",
                     functools.partial(same_entries, vocab, True))
    report.check("top-p kernel, equal values at the cut: as many stay as a sort keeps (entries that differ)", ties)
    for num_rows, vocab in sorted({(1, vocabs[-1]), (args.batch, vocabs[-1]), *((batch, v) for v in vocabs)}):
        source, top_p, min_p, _, _ = rows(num_rows, vocab)
        probs = torch.empty_like(source)
        shape = f"{num_rows} rows x {vocab}"
        report.group = f"top-p / min-p {num_rows} x {vocab}"

        def ours(source: torch.Tensor = source, probs: torch.Tensor = probs, top_p: torch.Tensor = top_p,
                 min_p: torch.Tensor = min_p) -> None:
            probs.copy_(source)
            nucleus_filter(probs, top_p, min_p)

        def theirs(source: torch.Tensor = source, probs: torch.Tensor = probs, top_p: torch.Tensor = top_p,
                   min_p: torch.Tensor = min_p) -> None:
            probs.copy_(source)
            torch_path(probs, top_p, min_p)

        report.time("nucleus_filter (Triton; with the copy in)", shape, ours, source.numel() * 8)
        report.time("torch top-p / min-p (sort, cumsum, scatter; with the copy in)", shape, theirs,
                    source.numel() * 8)
        # With top-k: the kernel over the whole rows' softmax, against the torch path's top-k on the
        # logits, its mask and softmax, then top-p and min-p (each from the logits: both start there).
        _, top_p, min_p, logits, top_k = rows(num_rows, vocab, True)

        def ours_k(logits: torch.Tensor = logits, top_p: torch.Tensor = top_p, min_p: torch.Tensor = min_p,
                   top_k: torch.Tensor = top_k) -> None:
            nucleus_filter(torch.softmax(logits, dim=-1), top_p, min_p, top_k)

        def theirs_k(logits: torch.Tensor = logits, top_p: torch.Tensor = top_p, min_p: torch.Tensor = min_p) -> None:
            torch_path(torch.softmax(top_k_masked(logits), dim=-1), top_p, min_p)

        report.time("nucleus_filter with top-k (Triton; with the softmax)", shape, ours_k, source.numel() * 8)
        report.time("torch top-k / top-p / min-p (topk, mask, softmax, sort, cumsum, scatter)", shape, theirs_k,
                    source.numel() * 8)
        time_copy(report, source.numel() * 8, torch.float32)
        del source, probs, logits


def bench_penalties(report: Report, args: argparse.Namespace, vocab: int | None = None, prompt_len: int = 512,
                    output_len: int = 128) -> None:
    """The repetition, presence and frequency penalties: the Triton kernel against the torch path it
    replaces (each penalty's gather, arithmetic and scatter over the stores' windows), checked for the
    same logits bit for bit, then both timed from the same logits (each run first copies them in).
    ``--batch`` rows of ``vocab`` (default ``--vocab``), prompts of ``prompt_len`` tokens and outputs
    of ``output_len`` (drawn from a few hundred ids: many repeats); the repetition penalty on half the
    rows, presence and frequency on half, both on a quarter."""
    import random

    from common.engine.penalties import TokenRows, apply_output_penalties, apply_repetition_penalty
    from common.engine.request import Request
    from common.sampling_params import SamplingParams
    from pdserve_kernels.triton_penalties import apply_penalties

    vocab = vocab or args.vocab
    rng = random.Random(3)
    num_rows = args.batch
    reqs = []
    for i in range(num_rows):
        req = Request(f"r{i}", [rng.randrange(vocab) for _ in range(prompt_len)], SamplingParams(), block_size=16,
                      model_id="m")
        for _ in range(output_len):
            req.append_output_token(rng.randrange(min(vocab, 300)))
        reqs.append(req)
    rep_rows = [i for i in range(num_rows) if i % 4 in (0, 1)]
    out_rows = [i for i in range(num_rows) if i % 4 in (1, 2)]
    programs = sorted({*rep_rows, *out_rows})
    rows = torch.tensor(programs, device=DEVICE)
    rep_k = torch.tensor([rep_rows.index(r) if r in rep_rows else -1 for r in programs], dtype=torch.int32, device=DEVICE)
    out_k = torch.tensor([out_rows.index(r) if r in out_rows else -1 for r in programs], dtype=torch.int32, device=DEVICE)
    penalty = torch.tensor([rng.uniform(0.8, 1.5) for _ in rep_rows], device=DEVICE)
    frequency = torch.tensor([rng.uniform(-1, 1) for _ in out_rows], device=DEVICE)
    presence = torch.tensor([rng.uniform(-1, 1) for _ in out_rows], device=DEVICE)
    all_store, out_store = TokenRows("all_token_ids", DEVICE), TokenRows("output_token_ids", DEVICE)
    rep_slots, rep_lens, _ = all_store.rows([reqs[r] for r in rep_rows])
    out_slots, out_lens, _ = out_store.rows([reqs[r] for r in out_rows])
    rep = (rep_k, all_store.ids, rep_slots, rep_lens, penalty)
    out = (out_k, out_store.ids, out_store.counts, out_slots, out_lens, frequency, presence)
    rep_ids = all_store.padded([reqs[r] for r in rep_rows])
    out_ids, out_counts = out_store.view([reqs[r] for r in out_rows])
    rep_index, out_index = torch.tensor(rep_rows, device=DEVICE), torch.tensor(out_rows, device=DEVICE)
    source = 3 * torch.randn(num_rows, vocab, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(4))
    logits = torch.empty_like(source)

    def ours() -> None:
        logits.copy_(source)
        apply_penalties(logits, rows, rep, out)

    def theirs() -> None:
        logits.copy_(source)
        apply_repetition_penalty(logits, rep_index, rep_ids, penalty)
        apply_output_penalties(logits, out_index, out_ids, out_counts, frequency, presence)

    def same() -> tuple[float, float]:
        theirs()
        expected = logits.clone()
        ours()
        return _exact(int((logits != expected).sum()))

    shape = f"{num_rows} rows x {vocab}, {prompt_len} + {output_len} tokens"
    report.check(f"penalties kernel = the torch penalties, {shape} (logits that differ)", same)
    report.group = f"penalties {num_rows} x {vocab}"
    report.time("apply_penalties (Triton; with the copy in)", shape, ours, source.numel() * 8)
    report.time("torch penalties (gathers, scatters; with the copy in)", shape, theirs, source.numel() * 8)
    time_copy(report, source.numel() * 8, torch.float32)


def bench_logprobs(report: Report, args: argparse.Namespace, vocab: int | None = None, k: int = 20) -> None:
    """The logprob table: ``topk`` and the Triton kernel against the torch path they replace (the rows'
    copy, a log-softmax, a gather of the sampled tokens, ``topk``, the ids' conversion, the concatenation),
    over ``--batch`` rows of ``vocab`` (default ``--vocab``), half of them asking for ``k`` logprobs.
    Checked: the same logprobs to within float32's rounding of the sum, the same ids (random logits:
    no ties); then both timed."""
    from pdserve_kernels.triton_logprobs import logprob_table

    vocab = vocab or args.vocab
    num_rows = args.batch
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    logits = 3 * torch.randn(num_rows, vocab, device=DEVICE, generator=gen)
    token_ids = torch.randint(0, vocab, (num_rows,), device=DEVICE, generator=gen)
    rows = torch.arange(0, num_rows, 2, device=DEVICE)

    def ours() -> torch.Tensor:
        return logprob_table(logits, rows, token_ids, k, torch.float32)

    def theirs() -> torch.Tensor:
        raw = torch.log_softmax(logits.index_select(0, rows), dim=-1)
        values, ids = raw.topk(k, dim=-1)
        return torch.cat([raw.gather(1, token_ids.index_select(0, rows).unsqueeze(1)), values, ids.float()], dim=1)

    def same_ids() -> tuple[float, float]:
        return _exact(int((ours()[:, 1 + k :] != theirs()[:, 1 + k :]).sum()))

    def close_values() -> tuple[float, float]:
        return float((ours()[:, : 1 + k] - theirs()[:, : 1 + k]).abs().max()), 1e-4

    shape = f"{len(rows)} of {num_rows} rows x {vocab}, k {k}"
    report.check(f"logprob table kernel: the torch path's ids, {shape} (ids that differ)", same_ids)
    report.check(f"logprob table kernel: the torch path's logprobs, {shape}", close_values)
    report.group = f"logprobs {num_rows} x {vocab}"
    report.time("logprob_table (rows' copy, topk, Triton)", shape, ours, len(rows) * vocab * 4 * 3)
    report.time("torch logprob table (copy, log_softmax, gather, topk, cat)", shape, theirs, len(rows) * vocab * 4 * 3)


def check_receive_ordering(report: Report, sleep_cycles: int = 200_000_000) -> None:
    """A decode instance gives a KV transfer blocks that its step in flight may still write (a slot of a
    request that has just finished), then scatters the received frame into them on the receiver's side
    stream. Giving them must not wait for that step (it would end the overlap of steps), and the
    scatter must land after the step's write. Here the "step" is a device-side sleep of
    ``sleep_cycles`` (about 0.1 s) and then a write of 7s into the blocks, queued on the current
    stream before the blocks are given."""
    from kvtransfer.blocks.layout import KVLayout
    from kvtransfer.blocks.packing import BlockUnpacker, wait
    from kvtransfer.wire.frames import FrameSpec

    cache = torch.zeros(2, 2, 64, 16, 2, 64, device=DEVICE)
    unpacker = BlockUnpacker(cache, KVLayout.from_kv_cache(cache, "ordering-check"))
    ids = [5, 9, 40]
    index = torch.tensor(ids, device=DEVICE)  # made now: a list's index would be copied, blocking, later
    frame = torch.randn(2, 2, len(ids), 16, 2, 64)
    result: dict[str, float] = {}

    def run() -> dict[str, float]:
        if not result:
            torch.cuda.synchronize()
            torch.cuda._sleep(sleep_cycles)
            cache.index_fill_(2, index, 7.0)
            start = time.perf_counter()
            block_ids = unpacker.block_ids(ids)
            result["give_ms"] = (time.perf_counter() - start) * 1e3
            wait(unpacker.unpack(FrameSpec(0, 2, 0, len(ids)), block_ids, [bytearray(frame.numpy().tobytes())]))
            torch.cuda.synchronize()
            result["wrong"] = float((cache.index_select(2, index).cpu() != frame).sum())
        return result

    report.check("KV receive: giving a transfer its blocks waits for no step in flight (ms it took, of a "
                 "0.1 s step)", lambda: _at_most(run()["give_ms"], 20.0))
    report.check("KV receive: the scatter lands after the step's earlier write into the same blocks "
                 "(entries that differ from the frame)", lambda: _exact(run()["wrong"]))


def check_staging(report: Report, sleep_cycles: int = 100_000_000) -> None:
    """The pinned ring that small uploads pass through (``common.engine.host_tensors``): behind a
    device-side sleep (about 50 ms) that holds every copy back, a small ring (2 chunks of 4 KiB) takes
    more uploads than it holds, so it wraps onto spans whose copies have not run yet; each upload must
    still arrive as it was sent (the ring waits for a chunk's event before writing it again). Then the
    host time of one small upload through the ring, beside ``Tensor.pin_memory`` and a copy, the way
    each upload went before."""
    from common.engine.host_tensors import _Staging, long_tensor

    stream = torch.cuda.current_stream()
    ring = _Staging(torch.device(DEVICE, torch.cuda.current_device()), stream, chunk_bytes=4096, num_chunks=2)
    gen = torch.Generator().manual_seed(3)
    sent = [torch.randint(0, 1 << 40, (int(n),), generator=gen) for n in torch.randint(50, 400, (24,), generator=gen)]
    result: dict[str, float] = {}

    def run() -> dict[str, float]:
        if not result:
            torch.cuda.synchronize()
            torch.cuda._sleep(sleep_cycles)
            arrived = []
            for t in sent:
                up = ring.upload([t, t[:7]])
                assert up is not None
                arrived.append(up)
            torch.cuda.synchronize()
            result["wrong"] = float(sum(not (torch.equal(a.cpu(), t) and torch.equal(b.cpu(), t[:7]))
                                        for (a, b), t in zip(arrived, sent, strict=True)))
        return result

    report.check("pinned upload ring: 24 uploads through a ring of 2 x 4 KiB behind a 50 ms sleep "
                 "(uploads that arrived changed)", lambda: _exact(run()["wrong"]))
    report.group = "host upload"
    values = list(range(256))

    def host_us(fn: Callable[[], Any], iters: int = 2000) -> float:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        elapsed = time.perf_counter() - start
        torch.cuda.synchronize()
        return elapsed / iters * 1e6

    def pinned_copy() -> torch.Tensor:
        return torch.tensor(values).pin_memory().to(DEVICE, non_blocking=True)

    for name, fn in (("long_tensor (through the pinned ring)", lambda: long_tensor(values, DEVICE)),
                     ("torch.tensor, pin_memory, copy (each upload before the ring)", pinned_copy)):
        us = host_us(fn)
        report.timings.append({"name": f"host time: {name}", "shape": "256 int64", "median_us": us, "bytes": 0.0,
                               "gb_per_s": None, "tflop_per_s": None, "group": report.group})
        print(f"[time] host time: {name} [256 int64] {us:.1f} us (mean)")


def _at_most(count: float, allowed: float) -> tuple[float, float]:
    return count, allowed


def _exact(count: float) -> tuple[float, float]:
    return _at_most(count, 0.0)


# The default model's shapes (SmolLM2-135M), for a random-weight stand-in where its package is not installed.
STAND_IN_DIMS: dict[str, Any] = {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}
# The stand-in's output layer, scaled up from its random initialisation: logits a few units apart, so that
# the rounding of one path against another seldom flips a greedy token (near ties are what random
# weights give otherwise).
STAND_IN_LOGIT_SCALE = 30.0
# A mixture of experts for the engine variants' section: Qwen3-30B-A3B's routing (8 of 128 experts,
# renormalized) at a smaller width and depth, random weights.
MOE_STAND_IN_DIMS: dict[str, Any] = {
    **STAND_IN_DIMS, "hidden_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 4,
    "intermediate_size": 2048, "moe_intermediate_size": 256, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True,
}


def _write_stand_in(folder: Path, config: Any) -> Path:
    """A random-weight checkpoint of transformers' ``config``, its output layer scaled up
    (``STAND_IN_LOGIT_SCALE``), written once into ``folder``: whole, then renamed, so a run cut short
    leaves no half a checkpoint."""
    if not folder.exists():
        import shutil

        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            model.lm_head.weight.mul_(STAND_IN_LOGIT_SCALE)
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(str(partial))
        partial.rename(folder)
    return folder


def moe_stand_in(folder: Path) -> Path:
    """A random-weight Qwen3-MoE checkpoint of ``MOE_STAND_IN_DIMS``, written once into ``folder``."""
    from transformers import Qwen3MoeConfig

    return _write_stand_in(folder, Qwen3MoeConfig(**MOE_STAND_IN_DIMS, tie_word_embeddings=False))


def quantized_stand_in(model: str | None, fmt: str, group: int = 64) -> str:
    """The engine section's model quantized (``pdserve bench quantized-weights``: GPTQ 4-bit in groups of ``group``,
    or FP8 in blocks of ``group`` x ``group``; a mixture's experts one by one), written once into the model cache;
    the Triton kernels keep its projections and experts packed."""
    from common.model.loader import cache_dir, resolve_model_path
    from ops.bench.quantized_weights import quantize

    source = resolve_model_path(model)
    folder = cache_dir() / f"stand-in-{source.name}-{fmt}-{group}"
    if not (folder / "config.json").exists():
        quantize(source, folder, argparse.Namespace(format=fmt, bits=4, group=group))
    return str(folder)


def engine_model(choice: str, folder: Path, meta: dict[str, Any]) -> str | None:
    """The engine section's model: ``choice`` as ``--model`` takes it; "auto", the default model where
    its package is installed, else a checkpoint of the same shapes with random weights, written once
    into ``folder`` (in the model cache; an offline GPU host may lack the package). What was chosen
    goes into ``meta``."""
    if choice != "auto":
        meta["engine_model"] = choice
        return choice
    from common.model.loader import default_gguf_path

    try:
        default_gguf_path()
        meta["engine_model"] = "the default model"
        return None
    except FileNotFoundError as exc:
        print(f"[engine] {exc}; a random-weight stand-in of its shapes is used instead")
    from transformers import LlamaConfig

    _write_stand_in(folder, LlamaConfig(**STAND_IN_DIMS, tie_word_embeddings=False))
    meta["engine_model"] = f"random-weight stand-in of the default model's shapes ({folder})"
    return str(folder)


# Graphs on against graphs off: the tokens compared per sequence, whose differences are judged.
EARLY_TOKENS = 4


# Decode steps measured before a profiled stretch starts (the graphs and caches warm by then).
PROFILE_AFTER_STEPS = 5
# The engine section's speculative decoding: n-gram drafts (a random-weight model's greedy output falls
# into loops that they find).
SPEC_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def _engine_run(
    mode: str, batch: int, prompts: list[list[int]], max_tokens: int, device: str = DEVICE, model: str | None = None,
    profile_steps: int = 0, profile: list[dict[str, Any]] | None = None, kv_cache_dtype: str = "auto",
    spec_counts: list[int] | None = None,
) -> tuple[list[list[int]], float, int]:
    """Greedy outputs, the median decode step (ms; steps where every request had its first token)
    and the steps that ran through ``DecodeGraphs``, of one engine on ``model`` (None: the default
    one): ``mode`` "eager" (``--enforce-eager``), "graphs" (captured and replayed), "async" (graphs and
    ``--async-scheduling``), "spec" (graphs and n-gram drafts, ``SPEC_CONFIG``: a step with drafts runs
    eagerly; the engine's draft counts are appended to ``spec_counts``), "padded" (the graphs' padded
    static-buffer forward run eagerly, what a replay must equal exactly), or "lora" / "lora-padded" (graphs,
    or the padded forward, with two random LoRA adapters of rank 16: request i with adapter i mod 3, the
    third the base model, so every step mixes them). On another ``device`` (a test's dry run on the CPU) nothing is captured:
    "graphs" and "async" then run eagerly. With ``profile_steps``, that many decode steps after the
    first few run under torch's profiler (left out of the median), their rows appended to ``profile``
    (``ops.bench.overhead.profile_rows``: host and device time per operation and per step)."""
    from common.config import EngineConfig
    from common.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
    from common.engine.engine import LLMEngine
    from common.sampling_params import SamplingParams
    from ops.bench.overhead import profiling

    prompt_len = len(prompts[0])
    lora = mode in ("lora", "lora-padded")
    with tempfile.TemporaryDirectory() as adapters:
        modules = _lora_adapters(Path(adapters), model) if lora else ()
        config = EngineConfig(model=model, device=device, enforce_eager=mode not in ("graphs", "async", "spec", "lora"),
                              max_num_seqs=batch, num_blocks=batch * -(-(prompt_len + max_tokens) // 16) + 64, seed=0,
                              async_scheduling=mode == "async", kv_cache_dtype=kv_cache_dtype,
                              speculative_config=SPEC_CONFIG if mode == "spec" else None,
                              enable_lora=lora, lora_modules=modules)
        engine = LLMEngine(config)
    runner = engine.runner
    if mode in ("padded", "lora-padded"):
        runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_cache, graph_batch_sizes(batch),
                                            runner.input_batch.block_table.shape[1], capture=False, lora=runner.lora)
    if mode != "eager" and runner.decode_graphs is None and device == DEVICE:
        raise RuntimeError("no CUDA graphs were captured (is PDSERVE_KERNEL_BACKEND=torch set?)")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"r{i}" for i in range(batch)]
    for i, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
        engine.add_request(rid, prompt, params, lora_name=[m.name for m in modules][i % 3] if lora and i % 3 < 2 else None)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    decode_s: list[float] = []
    profiler = contextlib.ExitStack()  # holds ``overhead.profiling`` while the profiled steps run
    profiled, active = 0, False
    while engine.has_unfinished_requests():
        decoding = all(tokens.values())
        if decoding and profiled < profile_steps and not active and len(decode_s) == PROFILE_AFTER_STEPS:
            profiler.enter_context(profiling(device == "cuda", profile_steps, [] if profile is None else profile))
            active = True
        t0 = time.perf_counter()
        outs = engine.step()
        if active:
            profiled += 1
            if profiled == profile_steps or not engine.has_unfinished_requests():
                profiler.close()
                active = False
        elif decoding:
            decode_s.append(time.perf_counter() - t0)
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
    replayed = runner.decode_graphs.num_runs if runner.decode_graphs is not None else 0
    if spec_counts is not None:
        spec_counts += [engine.spec_num_drafts, engine.spec_num_draft_tokens, engine.spec_num_accepted_tokens]
    return [tokens[rid] for rid in ids], statistics.median(decode_s) * 1e3 if decode_s else float("nan"), replayed


def _lora_adapters(folder: Path, model: str | None) -> tuple[Any, ...]:
    """Two random LoRA adapters of rank 16 on every projection of ``model`` (``pdserve bench lora``'s)."""
    from common.lora_modules import LoRAModule
    from common.model.loader import resolve_model_path
    from common.model.weights import load_hf_config
    from ops.bench.lora import write_adapter

    config = load_hf_config(resolve_model_path(model))
    return tuple(LoRAModule(f"a{i}", str(write_adapter(folder / f"a{i}", config, 16, i))) for i in range(2))


def _profile_summary(rows: list[dict[str, Any]]) -> str:
    """A profile's top operations by host time, and its totals per step (the rows are the top ones only:
    the totals are at least those)."""
    host = sum(r["self_host_us"] for r in rows)
    device = sum(r["self_device_us"] for r in rows)
    top = "; ".join(f"{r['name']} {r['self_host_us']:.0f}/{r['self_device_us']:.0f} us x{r['calls']:g}" for r in rows[:8])
    return f"per step, top operations: host {host:.0f} us, device {device:.0f} us (host/device each): {top}"


def bench_engine_graphs(report: Report, args: argparse.Namespace) -> None:
    """The engine on the default model with CUDA graphs off (``--enforce-eager``), on, and on with async
    scheduling, at batch 1 and at ``--engine-batch``: the median decode step of each side by side; a
    replay's greedy outputs must equal those of the same padded forward run eagerly, exactly, and so
    must async scheduling's equal synchronous steps' (every request starts and ends together, so both
    run the same batches). Graphs off sizes its attention splits from each step's own table, so its
    outputs may differ in the last bits: the count of sequences that differ from it is reported, and
    at most a tenth may differ in their first ``EARLY_TOKENS`` tokens."""
    import gc

    from common.model.loader import cache_dir

    model = engine_model(args.engine_model, cache_dir() / "stand-in-smollm2-135m-shapes", report.meta)
    report.group = "engine"
    prompt_len, max_tokens = 128, args.engine_tokens
    for batch in sorted({1, args.engine_batch}):
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(3, 10_000, (batch, prompt_len), generator=gen).tolist()
        outputs: dict[str, list[list[int]]] = {}
        spec_counts: list[int] = []
        for mode in ("eager", "graphs", "async", "spec", "padded", "lora", "lora-padded"):
            rows: list[dict[str, Any]] = []
            steps = args.engine_profile_steps if mode in ("graphs", "async") and batch == args.engine_batch else 0
            outputs[mode], ms, replayed = _engine_run(mode, batch, prompts, max_tokens, model=model,
                                                      profile_steps=steps, profile=rows, spec_counts=spec_counts)
            gc.collect()
            torch.cuda.empty_cache()
            if mode in ("padded", "lora-padded"):
                continue
            differ = sum(a != b for a, b in zip(outputs[mode], outputs["eager"], strict=True))
            name = {"eager": "engine decode step, CUDA graphs off", "graphs": "engine decode step, CUDA graphs on",
                    "async": "engine decode step, CUDA graphs on, async scheduling",
                    "spec": "engine decode step, CUDA graphs on, n-gram drafts",
                    "lora": "engine decode step, CUDA graphs on, two LoRA adapters and the base model mixed"}[mode]
            report.timings.append({"name": name, "shape": f"batch {batch}, {prompt_len}-token prompts",
                                   "median_us": ms * 1e3, "bytes": 0.0, "gb_per_s": None, "tflop_per_s": None,
                                   "group": report.group, "steps_replayed": replayed,
                                   "sequences_differing_from_eager": differ})
            print(f"[time] {name} [batch {batch}] {ms:.3f} ms per decode step; {replayed} steps replayed; "
                  f"{differ} of {batch} sequences differ from graphs off")
            if rows:
                report.timings[-1]["profile"] = rows
                print(f"[profile] {name} [batch {batch}] {_profile_summary(rows)}")
            if mode in ("graphs", "lora"):
                report.check(f"engine decode steps replayed from CUDA graphs{' with LoRA adapters' if mode == 'lora' else ''} "
                             f"(batch {batch}; err = 1 if none)", functools.partial(_exact, float(replayed == 0)))
        differences = float(sum(a != b for a, b in zip(outputs["graphs"], outputs["padded"], strict=True)))
        report.check(f"engine greedy outputs, CUDA graph replay == the same padded forward run eagerly "
                     f"(batch {batch}, {max_tokens} tokens; err = sequences that differ)",
                     functools.partial(_exact, differences))
        differences = float(sum(a != b for a, b in zip(outputs["lora"], outputs["lora-padded"], strict=True)))
        report.check(f"engine greedy outputs with LoRA adapters, CUDA graph replay == the same padded forward run "
                     f"eagerly (batch {batch}, {max_tokens} tokens; err = sequences that differ)",
                     functools.partial(_exact, differences))
        differences = float(sum(a != b for a, b in zip(outputs["async"], outputs["graphs"], strict=True)))
        report.check(f"engine greedy outputs, async scheduling == synchronous steps, CUDA graphs on "
                     f"(batch {batch}, {max_tokens} tokens; err = sequences that differ)",
                     functools.partial(_exact, differences))
        # The padded forward shares the graphs' padding, so a padding bug passes the check above: against
        # graphs off, a bad slot or context length changes most sequences within a few tokens, where
        # attention summed in another order flips only a near tie now and then.
        early = sum(a[:EARLY_TOKENS] != b[:EARLY_TOKENS] for a, b in zip(outputs["graphs"], outputs["eager"], strict=True))
        report.check(f"engine greedy outputs, CUDA graphs on ~ off: sequences whose first {EARLY_TOKENS} tokens "
                     f"differ (batch {batch}; at most a tenth)",
                     functools.partial(_at_most, float(early), float(batch // 10)))
        # Drafts are checked by a forward over several tokens per sequence (the prefill kernels), whose sums
        # may differ in the last bits from the decode kernel's: a near tie may flip, as with graphs off.
        drafts, draft_tokens, accepted = spec_counts
        print(f"[spec] batch {batch}: {drafts} drafting steps, kept {accepted} of {draft_tokens} draft tokens")
        report.timings[-1]["spec_decode"] = {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted}
        early = sum(a[:EARLY_TOKENS] != b[:EARLY_TOKENS] for a, b in zip(outputs["spec"], outputs["graphs"], strict=True))
        report.check(f"engine greedy outputs, n-gram drafts ~ none (CUDA graphs on): sequences whose first "
                     f"{EARLY_TOKENS} tokens differ (batch {batch}; at most a tenth)",
                     functools.partial(_at_most, float(early), float(batch // 10)))
        report.check(f"engine with n-gram drafts kept some (batch {batch}; err = 1 if none)",
                     functools.partial(_exact, float(accepted == 0)))


def bench_engine_variants(report: Report, args: argparse.Namespace, device: str = DEVICE,
                          variants: list[tuple[str, str | None, str]] | None = None, batch: int | None = None,
                          max_tokens: int | None = None) -> None:
    """The engine with an 8-bit KV cache, on a mixture of experts (the Triton grouped products, the pairs grouped
    on the device inside the graph), and with GPTQ and FP8 weights kept packed (the mixture's experts too): graphs
    on and off, decode steps timed side by side;
    a replay's greedy outputs must equal the same padded forward run eagerly, and at most a tenth of
    the sequences may differ from graphs off in their first ``EARLY_TOKENS`` tokens. ``variants``:
    (name, model, kv cache dtype); by default the engine section's model with ``fp8``, and the
    mixture's stand-in (``MOE_STAND_IN_DIMS``), as it is and in GPTQ 4-bit."""
    import gc

    from common.model.loader import cache_dir

    if variants is None:
        model = engine_model(args.engine_model, cache_dir() / "stand-in-smollm2-135m-shapes", report.meta)
        moe = str(moe_stand_in(cache_dir() / "stand-in-qwen3-moe-128-experts"))
        variants = [("8-bit KV cache", model, "fp8"), ("Qwen3-MoE stand-in, 8 of 128 experts", moe, "auto"),
                    *[(f"{name}, kept packed", quantized_stand_in(model, fmt), "auto")
                      for name, fmt in (("GPTQ 4-bit weights", "gptq"), ("FP8 weights", "fp8"))],
                    ("Qwen3-MoE stand-in, GPTQ 4-bit experts kept packed", quantized_stand_in(moe, "gptq"), "auto")]
    batch = batch or args.engine_batch
    max_tokens = max_tokens or args.engine_tokens
    # Ids every vocabulary here holds (a CPU dry run's tiny model's too).
    prompts = torch.randint(3, 100, (batch, 128), generator=torch.Generator().manual_seed(batch)).tolist()
    for name, model, kv in variants:
        report.group = f"engine, {name}"
        outputs: dict[str, list[list[int]]] = {}
        for mode in ("eager", "graphs", "padded"):
            outputs[mode], ms, replayed = _engine_run(mode, batch, prompts, max_tokens, device=device, model=model,
                                                      kv_cache_dtype=kv)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            if mode != "padded":
                report.timings.append({"name": f"engine decode step, {name}, CUDA graphs {'on' if mode == 'graphs' else 'off'}",
                                       "shape": f"batch {batch}, 128-token prompts", "median_us": ms * 1e3, "bytes": 0.0,
                                       "gb_per_s": None, "tflop_per_s": None, "group": report.group,
                                       "steps_replayed": replayed})
                print(f"[time] engine decode step, {name}, {mode} [batch {batch}] {ms:.3f} ms; {replayed} replayed")
        differences = float(sum(a != b for a, b in zip(outputs["graphs"], outputs["padded"], strict=True)))
        report.check(f"engine, {name}: CUDA graph replay == the same padded forward run eagerly "
                     f"(batch {batch}; err = sequences that differ)", functools.partial(_exact, differences))
        early = sum(a[:EARLY_TOKENS] != b[:EARLY_TOKENS] for a, b in zip(outputs["graphs"], outputs["eager"], strict=True))
        report.check(f"engine, {name}: graphs on ~ off, sequences whose first {EARLY_TOKENS} tokens differ "
                     f"(at most a tenth)", functools.partial(_at_most, float(early), float(batch // 10)))


def check_window_release(report: Report, args: argparse.Namespace, model: str | None = None, device: str = DEVICE,
                         batch: int | None = None, window: int = 64, max_num_batched_tokens: int = 512) -> None:
    """The engine's model read as a Mistral windowed on every layer (``--hf-overrides``), CUDA graphs on: blocks out
    of the window given back (during chunked prefill too, and the prefix hits that need only a window), beside
    the same engine keeping every block. A kernel that read a given-back place (its id another block's) would
    move a token: every sequence must be identical, and the blocks in use must stay within the bound admission
    counts (``max_blocks_held``) per request."""
    from common.config import EngineConfig
    from common.model.loader import cache_dir
    from ops.bench.window import run_greedy, windowed_engine

    if model is None:
        model = engine_model(args.engine_model, cache_dir() / "stand-in-smollm2-135m-shapes", report.meta)
    batch = batch or args.engine_batch
    prompt_len, max_tokens = 4 * window + 5, 2 * window
    report.group = "engine, a window on every layer"
    prompts = torch.randint(3, 100, (batch, prompt_len), generator=torch.Generator().manual_seed(7)).tolist()
    overrides = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": window}
    outputs: dict[bool, list[list[int]]] = {}
    most: dict[bool, int] = {}
    config = EngineConfig(model=model, device=device, max_num_seqs=batch, seed=0, hf_overrides=overrides,
                          num_blocks=batch * -(-(prompt_len + max_tokens) // 16) + 64,
                          max_num_batched_tokens=max_num_batched_tokens)
    bound = 0
    for release in (True, False):
        engine = windowed_engine(config, release)  # without release: every block kept, whole-prefix hits
        if release:
            bound = engine.kv.max_blocks_held(prompt_len + max_tokens, max_num_batched_tokens)
        run = run_greedy(engine, prompts, max_tokens)
        outputs[release], most[release] = run["outputs"], run["peak_blocks_in_use"]
        engine.close()
    differences = float(sum(a != b for a, b in zip(outputs[True], outputs[False], strict=True)))
    report.check(f"engine, window {window} on every layer: blocks given back == every block kept, sequences that "
                 f"differ (batch {batch}, {prompt_len}-token prompts in steps of {max_num_batched_tokens})",
                 functools.partial(_exact, differences))
    report.check(f"engine, window {window}: blocks in use at most (every block kept: {most[False]}) within {bound} "
                 f"a request", functools.partial(_at_most, float(most[True]), float(batch * bound)))
    print(f"[window] blocks in use at most: {most[True]} given back, {most[False]} kept")


def check_kv_offload(report: Report, args: argparse.Namespace, model: str | None = None, device: str = DEVICE,
                     conversations: int = 6, doc_len: int = 512, copy_blocks: int = 256) -> None:
    """The prefix cache's host tier (``--kv-offloading-size``) on the device: conversations whose documents the
    device pool (two documents) takes back for each other, turn after turn (``pdserve bench offload``'s workload),
    beside the same engine without a host tier. Every turn must answer the same, and every later turn must find
    its whole document cached: the copies to pinned host memory and back, queued on the stream without a wait,
    carried the KV. Then ``copy_blocks`` blocks saved and loaded, timed (each a block's bytes over PCIe)."""
    from common.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.kvcache.host_tier import LOAD, SAVE, HostCopy
    from common.model.loader import cache_dir
    from ops.bench.offload import run_turns

    if model is None:
        model = engine_model(args.engine_model, cache_dir() / "stand-in-smollm2-135m-shapes", report.meta)
    report.group = "engine, a host tier of the prefix cache"
    gen = torch.Generator().manual_seed(11)
    docs = [torch.randint(3, 100, (doc_len,), generator=gen).tolist() for _ in range(conversations)]
    turns = [doc + torch.randint(3, 100, (8,), generator=gen).tolist() for _ in range(2) for doc in docs]
    config = EngineConfig(model=model, device=device, max_num_seqs=4, seed=0, max_model_len=doc_len + 32,
                          num_blocks=2 * -(-(doc_len + 16) // 16))
    runs = {gib: run_turns(dataclasses.replace(config, kv_offloading_size=gib), turns, 8, conversations)
            for gib in (0.25, 0.0)}
    differences = float(sum(a != b for a, b in zip(runs[0.25]["outputs"], runs[0.0]["outputs"], strict=True)))
    report.check(f"engine, host tier == device only: turns that differ ({conversations} conversations of "
                 f"{doc_len}-token documents, twice)", functools.partial(_exact, differences))
    missed = conversations * (doc_len // 16) * 16 - runs[0.25]["cached_tokens"]
    report.check("engine, host tier: document tokens of the second turns not found cached",
                 functools.partial(_exact, float(missed)))
    print(f"[offload] TTFT p50 of the second turns: {runs[0.25]['later_rounds_ttft_p50_s'] * 1e3:.1f} ms with the "
          f"host tier, {runs[0.0]['later_rounds_ttft_p50_s'] * 1e3:.1f} ms without; "
          f"{runs[0.25]['host_copy_seconds'] * 1e3:.1f} ms in copies")
    engine = LLMEngine(dataclasses.replace(config, num_blocks=copy_blocks, kv_offloading_size=0.25))
    runner = engine.runner
    block_bytes = runner.bytes_per_block
    count = min(copy_blocks, runner.num_host_blocks)
    for direction, name in ((SAVE, "save"), (LOAD, "load")):
        copies = [HostCopy(direction, b, b) for b in range(count)]
        report.time(f"host tier {name}", f"{count} blocks of {block_bytes} B",
                    functools.partial(runner.copy_host, copies), num_bytes=2.0 * count * block_bytes)
    engine.close()


# The share of the GPU the sizing section's engine is given.
SIZING_UTILIZATION = 0.5


def check_kv_sizing(report: Report, args: argparse.Namespace, model: str | None = None) -> None:
    """An engine that sizes its own KV cache (``--gpu-memory-utilization`` ``SIZING_UTILIZATION``, after
    its profiled step) then runs ``--engine-batch`` requests at once, every sampling feature on in each
    (half of them seeded): every request gets its tokens, and the memory torch reserved at the peak,
    the cache and the steps included, stays within the share. On the CPU (a test's dry run) the cache
    is sized by ``--kv-cache-memory`` and only the requests are checked."""
    import gc

    from common.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.model.loader import cache_dir
    from common.sampling_params import MAX_LOGPROBS, SamplingParams

    if model is None:
        model = engine_model(args.engine_model, cache_dir() / "stand-in-smollm2-135m-shapes", report.meta)
    report.group = "engine"
    cuda = DEVICE == "cuda"
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    batch, max_tokens = args.engine_batch, 8
    engine = LLMEngine(EngineConfig(model=model, device=DEVICE, gpu_memory_utilization=SIZING_UTILIZATION,
                                    max_num_seqs=batch, seed=0))
    gen = torch.Generator().manual_seed(7)
    vocab = min(10_000, engine.vocab_size)
    for i, prompt in enumerate(torch.randint(3, vocab, (batch, 128), generator=gen).tolist()):
        engine.add_request(f"s{i}", prompt, SamplingParams(
            temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
            frequency_penalty=0.3, logprobs=MAX_LOGPROBS, seed=i if i % 2 else None, max_tokens=max_tokens,
            ignore_eos=True))
    counts: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
    short = sum(counts.get(f"s{i}", 0) != max_tokens for i in range(batch))
    report.check(f"engine sizing its own KV cache: {batch} requests with every sampling feature, each "
                 f"{max_tokens} tokens (err = requests short of them)", functools.partial(_exact, float(short)))
    runner = engine.runner
    cache_gib = runner.kv_cache.numel() * runner.kv_cache.element_size() / 2**30
    if not cuda:
        print(f"[sizing] {runner.num_blocks} KV blocks ({cache_gib:.2f} GiB) on {DEVICE}")
        return
    total = torch.cuda.get_device_properties(0).total_memory
    peak = torch.cuda.max_memory_reserved()
    profiled = getattr(runner, "profiled_peak_bytes", 0)
    report.meta["kv_sizing"] = {"utilization": SIZING_UTILIZATION, "kv_cache_gib": round(cache_gib, 2),
                                "profiled_step_peak_gib": round(profiled / 2**30, 3),
                                "peak_reserved_gib": round(peak / 2**30, 2), "total_gib": round(total / 2**30, 1)}
    print(f"[sizing] KV cache {cache_gib:.2f} GiB; profiled step {profiled / 2**30:.3f} GiB; peak reserved "
          f"{peak / 2**30:.2f} GiB of a {SIZING_UTILIZATION:g} share of {total / 2**30:.1f} GiB")
    report.check(f"engine sizing its own KV cache: peak memory reserved (GiB) within its "
                 f"{SIZING_UTILIZATION:g} share of the GPU", lambda: _at_most(peak / 2**30, total * SIZING_UTILIZATION / 2**30))


def run_sections(report: Report, sections: list[tuple[str, Callable[[], None]]], started: float) -> list[str]:
    """Run each section, saving the report after each; the names of the failed checks. A section that
    raises is a failed check of its own ("section ... ran to its end"): a crash before its checks must
    not leave a run that looks passed."""
    for name, section in sections:
        try:
            section()
        except Exception as exc:  # a broken section must not lose the others' results
            report.timings.append({"name": f"section {name}", "shape": "", "group": report.group,
                                   "error": _short(exc)})
            report.checks.append({"check": f"section {name} ran to its end", "ok": False, "max_abs_err": None,
                                  "tolerance": None, "error": _short(exc)})
            print(f"[section] {name} failed: {_short(exc)}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        report.meta["elapsed_s"] = round(time.perf_counter() - started, 1)
        report.save()
    return [c["check"] for c in report.checks if not c["ok"]]


def read_nvml(report: Report, when: str) -> None:
    """Print NVML's readings of every GPU (utilisation, memory, power, temperature, throttle
    reasons, as the engines export them) and keep them in the report's metadata."""
    from prometheus_client import CollectorRegistry

    from common.nvml_metrics import register_nvml_collector

    registry = CollectorRegistry()
    if register_nvml_collector(registry, {"when": when}) is None:
        print(f"[nvml] {when}: NVML unavailable")
        return
    readings = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.endswith("gpu_clock_throttled") and not sample.value:
                continue
            extra = f" {sample.labels['reason']}" if "reason" in sample.labels else ""
            key = f"gpu{sample.labels['gpu']} {sample.name.removeprefix('pdserve:')}{extra}"
            readings[key] = sample.value
            print(f"[nvml] {when}: {key} = {sample.value:g}")
    report.meta[f"nvml_{when}"] = readings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check and time the Triton kernels on a CUDA GPU.")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context-len", type=int, default=4096)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--store-tokens", type=int, default=16384, help="tokens of the prefill-sized store_kv")
    parser.add_argument("--num-layers", type=int, default=32, help="layers in the cache for block transfers")
    parser.add_argument("--kv-blocks", type=int, default=2048, help="blocks per layer in that cache")
    parser.add_argument("--transfer-blocks", type=int, default=256, help="blocks gathered / scattered")
    parser.add_argument("--small-batch", type=int, default=4, help="decode batch that takes the split path")
    parser.add_argument("--no-sweep", action="store_true", help="skip the decode tile sweep")
    parser.add_argument("--engine-batch", type=int, default=64,
                        help="decode batch of the engine section (CUDA graphs off and on; batch 1 too)")
    parser.add_argument("--engine-tokens", type=int, default=64, help="tokens each engine request generates")
    parser.add_argument("--engine-profile-steps", type=int, default=5,
                        help="decode steps of the engine section profiled (graphs on, and async; at --engine-batch)")
    parser.add_argument("--engine-model", default="auto",
                        help="the engine section's model (as --model takes it); auto: the default model, or a "
                             "random-weight stand-in of its shapes where its package is not installed")
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary of the seeded race's rows")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device is available; this check and benchmark needs an NVIDIA GPU.",
              file=sys.stderr)
        return 1
    try:
        import triton

        from pdserve_kernels import reference as ref
        from pdserve_kernels import triton_ops as ops
    except ImportError as exc:
        print(f"gpu_kernels: cannot import the Triton kernels ({exc}); install triton.", file=sys.stderr)
        return 1

    # The engine section requires a graph's replay (captured on a side stream) to equal, bit for bit,
    # the same forward run on the default stream; cuBLAS promises that across streams only with a
    # workspace per stream. Set before the first matrix product creates its handle.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    props = torch.cuda.get_device_properties(0)
    meta = {"device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "date": dt.datetime.now().isoformat(timespec="seconds"), "args": {k: str(v) for k, v in vars(args).items()}}
    report = Report(args.out_dir, meta)
    started = time.perf_counter()
    sections: list[tuple[str, Callable[[], None]]] = [
        ("nvml before", lambda: read_nvml(report, "before")),
        ("checks", lambda: run_checks(report, ops, ref)),
        ("decode", lambda: bench_decode(report, args, args.batch, sweep=not args.no_sweep)),
        ("decode small batch", lambda: bench_decode(report, args, args.small_batch, sweep=False)),
        ("prefill", lambda: bench_prefill(report, args, ops)),
        ("kv movement", lambda: bench_kv(report, args, ops)),
        ("latent attention", lambda: bench_latent(report, args, ops, ref)),
        ("seeded race", lambda: bench_seeded_race(report, args)),
        ("mixture of experts", lambda: bench_moe(report, ops, ref)),
        ("packed integer weights", lambda: bench_int_linear(report, ops, ref)),
        ("8-bit FP8 weights", lambda: bench_fp8_linear(report, ops, ref)),
        ("top-p / min-p", lambda: bench_nucleus(report, args)),
        ("penalties", lambda: bench_penalties(report, args)),
        ("logprobs", lambda: bench_logprobs(report, args)),
        ("kv receive ordering", lambda: check_receive_ordering(report)),
        ("pinned upload ring", lambda: check_staging(report)),
        ("engine, CUDA graphs off and on", lambda: bench_engine_graphs(report, args)),
        ("engine, an 8-bit KV cache and a mixture of experts", lambda: bench_engine_variants(report, args)),
        ("engine, KV cache sized by its profiled step", lambda: check_kv_sizing(report, args)),
        ("engine, blocks out of a window given back", lambda: check_window_release(report, args)),
        ("engine, a host tier of the prefix cache", lambda: check_kv_offload(report, args)),
        ("nvml after", lambda: read_nvml(report, "after")),
    ]
    failed = run_sections(report, sections, started)
    print(f"\nwrote {report.md_path} and {report.json_path} in {report.meta['elapsed_s']} s")
    print(report.md_path.read_text())
    if failed:
        print(f"FAILED checks: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
