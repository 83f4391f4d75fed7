"""Which ZMQ endpoints a message may name, and which hosts are loopback.

An engine connects to addresses it reads from messages (``reply_to``, a decode target's
``kv_address``) and from the registry; a bad one must fail that request, never make the engine
connect somewhere odd. Only ``tcp://HOST:PORT`` (a name, an IPv4 address or a bracketed IPv6
address, no wildcard) and ``ipc://PATH`` pass; ``inproc://``, multicast and anything else do not.
"""

from __future__ import annotations

import ipaddress
import re

MAX_ENDPOINT_CHARS = 512
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")
_WILDCARDS = {"*", "0.0.0.0", "::"}
_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


def _host_ok(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            return not ipaddress.IPv6Address(host[1:-1]).is_unspecified
        except ValueError:
            return False
    if host in _WILDCARDS:
        return False
    return bool(_HOSTNAME.match(host))


def check_endpoint(address: object, what: str) -> str:
    """``address`` if a connect may use it; else ``ValueError`` naming ``what`` and the rule broken."""
    if not isinstance(address, str) or not address:
        raise ValueError(f"{what} is empty")
    if len(address) > MAX_ENDPOINT_CHARS or any(c.isspace() or c == "\0" for c in address):
        raise ValueError(f"{what} {address[:80]!r} is too long or holds spaces or NUL")
    if address.startswith("ipc://"):
        if len(address) == len("ipc://"):
            raise ValueError(f"{what} {address!r} names no socket path")
        return address
    if not address.startswith("tcp://"):
        raise ValueError(f"{what} {address[:80]!r} must be tcp:// or ipc:// (tcp://HOST:PORT, ipc://PATH)")
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{what} {address!r} needs a port between 1 and 65535")
    if not _host_ok(host):
        raise ValueError(f"{what} {address!r} has no valid host to connect to (wildcards are not hosts)")
    return address


def is_loopback_host(host: str) -> bool:
    """True for names and addresses that only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    name = host.strip().strip("[]").lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
