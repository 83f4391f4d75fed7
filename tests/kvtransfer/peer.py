"""A separate process for the transfer tests: plays sender, receiver or a raw ZMQ peer on command.

Reads one JSON command per line on stdin, answers one JSON line on stdout, and between commands
polls its senders and receivers like an engine loop. Run as ``python -m tests.kvtransfer.peer``.
"""

from __future__ import annotations

import json
import logging
import os
import select
import sys
from typing import Any

import zmq

from kvtransfer import CurveConfig, KVLayout, KVReceiver, KVSender, TransferResult
from tests.kvtransfer.block_pool import BlockPool
from tests.kvtransfer.kv_data import digest, make_kv_cache


def _curve(spec: dict[str, Any] | None) -> CurveConfig | None:
    if not spec:
        return None
    return CurveConfig(
        spec["public"].encode(),
        spec["secret"].encode(),
        spec["server"].encode() if spec.get("server") else None,
        frozenset(k.encode() for k in spec.get("authorized", [])),
    )


def _result(r: TransferResult) -> dict[str, Any]:
    return {
        "request_id": r.request_id,
        "ok": r.ok,
        "reason": r.reason,
        "block_ids": r.block_ids,
        "num_cached_blocks": r.num_cached_blocks,
        "bytes_sent": r.bytes_sent,
        "bytes_received": r.bytes_received,
        "meta": r.meta.hex(),
        "receiver_busy": r.receiver_busy,
    }


class Peer:
    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.caches: dict[str, Any] = {}
        self.pools: dict[str, BlockPool] = {}
        self.results: dict[str, list[dict[str, Any]]] = {}
        self.sending: dict[str, set[str]] = {}
        self.context = zmq.Context()

    def poll(self) -> None:
        for name, obj in list(self.objects.items()):
            if isinstance(obj, KVReceiver | KVSender):
                for r in obj.poll():
                    self.results[name].append(_result(r))
                    self.sending.get(name, set()).discard(r.request_id)
                    if isinstance(obj, KVReceiver) and r.ok:
                        self.pools[name].finish(r.request_id, r.block_hashes)

    def handle(self, cmd: dict[str, Any]) -> Any:
        op, name = cmd["op"], cmd.get("name", "")
        if op == "receiver":
            kv = self.caches[name] = make_kv_cache(cmd["cache"])
            pool = self.pools[name] = BlockPool(kv.shape[2], kv.shape[3])
            pool.num_reserved = cmd.get("reserved", 0)
            layout = KVLayout.from_kv_cache(kv, cmd.get("model_id", "m"))
            rx = KVReceiver(
                cmd["address"],
                kv,
                layout,
                pool,
                timeout_s=cmd.get("timeout_s", 2.0),
                defer_timeout_s=cmd.get("defer_timeout_s", 2.0),
                curve=_curve(cmd.get("curve")),
            )
            self.objects[name], self.results[name] = rx, []
            return {"address": rx.address}
        if op == "sender":
            kv = self.caches[name] = make_kv_cache(cmd["cache"])
            layout = KVLayout.from_kv_cache(kv, cmd.get("model_id", "m"))
            if cmd.get("hash_scheme"):
                layout = KVLayout(
                    **{
                        **{f: getattr(layout, f) for f in layout.__struct_fields__},
                        "hash_scheme": cmd["hash_scheme"],
                    }
                )
            self.objects[name] = KVSender(
                kv,
                layout,
                timeout_s=cmd.get("timeout_s", 2.0),
                curve=_curve(cmd.get("curve")),
                layers_per_frame=cmd.get("layers_per_frame", 0),
            )
            self.results[name], self.sending[name] = [], set()
            return {}
        if op == "send":
            hashes = [bytes.fromhex(h) for h in cmd.get("hashes", [])]
            self.objects[name].send(
                cmd["request_id"],
                cmd["peer"],
                cmd["block_ids"],
                hashes,
                cmd["num_tokens"],
                bytes.fromhex(cmd.get("meta", "")),
            )
            self.sending[name].add(cmd["request_id"])
            return {}
        if op == "results":
            out, self.results[name] = self.results[name], []
            return out
        if op == "state":
            return int(self.objects[name].state(cmd["request_id"]))
        if op == "pool":
            if name in self.pools:
                pool = self.pools[name]
                return {"clean": pool.is_clean(), "held": sorted(pool.held), "free": len(pool.free)}
            return {"clean": not self.sending[name], "held": sorted(self.sending[name])}
        if op == "digest":
            return digest(self.caches[name], cmd["block_ids"])
        if op == "raw_dealer":
            sock = self.context.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(cmd["address"])
            self.objects[name] = sock
            return {}
        if op == "raw_router":
            sock = self.context.socket(zmq.ROUTER)
            sock.linger = 0
            sock.bind(cmd["address"])
            self.objects[name] = sock
            return {"address": sock.getsockopt_string(zmq.LAST_ENDPOINT)}
        if op == "raw_send":  # frames: hex strings, or {"size": n} for n random bytes
            frames = [
                bytes.fromhex(f) if isinstance(f, str) else os.urandom(f["size"]) for f in cmd["frames"]
            ]
            self.objects[name].send_multipart(frames)
            return {}
        if op == "raw_recv":  # one message: its frames in hex, or None after the timeout
            sock = self.objects[name]
            if not sock.poll(int(cmd.get("wait_s", 2.0) * 1000)):
                return None
            return [f.hex() for f in sock.recv_multipart()]
        if op == "close":
            obj = self.objects.pop(name)
            obj.close()
            return {}
        raise ValueError(f"unknown op {op!r}")


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    peer = Peer()
    print(json.dumps({"ready": True}), flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.002)
        if ready:
            line = sys.stdin.readline()
            if not line:
                return
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                return
            try:
                reply = {"ok": True, "value": peer.handle(cmd)}
            except Exception as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(reply), flush=True)
        peer.poll()


if __name__ == "__main__":
    main()
