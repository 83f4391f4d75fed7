"""ZMQ socket setup shared by both ends, and the wake-up pipe of their I/O threads.

Every socket: LINGER 0 (closing never waits on a dead peer), a maximum inbound message size
(a larger frame drops the connection before it is buffered), bounded queues and ZMTP
heartbeats, so a silent peer is disconnected instead of waited for.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat

import zmq

from kvtransfer.wire.curve import CurveConfig, make_client, make_server

MONITOR_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def heartbeat_ms(timeout_s: float) -> int:
    """ZMTP heartbeat interval: a few beats fit in one transfer timeout."""
    return int(min(max(timeout_s / 4.0, 0.1), 10.0) * 1000)


def _configure(sock: zmq.Socket, *, max_msg_size: int, timeout_s: float, sndhwm: int, rcvhwm: int) -> None:
    beat = heartbeat_ms(timeout_s)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    sock.setsockopt(zmq.SNDHWM, sndhwm)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.HEARTBEAT_IVL, beat)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * beat)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * beat)


def bind_router(
    context: zmq.Context,
    address: str,
    *,
    max_msg_size: int,
    timeout_s: float,
    rcvhwm: int,
    curve: CurveConfig | None,
) -> zmq.Socket:
    """A receiver's ROUTER bound to ``address``; unroutable replies raise instead of vanishing."""
    sock = context.socket(zmq.ROUTER)
    try:
        _configure(sock, max_msg_size=max_msg_size, timeout_s=timeout_s, sndhwm=1000, rcvhwm=rcvhwm)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if curve is not None:
            make_server(sock, curve)
        sock.bind(address)
    except BaseException:
        sock.close(0)
        raise
    return sock


def connect_dealer(
    context: zmq.Context, address: str, *, max_msg_size: int, timeout_s: float, curve: CurveConfig | None
) -> zmq.Socket:
    """A sender's DEALER connected to one receiver; the sender bounds its queue by staging memory."""
    sock = context.socket(zmq.DEALER)
    try:
        _configure(sock, max_msg_size=max_msg_size, timeout_s=timeout_s, sndhwm=10_000, rcvhwm=1000)
        if curve is not None:
            make_client(sock, curve)
        sock.connect(address)
    except BaseException:
        sock.close(0)
        raise
    return sock


def bound_address(sock: zmq.Socket) -> str:
    """The endpoint ``sock`` was bound to, with a tcp port 0 resolved."""
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


class Waker:
    """A self-pipe that makes an I/O thread's ``zmq.Poller`` return; safe from any thread."""

    def __init__(self) -> None:
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)

    def fileno(self) -> int:
        return self._read.fileno()

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # a full pipe already holds a pending wake-up
            self._write.send(b"\0")

    def drain(self) -> None:
        try:
            while self._read.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        self._read.close()
        self._write.close()


def describe_event(event: int) -> str:
    """A reason for a monitor event that ends a connection."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "authentication failed (CURVE key not admitted)"
    if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
        return "connection handshake failed (security settings differ?)"
    return "peer disconnected"


def remove_ipc_file(endpoint: str) -> None:
    """Delete the socket file an ``ipc://`` endpoint left behind (ZMQ keeps it after closing)."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        return
    path = endpoint[len("ipc://") :]
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)
