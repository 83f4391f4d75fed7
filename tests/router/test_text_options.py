"""How a choice's tokens become its text, through the router in front of fake engines: the token a
request stops on adds no text (as vLLM leaves it out) unless ``include_stop_str_in_output``, which
also keeps a matched stop string; ``skip_special_tokens: false`` keeps special tokens' text. And
``truncate_prompt_tokens``: a prompt cut to its last tokens instead of refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.router.fake_engine import FakeCluster
from tests.router.router_harness import SERVED_MODEL, RouterServer, fake_stack

# The fake engines answer with these tokens and finish ("stop") on the last one, as an engine does
# on a stop token.
TEXT = "Hello<|im_start|> world"


@pytest.fixture(scope="module")
def running(redis_url: str, prompts: Any, tokenizer: Any) -> Iterator[tuple[RouterServer, FakeCluster, list[int]]]:
    reply = list(tokenizer.encode(TEXT, add_special_tokens=False))
    assert tokenizer.decode(reply[-1:]) == " world" and len(reply) == 3
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001}, request_timeout_s=5.0) as (server, cluster):
        yield server, cluster, reply


@pytest.fixture
def stack(running: tuple[RouterServer, FakeCluster, list[int]]) -> tuple[RouterServer, list[int]]:
    return running[0], running[2]


def _text(server: RouterServer, stream: bool = False, **body: Any) -> str:
    request = {"model": SERVED_MODEL, "prompt": "Say hello", "max_tokens": 10, **body}
    if not stream:
        response = httpx.post(f"{server.url}/v1/completions", json=request, timeout=10)
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["text"])
    import json

    text = ""
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**request, "stream": True}, timeout=10) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


@pytest.mark.parametrize("stream", [False, True])
def test_the_stop_token_and_special_tokens(stack: tuple[RouterServer, list[int]], stream: bool) -> None:
    server, reply = stack
    world = reply[-1]
    assert _text(server, stream) == "Hello world"  # the special token skipped; " world" is no stop token
    assert _text(server, stream, stop_token_ids=[world]) == "Hello"
    assert _text(server, stream, stop_token_ids=[world], include_stop_str_in_output=True) == "Hello world"
    assert _text(server, stream, skip_special_tokens=False) == "Hello<|im_start|> world"
    # This tokenizer writes special tokens side by side, as false asks: the same text, not a 400.
    assert _text(server, stream, skip_special_tokens=False, spaces_between_special_tokens=False) == (
        "Hello<|im_start|> world"
    )
    assert _text(server, stream, stop=["wor"]) == "Hello "
    assert _text(server, stream, stop=["wor"], include_stop_str_in_output=True) == "Hello wor"


def test_a_prompt_too_long_for_the_context_is_cut_to_its_last_tokens(
    running: tuple[RouterServer, FakeCluster, list[int]], tokenizer: Any
) -> None:
    server, cluster, _ = running
    prompt = " ".join(f"w{i}" for i in range(400))  # over the fake engines' 256-token context
    ids = list(tokenizer.encode(prompt, add_special_tokens=False))
    url = f"{server.url}/v1/completions"
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 3}
    assert httpx.post(url, json=body, timeout=10).status_code == 400  # refused whole
    response = httpx.post(url, json={**body, "truncate_prompt_tokens": 20, "echo": True}, timeout=10)
    assert response.status_code == 200, response.text
    sent = [r for r in cluster.requests() if r.request_id.startswith(response.json()["id"])]
    assert sent and all(list(r.prompt_token_ids) == ids[-20:] for r in sent)
    assert response.json()["choices"][0]["text"].startswith(tokenizer.decode(ids[-20:]))  # echo: what was kept
    chat = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 3,
            "truncate_prompt_tokens": 30}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=10)
    assert response.status_code == 200, response.text
    sent = [r for r in cluster.requests() if r.request_id.startswith(response.json()["id"])]
    assert sent and all(len(r.prompt_token_ids) == 30 for r in sent)
    for k, status in ((0, 400), (-1, 400)):  # -1: the whole context, leaving no room for the answer
        response = httpx.post(url, json={**body, "truncate_prompt_tokens": k}, timeout=10)
        assert response.status_code == status, response.text


def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id(stack: tuple[RouterServer, list[int]]) -> None:
    server, reply = stack
    body = {"model": SERVED_MODEL, "max_tokens": 10, "logprobs": 1, "return_tokens_as_token_ids": True}
    response = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": "Say hello"}, timeout=10)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in reply]
    assert all(set(top) <= {f"token_id:{t}" for t in [*reply, 0]} for top in logprobs["top_logprobs"])
    chat = {**body, "logprobs": True, "top_logprobs": 1, "messages": [{"role": "user", "content": "Say hello"}]}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=10)
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["bytes"]) for c in content] == [(f"token_id:{t}", list(f"token_id:{t}".encode())) for t in reply]
    plain = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": "Say hello",
                                                             "return_tokens_as_token_ids": False}, timeout=10)
    assert not any(t.startswith("token_id:") for t in plain.json()["choices"][0]["logprobs"]["tokens"])


def test_priority_needs_the_priority_policy_and_then_reaches_the_engines(
    stack: tuple[RouterServer, list[int]], redis_url: str, prompts: Any, tokenizer: Any
) -> None:
    from router.config import RequestLimits

    server, _ = stack
    body = {"model": SERVED_MODEL, "prompt": "Say hello", "max_tokens": 3, "priority": 2}
    refused = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
    assert "--scheduling-policy priority" in refused.json()["error"]["message"]
    reply = list(tokenizer.encode(TEXT, add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, limits=RequestLimits(priority_scheduling=True)) as (urgent, cluster):
        response = httpx.post(f"{urgent.url}/v1/completions", json={**body, "priority": -5}, timeout=10)
        assert response.status_code == 200, response.text
        assert [r.sampling_params.priority for r in cluster.requests()] == [-5]


def test_a_client_request_id_names_the_response_and_the_engines_keep_unique_ids(
    stack: tuple[RouterServer, list[int]], running: tuple[RouterServer, FakeCluster, list[int]]
) -> None:
    server, _ = stack
    cluster = running[1]
    before = len(cluster.requests())
    ids = []
    for path, body in (("completions", {"prompt": "Say hello"}),
                       ("chat/completions", {"messages": [{"role": "user", "content": "Say hello"}]})):
        for stream in (False, True):
            request = {"model": SERVED_MODEL, "max_tokens": 2, "request_id": "my-id", "stream": stream, **body}
            response = httpx.post(f"{server.url}/v1/{path}", json=request, timeout=10)
            assert response.status_code == 200, response.text
            first = response.text.split("\n")[0].removeprefix("data: ") if stream else response.text
            ids.append(__import__("json").loads(first)["id"])
    assert ids == ["cmpl-my-id", "cmpl-my-id", "chatcmpl-my-id", "chatcmpl-my-id"]
    engine_ids = [r.request_id for r in cluster.requests()[before:]]
    assert len(set(engine_ids)) == len(engine_ids) == 4 and not any("my-id" in i for i in engine_ids)


def test_a_client_s_x_request_id_header_names_the_response_over_the_body_s_request_id(
    stack: tuple[RouterServer, list[int]]
) -> None:
    """As vLLM's server takes it: the header's id wins over ``request_id``; one that could not name a request
    (over 128 characters, or not printable ASCII) leaves the body's, or a new one."""
    import json

    server, _ = stack
    url = f"{server.url}/v1/completions"
    body = {"model": SERVED_MODEL, "max_tokens": 2, "prompt": "Say hello"}

    def response_id(headers: dict[str, str | bytes], **extra: object) -> str:
        response = httpx.post(url, json={**body, **extra}, headers=headers, timeout=10)
        assert response.status_code == 200, response.text
        first = response.text.split("\n")[0].removeprefix("data: ") if extra.get("stream") else response.text
        return str(json.loads(first)["id"])

    for stream in (False, True):
        assert response_id({"X-Request-Id": "trace-7"}, request_id="my-id", stream=stream) == "cmpl-trace-7"
    assert response_id({"X-Request-Id": "t" * 128}) == "cmpl-" + "t" * 128
    assert response_id({"X-Request-Id": "t" * 129}, request_id="my-id") == "cmpl-my-id"
    assert response_id({"X-Request-Id": "two words"}, request_id="my-id") == "cmpl-my-id"
    made = response_id({"X-Request-Id": "caf\u00e9".encode()})
    assert made.startswith("cmpl-") and len(made) == 5 + 32
    chat = httpx.post(f"{server.url}/v1/chat/completions", headers={"X-Request-Id": "trace-8"}, timeout=10, json={
        "model": SERVED_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Say hello"}]})
    assert chat.json()["id"] == "chatcmpl-trace-8"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_starts_an_answer_with_the_assistant_message_it_goes_on_from(
    stack: tuple[RouterServer, list[int]], stream: bool
) -> None:
    import json

    server, _ = stack

    def content(messages: list[dict[str, str]], **body: Any) -> str:
        request = {"model": SERVED_MODEL, "messages": messages, "max_tokens": 10, "echo": True, "stream": stream, **body}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=10)
        assert response.status_code == 200, response.text
        if not stream:
            return str(response.json()["choices"][0]["message"]["content"])
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])

    started = [{"role": "user", "content": "Greet me."}, {"role": "assistant", "content": "Sure:"}]
    assert content(started, add_generation_prompt=False, continue_final_message=True) == "Sure:Hello world"
    assert content(started[:1]) == "Hello world"  # the last message is the user's: nothing to echo


