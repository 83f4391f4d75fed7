"""The Responses API's ``background`` mode through the router with the openai client, before fake engines
and a real Redis: a response that runs on after its request and is read back; cancelled through the
router running it and through another one (its engine request aborted); deleted while it runs; and a
router that stops, or a router process SIGKILLed, while it runs (its lease lapses, and a read finds the
response failed); streamed, a client that dropped its stream reads the rest from where it was, through
any router, and the stream of a response cancelled or lost ends as it did."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from router import background_responses
from tests.conftest import free_port
from tests.router.fake_engine import FakeCluster
from tests.router.router_harness import SERVED_MODEL, RouterServer, fake_stack, make_state, wait_until

SLOW_TOKEN_S = 0.05  # a reply of 200 tokens takes 10 s: long enough to act on while it runs


@pytest.fixture
def short_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(background_responses, "LEASE_S", 1.5)
    monkeypatch.setattr(background_responses, "RENEW_S", 0.2)


@pytest.fixture
def stack(redis_url: str, prompts: Any, tokenizer: Any, short_lease: None) -> Iterator[tuple[RouterServer, FakeCluster]]:
    reply = list(tokenizer.encode(" word" * 200, add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": SLOW_TOKEN_S}, request_timeout_s=30.0,
                    response_ttl_s=600) as (server, cluster):
        yield server, cluster


def _client(server: RouterServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20)


def _settles(client: openai.OpenAI, response_id: str, timeout_s: float = 30.0) -> Any:
    """The response once it is no longer running."""
    final: list[Any] = []

    def done() -> bool:
        final[:] = [client.responses.retrieve(response_id)]
        return final[0].status not in ("queued", "in_progress")

    assert wait_until(done, timeout_s), f"{response_id} still {final[0].status}"
    return final[0]


def _aborted(cluster: FakeCluster) -> set[str]:
    """The engine requests aborted (on the prefill and the decode instance alike)."""
    return {rid for ids in cluster.aborts().values() for rid in ids}


def test_a_background_response_returns_at_once_and_is_read_back_when_done(stack: tuple[RouterServer, FakeCluster]) -> None:
    server, cluster = stack
    client = _client(server)
    started = time.monotonic()
    response = client.responses.create(model=SERVED_MODEL, input="Count.", background=True, max_output_tokens=20)
    assert time.monotonic() - started < 20 * SLOW_TOKEN_S, "the request waited for the answer"
    assert response.status == "in_progress" and response.background is True and response.output == []
    done = _settles(client, response.id)
    assert done.status == "incomplete" and done.output_text == " word" * 20  # cut at max_output_tokens
    assert done.background is True and done.usage is not None and done.usage.output_tokens == 20
    assert server.state.num_inflight == 0 and len(server.state.background) == 0  # its seat left with it
    later = client.responses.create(model=SERVED_MODEL, input="Again.", previous_response_id=done.id,
                                    max_output_tokens=2)
    assert later.output_text == " word" * 2  # it continues as any stored response
    # The output text's log-probabilities, asked for, run along: whole, and streamed into its log.
    asked: dict[str, Any] = dict(model=SERVED_MODEL, input="Count.", background=True, max_output_tokens=3,
                                 include=["message.output_text.logprobs"], top_logprobs=1)
    for stream in (False, True):
        response_id = (next(iter(client.responses.create(**asked, stream=True))).response.id if stream  # type: ignore[union-attr]
                       else client.responses.create(**asked).id)
        logprobs = _settles(client, response_id).output[0].content[0].logprobs
        assert [(e.token, e.logprob, len(e.top_logprobs)) for e in logprobs] == [(" word", -0.25, 1)] * 3, stream


def test_cancelling_stops_it_and_aborts_its_engine_request(stack: tuple[RouterServer, FakeCluster]) -> None:
    server, cluster = stack
    client = _client(server)
    response = client.responses.create(model=SERVED_MODEL, input="Long.", background=True, max_output_tokens=200)
    assert wait_until(lambda: cluster.requests(), 10)
    time.sleep(2 * background_responses.LEASE_S)  # its lease renewed meanwhile: still running, not failed
    assert client.responses.retrieve(response.id).status == "in_progress"
    cancelled = client.responses.cancel(response.id)
    assert cancelled.status == "cancelled"
    assert wait_until(lambda: len(_aborted(cluster)) == 1, 10), "the engine request was not aborted"
    assert wait_until(lambda: len(server.state.background) == 0, 10)
    assert client.responses.retrieve(response.id).status == "cancelled"  # not overwritten by the task's end
    assert client.responses.cancel(response.id).status == "cancelled"  # ended: returned as it is
    # Cancelled before its engine request went out (or just as it did): it ends all the same.
    early = client.responses.create(model=SERVED_MODEL, input="Long.", background=True, max_output_tokens=200)
    assert client.responses.cancel(early.id).status == "cancelled"
    assert wait_until(lambda: len(server.state.background) == 0, 10)
    assert client.responses.retrieve(early.id).status == "cancelled" and server.state.num_inflight == 0
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(client.responses.create(model=SERVED_MODEL, input="Hi.", max_output_tokens=2).id)


def test_another_router_cancels_it_and_the_one_running_it_stops(
    stack: tuple[RouterServer, FakeCluster], prompts: Any, redis_url: str,
) -> None:
    server, cluster = stack
    response = _client(server).responses.create(model=SERVED_MODEL, input="Long.", background=True,
                                                max_output_tokens=200)
    other_state = make_state(prompts, redis_url=redis_url, namespace=server.state.config.namespace,
                             request_timeout_s=30.0, response_ttl_s=600)
    with RouterServer(other_state) as other:
        other.wait_ready()
        assert _client(other).responses.cancel(response.id).status == "cancelled"
        # The router running it sees the mark at its next renewal and aborts its engine request.
        assert wait_until(lambda: len(_aborted(cluster)) == 1, 10), "the engine request was not aborted"
        assert wait_until(lambda: len(server.state.background) == 0, 10)
        assert _client(other).responses.retrieve(response.id).status == "cancelled"


def test_deleting_it_while_it_runs_stops_it(stack: tuple[RouterServer, FakeCluster]) -> None:
    server, cluster = stack
    client = _client(server)
    response = client.responses.create(model=SERVED_MODEL, input="Long.", background=True, max_output_tokens=200)
    assert wait_until(lambda: cluster.requests(), 10)  # running on an engine
    client.responses.delete(response.id)
    assert wait_until(lambda: len(_aborted(cluster)) == 1, 10), "the engine request was not aborted"
    assert wait_until(lambda: len(server.state.background) == 0, 10)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)  # and its end did not store it again


def test_a_router_that_stops_while_it_runs_leaves_it_failed_once_its_lease_lapses(
    redis_url: str, prompts: Any, tokenizer: Any, short_lease: None,
) -> None:
    reply = list(tokenizer.encode(" word" * 200, add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": SLOW_TOKEN_S}, request_timeout_s=30.0,
                    response_ttl_s=600) as (server, _):
        namespace = server.state.config.namespace
        other_state = make_state(prompts, redis_url=redis_url, namespace=namespace, request_timeout_s=30.0,
                                 response_ttl_s=600)
        with RouterServer(other_state) as other:
            other.wait_ready()
            with RouterServer(make_state(prompts, redis_url=redis_url, namespace=namespace, request_timeout_s=30.0,
                                         response_ttl_s=600)) as doomed:
                doomed.wait_ready()
                response = _client(doomed).responses.create(model=SERVED_MODEL, input="Long.", background=True,
                                                            max_output_tokens=200)
                assert _client(other).responses.retrieve(response.id).status == "in_progress"  # vouched for
            # That router has stopped: nothing renews the lease; once it lapses the response has failed.
            failed = _settles(_client(other), response.id, timeout_s=15)
            assert failed.status == "failed" and failed.error is not None
            assert "stopped before it finished" in failed.error.message


def _texts(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_streamed_one_resumes_where_its_client_dropped_it_through_any_router(
    stack: tuple[RouterServer, FakeCluster], prompts: Any, redis_url: str,
) -> None:
    """The client reads ten events and drops the connection: the response runs on; the rest, read from
    another router after sequence number 9, joins the first part exactly (numbers without gap, text
    whole), and ends as the stored response does."""
    server, _ = stack
    client = _client(server)
    first = []
    with client.responses.create(model=SERVED_MODEL, input="Count.", background=True, stream=True,
                                 max_output_tokens=60) as stream:
        for event in stream:
            first.append(event)
            if event.sequence_number == 9:
                break  # the connection closes here
    response_id = first[0].response.id
    assert [e.sequence_number for e in first] == list(range(10)) and first[0].type == "response.created"
    assert client.responses.retrieve(response_id).status == "in_progress"  # the drop did not stop it
    other_state = make_state(prompts, redis_url=redis_url, namespace=server.state.config.namespace,
                             request_timeout_s=30.0, response_ttl_s=600)
    with RouterServer(other_state) as other:
        other.wait_ready()
        rest = list(_client(other).responses.retrieve(response_id, stream=True, starting_after=9))
        assert [e.sequence_number for e in rest] == list(range(10, 10 + len(rest)))
        assert rest[-1].type == "response.incomplete" and rest[-1].response.output_text == " word" * 60
        assert _texts(first) + _texts(rest) == " word" * 60
        again = list(_client(other).responses.retrieve(response_id, stream=True))  # the whole log, once ended
        assert [e.model_dump() for e in again] == [e.model_dump() for e in first + rest]
    stored = _settles(client, response_id)
    assert stored.status == "incomplete" and stored.output_text == " word" * 60
    assert server.state.num_inflight == 0 and len(server.state.background) == 0


def test_a_streamed_one_cancelled_or_lost_ends_its_readers_streams(
    redis_url: str, prompts: Any, tokenizer: Any, short_lease: None,
) -> None:
    """Cancelled: a reader's stream ends after the events so far (status cancelled). Its router stopped:
    a reader on another router gets ``response.failed`` once the lease lapsed."""
    reply = list(tokenizer.encode(" word" * 200, add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": SLOW_TOKEN_S}, request_timeout_s=30.0,
                    response_ttl_s=600) as (server, cluster):
        client = _client(server)
        stream = client.responses.create(model=SERVED_MODEL, input="Long.", background=True, stream=True,
                                         max_output_tokens=200)
        events = [next(stream) for _ in range(8)]
        client.responses.cancel(events[0].response.id)
        events += list(stream)
        assert all(e.type not in ("response.completed", "response.incomplete", "response.failed") for e in events)
        assert client.responses.retrieve(events[0].response.id).status == "cancelled"
        assert wait_until(lambda: len(_aborted(cluster)) == 1, 10)

        namespace = server.state.config.namespace
        with RouterServer(make_state(prompts, redis_url=redis_url, namespace=namespace, request_timeout_s=30.0,
                                     response_ttl_s=600)) as doomed:
            doomed.wait_ready()
            lost = _client(doomed).responses.create(model=SERVED_MODEL, input="Long.", background=True, stream=True,
                                                    max_output_tokens=200)
            response_id = next(lost).response.id
            lost.close()
        tail = list(client.responses.retrieve(response_id, stream=True, starting_after=0))
        assert tail[-1].type == "response.failed" and "stopped before it finished" in tail[-1].response.error.message
        assert [e.sequence_number for e in tail] == list(range(1, 1 + len(tail)))


def test_what_background_cannot_do_is_refused_by_name(redis_url: str, prompts: Any, tokenizer: Any) -> None:
    reply = list(tokenizer.encode(" word", add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001}, response_ttl_s=600) as (server, _):
        client = _client(server)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=SERVED_MODEL, input="Hi.", background=True, store=False)
        assert refused.value.body["param"] == "background"  # type: ignore[index]
        plain = client.responses.create(model=SERVED_MODEL, input="Hi.", max_output_tokens=1)
        with pytest.raises(openai.BadRequestError) as refused:  # only a streaming background one is logged
            list(client.responses.retrieve(plain.id, stream=True))
        assert refused.value.body["param"] == "stream"  # type: ignore[index]
    with (fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001}, response_ttl_s=0) as (server, _),
          pytest.raises(openai.BadRequestError, match="--response-ttl")):
        _client(server).responses.create(model=SERVED_MODEL, input="Hi.", background=True)


def test_an_engine_s_error_leaves_it_failed_saying_so(redis_url: str, prompts: Any, tokenizer: Any) -> None:
    reply = list(tokenizer.encode(" word", add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001, "mode": "error"}, response_ttl_s=600,
                    request_timeout_s=10.0) as (server, _):
        client = _client(server)
        response = client.responses.create(model=SERVED_MODEL, input="Hi.", background=True)
        failed = _settles(client, response.id)
        assert failed.status == "failed" and failed.error is not None and "boom" in failed.error.message
        assert server.state.num_inflight == 0


def test_a_router_process_killed_while_it_runs_leaves_it_failed_once_its_lease_lapses(
    redis_url: str, prompts: Any, tokenizer: Any, tokenizer_dir: Path,
) -> None:
    """A real router process, SIGKILLed mid-response: nothing of it says goodbye. Another router reads the
    response ``in_progress`` while its lease holds, then ``failed``."""
    reply = list(tokenizer.encode(" word" * 200, add_special_tokens=False))  # 20 s: it cannot end first
    from common.model.loader import model_identity

    # The fakes say they serve the router process's model: it would leave out instances of another.
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.1, "model_id": model_identity(tokenizer_dir)},
                    request_timeout_s=60.0, response_ttl_s=600) as (server, _):
        port = free_port()
        root = Path(__file__).resolve().parents[2]
        doomed = subprocess.Popen(
            [sys.executable, "-m", "common.cli", "router", "--model", str(tokenizer_dir), "--served-model-name",
             SERVED_MODEL, "--redis-url", redis_url, "--namespace", server.state.config.namespace, "--port", str(port),
             "--response-ttl", "600", "--log-level", "warning"],
            cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            url = f"http://127.0.0.1:{port}"

            def ready() -> bool:
                assert doomed.poll() is None, doomed.stderr.read().decode() if doomed.stderr else ""
                try:
                    body = httpx.get(f"{url}/ready", timeout=2).json()
                except (httpx.HTTPError, ValueError):
                    return False
                return bool(body.get("prefill", 0) >= 1 and body.get("decode", 0) >= 1)

            assert wait_until(ready, 60, interval_s=0.3), "the router process did not come up"
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=20)
            response = client.responses.create(model=SERVED_MODEL, input="Long.", background=True,
                                               max_output_tokens=200)
            other = _client(server)
            assert other.responses.retrieve(response.id).status == "in_progress"
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(10)
            killed_at = time.monotonic()
            failed = _settles(other, response.id, timeout_s=background_responses.LEASE_S + 15)
            assert failed.status == "failed" and failed.error is not None
            assert "stopped before it finished" in failed.error.message
            assert time.monotonic() - killed_at <= background_responses.LEASE_S + 15
        finally:
            if doomed.poll() is None:
                doomed.kill()
                doomed.wait()
