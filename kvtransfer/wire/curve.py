"""Optional CURVE authentication and encryption, so only known services can move KV blocks.

Keys are z85 text (40 characters), as ``zmq.curve_keypair()`` makes and ``zmq.auth`` certificate
files hold. A receiver (CURVE server) admits only the client public keys it lists; a sender
(CURVE client) must know the receivers' public key. One server key pair per decode pool is the
intended deployment. ``for_cluster`` builds the simpler one-secret deployment (see
``common.cluster_key``): every service uses the same pair and admits only that public key.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

ENV_PREFIX = "PDSERVE_KV_CURVE_"
ZAP_DOMAIN = "pdserve-kv"


def _z85_key(key: bytes | str, what: str) -> bytes:
    raw = key.encode("ascii") if isinstance(key, str) else bytes(key)
    raw = raw.strip()
    if len(raw) == 32:
        return z85.encode(raw)
    try:
        if len(raw) == 40 and len(z85.decode(raw)) == 32:
            return raw
    except (ValueError, KeyError, IndexError, TypeError):
        pass
    raise ValueError(f"{what} is not a CURVE key (40 z85 characters or 32 raw bytes)")


@dataclass(frozen=True)
class CurveConfig:
    """This service's key pair, the receivers' public key (senders) and the admitted clients (receivers)."""

    public_key: bytes
    secret_key: bytes
    server_public_key: bytes | None = None
    authorized_keys: frozenset[bytes] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "public_key", _z85_key(self.public_key, "public_key"))
        object.__setattr__(self, "secret_key", _z85_key(self.secret_key, "secret_key"))
        if self.server_public_key is not None:
            object.__setattr__(
                self, "server_public_key", _z85_key(self.server_public_key, "server_public_key")
            )
        keys = frozenset(_z85_key(k, "authorized key") for k in self.authorized_keys)
        object.__setattr__(self, "authorized_keys", keys)

    @classmethod
    def for_cluster(cls, secret_key: bytes | str) -> CurveConfig:
        """Every process of a cluster holds one secret: it is client and server, and admits only itself."""
        secret = _z85_key(secret_key, "cluster key")
        public = zmq.curve_public(secret)
        return cls(public, secret, public, frozenset({public}))

    @classmethod
    def from_files(
        cls,
        cert_file: str | os.PathLike[str],
        *,
        server_cert_file: str | os.PathLike[str] | None = None,
        authorized_keys_dir: str | os.PathLike[str] | None = None,
        authorized_keys: Iterable[bytes | str] = (),
    ) -> CurveConfig:
        """Keys from ``zmq.auth`` certificate files; the directory holds clients' public ``*.key`` files."""
        public, secret = zmq.auth.load_certificate(cert_file)
        if secret is None:
            raise ValueError(f"{os.fspath(cert_file)!r} holds no secret key")
        server = zmq.auth.load_certificate(server_cert_file)[0] if server_cert_file else None
        keys = {_z85_key(k, "authorized key") for k in authorized_keys}
        if authorized_keys_dir is not None:
            keys.update(zmq.auth.load_certificates(authorized_keys_dir))
        return cls(public, secret, server, frozenset(keys))

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, prefix: str = ENV_PREFIX
    ) -> CurveConfig | None:
        """Keys from ``{prefix}CERT`` (a secret certificate file) or ``{prefix}PUBLIC_KEY`` and
        ``{prefix}SECRET_KEY``, plus optional ``{prefix}SERVER_KEY`` / ``{prefix}SERVER_CERT``,
        ``{prefix}AUTHORIZED_KEYS`` (comma-separated) / ``{prefix}AUTHORIZED_DIR``; ``None`` if unset."""
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            return env.get(prefix + name) or None

        if get("CERT"):
            public, secret = zmq.auth.load_certificate(get("CERT") or "")
            if secret is None:
                raise ValueError(f"{prefix}CERT holds no secret key")
        elif get("PUBLIC_KEY") and get("SECRET_KEY"):
            public, secret = (get("PUBLIC_KEY") or "").encode(), (get("SECRET_KEY") or "").encode()
        else:
            return None
        server = get("SERVER_KEY")
        server_key = server.encode() if server else None
        if server_key is None and get("SERVER_CERT"):
            server_key = zmq.auth.load_certificate(get("SERVER_CERT") or "")[0]
        keys = {_z85_key(k, "authorized key") for k in (get("AUTHORIZED_KEYS") or "").split(",") if k.strip()}
        if get("AUTHORIZED_DIR"):
            keys.update(zmq.auth.load_certificates(get("AUTHORIZED_DIR") or ""))
        return cls(public, secret, server_key, frozenset(keys))


class _KeyList:
    """ZAP callback: admit exactly the listed client keys."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def start_authenticator(context: zmq.Context, curve: CurveConfig) -> ThreadAuthenticator:
    """Start a ZAP handler on ``context`` admitting ``curve.authorized_keys``; call before bind."""
    if not curve.authorized_keys:
        raise ValueError("a CURVE receiver needs at least one authorized client key")
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_KeyList(curve.authorized_keys))
    return auth


def make_server(sock: zmq.Socket, curve: CurveConfig) -> None:
    """Turn ``sock`` into a CURVE server that asks the ZAP handler about every client."""
    sock.curve_secretkey = curve.secret_key
    sock.curve_publickey = curve.public_key
    sock.zap_domain = ZAP_DOMAIN.encode()
    sock.curve_server = True


def make_client(sock: zmq.Socket, curve: CurveConfig) -> None:
    """Turn ``sock`` into a CURVE client of the receivers' ``server_public_key``."""
    if curve.server_public_key is None:
        raise ValueError("a CURVE sender needs server_public_key")
    sock.curve_secretkey = curve.secret_key
    sock.curve_publickey = curve.public_key
    sock.curve_serverkey = curve.server_public_key
