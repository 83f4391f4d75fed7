"""Environment variables for the child processes a benchmark starts, put back afterwards."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


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
