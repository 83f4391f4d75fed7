"""Printing, JSON and plots of a serving benchmark (no measuring here)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _f(value: float | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _dist(d: dict[str, float]) -> str:
    return "/".join(_f(d[k]) for k in ("p50", "p90", "p99"))


def run_label(run: dict[str, Any]) -> str:
    if run.get("concurrency"):
        return f"{run['target']} c={run['concurrency']}"
    rate = run.get("request_rate")
    return f"{run['target']} rate={'inf' if rate is None else _f(rate, 2)}"


def results_table(runs: Sequence[dict[str, Any]], kind: str | None = None) -> str:
    """One row per (target, load level): throughput, goodput and latency percentiles."""
    head = (
        f"{'target':<12}{'conc':>5}{'rate':>6}{'ok/n':>8}{'dur_s':>8}{'req/s':>7}{'out_tok/s':>10}"
        f"{'goodput':>8}  {'TTFT ms p50/p90/p99':<22}{'ITL ms p50/p90/p99':<20}{'E2E ms p50/p90/p99':<20}"
    )
    lines = [head, "-" * len(head)]
    for run in runs:
        s = run["summary"] if kind is None else run["by_kind"][kind]
        rate = run.get("request_rate")
        lines.append(
            f"{run['target']:<12}{run.get('concurrency') or '-':>5}{'inf' if rate is None else _f(rate, 1):>6}"
            f"{str(s['num_ok']) + '/' + str(s['num_requests']):>8}{_f(s['duration_s'], 1):>8}"
            f"{_f(s['request_throughput'], 2):>7}{_f(s['output_throughput'], 1):>10}{_f(s['goodput'], 2):>8}  "
            f"{_dist(s['ttft_ms']):<22}{_dist(s['itl_ms']):<20}{_dist(s['e2e_ms']):<20}"
        )
    return "\n".join(lines)


def ratio(numerator: float, denominator: float) -> float:
    if not denominator or math.isnan(denominator) or math.isnan(numerator):
        return math.nan
    return numerator / denominator


def ratio_lines(runs: Sequence[dict[str, Any]]) -> list[str]:
    """Every target against the first one at the same load level."""
    lines = []
    levels: dict[Any, list[dict[str, Any]]] = {}
    for run in runs:
        levels.setdefault((run.get("concurrency"), run.get("request_rate")), []).append(run)
    for group in levels.values():
        base = group[0]
        for other in group[1:]:
            b, o = base["summary"], other["summary"]
            lines.append(
                f"{run_label(other)} vs {base['target']}: output tok/s {_f(ratio(o['output_throughput'], b['output_throughput']), 2)}x, "
                f"TTFT p50 {_f(ratio(o['ttft_ms']['p50'], b['ttft_ms']['p50']), 2)}x, "
                f"ITL p50 {_f(ratio(o['itl_ms']['p50'], b['itl_ms']['p50']), 2)}x, "
                f"E2E p50 {_f(ratio(o['e2e_ms']['p50'], b['e2e_ms']['p50']), 2)}x"
            )
    return lines


def comparison_lines(runs: list[dict[str, Any]], baselines: dict[str, Any]) -> list[str]:
    """Ceiling and transformers ratios for served runs; caching on vs off for shared prefixes.

    Also records the ratios in the runs (``vs_ceiling``, ``vs_hf``, ``ttft_p50_speedup_vs_nocache``).
    """
    lines = []
    hf = {b["batch_size"]: b for b in baselines["hf"]}
    for run in runs:
        s, label = run["summary"], run_label(run)
        parts = []
        c = run.get("ceiling")
        if c:
            run["vs_ceiling"] = ratio(s["output_throughput"], c["tokens_per_s"])
            parts.append(f"{_f(s['output_throughput'], 1)} tok/s = {100 * run['vs_ceiling']:.1f}% of the bare "
                         f"decode forward at batch {c['batch_size']} ({_f(c['tokens_per_s'], 1)} tok/s)")
        base = hf.get(run["concurrency"] or 16) or (baselines["hf"][0] if len(baselines["hf"]) == 1 else None)
        if base:
            run["vs_hf"] = ratio(s["output_throughput"], base["output_throughput"])
            parts.append(f"{run['vs_hf']:.2f}x transformers generate at batch {base['batch_size']} "
                         f"({_f(base['output_throughput'], 1)} tok/s)")
        if parts:
            lines.append(f"{label}: " + "; ".join(parts))
        reuse = run.get("prefix_reuse")
        if reuse and "nocache" in run["target"]:
            lines.append(f"{label}: prefix tokens reused {100 * reuse['reused_fraction']:.1f}% (prefix caching off)")
        elif reuse:
            lines.append(
                f"{label}: prefix tokens reused {100 * reuse['reused_fraction']:.1f}% = "
                f"{reuse['prefix_tokens_reused']:.0f} / ({reuse['num_requests']} requests x {reuse['prefix_len']}) "
                f"(best possible {100 * reuse['best_possible_fraction']:.1f}%: the first request of each of the "
                f"{reuse.get('num_prefixes', 1)} prefixes computes it)"
            )
    for on in [r for r in runs if r["target"] == "pd" and r.get("prefix_reuse")]:
        for off in [r for r in runs if r["target"] == "pd-nocache" and r["concurrency"] == on["concurrency"]]:
            factor = ratio(off["summary"]["ttft_ms"]["p50"], on["summary"]["ttft_ms"]["p50"])
            on["ttft_p50_speedup_vs_nocache"] = factor
            lines.append(f"TTFT p50 with prefix caching {_f(on['summary']['ttft_ms']['p50'])} ms vs without "
                         f"{_f(off['summary']['ttft_ms']['p50'])} ms: {factor:.1f}x lower ({run_label(on)})")
    return lines


def write_json(path: str | Path, report: dict[str, Any]) -> None:
    """``report`` as indented JSON: floats to 6 significant digits, NaN and infinity as null."""
    def clean(value: Any) -> Any:
        if isinstance(value, float):
            return None if math.isnan(value) or math.isinf(value) else float(f"{value:.6g}")
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(clean(report), indent=1) + "\n")


def _cdf(ax: Any, values: list[float], label: str) -> None:
    data = sorted(v for v in values if v is not None and not math.isnan(v))
    if data:
        ax.step(data, [(i + 1) / len(data) for i in range(len(data))], where="post", label=label)


def plot_latency_cdfs(path: str | Path, runs: Sequence[dict[str, Any]], title: str) -> None:
    """TTFT, ITL and end-to-end latency CDFs, one line per (target, load level)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in runs:
        label = run_label(run)
        _cdf(axes[0], [r["ttft_s"] * 1000 for r in run["requests"] if r["ok"]], label)
        _cdf(axes[1], [g * 1000 for g in run["itl_samples_s"]], label)
        _cdf(axes[2], [r["e2e_s"] for r in run["requests"] if r["ok"]], label)
    names = (
        ("TTFT (ms)", "fraction of requests"),
        ("inter-token latency (ms)", "fraction of token gaps"),
        ("end-to-end latency (s)", "fraction of requests"),
    )
    for ax, (x_name, y_name) in zip(axes, names, strict=True):
        ax.set_xlabel(x_name)
        ax.set_ylabel(y_name)
        ax.set_xscale("log")
        low, high = ax.get_xlim()
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if high / low < 300 else (1.0,)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path, title)


