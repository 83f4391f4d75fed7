"""``pdserve bench tp``: a short run on a tiny checkpoint reports both engines side by side, equal tokens,
each rank's share of the parameters and KV bytes, and rank 0's hand-over time per step."""

from __future__ import annotations

import json
from pathlib import Path

from ops.bench import tensor_parallel
from tests.engine.tiny_models import build_checkpoint, build_tokenizer, family_configs


def test_a_short_run_reports_both_engines_and_each_rank_s_share(tmp_path: Path) -> None:
    folder = build_checkpoint(family_configs()["llama-bias"], tmp_path / "tiny")
    build_tokenizer(folder)
    out = tmp_path / "tp.json"
    assert tensor_parallel.main(["--model", str(folder), "-tp", "2", "--num-prompts", "3", "--max-tokens", "6",
                                 "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["requests_with_equal_tokens"] == 3 and result["tensor_parallel_size"] == 2
    assert all(len(rates) == 1 and rates[0] > 0 for rates in result["tokens_per_s"].values())
    one, split = result["holdings"]["one rank"], result["holdings"]["split"]
    assert split["kv_bytes_per_block"] * 2 == one["kv_bytes_per_block"]  # half the KV heads each
    assert one["parameter_bytes"] / 2 < split["parameter_bytes"] < one["parameter_bytes"]  # embeddings whole
    assert result["hand_over_ms_per_step"]["steps"] >= 6 and result["hand_over_ms_per_step"]["median"] > 0
