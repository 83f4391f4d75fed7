"""What the child processes a benchmark starts are given: environment variables, put back afterwards,
and a folder for their logs, removed afterwards unless the run failed."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path


@contextlib.contextmanager
def child_env(extra: Mapping[str, str]) -> Iterator[None]:
    """``extra`` in ``os.environ`` while the block runs (children started in it inherit it)."""
    saved = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class LogFolder:
    """A new temporary folder for the logs of a benchmark's processes. ``close(ok)`` removes it after a run
    that went well and keeps it, named on stderr, after one that did not (or that raised)."""

    def __init__(self, prefix: str) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=prefix))

    def close(self, ok: bool) -> None:
        if ok:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            print(f"logs kept in {self.path}", file=sys.stderr)
