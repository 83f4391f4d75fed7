"""What ``pdserve prefill`` / ``pdserve decode`` do between building the service and running it."""

from __future__ import annotations

import gc

from common.service import service_main


def test_a_service_runs_with_what_start_up_built_frozen() -> None:
    """Start-up's objects (torch, the model, the tokenizer) are frozen out of every collection: with
    the default model a full collection over them took 100 ms, a stall of every stream."""
    seen: list[int] = []

    class Service:
        def run(self) -> None:
            seen.append(gc.get_freeze_count())

    assert gc.get_freeze_count() == 0
    try:
        assert service_main("decode", lambda args: Service(), []) == 0
    finally:
        gc.unfreeze()
    assert len(seen) == 1 and seen[0] > 0
