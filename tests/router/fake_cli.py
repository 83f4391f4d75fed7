"""Stand-in for the service command in launcher tests: fake engines, the real router.

``FAKE_CLI_EXIT=<instance id>`` makes that instance (``router``: the router) exit with code 3 right
after starting. ``FAKE_CLI_EXIT_FILE=<path>`` does the same for every name listed in that file (one
a line) when a run starts, so a test can let a stack come up and then make restarts fail.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from common.cluster_key import ClusterKey
from common.model.loader import model_identity, resolve_model_path
from tests.router.fake_engine import FakeEngine


def _told_to_exit(name: str) -> bool:
    names = {os.environ.get("FAKE_CLI_EXIT")}
    path = os.environ.get("FAKE_CLI_EXIT_FILE")
    if path and os.path.exists(path):
        with open(path) as f:
            names.update(line.strip() for line in f)
    return name in names


def _exit_at_once(name: str) -> int:
    print(f"fake_cli: {name} was told to exit", flush=True)
    return 3


def main(argv: list[str]) -> int:
    role, rest = argv[0], argv[1:]
    if role == "router":
        if _told_to_exit("router"):
            return _exit_at_once("router")
        from router.main import main as router_main

        router_main(rest)
        return 0
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--instance-id", required=True)
    parser.add_argument("--model", default=None)
    args, _ = parser.parse_known_args(rest)
    if _told_to_exit(args.instance_id):
        return _exit_at_once(args.instance_id)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # It says it serves the model it was given, as an engine does: the router leaves out any other model's.
    engine = FakeEngine(
        role, args.instance_id, args.redis_url, "pdserve", [28, 29, 30, 31], peers={}, cluster_key=ClusterKey.load(),
        model_id=model_identity(resolve_model_path(args.model)),
    )
    engine.start()
    stop.wait()
    engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
