"""``pdserve bench window``: a short run on the default model read as a windowed Mistral, beside the engine that
keeps every block; and its refusal of a model with a layer that sees everything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.bench import window


def test_a_short_run_holds_fewer_blocks_than_the_baseline_and_the_same_tokens(tmp_path: Path) -> None:
    out = tmp_path / "window.json"
    # 3 requests of 16 + 40 tokens in blocks of 8 need 21 blocks kept whole; a window of 16 needs about 4 each.
    assert window.main(["--num-requests", "3", "--prompt-len", "16", "--max-tokens", "40", "--window", "16",
                        "--num-blocks", "14", "--block-size", "8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    release, keep = result["runs"]["release"], result["runs"]["keep every block"]
    assert release["window"] == keep["window"] == 16 and release["num_blocks"] == keep["num_blocks"] == 14
    assert release["output_tokens"] == keep["output_tokens"] == 3 * 40
    assert release["preemptions"] == 0 < keep["preemptions"]  # 14 blocks hold the windows, not the sequences
    assert release["peak_running_requests"] == 3
    assert release["peak_blocks_in_use"] <= 3 * (-(-(16 + 8) // 8) + 1)
    assert result["identical_sequences"] == 3


def test_a_model_with_a_layer_without_a_window_is_refused() -> None:
    with pytest.raises(SystemExit, match="without a window"):
        window.main(["--window", "0", "--num-requests", "1", "--prompt-len", "4", "--max-tokens", "1"])