@pytest.mark.parametrize("stream", [False, True])
def test_return_token_ids_gives_the_prompt_s_and_each_choice_s_ids(stack: tuple[RouterServer, list[int]],
                                                                   stream: bool) -> None:
    import json

    server, reply = stack
    messages = [{"role": "user", "content": "Say hello"}]
    for path, body, prompt_body in (
        ("completions", {"prompt": "Say hello"}, {"prompt": "Say hello"}),
        ("chat/completions", {"messages": messages}, {"messages": messages, "add_generation_prompt": True}),
    ):
        prompt = httpx.post(f"{server.url}/tokenize", json={"model": SERVED_MODEL, **prompt_body}, timeout=10).json()
        request = {"model": SERVED_MODEL, "max_tokens": 10, "n": 2, "return_token_ids": True, "stream": stream, **body}
        response = httpx.post(f"{server.url}/v1/{path}", json=request, timeout=10)
        assert response.status_code == 200, response.text
        if not stream:
            done = response.json()
            prompt_ids = done.get("prompt_token_ids") or done["choices"][0]["prompt_token_ids"]
            assert prompt_ids == prompt["tokens"]
            assert [c["token_ids"] for c in done["choices"]] == [reply, reply]
            continue
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        ids: dict[int, list[int]] = {0: [], 1: []}
        firsts = []
        for event in events:
            if event.get("prompt_token_ids") is not None:
                firsts.append(event["prompt_token_ids"])
            for choice in event["choices"]:
                ids[choice["index"]] += choice.get("token_ids") or []
                if choice.get("prompt_token_ids") is not None:
                    firsts.append(choice["prompt_token_ids"])
        assert ids == {0: reply, 1: reply}
        assert firsts == [prompt["tokens"]] * (1 if path.startswith("chat") else 2)  # chat: the first chunk only
    plain = httpx.post(f"{server.url}/v1/completions", json={"model": SERVED_MODEL, "prompt": "Say hello"}, timeout=10)
    assert "token_ids" not in plain.json()["choices"][0]


