"""``pdserve bench offload``: a short run on the default model, the host tier beside the device-only engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.bench import offload


def test_a_short_run_finds_the_documents_the_device_gave_back_and_answers_the_same(tmp_path: Path) -> None:
    out = tmp_path / "offload.json"
    # 3 documents of 4 blocks of 16, a pool of 7 blocks: each turn takes back the last document's blocks.
    assert offload.main(["--conversations", "3", "--rounds", "2", "--doc-len", "64", "--question-len", "4",
                         "--max-tokens", "3", "--num-blocks", "7", "--offload-gib", "0.02", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    host, device = result["runs"]["host tier"], result["runs"]["device only"]
    assert host["prompt_tokens"] == device["prompt_tokens"] == 6 * (64 + 4)
    assert host["cached_tokens"] == 3 * 64 and device["cached_tokens"] == 0  # every second turn's document
    assert host["loaded_blocks"] == 3 * 4 and host["saved_blocks"] >= 3 * 4
    assert device["saved_blocks"] == device["loaded_blocks"] == 0
    assert result["identical_turns"] == result["turns"] == 6


def test_a_run_without_a_second_round_is_refused() -> None:
    with pytest.raises(SystemExit, match="--rounds >= 2"):
        offload.main(["--rounds", "1"])
