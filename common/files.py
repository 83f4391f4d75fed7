"""Small file helpers shared by the services and the launcher."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomically(path: str | Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one rename: a reader sees the old file or the new one, never
    a part; the temporary file is removed if anything fails."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
