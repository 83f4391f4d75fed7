"""Tensor-parallel engines through the real stack: a real redis-server, a router, one prefill and two
decode processes, each engine ``--tensor-parallel-size 2`` (rank 0 the service process, rank 1 a worker
it starts), on a tiny random checkpoint. The openai client's streamed greedy text, prefill (two ranks) ->
the real ZeroMQ KV transfer (every rank's heads) -> decode (two ranks), equals transformers'; and when a
decode's worker rank is killed while that decode streams a request, its service process exits with
code 70 and the router continues the request on the other decode: the client's stream is the
uninterrupted one."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import RedisServer
from tests.e2e.stack import Stack
from tests.engine.tiny_models import (
    TINY_DIMS,
    build_checkpoint,
    build_tokenizer,
    family_configs,
    hf_greedy,
    prompt_token_ids,
)

pytestmark = pytest.mark.timeout(300)

TP = ["--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32"]
PREFILL = "prefill-tp"
DECODES = ("decode-tp1", "decode-tp2")
BLOCK_SIZE = 16  # the engines' default
BOS = 1  # what the tiny tokenizer puts before a text prompt
SHORT_TOKENS = 24
LONG_TOKENS = 200  # 41 + 200 positions: within the tiny model's 256


@dataclass(frozen=True)
class Tiny:
    folder: Path


def wait_until(cond: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    folder = build_checkpoint(family_configs()["llama-bias"], tmp_path_factory.mktemp("tp-tiny") / "llama-bias")
    build_tokenizer(folder)
    return Tiny(folder)


@pytest.fixture(scope="module")
def stack(tiny: Tiny) -> Iterator[Stack]:
    redis = RedisServer()  # its own: the registry lists only this module's instances
    s = Stack(redis_url=redis.url, model=str(tiny.folder), env={"OMP_NUM_THREADS": "1"})
    try:
        s.start_engine("prefill", PREFILL, TP)
        for name in DECODES:
            s.start_engine("decode", name, TP)
        s.start_router()
        s.wait_ready(1, 2, timeout_s=240)
        yield s
    finally:
        s.stop()
        redis.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def served_model(client: openai.OpenAI) -> str:
    (card,) = client.models.list().data
    return card.id


def prompt_of(length: int, seed: int) -> tuple[str, list[int]]:
    """A text prompt of ``length`` words and the token ids the router makes of it (BOS first)."""
    ids = prompt_token_ids(length, seed=seed)
    return " ".join(f"w{t}" for t in ids), [BOS, *ids]


def expected_text(tiny: Tiny, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    """transformers' greedy tokens for the prompt, and their text."""
    from transformers import AutoTokenizer

    tokens = hf_greedy(tiny.folder, prompt_ids, max_tokens)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny.folder))
    # The continuation's text as an incremental detokenizer gives it: the prompt's text and the tokens',
    # less the prompt's (here: a space before each word, the first one's too).
    prefix = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full = tokenizer.decode([*prompt_ids, *tokens], skip_special_tokens=True)
    assert full.startswith(prefix)
    return tokens, full[len(prefix):]


def stream(client: openai.OpenAI, prompt: str, max_tokens: int, on_chunk: Callable[[int], None] = lambda n: None,
           ) -> tuple[str, list[Any]]:
    """The streamed text and its chunks; ``on_chunk(number of text chunks so far)`` after each one."""
    text, chunks = "", []
    for chunk in client.completions.create(model=served_model(client), prompt=prompt, max_tokens=max_tokens,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True}):
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].text:
            text += chunk.choices[0].text
            on_chunk(len([c for c in chunks if c.choices and c.choices[0].text]))
    return text, chunks


