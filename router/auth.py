"""Optional bearer-token API keys; each key gets its own cache salt so tenants never share blocks."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable

from router.errors import APIError

ENV_VAR = "PDSERVE_API_KEYS"
SALT_HEX_CHARS = 32


def keys_from_env(environ: dict[str, str] | None = None) -> list[str]:
    raw = (os.environ if environ is None else environ).get(ENV_VAR, "")
    return [key.strip() for key in raw.split(",") if key.strip()]


def cache_salt_for(key: str) -> str:
    """Stable per-key salt (sha256 of the key, hex, truncated); the key itself never leaves the router."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:SALT_HEX_CHARS]


def with_request_salt(key_salt: str | None, request_salt: str | None) -> str | None:
    """The cache salt of a request that names one of its own (vLLM's ``cache_salt``), under its API
    key's: requests share cached blocks only with the same key and the same salt."""
    if request_salt is None:
        return key_salt
    return hashlib.sha256(f"{key_salt or ''}\x00{request_salt}".encode()).hexdigest()[:SALT_HEX_CHARS]


class ApiKeys:
    """Checks ``Authorization: Bearer <key>``; with no keys configured, everything is allowed."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._salts = {key: cache_salt_for(key) for key in keys if key}

    @property
    def enabled(self) -> bool:
        return bool(self._salts)

    def check(self, authorization: str | None) -> str | None:
        """The caller's cache salt (None when keys are off); raises a 401 ``APIError`` otherwise."""
        if not self._salts:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        for key, salt in self._salts.items():
            if hmac.compare_digest(key.encode("utf-8"), token.encode("utf-8")):
                return salt
        raise APIError(401, "incorrect API key provided", code="invalid_api_key")
