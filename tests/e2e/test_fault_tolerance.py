"""No request dies with a process: real engines killed, stopped and restarted under the openai client.

One prefill and two decode processes (one of them with async scheduling, the other with n-gram
drafts; all three serving a LoRA adapter), a real Redis and the real model. Each test breaks a process while it holds a request, then checks that the client saw one
unbroken output equal to the uninterrupted run (greedy), and that every live engine is back to 0
blocks in use with its idle pool check clean. The uninterrupted reference runs after the fault, on the repaired stack, so a
prefix-cache hit cannot hide the work the fault case had to redo.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import RedisServer
from tests.e2e.stack import Stack
from tests.engine.conftest import model_path
from tests.engine.tiny_models import peft_adapter

pytestmark = pytest.mark.timeout(900)

MODEL = "SmolLM2-135M-Instruct"
ROLES = {"prefill-f": "prefill", "decode-f1": "decode", "decode-f2": "decode"}
DECODES = ("decode-f1", "decode-f2")
# Long enough to see the stall path by the registry (about 6 s) before the stall timeout.
ROUTER_FLAGS = ["--engine-stall-timeout", "15"]
ENGINE_FLAGS = ["--router-lease-timeout", "6"]
# Every process serves the LoRA adapter "sql" (``--lora-modules``, its folder set by the stack fixture): a
# request with it must keep it wherever it moves.
LORA_MODULES: list[str] = []
# One decode schedules each step while the one before is in flight, the other synchronously, checking
# n-gram drafts (several tokens a step): a request moved between them must still give the uninterrupted
# output.
ASYNC_ENGINES = {"decode-f1"}
DRAFTING_ENGINES = {"decode-f2": ["--speculative-config", json.dumps(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
)]}


def engine_flags(name: str) -> list[str]:
    return [*ENGINE_FLAGS, *(["--async-scheduling"] if name in ASYNC_ENGINES else []), *DRAFTING_ENGINES.get(name, []),
            "--enable-lora", "--lora-modules", *LORA_MODULES]


def router_flags() -> list[str]:
    return [*ROUTER_FLAGS, "--lora-modules", *LORA_MODULES]


def wait_until(cond: Callable[[], Any], timeout_s: float = 120.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    adapter = peft_adapter(Path(model_path()), tmp_path_factory.mktemp("lora") / "sql", r=8, lora_alpha=16, scale=2.0,
                           target_modules=["v_proj", "o_proj", "up_proj", "down_proj"])
    LORA_MODULES[:] = [f"sql={adapter}"]
    redis = RedisServer()
    s = Stack(redis_url=redis.url, model=model_path())
    for name, role in ROLES.items():
        s.start_engine(role, name, engine_flags(name))
    s.start_router(router_flags())
    try:
        s.wait_ready(1, 2, timeout_s=300)
        yield s
    finally:
        s.stop()
        redis.stop()


@pytest.fixture
def client(stack):  # type: ignore[no-untyped-def]
    """The client, and afterwards: the stack repaired, every pool idle at 0 blocks and sound."""
    yield openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    repair(stack)
    assert_pools_clean(stack)


def repair(s: Stack) -> None:
    """Restart whatever a test killed or stopped, and wait until all of it serves again."""
    for name, proc in list(s.procs.items()):
        if proc.popen.poll() is None:
            os.kill(proc.popen.pid, signal.SIGCONT)
        elif name == "router":
            s.start_router(router_flags())
        else:
            s.start_engine(ROLES[name], name, engine_flags(name))
    s.wait_ready(1, 2, timeout_s=300)


def kill(proc: Any) -> None:
    """SIGKILL and reap, so ``repair`` sees the process as dead."""
    proc.popen.kill()
    proc.popen.wait(30)


def registry_view(s: Stack) -> dict[str, Any]:
    from common.registry import Registry

    return {i.instance_id: i for i in Registry(s.redis_url).instances()}


def assert_pools_clean(s: Stack) -> None:
    """Every live engine: 0 blocks in use once idle (from its registry entry) and no failed check."""
    def idle() -> bool:
        view = registry_view(s)
        return set(view) == set(ROLES) and all(i.num_blocks_in_use == 0 for i in view.values())

    try:
        wait_until(idle, 60, "every pool to return to 0 blocks in use")
    except AssertionError:
        raise AssertionError({n: i.num_blocks_in_use for n, i in registry_view(s).items()}) from None
    for name in ROLES:
        assert s.metrics(name).get("pdserve:kv_integrity_errors_total", 0.0) == 0.0, s.procs[name].log()


def running_on(s: Stack, names: tuple[str, ...]) -> str | None:
    """The first of ``names`` with a request in its running batch (from its /metrics)."""
    for name in names:
        if s.procs[name].popen.poll() is None and s.metrics(name).get("pdserve:num_requests_running", 0) > 0:
            return name
    return None


def chat_kwargs(content: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0, "extra_body": {"ignore_eos": True},
    }


def stream_text(client: openai.OpenAI, kwargs: dict[str, Any], on_chunk: Callable[[int], None]) -> str:
    """The streamed text; ``on_chunk(number of content chunks so far)`` runs after each one."""
    text, num_chunks = "", 0
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            num_chunks += 1
            on_chunk(num_chunks)
    return text


def reference(client: openai.OpenAI, kwargs: dict[str, Any]) -> str:
    text = client.chat.completions.create(**kwargs).choices[0].message.content
    assert text
    return text


def stream_killing_its_decode(stack: Stack, client: openai.OpenAI, kwargs: dict[str, Any]) -> str:
    """The streamed text of a request whose decode is killed after its fourth chunk; the stack repaired."""
    killed: list[str] = []

    def kill_holder(num_chunks: int) -> None:
        if num_chunks == 4 and not killed:
            victim = wait_until(lambda: running_on(stack, DECODES), 30, "a decode holding the stream")
            kill(stack.procs[victim])
            killed.append(victim)

    text = stream_text(client, kwargs, kill_holder)
    assert killed, "the stream ended before a decode was killed"
    repair(stack)
    return text


def test_decode_killed_mid_stream_continues_elsewhere(stack, client):  # type: ignore[no-untyped-def]
    kwargs = chat_kwargs("Tell me a long story about a lighthouse keeper.", 40)
    assert stream_killing_its_decode(stack, client, kwargs) == reference(client, kwargs)


def test_decode_killed_mid_stream_with_a_lora_adapter_continues_with_it(stack, client):  # type: ignore[no-untyped-def]
    """The request names the adapter: it moves to the other decode with it (the migration carries its
    name and only instances serving it are chosen), so the text is the adapter's uninterrupted one, not
    the base model's after the fault."""
    kwargs = {**chat_kwargs("Tell me a long story about a lighthouse keeper.", 40), "model": "sql"}
    text = stream_killing_its_decode(stack, client, kwargs)
    assert text == reference(client, kwargs)
    assert text != reference(client, {**kwargs, "model": MODEL})


