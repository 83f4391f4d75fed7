"""C-library settings for an engine process, most of them read by glibc at start-up.

Two glibc defaults make an engine's large buffers dearer than they need be:

- ``memcpy`` of a few MB goes through the CPU caches and first reads every destination line it
  is about to overwrite. From 256 KiB on, non-temporal stores write straight to memory, which
  for a cold KV cache roughly halves the copy of a received KV frame into the cache.
- malloc serves an allocation above its mmap threshold with a fresh mapping, unmapped again when
  it is freed, and hands the free top of its heap back to the kernel past its trim threshold. Both
  adapt, upwards only, as far as 32 MiB, and on the way the temporaries of a step (a received
  multi-MB KV message; on the CPU, sampling temporaries and activations of a few MB) came back as
  fresh, zeroed pages. (The null-forward bench at batch 256 over the default model's 49,152 logits,
  mixed sampling parameters: 12,000 to 43,000 minor faults per step; with the thresholds below, a
  few hundred at most; see ``ops/bench/results/README.md``.) With both fixed, allocations up to
  32 MiB come from the heap, and up to 1 GiB of free memory may stay at its top.

  The cost is memory: what the heap took stays with the process. A buffer of the same size taken
  and freed step after step, with small allocations living on between, settled at about eight
  times its size of free heap (measured with ``mallinfo2``: 240 MiB for 30 MiB), so the threshold
  stays at glibc's own ceiling: above it, a step's buffers (the logits of a large decode batch) are
  mappings of their own, faulted in afresh but given back.

``python -m ops.bench.kv_transfer_bench --glibc-defaults`` measures the KV receive path without them;
``pdserve bench overhead`` reports the minor page faults per step.

``GLIBC_TUNABLES`` takes effect only in a process started with it, so the launcher and the container
image set it for the engines. An engine built in a process started without it (``pdserve generate``,
the benches, a program of one's own) sets the two malloc thresholds itself, through ``mallopt``, once
its weights and KV cache are in place (``set_malloc_thresholds``); the non-temporal threshold has no
such call. Other C libraries ignore all this; the non-temporal threshold exists on x86-64 only. A
setting the user already made, in ``GLIBC_TUNABLES`` or through glibc's older
``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` variables, is kept. For an engine started by
hand: ``export GLIBC_TUNABLES=$(python -m common.glibc_env)``.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from collections.abc import Mapping

logger = logging.getLogger(__name__)

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


# ``mallopt``'s parameters (malloc.h) for the two malloc tunables.
_MALLOPT_PARAMS = {"glibc.malloc.trim_threshold": -1, "glibc.malloc.mmap_threshold": -3}
_set_in_process: bool | None = None


def _malloc_settings_given(env: Mapping[str, str]) -> bool:
    """Whether ``env`` (a process's own) names either malloc threshold: the launcher's settings, or the user's."""
    tunables = {entry.split("=", 1)[0] for entry in env.get("GLIBC_TUNABLES", "").split(":") if entry}
    return any(name in tunables or _OLDER_VARIABLES[name] in env for name in _MALLOPT_PARAMS)


def set_malloc_thresholds() -> bool:
    """Set ``TUNABLES``' malloc thresholds in this process with glibc's ``mallopt``, unless it was started
    with either threshold set (then they are in force, or the user's choice); True if they were set now
    or by an earlier call. Call it once the process's one-off large allocations (the weights, the KV
    cache) are done: allocations made later, up to the mmap threshold, come from the heap and its memory
    stays with the process. The mmap threshold goes first: setting either fixes both (glibc stops
    adapting them), and a refused mmap threshold would leave glibc's smallest one, 128 KiB."""
    global _set_in_process
    if _set_in_process is not None:
        return _set_in_process
    _set_in_process = False
    if platform.libc_ver()[0] != "glibc" or _malloc_settings_given(os.environ):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    for name in ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold"):
        if mallopt(_MALLOPT_PARAMS[name], int(TUNABLES[name])) != 1:
            logger.warning("glibc refused %s=%s through mallopt; large buffers may be mapped afresh each time",
                           name, TUNABLES[name])
            return False
    _set_in_process = True
    return True


def keep_malloc_defaults() -> bool:
    """Make ``set_malloc_thresholds`` leave glibc's own in this process (a bench measuring what they cost);
    False if it already set them."""
    global _set_in_process
    if _set_in_process is None:
        _set_in_process = False
    return not _set_in_process


def malloc_thresholds_state() -> str:
    """Which malloc thresholds this process runs with: "environment" (started with either set),
    "set in process", or "glibc defaults"."""
    if _malloc_settings_given(os.environ):
        return "environment"
    return "set in process" if _set_in_process else "glibc defaults"


if __name__ == "__main__":
    print(tuned_env(os.environ)["GLIBC_TUNABLES"])