def test_an_end_of_sequence_the_model_s_configs_name_is_a_stop_whose_text_is_left_out(
    redis_url: str, tokenizer: Any, tmp_path: Any
) -> None:
    """An engine ends a sequence on every end-of-sequence token the model's ``config.json`` and
    ``generation_config.json`` name (gpt-oss's ``<|call|>``, Llama 3's ``<|eot_id|>``), not only the tokenizer's:
    the router names them as the request's stops, so the text of the one it stopped on is left out even where
    special tokens are kept, as vLLM leaves it out."""
    from router.tokenization import PromptProcessor

    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer.save_pretrained(str(tmp_path))
    assert tokenizer.eos_token_id not in (3, 4, im_start)
    (tmp_path / "config.json").write_text('{"eos_token_id": 4, "text_config": {"eos_token_id": [3]}}')
    (tmp_path / "generation_config.json").write_text(f'{{"eos_token_id": [{im_start}, 4, 10000000]}}')
    prompts = PromptProcessor.from_model_dir(tmp_path)
    assert prompts.eos_token_ids == (tokenizer.eos_token_id, 4, 3, im_start)  # past the vocabulary: left out
    reply = list(tokenizer.encode("Hello world<|im_start|>", add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001}, request_timeout_s=5.0) as (server, cluster):
        for stream in (False, True):
            assert _text(server, stream, skip_special_tokens=False) == "Hello world"
            assert _text(server, stream, skip_special_tokens=False, include_stop_str_in_output=True) == (
                "Hello world<|im_start|>")
        def sent() -> list[Any]:
            return [r for engine in cluster.peers.values() for r in engine.requests]

        earlier = sent()
        assert earlier and all(set(prompts.eos_token_ids) <= set(r.sampling_params.stop_token_ids) for r in earlier)
        assert _text(server, ignore_eos=True, skip_special_tokens=False) == "Hello world<|im_start|>"
        [ignoring] = [r for r in sent() if all(r is not e for e in earlier)]
        assert ignoring.sampling_params.stop_token_ids == []
