"""C-library settings for a process that receives KV blocks on the CPU, read by glibc at start-up.

Receiving a frame over ZMQ costs one copy of its bytes out of the message ZMQ read them into and
into the cache. Two glibc defaults make that copy, and the message itself, dearer than needed
(``python -m ops.bench.kv_transfer_bench --glibc-defaults`` measures without these settings):

- ``memcpy`` of a few MB goes through the CPU caches and first reads every destination line it
  is about to overwrite. From 256 KiB on, non-temporal stores write straight to memory, which
  for a cold KV cache roughly halves the copy.
- malloc's adaptive thresholds hand a freed multi-MB message back to the kernel (``madvise``)
  and fault fresh zeroed pages in for the next one. With messages up to 32 MiB served from the
  heap and up to 1 GiB of free memory kept at the top of each malloc arena, the buffers are reused.

The settings only take effect in a process started with them (``GLIBC_TUNABLES``), so the
launcher and the container image set them for the engines. Other C libraries ignore them; the
non-temporal threshold exists on x86-64 only. A setting the user already made, in
``GLIBC_TUNABLES`` or through glibc's older ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
variables, is kept. For an engine started by hand:
``export GLIBC_TUNABLES=$(python -m common.glibc_env)``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TUNABLES = {
    "glibc.cpu.x86_non_temporal_threshold": hex(256 << 10),
    "glibc.malloc.mmap_threshold": str(32 << 20),
    "glibc.malloc.trim_threshold": str(1 << 30),
}


# glibc's older variables for two of them (in a process started with both, the tunable wins).
_OLDER_VARIABLES = {
    "glibc.malloc.mmap_threshold": "MALLOC_MMAP_THRESHOLD_",
    "glibc.malloc.trim_threshold": "MALLOC_TRIM_THRESHOLD_",
}


def tuned_env(env: Mapping[str, str]) -> dict[str, str]:
    """``GLIBC_TUNABLES`` for a child started with ``env``: its own tunables, then ``TUNABLES``."""
    current = env.get("GLIBC_TUNABLES", "")
    entries = [entry for entry in current.split(":") if entry]
    already = {entry.split("=", 1)[0] for entry in entries}
    already |= {name for name, variable in _OLDER_VARIABLES.items() if variable in env}
    entries += [f"{name}={value}" for name, value in TUNABLES.items() if name not in already]
    return {"GLIBC_TUNABLES": ":".join(entries)}


if __name__ == "__main__":
    print(tuned_env(os.environ)["GLIBC_TUNABLES"])
