"""Two prefill and two decode instances: prefix-aware routing, decode load spread, replacement.

Runs on its own redis-server so no instance of another test joins the pools.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.e2e.stack import Stack
from tests.e2e.test_stack import LONG_PREFIX, MODEL
from tests.engine.conftest import model_path, tokenizer
from tests.router.router_harness import wait_until

pytestmark = pytest.mark.timeout(600)

# Deadlines for what a loaded host may make slow (an index write, an engine start, a TTL expiry);
# every wait polls its condition and ends as soon as it holds.
DEADLINE_S = 120.0


def _generated_tokens(s: Stack, name: str) -> float:
    """Tokens ``name`` reports having generated; 0 while its metrics server is not up yet."""
    try:
        return s.metrics(name).get("pdserve:generation_tokens_total", 0.0)
    except httpx.HTTPError:
        return 0.0


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
        registry, index = Registry(private_redis_url), PrefixIndex(private_redis_url)
        some_prefill = registry.instances("prefill")[0]
        ids = list(tokenizer()(LONG_PREFIX).input_ids)
        hashes = [bytes(h) for h in compute_block_hashes(ids, some_prefill.block_size, some_prefill.model)]
        # The prompt's text after the prefix may re-tokenize the prefix's last block, hence len - 1.
        num_prefix_blocks = len(hashes) - 1
        first = client.completions.create(model=MODEL, prompt=LONG_PREFIX + "Question 0?", max_tokens=4,
                                          temperature=0)
        assert first.choices[0].text, "the first completion is empty"
        assert first.choices[0].finish_reason in ("length", "stop")
        # The prefix index is written off the step loop: wait until it names the prefix's holder.
        def prefix_indexed() -> bool:
            return max(index.match(hashes).values(), default=0) >= num_prefix_blocks

        indexed = wait_until(prefix_indexed, DEADLINE_S, 0.2)
        assert indexed, f"no prefill instance was indexed as holding the prefix: {index.match(hashes)}"
        hits_before = {n: s.metrics(n).get("pdserve:prefix_cache_hits_total", 0.0) for n in ("prefill-x", "prefill-y")}
        for i in range(1, 5):
            client.completions.create(model=MODEL, prompt=LONG_PREFIX + f"Question {i}?", max_tokens=4,
                                      temperature=0)
        hits: dict[str, float] = {}

        def routed_to_holder() -> bool:  # an engine publishes its counters twice a second: they may trail
            hits.update({n: s.metrics(n).get("pdserve:prefix_cache_hits_total", 0.0) - hits_before[n] for n in hits_before})
            return max(hits.values()) >= 4 * 64

        assert wait_until(routed_to_holder, DEADLINE_S, 0.2), f"repeated prefix was not routed to the instance caching it: {hits}"
        holder = max(hits, key=hits.get)  # type: ignore[arg-type]
        # Redis names that instance as holding the prefix's blocks.
        assert index.match(hashes).get(holder, 0) >= num_prefix_blocks

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
        gen: dict[str, float] = {}

        def spread() -> bool:
            gen.update({n: s.metrics(n).get("pdserve:generation_tokens_total", 0.0) - gen_before[n] for n in gen_before})
            return all(v > 0 for v in gen.values())

        assert wait_until(spread, DEADLINE_S, 0.2), f"decode load did not spread: {gen}"

        # Kill one decode instance and start a new one while traffic runs: once the registry lists
        # the replacement and no longer the dead one, every request succeeds, and the replacement serves.
        outcomes: list[tuple[float, str | None]] = []  # (start time, error or None), in start order
        stop = threading.Event()

        def traffic() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                started = time.monotonic()
                try:
                    out = client.completions.create(model=MODEL, prompt=f"Short fact {i}:", max_tokens=6,
                                                    temperature=0)
                    finish = out.choices[0].finish_reason
                    error = None if finish in ("length", "stop") and out.choices[0].text else f"got {out}"
                except openai.APIError as exc:
                    error = repr(exc)
                outcomes.append((started, error))

        def decode_ids() -> set[str]:
            return {i.instance_id for i in registry.instances("decode")}

        worker = threading.Thread(target=traffic)
        worker.start()
        try:
            assert wait_until(lambda: outcomes, DEADLINE_S, 0.1), "no request finished before the kill"
            s.procs["decode-x"].stop(kill=True)
            killed_at = time.monotonic()
            s.start_engine("decode", "decode-z")
            replaced = wait_until(lambda: decode_ids() == {"decode-y", "decode-z"}, DEADLINE_S, 0.2)
            waited = time.monotonic() - killed_at
            assert replaced, f"the registry lists {sorted(decode_ids())} {waited:.0f}s after the kill"
            settled_at = time.monotonic()
            # Traffic runs on until the replacement has generated tokens (it joined and serves) and a
            # request started after the registry settled has finished.
            assert wait_until(lambda: _generated_tokens(s, "decode-z") > 0, DEADLINE_S, 0.5), (
                "the replacement decode-z generated no tokens"
            )
            assert wait_until(lambda: any(t >= settled_at for t, _ in outcomes), DEADLINE_S, 0.1), (
                "no request started after the registry settled finished"
            )
        finally:
            stop.set()
            worker.join(timeout=DEADLINE_S)
        assert not worker.is_alive(), "a request hung"
        after = [(started, error) for started, error in outcomes if started >= settled_at]
        assert after, "no request started after the replacement was registered and the dead one deregistered"
        failed = [f"started {t - killed_at:.1f}s after the kill: {error}" for t, error in after if error]
        settled = settled_at - killed_at
        assert not failed, f"requests started {settled:.1f}s+ after the kill (registry settled) failed: {failed}"
        ok = client.completions.create(model=MODEL, prompt="Final check:", max_tokens=4, temperature=0)
        assert ok.choices[0].finish_reason in ("length", "stop") and ok.choices[0].text
    finally:
        s.stop()