def test_decode_killed_during_a_non_streaming_request(stack, client):  # type: ignore[no-untyped-def]
    kwargs = chat_kwargs("Describe a rainy afternoon in a busy city.", 40)
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["text"] = client.chat.completions.create(**kwargs).choices[0].message.content
        except Exception as exc:  # reported below
            result["error"] = exc

    worker = threading.Thread(target=call)
    before = {n: stack.metrics(n).get("pdserve:generation_tokens_total", 0.0) for n in DECODES}
    worker.start()

    def holder_with_progress() -> str | None:
        for name in DECODES:
            if stack.metrics(name).get("pdserve:generation_tokens_total", 0.0) - before[name] >= 5:
                return name
        return None

    victim = wait_until(holder_with_progress, 120, "a decode to stream 5 tokens")
    kill(stack.procs[victim])
    worker.join(300)
    assert "error" not in result, result
    repair(stack)
    assert result["text"] == reference(client, kwargs)


def _long_prompt(tag: str) -> str:
    return f"[{tag}] " + "Here is some background about the planets of the solar system and their moons. " * 60


def test_prefill_killed_before_its_first_token(stack, client):  # type: ignore[no-untyped-def]
    kwargs = chat_kwargs(_long_prompt("before-first") + " Summarise it.", 12)
    result: dict[str, Any] = {}
    worker = threading.Thread(target=lambda: result.update(text=stream_text(client, kwargs, lambda n: None)))
    worker.start()
    wait_until(lambda: running_on(stack, ("prefill-f",)), 120, "the prefill to start the prompt")
    kill(stack.procs["prefill-f"])
    worker.join(300)
    assert "text" in result, "the streamed request failed"
    repair(stack)
    assert result["text"] == reference(client, kwargs)


