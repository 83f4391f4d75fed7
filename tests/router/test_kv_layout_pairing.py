"""The router hands a request's prefill only to a prefill instance whose KV layout fits the decode it
chose (a fleet part way through a change of ``--kv-cache-dtype``, say): over real ZMQ and Redis, fake
engines publishing their layouts. With none that fits, the decode runs the whole request."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from router.tokenization import PromptProcessor
from tests.router.fake_engine import FakeCluster
from tests.router.router_harness import RouterServer, make_state

REPLY = [5, 6, 7]


def _run(redis_url: str, prompts: PromptProcessor, layouts: dict[str, str], num_requests: int = 6) -> dict[str, Any]:
    """Requests through a router before fake engines with these ``layouts``; which engines took them."""
    namespace = f"fake-{uuid.uuid4().hex[:8]}"
    state = make_state(prompts, redis_url=redis_url, namespace=namespace, routing_policy="round-robin")
    cluster = FakeCluster(redis_url, namespace, REPLY, num_prefill=2, num_decode=1, token_delay_s=0.001)
    for instance_id, layout in layouts.items():
        cluster.engine(instance_id).kv_layout = layout
    with cluster, RouterServer(state) as server:
        server.wait_ready(prefill=2, decode=1)
        prompt = list(range(10, 80))  # longer than a block: sent through a prefill where one fits
        for _ in range(num_requests):
            response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                                  json={"model": "test-model", "prompt": prompt, "max_tokens": 3})
            assert response.status_code == 200, response.text
        return {i: len(cluster.engine(i).requests) for i in ("prefill-0", "prefill-1", "decode-0")}


def test_only_a_prefill_whose_kv_layout_fits_the_decode_gets_the_prefill(redis_url: str, prompts: PromptProcessor) -> None:
    taken = _run(redis_url, prompts, {"prefill-0": "float8_e4m3fn:aa", "prefill-1": "bfloat16:bb",
                                      "decode-0": "float8_e4m3fn:aa"})
    # Round-robin would have split them; the decode gets its KV from prefill-0 (not a request of its own).
    assert taken == {"prefill-0": 6, "prefill-1": 0, "decode-0": 0}


def test_with_no_prefill_that_fits_the_decode_runs_the_request_whole(redis_url: str, prompts: PromptProcessor) -> None:
    taken = _run(redis_url, prompts, {"prefill-0": "bfloat16:bb", "prefill-1": "bfloat16:bb",
                                      "decode-0": "float8_e4m3fn:aa"}, num_requests=3)
    assert taken == {"prefill-0": 0, "prefill-1": 0, "decode-0": 3}


def test_unknown_layouts_fit_anything(redis_url: str, prompts: PromptProcessor) -> None:
    taken = _run(redis_url, prompts, {"prefill-1": "bfloat16:bb"})
    assert taken["prefill-0"] + taken["prefill-1"] == 6 and taken["prefill-0"] > 0 and taken["prefill-1"] > 0


def test_a_decode_that_takes_no_kv_gets_every_request_whole(redis_url: str, prompts: PromptProcessor) -> None:
    """A decode instance that takes no KV (a tensor-parallel engine on GPUs) publishes ``NO_KV_TRANSFER``: no
    prefill's layout fits it, so it runs every request whole."""
    from common.registry import NO_KV_TRANSFER

    taken = _run(redis_url, prompts, {"prefill-0": "bfloat16:bb", "decode-0": NO_KV_TRANSFER}, num_requests=3)
    assert taken == {"prefill-0": 0, "prefill-1": 0, "decode-0": 3}
