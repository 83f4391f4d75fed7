"""``pdserve bench spec``: a short run on the default model reports both engines on both workloads, and
the drafting engine's outputs equal the baseline's."""

from __future__ import annotations

import json
from pathlib import Path

from ops.bench import spec_decode


def test_a_short_run_reports_drafts_and_equal_outputs(tmp_path: Path) -> None:
    out = tmp_path / "spec.json"
    # One batch size (of 2: drafts checked for several rows in one step) keeps the suite's time down.
    assert spec_decode.main(["--num-prompts", "2", "--max-tokens", "12", "--batches", "2", "--cost-batches", "4",
                              "--cost-contexts", "50", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = result["runs"]
    (cost,) = result["proposer_host_time"]
    assert cost["batch"] == 4 and cost["context"] == 50 and cost["propose_ms_per_step"] > 0
    assert [(r["workload"], r["sampling"], r["batch"], r["engine"]) for r in runs] == [
        (w, m, 2, e) for w in ("edit", "open") for m in ("greedy", "seeded") for e in ("baseline", "ngram")
    ]
    for r in runs:
        assert 0 < r["output_tokens"] <= 24 and r["tokens_per_s"] > 0
        if r["engine"] == "baseline":
            assert r["draft_tokens"] == 0
        else:
            assert r["outputs_equal_baseline"] is True
            assert r["accepted_tokens"] <= r["draft_tokens"]
    # The edit prompts restate their code: drafts are checked there.
    assert sum(r["draft_tokens"] for r in runs if r["workload"] == "edit") > 0
