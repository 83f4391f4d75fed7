"""splitmix64 in plain Python, for the seeded draws' tests: its output function and that function's
inverse, to build a draw key whose noise at a chosen token id comes from a chosen 64-bit state."""

from __future__ import annotations

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
_MIX_1 = 0xBF58476D1CE4E5B9
_MIX_2 = 0x94D049BB133111EB


def mix(z: int) -> int:
    """splitmix64's output function on an unsigned 64-bit ``z``."""
    z = ((z ^ (z >> 30)) * _MIX_1) & MASK
    z = ((z ^ (z >> 27)) * _MIX_2) & MASK
    return z ^ (z >> 31)


def _unshift(z: int, shift: int) -> int:
    """The ``x`` of ``z = x ^ (x >> shift)``."""
    x = z
    for k in range(shift, 64, shift):
        x ^= z >> k
    return x


def unmix(z: int) -> int:
    """The ``x`` with ``mix(x) == z``."""
    z = _unshift(z, 31)
    z = (z * pow(_MIX_2, -1, 1 << 64)) & MASK
    z = _unshift(z, 27)
    z = (z * pow(_MIX_1, -1, 1 << 64)) & MASK
    return _unshift(z, 30)


def key_with_state(token_id: int, state: int) -> int:
    """A draw key (signed, as the int64 tensors hold it) whose stream at ``token_id`` is ``state``:
    ``exponentials`` hashes ``key + (token_id + 1) * GOLDEN``; ``state`` below 2**11 makes its uniform 0."""
    key = (unmix(state) - (token_id + 1) * GOLDEN) & MASK
    return key - (1 << 64) if key >> 63 else key
