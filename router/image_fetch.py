"""Images by URL: fetched by the router from the hosts its operator allows, and no others.

vLLM fetches an ``http(s)://`` image URL from any host unless ``--allowed-media-domains`` narrows it. A router
that fetches whatever a client names reaches, from inside the deployment, hosts the client cannot (cloud
metadata endpoints, internal services): here nothing is fetched unless ``--allowed-media-domains`` lists the
URL's host, exactly (a redirect is followed only to a listed host too, at most ``MAX_REDIRECTS`` times). A
fetch is bounded in time (``--media-fetch-timeout``, vLLM's default of 5 seconds) and in bytes (the bytes of an
inline image, ``MAX_ENCODED_IMAGE_BYTES``); its failure is the request's 400, naming the image's field.
"""

from __future__ import annotations

import argparse
import asyncio
import urllib.parse
from collections.abc import Sequence

import httpx

from router.errors import bad_request

MAX_REDIRECTS = 3
DEFAULT_FETCH_TIMEOUT_S = 5.0


def fetch_timeout_arg(text: str) -> float:
    """``--media-fetch-timeout``: seconds, more than 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--media-fetch-timeout must be a number of seconds above 0, got {text!r}")
    return value


class ImageFetcher:
    """Fetches image URLs from ``allowed_domains`` (host names, matched exactly, case aside)."""

    def __init__(self, allowed_domains: Sequence[str], timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
                 max_bytes: int = 32 << 20) -> None:
        self.allowed = frozenset(domain.lower().rstrip(".") for domain in allowed_domains)
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self._client: httpx.AsyncClient | None = None

    def _checked(self, url: str, param: str) -> str:
        """``url`` where it is an http(s) URL of an allowed host; else a 400 naming ``param``."""
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").rstrip(".")
        if parts.scheme not in ("http", "https") or not host:
            raise bad_request("an image URL must be an http(s) URL or a data URL (data:image/png;base64,...)",
                              param=param)
        if host not in self.allowed:
            listed = ", ".join(sorted(self.allowed)) or "none"
            raise bad_request(f"images are fetched only from the hosts --allowed-media-domains lists ({listed}), "
                              f"not {host}; or send the image inline as a data URL", param=param)
        return url

    async def fetch(self, url: str, param: str) -> bytes:
        """The bytes at ``url`` (following redirects to allowed hosts); a 400 naming ``param`` where the host is
        not allowed, the fetch fails or takes longer than the timeout, or the body passes ``max_bytes``."""
        if self._client is None:  # one pool of connections, made on the router's event loop at first use
            self._client = httpx.AsyncClient(follow_redirects=False, trust_env=False)
        target = self._checked(url, param)
        try:
            async with asyncio.timeout(self.timeout_s):
                for _ in range(MAX_REDIRECTS + 1):
                    async with self._client.stream("GET", target, timeout=self.timeout_s) as response:
                        if response.is_redirect:
                            location = response.headers.get("location", "")
                            target = self._checked(urllib.parse.urljoin(target, location), param)
                            continue
                        if response.status_code != 200:
                            raise bad_request(f"fetching the image answered HTTP {response.status_code}", param=param)
                        length = response.headers.get("content-length")
                        if length is not None and length.isdigit() and int(length) > self.max_bytes:
                            raise bad_request(f"the image at the URL takes more than {self.max_bytes} bytes",
                                              param=param)
                        body = bytearray()
                        async for chunk in response.aiter_bytes():
                            body += chunk
                            if len(body) > self.max_bytes:
                                raise bad_request(f"the image at the URL takes more than {self.max_bytes} bytes",
                                                  param=param)
                        return bytes(body)
                raise bad_request(f"fetching the image was redirected more than {MAX_REDIRECTS} times", param=param)
        except TimeoutError:
            raise bad_request(f"fetching the image took more than {self.timeout_s:g} s (--media-fetch-timeout)",
                              param=param) from None
        except httpx.HTTPError as exc:
            raise bad_request(f"the image could not be fetched: {type(exc).__name__}", param=param) from None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
