"""``pdserve bench images``: a short run on the generated SmolVLM-256M processing."""

from __future__ import annotations

import json
from pathlib import Path

from ops.bench import images


def test_a_short_run_reports_first_sight_and_cached_preparation(tmp_path: Path) -> None:
    out = tmp_path / "images.json"
    assert images.main(["--repeat", "1", "--sizes", "300x700", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["size"], r["format"]) for r in rows] == [([300, 700], "JPEG"), ([300, 700], "PNG")]
    for row in rows:
        # 300 x 700 at a longest side of 2,048: 878 x 2048, in tiles of 512 rounded up: 2 x 4 and the whole image.
        assert row["processed"] == [1024, 2048]
        assert row["image_tokens"] == 9 * (64 + 2) + 1 + 2
        assert row["pixels_mib"] == 9 * 3 * 512 * 512 * 4 / (1 << 20)
        assert row["first_ms"] > 0 and row["again_ms"] > 0
