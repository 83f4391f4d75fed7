"""The router when things go wrong: engine errors, silence, overload, Redis down; and API keys."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from common.kvcache.hashing import compute_block_hashes
from common.registry import PrefixIndex
from router.auth import cache_salt_for
from tests.router.fake_engine import MODEL_ID, FakeCluster
from tests.router.router_harness import SERVED_MODEL, RouterServer, fake_stack, make_state, wait_until

PROMPT = "Explain, in a few sentences, why the sky looks blue during the day and red at sunset."
CHAT = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5}


@contextmanager
def running(
    redis_url: str, prompts: Any, cluster_kw: dict[str, Any] | None = None, **config: Any
) -> Iterator[tuple[RouterServer, FakeCluster]]:
    tokens = list(prompts.tokenizer.encode(" one two three four five six", add_special_tokens=False))
    with fake_stack(redis_url, prompts, tokens, cluster_kw, **config) as stack:
        yield stack


def _error(response: httpx.Response) -> dict[str, Any]:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_engine_error_becomes_json_error_and_sse_error_event(redis_url: str, prompts: Any) -> None:
    with running(redis_url, prompts, cluster_kw={"mode": "error"}) as (server, _):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 500 and "boom" in _error(response)["message"]
        streamed = httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10)
        events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]"


def test_lost_transfer_before_any_output_is_sent_again_and_succeeds(redis_url: str, prompts: Any) -> None:
    with running(redis_url, prompts, cluster_kw={"mode": "transfer-fail-once"}) as (server, cluster):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"]
        ids = [r.request_id for r in cluster.requests()]
        assert len(ids) == 2 and ids[1] == ids[0] + ".m1"
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        # A lost transfer reported by the instance: counted as run there (which one is not known).
        assert 'pdserve:request_migrations_total{where="running"} 1.0' in metrics
        assert 'pdserve:request_migrations_total{where="waiting"} 0.0' in metrics


def test_an_overloaded_refusal_is_sent_again_later_and_is_not_a_migration(redis_url: str, prompts: Any) -> None:
    with running(redis_url, prompts, cluster_kw={"mode": "overloaded-once"}) as (server, cluster):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"]
        ids = [r.request_id for r in cluster.requests()]
        assert len(ids) == 2 and ids[1] == ids[0] + ".r1"
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'pdserve:request_migrations_total{where="running"} 0.0' in metrics
        assert 'pdserve:request_migrations_total{where="waiting"} 0.0' in metrics


def test_kv_a_draining_decode_refused_after_the_first_token_is_sent_again_from_there_not_migrated(
    redis_url: str, prompts: Any
) -> None:
    """The prefill streamed the first token, then the decode refused its KV as draining: the
    request goes again with that token as output so far, and the client sees one unbroken answer."""
    with running(redis_url, prompts, cluster_kw={"mode": "kv-busy-once", "num_prefill": 1}) as (server, cluster):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 200, response.text
        content = response.json()["choices"][0]["message"]["content"]
        reference = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=10).json()["choices"][0]
        assert content == reference["message"]["content"] == " one two three four five"
        first, again = [r for r in cluster.requests() if r.decode_target is not None][:2]
        assert again.request_id == first.request_id + ".r1"
        assert again.output_token_ids == cluster.engine("prefill-0").reply_tokens[:1]
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'pdserve:request_migrations_total{where="running"} 0.0' in metrics
        assert 'pdserve:request_migrations_total{where="waiting"} 0.0' in metrics


def test_requests_a_draining_instance_refuses_go_elsewhere_before_the_registry_says_so(
    redis_url: str, prompts: Any
) -> None:
    """A rolling restart's window: the decode drains (refusing new requests, as the engines do, as a
    refusal, not a loss) while the registry still lists it as taking them, for a second. Every
    request is served by the other decode, none is failed for running out of migrations, and the
    refusals are no migrations."""
    from concurrent.futures import ThreadPoolExecutor

    with running(redis_url, prompts, cluster_kw={"num_prefill": 0, "num_decode": 2}) as (server, cluster):
        cluster.engine("decode-0").drain(registry_lag_s=1.0)
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(
                lambda _: httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=30), range(16)))
        assert [r.status_code for r in responses] == [200] * 16, [r.text for r in responses if r.status_code != 200]
        assert cluster.engine("decode-0").num_draining_refusals > 0  # the window was there
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        assert 'pdserve:request_migrations_total{where="running"} 0.0' in metrics


@pytest.mark.parametrize("stream", [False, True])
def test_request_lost_midstream_continues_elsewhere_without_a_lost_or_repeated_token(
    redis_url: str, prompts: Any, stream: bool
) -> None:
    """The decode engine loses the request after three tokens; the router continues it from there
    (prompt + those tokens) and the client gets every canned token exactly once, no error."""
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": stream}
    with running(redis_url, prompts, cluster_kw={"decode_mode": "lose-midstream-once"}) as (server, cluster):
        whole = " one two three four five six"
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=20)
        assert response.status_code == 200, response.text
        if stream:
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
            import json

            text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
        else:
            text = response.json()["choices"][0]["text"]
        assert text == whole
        sent = cluster.requests()
        continued = [r for r in sent if r.request_id.endswith(".m1")]
        assert len(continued) == 1 and len(continued[0].output_token_ids) == 3


def test_one_lost_choice_of_an_n_request_continues_alone_from_its_own_seed(redis_url: str, prompts: Any) -> None:
    """n = 2 goes as one engine request; when choice 1 alone is lost, it continues as an n = 1
    request from its tokens, drawing from its own seed (seed + 1, as the engines' fork seeds it)."""
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 6, "n": 2, "seed": 5, "temperature": 1.0}
    with running(redis_url, prompts, cluster_kw={"decode_mode": "lose-choice-1-midstream-once"}) as (server, cluster):
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=20)
        assert response.status_code == 200, response.text
        texts = {c["index"]: c["text"] for c in response.json()["choices"]}
        assert texts == {0: " one two three four five six", 1: " one two three four five six"}
        sent = cluster.requests()
        [first] = [r for r in sent if r.sampling_params.n == 2]
        assert first.sampling_params.seed == 5 and not first.output_token_ids
        [continued] = [r for r in sent if r.request_id.endswith(".m1")]
        assert continued.request_id == first.request_id + "#1.m1"
        assert (continued.sampling_params.n, continued.sampling_params.seed) == (1, 6)
        # The tokens the router had of choice 1 when its loss came (the engine sent 3 first; on a
        # loaded host the loss can be handled before the router read them).
        assert len(continued.output_token_ids) <= 3


