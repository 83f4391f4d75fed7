"""A reasoning item's ``encrypted_content`` (OpenAI's Responses API, ``include: ["reasoning.encrypted_content"]``):
the thinking in an opaque string the client hands back in its next request's input, so that a conversation kept by
the client (``store: false``, as Codex runs) shows the model its earlier thinking again.

OpenAI encrypts it because it hides the thinking. Here the thinking is in the item's ``content`` anyway, so the
string is the text compressed and encoded, not encrypted, and, with a cluster key, signed (HMAC-SHA256 under the
key, over the format's prefix and the text): a string another deployment made, or one changed on the way, is
refused by name rather than shown to the model. Without a cluster key nothing is signed, and a string of this
format is taken as it is.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import zlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.cluster_key import ClusterKey

INCLUDE = "reasoning.encrypted_content"  # what a request's ``include`` names to get them
_PREFIX = "pdserve.rs1."
MAX_TEXT_BYTES = 8 << 20  # the thinking one may hold, at most (what a string may inflate to)


class ReasoningSeal:
    """Turns a reasoning item's text into its ``encrypted_content`` and back, under the deployment's cluster key."""

    def __init__(self, key: ClusterKey | None) -> None:
        self._key = key

    def _mac(self, payload: str) -> str:
        return self._key.sign(f"reasoning item\n{_PREFIX}{payload}".encode()) if self._key is not None else ""

    def seal(self, text: str) -> str:
        payload = base64.urlsafe_b64encode(zlib.compress(text.encode("utf-8"))).decode("ascii")
        return f"{_PREFIX}{payload}.{self._mac(payload)}"

    def open(self, sealed: object) -> str | None:
        """The text ``seal`` made ``sealed`` of; None where it is no such string, or (with a cluster key) its
        signature is not this deployment's."""
        if not isinstance(sealed, str) or not sealed.startswith(_PREFIX):
            return None
        payload, _, mac = sealed[len(_PREFIX):].partition(".")
        if self._key is not None and not hmac.compare_digest(self._mac(payload), mac):
            return None
        try:
            inflate = zlib.decompressobj()
            raw = inflate.decompress(base64.urlsafe_b64decode(payload.encode("ascii")), MAX_TEXT_BYTES)
            if inflate.unconsumed_tail or not inflate.eof:  # (more than the bound, or cut short)
                return None
            return raw.decode("utf-8")
        except (ValueError, binascii.Error, zlib.error, UnicodeError):
            return None
