"""The cluster key: one CURVE secret that authenticates every internal plane.

Every process of a deployment holds the same z85 CURVE secret key (40 characters, as
``zmq.curve_keypair()`` makes). With it:
- every binding socket (an engine's control socket, the router's reply socket, a decode
  instance's KV socket) is a CURVE server whose ZAP handler admits only the cluster's public key,
  and every connecting socket is a CURVE client of that key, so nobody without the secret can
  connect, send or read (CURVE also encrypts);
- registry entries carry an HMAC-SHA256 under a key derived from the secret, and readers drop
  the entries that do not verify (``common.registry``).

Where it comes from, first found wins: ``--cluster-key-file``, ``PDSERVE_CLUSTER_KEY`` (the key
itself), ``PDSERVE_CLUSTER_KEY_FILE``. A key file holds the key alone, or is a ``zmq.auth``
secret certificate. Without a key the planes are open: accepted on loopback (one warning), refused
on any other address unless ``--insecure`` says the network is trusted.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
from collections.abc import Mapping

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from common.endpoints import is_loopback_host
from kvtransfer.wire.curve import CurveConfig, make_client, make_server, start_authenticator

logger = logging.getLogger(__name__)

ENV_KEY = "PDSERVE_CLUSTER_KEY"
ENV_KEY_FILE = "PDSERVE_CLUSTER_KEY_FILE"
_REGISTRY_KEY_INFO = b"pdserve registry entry mac v1"

_warned_open = False


class ClusterKey:
    """The shared secret; never printed (its repr shows only the public key)."""

    def __init__(self, secret_key: bytes | str) -> None:
        self.curve = CurveConfig.for_cluster(secret_key)
        raw = z85.decode(self.curve.secret_key)
        # HKDF-SHA256 (RFC 5869), one block: the MAC key is not the CURVE secret itself.
        prk = hmac.new(b"pdserve", raw, hashlib.sha256).digest()
        self._registry_key = hmac.new(prk, _REGISTRY_KEY_INFO + b"\x01", hashlib.sha256).digest()

    @classmethod
    def generate(cls) -> ClusterKey:
        return cls(zmq.curve_keypair()[1])

    @property
    def secret_text(self) -> str:
        """The z85 secret, for handing to a child process's environment."""
        return self.curve.secret_key.decode()

    @property
    def public_key(self) -> bytes:
        return self.curve.public_key

    def __repr__(self) -> str:
        return f"ClusterKey(public={self.public_key.decode()})"

    # ------------------------------------------------------------ registry MACs
    def sign(self, message: bytes) -> str:
        """HMAC-SHA256 of ``message`` under the registry key, as hex."""
        return hmac.new(self._registry_key, message, hashlib.sha256).hexdigest()

    def verify(self, message: bytes, mac: str) -> bool:
        return hmac.compare_digest(self.sign(message), mac)

    # ------------------------------------------------------------ sockets
    def authenticate(self, context: zmq.Context) -> ThreadAuthenticator:
        """Start the ZAP handler of ``context`` (one per context), before any ``serve`` socket binds."""
        return start_authenticator(context, self.curve)

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server admitting only the cluster's key; call before bind."""
        make_server(sock, self.curve)

    def connect_as_client(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the cluster's servers; call before connect."""
        make_client(sock, self.curve)

    # ------------------------------------------------------------ loading
    @classmethod
    def load(cls, key_file: str | None = None, environ: Mapping[str, str] | None = None) -> ClusterKey | None:
        """The key from ``key_file``, else the environment; ``None`` when none is configured.
        A configured key that cannot be read is a ``ValueError`` (never silently no key)."""
        env = os.environ if environ is None else environ
        if key_file:
            return cls(read_key_file(key_file))
        if env.get(ENV_KEY):
            try:
                return cls(env[ENV_KEY])
            except ValueError as exc:
                raise ValueError(f"{ENV_KEY}: {exc}") from None
        if env.get(ENV_KEY_FILE):
            return cls(read_key_file(env[ENV_KEY_FILE]))
        return None


def read_key_file(path: str) -> bytes:
    """The z85 secret in ``path``: the key alone, or a ``zmq.auth`` secret certificate."""
    try:
        with open(path, "rb") as f:
            text = f.read(64 << 10).strip()
    except OSError as exc:
        raise ValueError(f"cannot read the cluster key file {path!r}: {exc.strerror}") from None
    if len(text) != 40:
        try:
            secret = zmq.auth.load_certificate(path)[1]
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path!r} holds neither a 40-character z85 key nor a certificate: {exc}") from None
        if secret is None:
            raise ValueError(f"{path!r} is a public certificate; the cluster key is a secret key")
        text = secret
    try:
        CurveConfig.for_cluster(text)
    except ValueError as exc:
        raise ValueError(f"{path!r}: {exc}") from None
    return text


def add_cluster_key_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cluster-key-file", default=None,
        help=f"file holding the cluster's z85 CURVE secret key (else env {ENV_KEY} or {ENV_KEY_FILE}); "
        "authenticates the control, reply and KV sockets and signs registry entries",
    )
    parser.add_argument(
        "--insecure", action="store_true",
        help="run without a cluster key on a non-loopback address (trusted networks only)",
    )


def cluster_key_from_args(args: argparse.Namespace, bind_host: str, what: str) -> ClusterKey | None:
    """The configured key; exits with a clear message when it is unreadable, or when there is none
    and ``bind_host`` is reachable from other machines without ``--insecure``."""
    global _warned_open
    try:
        key = ClusterKey.load(args.cluster_key_file)
    except ValueError as exc:
        raise SystemExit(f"pdserve {what}: bad cluster key: {exc}") from None
    if key is not None:
        return key
    if not is_loopback_host(bind_host):
        if not args.insecure:
            raise SystemExit(
                f"pdserve {what}: refusing to expose the internal ZeroMQ planes on {bind_host!r} without a "
                f"cluster key: set {ENV_KEY} (or {ENV_KEY_FILE}, or --cluster-key-file) to a z85 CURVE "
                "secret key shared by the router and every engine, or pass --insecure on a trusted network"
            )
        logger.warning(
            "%s: --insecure: internal planes on %s are UNAUTHENTICATED; anyone who reaches them can "
            "submit, abort or read requests", what, bind_host,
        )
    elif not _warned_open:
        _warned_open = True
        logger.warning(
            "%s: no cluster key (%s): internal planes are unauthenticated, acceptable on loopback only",
            what, ENV_KEY,
        )
    return None