def _continued_after_three_tokens(server: RouterServer, cluster: FakeCluster, within_s: float) -> Any:
    """A 6-token completion whose first attempt stops after 3 tokens: the whole text arrives within
    ``within_s``, and the request continued (``.m1``) from those 3; returns the continued request."""
    body = {"model": SERVED_MODEL, "prompt": PROMPT, "max_tokens": 6}
    started = time.monotonic()
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=within_s + 60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == " one two three four five six"
    assert time.monotonic() - started < within_s
    [continued] = [r for r in cluster.requests() if r.request_id.endswith(".m1")]
    assert len(continued.output_token_ids) == 3
    return continued


def test_a_stalled_engine_that_stays_registered_is_taken_for_dead_and_the_request_continues(
    redis_url: str, prompts: Any
) -> None:
    """No output and no progress for longer than the stall timeout: the router continues the
    request elsewhere although the registry still lists the instance (its heartbeat thread lives)."""
    with running(redis_url, prompts, cluster_kw={"decode_mode": "stall-once"}, engine_stall_timeout_s=1.0) as (
        server, cluster,
    ):
        _continued_after_three_tokens(server, cluster, within_s=20)
        assert wait_until(lambda: any(a.endswith("-0") for a in cluster.aborts().get("decode-0", [])))


def test_an_engine_restarted_under_the_same_id_does_not_strand_its_requests(redis_url: str, prompts: Any) -> None:
    """A decode instance restarts under its id mid-stream (a rolling restart, a supervisor): the new
    process heartbeats under the id, so the id never looks silent or gone, but it does not hold the
    request. The registry entry's ``started_at`` changed: the router continues the request at once,
    long before the stall timeout, from the 3 tokens it streamed, and on the restarted instance
    itself (the only decode one), which it does not take for unavailable."""
    with running(redis_url, prompts, cluster_kw={"decode_mode": "restart-once"}, engine_stall_timeout_s=60.0) as (
        server, cluster,
    ):
        continued = _continued_after_three_tokens(server, cluster, within_s=30)  # not the stall timeout (60 s)
        assert continued.decode_target is not None and continued.decode_target.instance_id == "decode-0"
        assert "decode-0" not in server.state.pool._unavailable_until  # no quarantine for a healthy restart


