"""The thread-safe meeting point of an I/O thread and the engine: states and unpolled results."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

from kvtransfer.transfer_state import TransferResult, TransferState


class StateBoard:
    """States of live transfers, of the last ``history`` finished ones, and results awaiting ``drain``."""

    def __init__(self, history: int = 4096) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, TransferState] = {}
        self._finished: OrderedDict[str, TransferState] = OrderedDict()
        self._results: deque[TransferResult] = deque()
        self._history = history

    def start(self, request_id: str, state: TransferState) -> bool:
        """Register a new transfer; ``False`` (and no change) if one with this id is still live."""
        with self._lock:
            if request_id in self._live:
                return False
            self._live[request_id] = state
            self._finished.pop(request_id, None)
            return True

    def set(self, request_id: str, state: TransferState) -> None:
        """Move a live transfer to an unfinished ``state``."""
        with self._lock:
            if request_id in self._live:
                self._live[request_id] = state

    def get(self, request_id: str) -> TransferState:
        """The state of a live or recently finished transfer; ``KeyError`` for unknown ids."""
        with self._lock:
            state = self._live.get(request_id)
            return state if state is not None else self._finished[request_id]

    def is_live(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._live

    def finish(self, result: TransferResult, *, report: bool = True) -> None:
        """End a live transfer with ``result``; queue it for ``drain`` unless ``report`` is false."""
        state = TransferState.SUCCESS if result.ok else TransferState.FAILED
        with self._lock:
            self._live.pop(result.request_id, None)
            self._finished[result.request_id] = state
            self._finished.move_to_end(result.request_id)
            while len(self._finished) > self._history:
                self._finished.popitem(last=False)
            if report:
                self._results.append(result)

    def drain(self) -> list[TransferResult]:
        """Every result not returned before, oldest first. Never blocks for long."""
        with self._lock:
            out = list(self._results)
            self._results.clear()
            return out

    def live_ids(self) -> list[str]:
        with self._lock:
            return list(self._live)