def plot_throughput(path: str | Path, runs: Sequence[dict[str, Any]], baselines: dict[str, Any], title: str) -> None:
    """Output tokens/s and TTFT p50 against concurrency, one line per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, (ax_tput, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    targets = list(dict.fromkeys(r["target"] for r in runs))
    for target in targets:
        points = sorted((r["concurrency"], r["summary"]) for r in runs if r["target"] == target and r.get("concurrency"))
        if not points:
            continue
        xs = [c for c, _ in points]
        line = ax_tput.plot(xs, [s["output_throughput"] for _, s in points], marker="o", label=target)[0]
        ceiling = sorted((r["concurrency"], r["ceiling"]["tokens_per_s"]) for r in runs
                         if r["target"] == target and r.get("concurrency") and r.get("ceiling"))
        if ceiling:
            ax_tput.plot([c for c, _ in ceiling], [t for _, t in ceiling], linestyle=":", marker=".",
                         color=line.get_color(), label=f"{target}: bare decode forward at its batch")
        ax_ttft.plot(xs, [s["ttft_ms"]["p50"] for _, s in points], marker="o", label=target)
    hf = sorted((b["batch_size"], b["output_throughput"]) for b in baselines.get("hf", []))
    if hf:
        ax_tput.plot([b for b, _ in hf], [t for _, t in hf], marker="s", linestyle="--", label="transformers (static batch)")
    levels = sorted({r["concurrency"] for r in runs if r.get("concurrency")})
    for ax, name in ((ax_tput, "output tokens/s"), (ax_ttft, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path, title)


def _save(fig: Any, path: str | Path, title: str) -> None:
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
