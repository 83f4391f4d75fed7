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
                        "--num-blocks", "14", "--block-size", "8", "--prefill-requests", "2", "--prefill-len", "64",
                        "--max-num-batched-tokens", "8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    release, keep = result["runs"]["release"], result["runs"]["keep every block"]
    assert release["window"] == keep["window"] == 16 and release["num_blocks"] == keep["num_blocks"] == 14
    assert release["output_tokens"] == keep["output_tokens"] == 3 * 40
    assert release["preemptions"] == 0 < keep["preemptions"]  # 14 blocks hold the windows, not the sequences
    assert release["peak_running_requests"] == 3
    assert release["peak_blocks_in_use"] <= 3 * (-(-(16 + 8) // 8) + 1)
    assert result["identical_sequences"] == 6  # the first turns and the next
    # Each next turn (its conversation and 16 tokens more) finds its last window cached, though the conversation's
    # first blocks went back early and were taken; without a window a hit needs the first block.
    assert release["continuation_prompt_tokens"] == keep["continuation_prompt_tokens"] == 3 * (16 + 40 + 16)
    assert release["continuation_hit_tokens"] >= 3 * 16 > keep["continuation_hit_tokens"]
    # A prefill holding 2 prompts of 8 blocks for their transfers: all 16 kept, or about a window and two chunks each.
    prefill = result["prefill"]["runs"]
    assert prefill["keep every block"]["peak_blocks_in_use"] == 16 == result["prefill"]["num_blocks"]
    assert prefill["release"]["peak_blocks_in_use"] <= 2 * (-(-(16 + 2 * 8) // 8) + 1)


def test_a_model_with_a_layer_without_a_window_is_refused() -> None:
    with pytest.raises(SystemExit, match="without a window"):
        window.main(["--window", "0", "--num-requests", "1", "--prompt-len", "4", "--max-tokens", "1"])