@pytest.mark.parametrize("announced", [False, True])
def test_losses_where_a_request_only_waited_do_not_use_up_its_migrations(
    redis_url: str, prompts: Any, announced: bool
) -> None:
    """The decode instance restarts under its id as each of the request's first 5 attempts arrives.
    Where it had not said it runs them, they only waited in its queue and cannot have caused the
    restarts: the request goes on past its 3 migrations and succeeds. Where it had
    (``RequestsStarted``, as the real engines send before a request's first step), the fourth loss
    fails the request with a 502 that says so, as a request that crashes every engine would."""
    cluster_kw = {"num_prefill": 0, "announce": announced, "restarts_on_arrival": 5}
    with running(redis_url, prompts, cluster_kw=cluster_kw, engine_stall_timeout_s=60.0) as (server, cluster):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=90)
        attempts = [r.request_id for r in cluster.requests()]
        if announced:
            assert response.status_code == 502, response.text
            assert "lost 4 times on instances running it" in _error(response)["message"]
            assert len(attempts) == 4
        else:
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"].split() == ["one", "two", "three", "four", "five"]
            assert len(attempts) == 6 and attempts[5] == attempts[0] + ".m5"
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
        ran, waited = (3.0, 0.0) if announced else (0.0, 5.0)
        assert f'pdserve:request_migrations_total{{where="running"}} {ran}' in metrics
        assert f'pdserve:request_migrations_total{{where="waiting"}} {waited}' in metrics


def test_silent_engine_times_out_with_504_and_abort(redis_url: str, prompts: Any) -> None:
    with running(redis_url, prompts, cluster_kw={"mode": "silent"}, request_timeout_s=0.5) as (
        server,
        cluster,
    ):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 504
        [sent] = cluster.requests()
        assert wait_until(lambda: all(sent.request_id in a for a in cluster.aborts().values()))


def test_too_many_in_flight_gets_429(redis_url: str, prompts: Any) -> None:
    with running(redis_url, prompts, cluster_kw={"token_delay_s": 0.2}, max_inflight=1) as (server, _):
        body = {**CHAT, "stream": True, "max_tokens": 6}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=10) as first:
            lines = first.iter_lines()  # keep a reference: a dropped iterator closes the connection
            next(lines)
            second = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=10)
            assert second.status_code == 429 and _error(second)["type"] == "rate_limit_error"
            assert second.headers["retry-after"] == "1" and "--max-inflight" in _error(second)["message"]
        assert wait_until(lambda: server.state.num_inflight == 0)


def test_no_instances_gives_503_and_not_ready(redis_url: str, prompts: Any) -> None:
    state = make_state(prompts, redis_url=redis_url, namespace=f"empty-{uuid.uuid4().hex[:8]}")
    with RouterServer(state) as server:
        assert httpx.get(f"{server.url}/ready").status_code == 503
        response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 503 and _error(response)["code"] == "no_instances"


def test_decode_only_cluster_is_ready_and_serves(redis_url: str, prompts: Any) -> None:
    """Without a prefill instance the decode instance prefills too, so the router is ready."""
    with running(redis_url, prompts, cluster_kw={"num_prefill": 0}) as (server, _):
        body = httpx.get(f"{server.url}/ready").json()
        assert body["status"] == "ready" and body["prefill"] == 0 and body["decode"] == 1
        response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 200, response.text


def test_prefill_only_cluster_is_not_ready(redis_url: str, prompts: Any) -> None:
    namespace = f"ponly-{uuid.uuid4().hex[:8]}"
    with FakeCluster(redis_url, namespace, [1, 2], num_decode=0):
        state = make_state(prompts, redis_url=redis_url, namespace=namespace)
        with RouterServer(state) as server:
            assert wait_until(lambda: httpx.get(f"{server.url}/ready").json()["prefill"] == 1, timeout_s=10)
            assert httpx.get(f"{server.url}/ready").status_code == 503


