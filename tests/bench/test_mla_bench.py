"""``pdserve bench mla``: a short run reports both prefill forms side by side, agreeing to float rounding."""

from __future__ import annotations

import json
from pathlib import Path

from ops.bench import mla


def test_a_short_run_reports_both_forms_and_their_agreement(tmp_path: Path) -> None:
    out = tmp_path / "mla.json"
    assert mla.main(["--prompt-lens", "48", "--heads", "2", "--layers", "1", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    [row] = result["prefill"]
    assert row["prompt_len"] == 48 and row["expands"] and row["expanded_ms"] > 0 and row["absorbed_ms"] > 0
    assert 0 < row["max_hidden_diff"] < 1e-3  # two forms of one computation: rounding apart, not equal bits
    assert result["kv_cache_entries_per_token_layer"]["latent"] == 576
