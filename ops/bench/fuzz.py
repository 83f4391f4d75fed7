"""``pdserve bench fuzz``: hostile messages on every ZMQ socket of a live stack; crashes counted.

Starts ``pdserve up --prefill 1 --decode 1`` on its own Redis (or uses ``--redis-url`` of a running
stack), then sends Hypothesis-generated hostile messages (``ops.bench.fuzz_messages``) to each
engine's control socket and each decode instance's KV socket, and pickles, garbage and oversized
frames to all of them. Afterwards it checks that every process is the one it started with (none
died or was restarted), that nothing was unpickled, and that the stack still serves a request.
Prints messages sent per socket and the number of crashes; exits non-zero on any crash.
Needs the test extras (Hypothesis).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import zmq

from common.cluster_key import ENV_KEY, ClusterKey
from common.registry import Registry
from ops.bench.chaos_stack import UpStack
from ops.bench.environ import LogFolder
from ops.bench.fuzz_messages import FuzzStats, abort_all, fuzz_control, fuzz_kv, pickle_marker
from ops.launcher import die_with_parent, free_port


def _start_redis() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: install Redis or pass --redis-url")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
    return proc, f"redis://127.0.0.1:{port}/0"


def _pids(log_dir: Path) -> dict[str, Any]:
    path = log_dir / "children.json"
    return json.loads(path.read_text()) if path.exists() else {}


def run(args: argparse.Namespace, redis_url: str, stack: UpStack | None) -> dict[str, Any]:
    # With the cluster key (the environment's, as the engines have it) the fuzzer is an insider:
    # its messages pass CURVE and reach the engines' message handling, which is what is tested.
    key = ClusterKey.load(args.cluster_key_file)
    infos = Registry(redis_url, cluster_key=key).instances()
    if not infos:
        raise SystemExit(f"no instance registered in {redis_url}")
    before = _pids(stack.log_dir) if stack is not None else {}
    ctx = zmq.Context()
    zap = key.authenticate(ctx) if key is not None else None
    prepare = key.connect_as_client if key is not None else None
    pull = ctx.socket(zmq.PULL)  # where the fuzzed requests' answers go (and are dropped)
    pull.setsockopt(zmq.LINGER, 0)
    if key is not None:
        key.serve(pull)
    reply_to = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    stats = FuzzStats()
    kv_addresses = [i.kv_address for i in infos if i.role == "decode" and i.kv_address]
    started = time.monotonic()
    try:
        with pickle_marker() as marker:
            for info in infos:
                fuzz_control(ctx, info.control_address, reply_to, kv_addresses, stats, max_examples=args.examples,
                             name=f"{info.instance_id} control", marker=marker, seed=args.seed, prepare=prepare)
                while pull.poll(0):
                    pull.recv()
                if info.role == "decode" and info.kv_address:
                    fuzz_kv(ctx, info.kv_address, reply_to, stats, max_examples=args.examples,
                            name=f"{info.instance_id} kv", marker=marker, seed=args.seed, prepare=prepare)
            for info in infos:
                abort_all(ctx, info.control_address, stats.request_ids, prepare)
            unpickled = Path(marker).exists()
    finally:
        pull.close(0)
        if zap is not None:
            zap.stop()
        ctx.destroy(linger=0)
    elapsed = time.monotonic() - started
    after = _pids(stack.log_dir) if stack is not None else {}
    restarted = sorted(name for name, child in after.items()
                       if name in before and (child.get("pid") != before[name].get("pid")
                                              or child.get("restarts", 0) > before[name].get("restarts", 0)))
    left = {i.instance_id for i in Registry(redis_url, cluster_key=key).instances()}
    missing = sorted({i.instance_id for i in infos} - left)
    served = None
    if stack is not None:
        reply = httpx.post(stack.url + "/v1/completions", timeout=300,
                           json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        served = reply.status_code
    return {"messages_per_socket": dict(stats.sent), "seconds": round(elapsed, 1),
            "crashes": len(set(restarted) | set(missing)), "restarted": restarted, "missing_from_registry": missing,
            "unpickled": unpickled, "request_after_fuzz_status": served}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench fuzz", description=__doc__.split("\n")[0])
    p.add_argument("--examples", type=int, default=500, help="hostile messages per socket (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help="derandomize the generation")
    p.add_argument("--redis-url", default=None, help="fuzz the engines of a running stack instead of starting one")
    p.add_argument("--model", default=None, help="model of the stack it starts (default model if unset)")
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--cluster-key-file", default=None,
                   help=f"the running stack's cluster key (else env {ENV_KEY}); a started stack gets a fresh one")
    args = p.parse_args(argv)
    if not args.redis_url and ClusterKey.load(args.cluster_key_file) is None:
        os.environ[ENV_KEY] = ClusterKey.generate().secret_text  # ``pdserve up`` hands it to its children
    if args.redis_url:
        result = run(args, args.redis_url, None)
    else:
        from common.model.loader import resolve_model_path

        redis, redis_url = _start_redis()
        logs, ok = LogFolder("pdserve-fuzz-"), False
        try:
            time.sleep(0.5)
            with UpStack(1, 1, str(resolve_model_path(args.model)), logs.path, ["--redis-url", redis_url]) as stack:
                result = run(args, redis_url, stack)
            ok = _passed(result)
        finally:
            redis.kill()
            redis.wait()
            logs.close(ok)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if _passed(result) else 1


def _passed(result: dict[str, Any]) -> bool:
    return not result["crashes"] and not result["unpickled"] and result["request_after_fuzz_status"] in (None, 200)


if __name__ == "__main__":
    sys.exit(main())
