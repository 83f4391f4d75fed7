"""Tables, ratios, JSON and plots of a serving benchmark, from synthetic runs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ops.bench import serve_report as report
from ops.bench.serve_metrics import RequestResult, summarize


def run(target: str, concurrency: int, ttft: float, tokens_per_s: float) -> dict[str, Any]:
    results = [RequestResult(ok=True, output_tokens=10, ttft_s=ttft, e2e_s=ttft + 0.9, itl_s=[0.1] * 9)
               for _ in range(4)]
    summary = summarize(results, duration_s=40 / tokens_per_s)
    return {
        "target": target, "concurrency": concurrency, "request_rate": None, "summary": summary, "by_kind": {},
        "requests": [r.to_json() for r in results], "itl_samples_s": [g for r in results for g in r.itl_s],
    }


def test_table_has_one_row_per_run_with_the_percentiles() -> None:
    table = report.results_table([run("pd", 4, 0.2, 50.0), run("pd-nocache", 4, 2.0, 40.0)])
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("pd ") and "200/200/200" in lines[2] and "50.0" in lines[2]
    assert "2000/2000/2000" in lines[3]


def test_ratios_compare_each_target_with_the_first_at_the_same_level() -> None:
    lines = report.ratio_lines([run("pd", 4, 0.2, 50.0), run("single", 4, 0.4, 25.0), run("pd", 8, 0.2, 60.0)])
    assert lines == ["single c=4 vs pd: output tok/s 0.50x, TTFT p50 2.00x, ITL p50 1.00x, E2E p50 1.18x"]
    assert math.isnan(report.ratio(1.0, 0.0))


def test_json_has_no_nan_and_plots_are_png_files(tmp_path: Path) -> None:
    runs = [run("pd", c, 0.2, 10.0 * c) for c in (1, 4)] + [run("single", c, 0.3, 8.0 * c) for c in (1, 4)]
    runs[0]["summary"]["ttft_ms"]["p99"] = math.nan
    report.write_json(tmp_path / "r.json", {"runs": runs, "inf": math.inf})
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["runs"][0]["summary"]["ttft_ms"]["p99"] is None and data["inf"] is None
    report.plot_latency_cdfs(tmp_path / "cdf.png", runs, "test")
    report.plot_throughput(tmp_path / "tput.png", runs, {"hf": [{"batch_size": 4, "output_throughput": 5.0}]}, "t")
    for name in ("cdf.png", "tput.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_comparisons_put_served_throughput_beside_the_ceiling_and_transformers() -> None:
    served = run("pd", 4, 0.2, 45.0)
    served["ceiling"] = {"batch_size": 4, "tokens_per_s": 50.0}
    baselines = {"ceiling": [served["ceiling"]], "hf": [{"batch_size": 4, "output_throughput": 15.0}]}
    (line,) = report.comparison_lines([served], baselines)
    assert "= 90.0% of the bare decode forward at batch 4" in line and "3.00x transformers" in line
    assert served["vs_ceiling"] == 0.9 and served["vs_hf"] == 3.0


def test_comparisons_report_prefix_reuse_and_ttft_with_caching_on_and_off() -> None:
    on, off = run("pd", 2, 0.2, 10.0), run("pd-nocache", 2, 2.0, 5.0)
    for r, hits in ((on, 31 * 2000), (off, 0)):
        r["mean_decode_batch"] = None
        r["prefix_reuse"] = {"reused_fraction": hits / 64000, "prefix_tokens_reused": hits, "num_requests": 32,
                             "prefix_len": 2000, "best_possible_fraction": 31 / 32}
    lines = report.comparison_lines([on, off], {"ceiling": [], "hf": []})
    assert lines[0].startswith("pd c=2: prefix tokens reused 96.9% = 62000 / (32 requests x 2000)")
    assert lines[1] == "pd-nocache c=2: prefix tokens reused 0.0% (prefix caching off)"
    assert lines[2].endswith("10.0x lower (pd c=2)") and on["ttft_p50_speedup_vs_nocache"] == 10.0