def _kill_prefill_while_decodes_paused(stack: Stack, client: openai.OpenAI, attempt: int) -> bool:
    """One try; the output must be the uninterrupted one. True when the prefill died while the
    decodes were still paused (so mid-transfer)."""
    # Long enough to go through a prefill instance, short enough to prefill within the pause
    # on a loaded host (the transfer cannot finish anyway: the decodes are stopped).
    kwargs = chat_kwargs(f"[{attempt}] " + "Here is some background about the planets and their moons. " * 5
                         + "Summarise it.", 12)
    decode_pids = [stack.procs[n].popen.pid for n in DECODES]
    resumed = threading.Lock()
    killed_while_paused: list[bool] = []

    def resume_decodes() -> None:
        with resumed:
            for pid in decode_pids:
                os.kill(pid, signal.SIGCONT)

    # Paused for less than the registry needs to forget them (about 6 s), so the router still
    # routes to them; the watchdog resumes them whatever happens.
    watchdog = threading.Timer(4.0, resume_decodes)

    def kill_prefill_then_resume(num_chunks: int) -> None:
        if num_chunks == 1:
            killed_while_paused.append(not watchdog.finished.is_set())
            kill(stack.procs["prefill-f"])
            resume_decodes()

    for pid in decode_pids:
        os.kill(pid, signal.SIGSTOP)
    watchdog.start()
    try:
        text = stream_text(client, kwargs, kill_prefill_then_resume)
    finally:
        watchdog.cancel()
        resume_decodes()
    repair(stack)
    assert text == reference(client, kwargs)
    return killed_while_paused == [True]


def test_prefill_killed_mid_transfer(stack, client):  # type: ignore[no-untyped-def]
    """The decodes are paused while the prompt prefills, so the KV transfer cannot finish before
    the prefill dies right after its first token; the decode that was offered the KV frees its
    blocks, and the request continues elsewhere from that token. On a loaded host the first token
    may come only after the watchdog resumed the decodes: then the case is tried again (up to 5
    times); every try's output must be the uninterrupted one."""
    for attempt in range(5):
        if _kill_prefill_while_decodes_paused(stack, client, attempt):
            return
    raise AssertionError("in 5 tries the first token never came while the decodes were paused")


def test_stopped_decode_is_taken_for_dead_and_its_stream_continues(stack, client):  # type: ignore[no-untyped-def]
    kwargs = chat_kwargs("Explain how bread is made, step by step.", 40)
    stopped: list[str] = []

    def stop_holder(num_chunks: int) -> None:
        if num_chunks == 4 and not stopped:
            victim = wait_until(lambda: running_on(stack, DECODES), 30, "a decode holding the stream")
            os.kill(stack.procs[victim].popen.pid, signal.SIGSTOP)
            stopped.append(victim)

    text = stream_text(client, kwargs, stop_holder)
    assert stopped
    os.kill(stack.procs[stopped[0]].popen.pid, signal.SIGCONT)  # it must now drop the old request
    repair(stack)
    assert text == reference(client, kwargs)


def test_router_killed_engines_free_its_requests_within_the_lease(stack, client):  # type: ignore[no-untyped-def]
    kwargs = chat_kwargs("Write a very long poem about the sea.", 400)
    started = threading.Event()

    def orphan() -> None:
        with contextlib.suppress(Exception):  # the router dies under it
            stream_text(client, kwargs, lambda n: started.set())

    threading.Thread(target=orphan, daemon=True).start()
    wait_until(started.is_set, 120, "the stream to start")
    busy = wait_until(lambda: running_on(stack, DECODES), 30, "a decode holding the stream")
    wait_until(lambda: registry_view(stack)[busy].num_blocks_in_use > 0, 30, "the registry to show its blocks")
    kill(stack.procs["router"])
    killed_at = time.monotonic()
    wait_until(lambda: registry_view(stack)[busy].num_blocks_in_use == 0, 60, "the orphan's blocks to be freed")
    # The lease (6 s here) plus a heartbeat or two, not the request's 400 tokens.
    assert time.monotonic() - killed_at < 30


def test_rolling_restart_under_load_fails_no_request(stack, client):  # type: ignore[no-untyped-def]
    prompts = [f"Give me one fact about the number {i}." for i in range(4)]
    failures: list[str] = []
    outputs: dict[int, set[str]] = {i: set() for i in range(len(prompts))}
    stop = threading.Event()

    def load(worker: int) -> None:
        i = worker
        while not stop.is_set():
            k = i % len(prompts)
            try:
                outputs[k].add(client.chat.completions.create(**chat_kwargs(prompts[k], 16)).choices[0].message.content)
            except Exception as exc:
                failures.append(repr(exc))
            i += 2

    workers = [threading.Thread(target=load, args=(w,)) for w in range(2)]
    for w in workers:
        w.start()
    try:
        for name in ROLES:
            proc = stack.procs[name]
            proc.popen.send_signal(signal.SIGTERM)
            assert proc.popen.wait(120) == 0, proc.log()
            stack.start_engine(ROLES[name], name, engine_flags(name))
            stack.wait_ready(1, 2, timeout_s=300)
    finally:
        stop.set()
        for w in workers:
            w.join(300)
    assert not failures, failures
    for k, texts in outputs.items():
        assert texts == {reference(client, chat_kwargs(prompts[k], 16))}, texts
