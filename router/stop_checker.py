"""Stop strings over streamed text, across token boundaries.

Text that could be the start of a stop string is held back until it is clear either way, so a
client never sees part of a stop string. The stop string itself is emitted only when asked for
(vLLM's ``include_stop_str_in_output``).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    """``push`` returns the text safe to emit; after a stop string hits, ``stopped`` is True."""

    __slots__ = ("_held", "_include", "_max_hold", "_stop", "stopped")

    def __init__(self, stop: Sequence[str], include: bool = False) -> None:
        self._stop = [s for s in stop if s]
        self._include = include  # the stop string that hits ends the text, instead of being cut
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped or not text:
            return ""
        if not self._stop:
            return text
        buffer = self._held + text
        # The stop string that completes first in generation order wins (ties: the one starting
        # first), whatever the token boundaries: a longer one still growing cannot be known yet.
        hits = [(pos + len(s), pos) for s in self._stop if (pos := buffer.find(s)) >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            end, start = min(hits)
            return buffer[: end if self._include else start]
        num_held = self._num_to_hold(buffer)
        self._held = buffer[len(buffer) - num_held :]
        return buffer[: len(buffer) - num_held]

    def _num_to_hold(self, buffer: str) -> int:
        """Length of the longest tail of ``buffer`` that is a proper prefix of a stop string."""
        for size in range(min(self._max_hold, len(buffer)), 0, -1):
            tail = buffer[-size:]
            if any(s.startswith(tail) for s in self._stop):
                return size
        return 0

    def flush(self) -> str:
        """Release held text at the end of a request that did not stop on a string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
