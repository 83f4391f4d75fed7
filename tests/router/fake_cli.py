"""Stand-in for the service command in launcher tests: fake engines, the real router.

``FAKE_CLI_EXIT=<instance id>`` makes that instance exit with code 3 right after starting.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from tests.router.fake_engine import FakeEngine


def main(argv: list[str]) -> int:
    role, rest = argv[0], argv[1:]
    if role == "router":
        from router.main import main as router_main

        router_main(rest)
        return 0
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--instance-id", required=True)
    args, _ = parser.parse_known_args(rest)
    if os.environ.get("FAKE_CLI_EXIT") == args.instance_id:
        return 3
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    engine = FakeEngine(role, args.instance_id, args.redis_url, "pdserve", [28, 29, 30, 31], peers={})
    engine.start()
    stop.wait()
    engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
