"""``pdserve bench kv-dtype``: a short run on the default model, and its agreement measure by hand."""

from __future__ import annotations

import json
from pathlib import Path

from ops.bench import kv_dtype


def test_agreement_counts_identical_sequences_prefixes_and_positions() -> None:
    a = kv_dtype.agreement([[1, 2, 3, 4], [5, 6], [7, 8]], [[1, 2, 9, 4], [5, 6], [0, 8]])
    assert a["identical_sequences"] == 1 and a["num_sequences"] == 3
    assert a["mean_share_before_first_difference"] == (2 / 4 + 1 + 0) / 3
    assert a["tokens_agreeing_at_equal_positions"] == 6 / 8


def test_a_short_run_reports_capacity_and_agreement(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    assert kv_dtype.main(["--num-prompts", "2", "--max-tokens", "4", "--dtypes", "float32",
                          "--kv-cache-memory", "16M", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = result["runs"]
    for run in runs.values():  # as many whole blocks as the memory holds
        assert run["num_blocks"] == (16 << 20) // (run["bytes_per_token"] * 16)
    assert sorted(runs) == ["float32/auto", "float32/fp8", "float32/fp8_e5m2"]
    for kv, dtype in (("fp8", "torch.float8_e4m3fn"), ("fp8_e5m2", "torch.float8_e5m2")):
        assert 4.0 <= result["capacity_ratio"][f"float32/{kv}"] < 4.2  # 8 bits where float32 keeps 32
        assert runs[f"float32/{kv}"]["cache_torch_dtype"] == dtype
        assert runs["float32/auto"]["bytes_per_token"] == 4 * runs[f"float32/{kv}"]["bytes_per_token"]
        agreement = result["greedy_agreement"][f"float32/{kv} vs float32/auto"]
        assert agreement["num_sequences"] == 2 and 0 <= agreement["tokens_agreeing_at_equal_positions"] <= 1
    assert all(r["output_tokens"] == 8 for r in runs.values())