def test_redis_down_keeps_serving_from_last_known_instances(make_redis_server: Any, prompts: Any) -> None:
    redis_server = make_redis_server()
    with running(redis_server.url, prompts) as (server, _):
        redis_server.stop()
        for _ in range(3):
            response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=10)
            assert response.status_code == 200, response.text
        assert httpx.get(f"{server.url}/ready").json()["registry"] == "unreachable"
        make_redis_server(port=redis_server.port)  # empty: instances re-register on their next heartbeat
        assert wait_until(lambda: httpx.get(f"{server.url}/ready").json()["registry"] == "ok", timeout_s=10)
        for _ in range(10):  # no window in which the router forgets every instance
            assert httpx.get(f"{server.url}/ready").status_code == 200
            time.sleep(0.1)


def test_prefix_hit_routes_to_the_instance_holding_the_blocks(redis_url: str, prompts: Any) -> None:
    with running(redis_url, prompts, cluster_kw={"num_prefill": 3}, api_keys=["key-a"]) as (server, cluster):
        token_ids = prompts.chat_prompt([{"role": "user", "content": PROMPT}])
        hashes = compute_block_hashes(token_ids, 16, MODEL_ID, cache_salt_for("key-a"))
        namespace = server.state.config.namespace
        assert PrefixIndex(redis_url, namespace).add("prefill-2", hashes)
        headers = {"Authorization": "Bearer key-a"}
        for _ in range(3):
            response = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers=headers, timeout=10)
            assert response.status_code == 200
        assert len(cluster.engine("prefill-2").requests) == 3
        assert {r.cache_salt for r in cluster.requests()} == {cache_salt_for("key-a")}


@pytest.mark.parametrize("kv_window", [0, 32])
def test_a_windowed_model_s_request_goes_where_its_last_window_is_cached(
    redis_url: str, prompts: Any, kv_window: int,
) -> None:
    """A conversation's next turn, on instances whose model reads 32 keys back (blocks of 16): the one holding the
    blocks its last window needs takes it, though another holds its first block and it does not (given back
    first, taken for others). Without a window only leading blocks count."""
    with running(redis_url, prompts, cluster_kw={"num_prefill": 3, "kv_window": kv_window}) as (server, cluster):
        content = " ".join(["Tell me more about the colour of the sky at dawn and at noon."] * 6)
        body = {**CHAT, "messages": [{"role": "user", "content": content}]}
        hashes = compute_block_hashes(prompts.chat_prompt(body["messages"]), 16, MODEL_ID)
        assert len(hashes) >= 5
        index = PrefixIndex(redis_url, server.state.config.namespace)
        assert index.add("prefill-1", hashes[:1]) and index.add("prefill-2", hashes[-3:])
        for _ in range(3):
            assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=10).status_code == 200
        assert len(cluster.engine("prefill-2" if kv_window else "prefill-1").requests) == 3


def test_api_keys_guard_v1_but_not_health_or_metrics(redis_url: str, prompts: Any) -> None:
    with running(redis_url, prompts, api_keys=["key-a", "key-b"]) as (server, cluster):
        url = f"{server.url}/v1/chat/completions"
        missing = httpx.post(url, json=CHAT)
        wrong = httpx.post(url, json=CHAT, headers={"Authorization": "Bearer nope"})
        for response in (missing, wrong, httpx.get(f"{server.url}/v1/models")):
            assert response.status_code == 401 and _error(response)["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert httpx.get(f"{server.url}/metrics").status_code == 200
        for key in ("key-a", "key-b"):
            ok = httpx.post(url, json=CHAT, headers={"Authorization": f"Bearer {key}"}, timeout=10)
            assert ok.status_code == 200
        salts = [r.cache_salt for r in cluster.requests()]
        assert salts == [cache_salt_for("key-a"), cache_salt_for("key-b")] and salts[0] != salts[1]


@pytest.mark.parametrize("policy", ["least-loaded", "round-robin"])
def test_load_based_policies_spread_equal_instances(redis_url: str, prompts: Any, policy: str) -> None:
    cluster_kw = {"num_prefill": 2, "num_decode": 2}
    with running(redis_url, prompts, cluster_kw=cluster_kw, routing_policy=policy) as (server, cluster):
        for _ in range(4):
            assert httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
        for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
            assert len(cluster.engine(name).requests) + _handoffs(cluster, name) >= 1, name


def _handoffs(cluster: FakeCluster, decode_id: str) -> int:
    return sum(1 for r in cluster.requests() if r.decode_target and r.decode_target.instance_id == decode_id)
