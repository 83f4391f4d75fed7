"""Redis is a hint: with it down requests still succeed, and everything reconnects when it returns."""

from __future__ import annotations

import time

import openai
import pytest

from common.kvcache.hashing import compute_block_hashes
from common.registry import PrefixIndex, Registry
from tests.e2e.stack import Stack
from tests.e2e.test_stack import LONG_PREFIX, MODEL
from tests.engine.conftest import model_path, tokenizer

pytestmark = pytest.mark.timeout(600)

# The index is written off the engine's step loop, and after a Redis restart only once the next
# heartbeat finds the entry gone; on a loaded host either can take a while.
INDEX_DEADLINE_S = 60.0


def _prefix_blocks_held(redis_url: str, instance_id: str) -> int:
    """Leading blocks of ``LONG_PREFIX`` the index says ``instance_id`` holds; -1 while it is unregistered."""
    registry, index = Registry(redis_url), PrefixIndex(redis_url)
    try:
        info = next((i for i in registry.instances("prefill") if i.instance_id == instance_id), None)
        if info is None:
            return -1
        hashes = compute_block_hashes(list(tokenizer()(LONG_PREFIX).input_ids), info.block_size, info.model)
        return index.match([bytes(h) for h in hashes]).get(instance_id, 0)
    finally:
        registry.close()
        index.close()


def _wait_for_prefix_blocks(redis_url: str, instance_id: str, timeout_s: float = INDEX_DEADLINE_S) -> int:
    """Poll until the index lists ``instance_id`` as holding the prefix; what it last said otherwise."""
    deadline = time.monotonic() + timeout_s
    held = _prefix_blocks_held(redis_url, instance_id)
    while held <= 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        held = _prefix_blocks_held(redis_url, instance_id)
    return held


def test_requests_succeed_with_redis_down_and_index_returns_after_restart(make_redis_server):  # type: ignore[no-untyped-def]
    server = make_redis_server()
    s = Stack(redis_url=server.url, model=model_path())
    s.start_engine("prefill", "prefill-r")
    s.start_engine("decode", "decode-r")
    s.start_router()
    try:
        s.wait_ready(1, 1)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        client.completions.create(model=MODEL, prompt=LONG_PREFIX + "First?", max_tokens=4, temperature=0)
        held = _wait_for_prefix_blocks(server.url, "prefill-r")
        assert held > 0, f"the prefill instance did not publish its cached blocks in {INDEX_DEADLINE_S:.0f}s"

        port = server.port
        server.stop()
        for i in range(3):
            out = client.completions.create(model=MODEL, prompt=LONG_PREFIX + f"Down {i}?", max_tokens=4,
                                            temperature=0)
            assert out.choices[0].finish_reason in ("length", "stop")

        restarted = make_redis_server(port)  # empty: the registry and the index must be rebuilt
        held = _wait_for_prefix_blocks(restarted.url, "prefill-r")
        assert held > 0, f"prefill-r did not re-register and republish its blocks in {INDEX_DEADLINE_S:.0f}s"
        out = client.completions.create(model=MODEL, prompt=LONG_PREFIX + "Back?", max_tokens=4, temperature=0)
        assert out.usage.prompt_tokens_details.cached_tokens > 0
    finally:
        s.stop()


# A request's bound while Redis hangs or refuses writes: every Redis call has a 0.5 s socket timeout
# and a back-off after a failure, so nothing waits on Redis for long (generous for a loaded host).
REQUEST_BOUND_S = 60.0
# Longer than the registry TTL (3 s) plus the router's grace for missing instances (3 s).
OUTAGE_S = 10.0


def _serve_for(client: openai.OpenAI, seconds: float, what: str) -> list[float]:
    """Send requests one after another for ``seconds``; each must finish, within the bound."""
    latencies: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end or len(latencies) < 2:
        started = time.monotonic()
        out = client.completions.create(model=MODEL, prompt=LONG_PREFIX + f"{what} {len(latencies)}?",
                                        max_tokens=4, temperature=0)
        latencies.append(time.monotonic() - started)
        assert out.choices[0].finish_reason in ("length", "stop")
        assert latencies[-1] < REQUEST_BOUND_S, f"a request took {latencies[-1]:.1f}s with Redis {what}"
    return latencies


def test_requests_complete_while_redis_hangs_and_while_it_refuses_writes(make_redis_server):  # type: ignore[no-untyped-def]
    import os
    import signal

    import redis as redis_py

    server = make_redis_server()
    s = Stack(redis_url=server.url, model=model_path())
    s.start_engine("prefill", "prefill-h")
    s.start_engine("decode", "decode-h")
    s.start_router()
    try:
        s.wait_ready(1, 1)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        _serve_for(client, 0, "up")

        os.kill(server.proc.pid, signal.SIGSTOP)  # hung: connections open, nothing answers
        try:
            hung = _serve_for(client, OUTAGE_S, "hung")
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)

        admin = redis_py.Redis(host="127.0.0.1", port=server.port, socket_timeout=5)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # every write is refused with OOM from now on
        try:
            with pytest.raises(redis_py.ResponseError, match="maxmemory"):
                admin.set("probe", "x")
            full = _serve_for(client, OUTAGE_S, "full")
        finally:
            admin.config_set("maxmemory", 0)
            admin.close()
        print(f"\nrequests with Redis hung: {len(hung)}, slowest {max(hung):.2f}s; "
              f"at maxmemory: {len(full)}, slowest {max(full):.2f}s")
        for proc in s.procs.values():
            assert proc.popen.poll() is None, f"{proc.name} died:\n{proc.log()}"
    finally:
        s.stop()
