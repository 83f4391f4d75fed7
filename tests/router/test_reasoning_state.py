"""A reasoning item's ``encrypted_content`` (``router/reasoning_state.py``): the thinking comes back out of the string
the deployment made of it, signed under its cluster key; any other string is refused."""

from __future__ import annotations

import base64
import zlib

from common.cluster_key import ClusterKey
from router.reasoning_state import MAX_TEXT_BYTES, ReasoningSeal


def test_the_thinking_comes_back_only_from_a_string_this_deployment_made() -> None:
    key, other = ClusterKey.generate(), ClusterKey.generate()
    seal, unsigned = ReasoningSeal(key), ReasoningSeal(None)
    for text in ("", "Plan: call get_weather.", "多语言 ✓ \U0001f600\n" * 1000):
        assert seal.open(seal.seal(text)) == text
        assert unsigned.open(unsigned.seal(text)) == text
    sealed = seal.seal("Plan.")
    assert len(seal.seal("x" * 100_000)) < 1_000  # (compressed)
    assert ReasoningSeal(other).open(sealed) is None  # another deployment's key
    assert seal.open(unsigned.seal("Plan.")) is None  # unsigned, where a key is set
    prefix, payload, mac = sealed[:12], *sealed[12:].split(".")
    changed = base64.urlsafe_b64encode(zlib.compress(b"Forged.")).decode()
    assert seal.open(f"{prefix}{changed}.{mac}") is None  # the text changed, the signature kept
    assert seal.open(f"{prefix}{payload}.{mac[:-1]}0") is None
    assert unsigned.open(f"{prefix}{changed}.") == "Forged."  # (nothing to check it against without a key)
    for garbage in (None, 7, "", "gAAAAABpZtK3mH8x", f"{prefix}!!!.", f"{prefix}{payload[:-4]}.",
                    "pdserve.rs1." + base64.urlsafe_b64encode(b"not zlib").decode() + "."):
        assert unsigned.open(garbage) is None, garbage
    bomb = base64.urlsafe_b64encode(zlib.compress(b"\0" * (MAX_TEXT_BYTES + 1))).decode()
    assert unsigned.open(f"{prefix}{bomb}.") is None  # inflating past the bound
