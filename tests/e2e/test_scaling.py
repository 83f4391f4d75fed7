"""Two prefill and two decode instances: prefix-aware routing, decode load spread, replacement.

Runs on its own redis-server so no instance of another test joins the pools.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest

from tests.conftest import RedisServer
from tests.e2e.stack import Stack
from tests.e2e.test_stack import LONG_PREFIX, MODEL
from tests.engine.conftest import model_path, tokenizer

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def private_redis_url():  # type: ignore[no-untyped-def]
    server = RedisServer()
    try:
        yield server.url
    finally:
        server.stop()


def test_two_by_two_prefix_routing_load_spread_and_decode_replacement(private_redis_url):  # type: ignore[no-untyped-def]
    from common.kvcache.hashing import compute_block_hashes
    from common.registry import PrefixIndex, Registry

    s = Stack(redis_url=private_redis_url, model=model_path())
    # A separate namespace of instances: reuse the same Redis, different ids.
    for name in ("prefill-x", "prefill-y"):
        s.start_engine("prefill", name)
    for name in ("decode-x", "decode-y"):
        s.start_engine("decode", name)
    s.start_router()
    try:
        s.wait_ready(2, 2)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        first = client.completions.create(model=MODEL, prompt=LONG_PREFIX + "Question 0?", max_tokens=4,
                                          temperature=0)
        assert first.choices[0].text is not None
        time.sleep(1.5)  # the prefix index is written off the step loop
        hits_before = {n: s.metrics(n).get("pdserve:prefix_cache_hits_total", 0.0) for n in ("prefill-x", "prefill-y")}
        for i in range(1, 5):
            client.completions.create(model=MODEL, prompt=LONG_PREFIX + f"Question {i}?", max_tokens=4,
                                      temperature=0)
        hits = {n: s.metrics(n).get("pdserve:prefix_cache_hits_total", 0.0) - hits_before[n] for n in hits_before}
        holder = max(hits, key=hits.get)  # type: ignore[arg-type]
        assert hits[holder] >= 4 * 64, f"repeated prefix was not routed to the instance caching it: {hits}"
        # Redis names that instance as holding the prefix's blocks.
        info = next(i for i in Registry(private_redis_url).instances("prefill") if i.instance_id == holder)
        ids = list(tokenizer()(LONG_PREFIX).input_ids)
        hashes = compute_block_hashes(ids, info.block_size, info.model)
        assert PrefixIndex(private_redis_url).match([bytes(h) for h in hashes]).get(holder, 0) >= len(hashes) - 1

        # Decode load spreads over both decode instances.
        gen_before = {n: s.metrics(n).get("pdserve:generation_tokens_total", 0.0) for n in ("decode-x", "decode-y")}
        threads = [
            threading.Thread(target=client.completions.create, kwargs={
                "model": MODEL, "prompt": f"Tell me about the number {i}.", "max_tokens": 16, "temperature": 0})
            for i in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        gen = {n: s.metrics(n).get("pdserve:generation_tokens_total", 0.0) - gen_before[n] for n in gen_before}
        assert all(v > 0 for v in gen.values()), f"decode load did not spread: {gen}"

        # Kill one decode instance and start a new one while traffic runs: new requests succeed.
        failures: list[str] = []
        stop = threading.Event()

        def traffic() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                started = time.monotonic()
                try:
                    client.completions.create(model=MODEL, prompt=f"Short fact {i}:", max_tokens=6, temperature=0)
                except openai.APIError as exc:
                    failures.append(f"{started:.1f} {exc}")

        worker = threading.Thread(target=traffic)
        worker.start()
        time.sleep(1.0)
        s.procs["decode-x"].stop(kill=True)
        s.start_engine("decode", "decode-z")
        time.sleep(6.0)  # the dead instance's registry entry expires; the new one registers
        killed_at = time.monotonic()
        time.sleep(6.0)
        stop.set()
        worker.join(timeout=120)
        late = [f for f in failures if float(f.split()[0]) > killed_at]
        assert not late, f"requests started after the replacement joined failed: {late}"
        ok = client.completions.create(model=MODEL, prompt="Final check:", max_tokens=4, temperature=0)
        assert ok.choices[0].finish_reason in ("length", "stop")
        assert s.metrics("decode-z").get("pdserve:generation_tokens_total", 0.0) >= 0
    finally:
        s.stop()
