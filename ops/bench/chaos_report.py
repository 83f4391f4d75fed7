"""Printing and the timeline plot of a chaos run (no measuring here; JSON goes through ``serve_report``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ops.bench.serve_report import _save

COLORS = {"ok": "tab:green", "mismatch": "tab:orange", "failed": "tab:red"}


def _s(value: float | None, digits: int = 1) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.{digits}f}"


def outcome_of(row: dict[str, Any]) -> str:
    """``ok`` (identical), ``failed`` (not completed) or ``mismatch`` (completed, different)."""
    if row["verdict"] == "identical":
        return "ok"
    return "failed" if not row["chaos"]["ok"] else "mismatch"


def fault_lines(faults: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    for f in faults:
        span = f" until t={f['end_s']:.1f}s" if f["kind"] == "stop" else ""
        lines.append(f"  t={f['start_s']:7.1f}s  {f['kind']:<5} {f['target']} (pid {f['pid']}){span}")
    return lines


def report_lines(result: dict[str, Any]) -> list[str]:
    """The printed report: faults, both passes, verdicts, extra latency, blocks once idle, the gate."""
    s = result["summary"]
    faults = result["faults"]
    kinds = {k: sum(1 for f in faults if f["kind"] == k) for k in ("kill", "stop")}
    lines = [f"faults: {len(faults)} ({kinds['kill']} kill -9, {kinds['stop']} SIGSTOP/SIGCONT)"
             f"{', ' + str(result['num_faults_skipped']) + ' slots skipped (no engine to spare)' if result['num_faults_skipped'] else ''}"]
    lines += fault_lines(faults)
    head = f"{'pass':<11}{'ok/n':>9}{'dur_s':>8}  {'latency s p50/p99/max':<24}"
    lines += ["", head, "-" * len(head)]
    for name, ok_key, lat_key in (("reference", "num_reference_ok", "reference_latency_s"),
                                  ("chaos", "num_completed", "chaos_latency_s")):
        lat = s[lat_key]
        lines.append(f"{name:<11}{str(s[ok_key]) + '/' + str(s['num_requests']):>9}"
                     f"{_s(result['passes'][name]['duration_s']):>8}  "
                     f"{_s(lat['p50'], 2) + '/' + _s(lat['p99'], 2) + '/' + _s(lat['max'], 2):<24}")
    v = s["verdicts"]
    others = ", ".join(f"{k} {n}" for k, n in v.items() if k != "identical")
    lines += [
        "",
        f"completed: {s['num_completed']}/{s['num_requests']}",
        f"identical to the reference: {s['num_identical']}/{s['num_requests']} ({others})",
        f"tokens duplicated: {s['num_tokens_duplicated']}, tokens missing: {s['num_tokens_missing']}, "
        f"usage.completion_tokens different: {s['num_usage_mismatch']} requests",
    ]
    hit, other = s["extra_latency_overlapping_s"], s["extra_latency_other_s"]
    lines.append(f"requests overlapping a fault: {s['num_overlapping_fault']}; extra latency vs reference "
                 f"p50 {_s(hit['p50'], 2)} s, p99 {_s(hit['p99'], 2)} s "
                 f"(requests overlapping none: p50 {_s(other['p50'], 2)} s, p99 {_s(other['p99'], 2)} s)")
    after, before = result.get("instances_after"), result.get("instances_before")
    if after and after.get("counts") and before:
        back = ", ".join(f"{role} {after['counts'][role]}/{n}" for role, n in before.items())
        lines.append(f"instances serving after the chaos pass: {back} (after {after['waited_s']:.1f}s)")
    lines.append(blocks_line(result["blocks_after"]))
    restarts = {n: c.get("restarts") for n, c in result.get("children_after", {}).items() if isinstance(c, dict)}
    if restarts:
        lines.append("restarts: " + ", ".join(f"{n} {r}" for n, r in sorted(restarts.items())))
    lines.append(f"result: {'PASS' if result['passed'] else 'FAIL'}"
                 + ("" if result["passed"] else " (" + "; ".join(result["failures"]) + ")"))
    return lines


def blocks_line(blocks: dict[str, Any]) -> str:
    if not blocks.get("exported"):
        why = f": {blocks['error']}" if blocks.get("error") else ""
        return f"blocks in use once idle: not reported by the router's /metrics{why}"
    per = ", ".join(f"{name} {_blocks(entry.get('pdserve:num_blocks_in_use'))}"
                    for name, entry in blocks["instances"].items())
    state = "all 0" if blocks["idle"] else "NOT all 0"
    return f"blocks in use once idle ({state} after {blocks['waited_s']:.1f}s): {per}"


def _blocks(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def plot_timeline(path: str | Path, rows: Sequence[dict[str, Any]], faults: Sequence[dict[str, Any]],
                  title: str) -> None:
    """Each chaos-pass request as a bar from its start to its end, coloured by outcome; faults as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ordered = sorted(rows, key=lambda r: (r["chaos"]["start_s"], r["request_index"]))
    fig, ax = plt.subplots(figsize=(12, max(4.0, min(12.0, 2.5 + len(rows) * 0.04))))
    for y, row in enumerate(ordered):
        start, end = row["chaos"]["start_s"], row["chaos"]["end_s"]
        if math.isnan(start) or math.isnan(end):
            continue
        color = COLORS[outcome_of(row)]
        ax.plot([start, end], [y, y], color=color, linewidth=1.6, solid_capstyle="butt")
        ax.plot([end], [y], marker="|", color=color, markersize=4)
    for f in faults:
        if f["kind"] == "stop":
            ax.axvspan(f["start_s"], f["end_s"], color="tab:purple", alpha=0.15)
        ax.axvline(f["start_s"], color="tab:purple" if f["kind"] == "stop" else "black", linestyle="--",
                   linewidth=1.0)
        ax.text(f["start_s"], 0.99, f"{f['kind']} {f['target']} ", rotation=90, fontsize=7, va="top", ha="right",
                transform=ax.get_xaxis_transform())
    handles: list[Any] = [Patch(color=c, label=name) for name, c in COLORS.items()]
    handles += [Line2D([], [], color="black", linestyle="--", label="kill -9"),
                Patch(color="tab:purple", alpha=0.3, label="SIGSTOP .. SIGCONT")]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xlabel("time since the chaos pass started (s)")
    ax.set_ylabel("request (by start time)")
    ax.set_ylim(-1, len(ordered) + max(3, len(ordered) * 0.12))
    ax.grid(True, axis="x", alpha=0.3)
    _save(fig, path, title)