def router_counter(url: str, name: str, label: str) -> float:
    """A labelled counter of the router's /metrics (``label``: e.g. ``path="disaggregated"``)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and label in line:
            total += float(line.rpartition(" ")[2])
    return total


def block_bytes() -> int:
    """One KV block as the transfer carries it: K and V of every layer and KV head, float32."""
    return (2 * TINY_DIMS["num_hidden_layers"] * TINY_DIMS["num_key_value_heads"] * TINY_DIMS["head_dim"]
            * BLOCK_SIZE * 4)


def test_streamed_greedy_text_over_two_ranks_and_the_kv_transfer_equals_transformers(tiny, stack, client):  # type: ignore[no-untyped-def]
    prompt, prompt_ids = prompt_of(40, seed=3)
    tokens, expected = expected_text(tiny, prompt_ids, SHORT_TOKENS)
    names = [PREFILL, *DECODES]
    before = {n: stack.metrics(n) for n in names}
    routed = router_counter(stack.url, "pdserve:router_requests_routed_total", 'path="disaggregated"')

    text, chunks = stream(client, prompt, SHORT_TOKENS)

    assert text == expected
    assert text.split() == [f"w{t}" for t in tokens if t > 2]  # every token's own word
    assert chunks[-1].choices[0].finish_reason == "length"
    after: dict[str, dict[str, float]] = {}

    def grew(name: str, metric: str) -> float:
        return after[name].get(metric, 0.0) - before[name].get(metric, 0.0)

    def transferred() -> bool:  # an engine publishes its counters twice a second: they may trail the answer
        after.update({n: stack.metrics(n) for n in names})
        return grew(PREFILL, "pdserve:kv_transfer_seconds_count") >= 1 and sum(
            grew(n, "pdserve:kv_transfer_seconds_count") for n in DECODES) >= 1

    wait_until(transferred, 30, "both sides of the KV transfer to be counted")

    # The prompt went prefill -> KV transfer -> decode, and its blocks (each with both ranks' heads)
    # arrived whole: the decode did not recompute it.
    assert router_counter(stack.url, "pdserve:router_requests_routed_total", 'path="disaggregated"') == routed + 1
    num_blocks = -(-len(prompt_ids) // BLOCK_SIZE)
    sent = grew(PREFILL, "pdserve:kv_transfer_bytes_total")
    assert sent == num_blocks * block_bytes(), (sent, num_blocks)
    received = {n: grew(n, "pdserve:kv_transfer_bytes_total") for n in DECODES}
    assert sorted(received.values()) == [0.0, sent], received
    assert all(grew(n, "pdserve:kv_transfer_failures_total") == 0 for n in names)
    # One transfer each side: the prefill's sent, the receiving decode's landed.
    transfers = {n: grew(n, "pdserve:kv_transfer_seconds_count") for n in names}
    assert transfers == {n: float(n == PREFILL or received[n] > 0) for n in names}, transfers


def test_an_embedding_over_two_ranks_is_transformers_last_hidden_state(tiny, stack, client):  # type: ignore[no-untyped-def]
    """/v1/embeddings on the tensor-parallel prefill: rank 0's last hidden state (each rank's the same),
    normalized, equals transformers' base model's."""
    import numpy as np
    import torch

    from tests.engine.tiny_models import hf_model

    routed = router_counter(stack.url, "pdserve:router_requests_routed_total", 'path="pooling"')
    prompt, prompt_ids = prompt_of(30, seed=5)
    got = client.embeddings.create(model=served_model(client), input=prompt, encoding_format="float")
    with torch.inference_mode():
        hidden = hf_model(tiny.folder).model(torch.tensor([prompt_ids])).last_hidden_state[0, -1].double().numpy()
    np.testing.assert_allclose(got.data[0].embedding, hidden / np.linalg.norm(hidden), rtol=1e-4, atol=1e-6)
    assert got.usage.prompt_tokens == len(prompt_ids)
    assert router_counter(stack.url, "pdserve:router_requests_routed_total", 'path="pooling"') == routed + 1


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except (FileNotFoundError, ProcessLookupError):
        return []


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(") ")[2][:1] != "Z"
    except FileNotFoundError:
        return False


def tp_worker(stack: Stack, name: str) -> int:
    """The pid of the instance's one worker rank: the child of its service process (any of its threads')
    started as ``python -m common.engine.tensor_parallel``."""
    pid = stack.procs[name].popen.pid
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            children += [int(c) for c in (task / "children").read_text().split()]
    workers = [c for c in children if "common.engine.tensor_parallel" in _cmdline(c)]
    assert len(workers) == 1, (name, {c: _cmdline(c) for c in children})
    return workers[0]


def generation_tokens(stack: Stack, name: str) -> float:
    """Tokens the instance generated so far (counted as each step's outputs leave, not on a timer)."""
    return stack.metrics(name).get("pdserve:generation_tokens_total", 0.0)


def signal_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # the killed one, reaped
            os.kill(pid, sig)


def test_a_decode_whose_worker_rank_dies_mid_stream_exits_70_and_the_stream_continues_elsewhere(  # type: ignore[no-untyped-def]
        tiny, stack, client):
    """The decodes' worker ranks are stopped a few chunks into a long stream, which freezes the request on
    the decode serving it (its rank 0 waits for its worker in the step's collectives); that decode is
    the one whose metrics count tokens of it, its worker killed, the other decode's resumed. The killed worker's engine exits
    with code 70 at once, the others keep their ranks, and the router continues the request on the other
    decode: the client's one stream equals transformers' uninterrupted output. (The module's last test: it
    leaves one decode dead.)"""
    prompt, prompt_ids = prompt_of(40, seed=5)
    _, expected = expected_text(tiny, prompt_ids, LONG_TOKENS)
    workers = {n: tp_worker(stack, n) for n in DECODES}
    prefill_worker = tp_worker(stack, PREFILL)
    migrations = router_counter(stack.url, "pdserve:request_migrations_total", 'where="running"')
    generated = {n: generation_tokens(stack, n) for n in DECODES}
    killed: dict[str, Any] = {}

    def holder() -> str | None:
        """The decode that has streamed tokens of this request (the only one in flight)."""
        busy = [n for n in DECODES if generation_tokens(stack, n) > generated[n]]
        assert len(busy) <= 1, busy
        return busy[0] if busy else None

    def kill_the_holder_s_worker(num_chunks: int) -> None:
        if num_chunks != 3 or killed:
            return
        signal_all(list(workers.values()), signal.SIGSTOP)
        try:
            victim = wait_until(holder, 30, "a decode holding the stream")
            killed.update(name=victim, generated=generation_tokens(stack, victim) - generated[victim])
            os.kill(workers[victim], signal.SIGKILL)
        finally:
            signal_all([pid for n, pid in workers.items() if n != killed.get("name")], signal.SIGCONT)

    text, chunks = stream(client, prompt, LONG_TOKENS, kill_the_holder_s_worker)

    assert killed, "the stream ended before a decode's worker was killed"
    victim = killed["name"]
    (survivor,) = [n for n in DECODES if n != victim]
    # The request was mid-stream there (its rank 0 waiting for the stopped worker): it had made tokens,
    # not all it was asked for (the prefill made the first).
    assert 0 < killed["generated"] < LONG_TOKENS - 1, killed
    assert stack.procs[victim].popen.wait(60) == 70, stack.procs[victim].log()
    # Its rank 0 said why (its watchdog saw the worker gone, or its step's collective lost the peer first).
    assert "this engine stops" in stack.procs[victim].log(), stack.procs[victim].log()
    wait_until(lambda: not alive(workers[victim]), 30, "the killed worker to be gone")
    # The fault stayed in its engine: the other engines keep both their ranks.
    assert all(stack.procs[n].popen.poll() is None for n in (PREFILL, survivor))
    assert alive(workers[survivor]) and alive(prefill_worker)

    assert text == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    assert router_counter(stack.url, "pdserve:request_migrations_total", 'where="running"') >= migrations + 1
    # The survivor finished it: it made the tokens the victim had not.
    assert generation_tokens(stack, survivor) > generated[survivor]

    from common.registry import Registry

    def pools_idle() -> bool:
        view = {i.instance_id: i for i in Registry(stack.redis_url).instances()}
        return set(view) == {PREFILL, survivor} and all(i.num_blocks_in_use == 0 for i in view.values())

    wait_until(pools_idle, 60, "the dead decode to leave the registry and the live pools to return to 0 blocks")
    for name in (PREFILL, survivor):
        assert stack.metrics(name).get("pdserve:kv_integrity_errors_total", 0.0) == 0.0, stack.procs[name].log()
