"""Warnings about bad input, at a bounded rate: a misbehaving peer must not flood the log."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """Logs at most ``per_second`` records each second, then says how many it left out."""

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING, per_second: int = 20) -> None:
        self.logger = logger
        self.level = level
        self.per_second = per_second
        self._window = 0.0
        self._count = 0
        self._dropped = 0

    def __call__(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._window >= 1.0:
            if self._dropped:
                self.logger.log(self.level, "left out %d similar messages", self._dropped)
            self._window, self._count, self._dropped = now, 0, 0
        if self._count < self.per_second:
            self._count += 1
            self.logger.log(self.level, msg, *args)
        else:
            self._dropped += 1
