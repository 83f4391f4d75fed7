"""A reasoning model's thinking split into ``reasoning_content``: the parsers over every chunking of
an answer, and through the router (OpenAI client -> router -> fake engines answering with thinking,
then a tool call), streamed or whole, and left whole where a grammar holds the output."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import openai
import pytest

from router.reasoning import REASONING_PARSERS
from router.tokenization import PromptProcessor, load_chat_template
from tests.router.router_harness import SERVED_MODEL, fake_stack

TEXTS = [
    "<think>\nThe user wants Paris.\n</think>\n\nParis.",
    "  <think>cut short",
    "No thinking at all.",
    "plain words</think>\n\nthen an answer",
    "<think></think>X",
    "<thi",
    "",
    "\n\n",
    "<think>a</think>",
    "<think>nested <think> tags </think> and </think> twice",
]


def _streamed(parser_name: str, text: str, cuts: list[int]) -> tuple[str, str]:
    stream = REASONING_PARSERS[parser_name].stream()
    reasoning, content = "", ""
    for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True):
        r, c = stream.feed(text[start:end])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("parser_name", list(REASONING_PARSERS))
@pytest.mark.parametrize("text", TEXTS)
def test_any_chunking_streams_what_the_whole_answer_splits_into(parser_name: str, text: str) -> None:
    if parser_name == "seed_oss":  # (its own tags)
        text = text.replace("think>", "seed:think>")
    reasoning, content = REASONING_PARSERS[parser_name].split(text)
    rng = random.Random(len(text))
    chunkings = [[i] for i in range(1, len(text))] + [
        sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) for _ in range(20) if len(text) > 1
    ]
    for cuts in [[], *chunkings]:
        assert _streamed(parser_name, text, cuts) == (reasoning or "", content), (text, cuts)


def test_what_each_parser_makes_of_an_answer() -> None:
    qwen3, r1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]
    assert qwen3.split(TEXTS[0]) == r1.split(TEXTS[0]) == ("\nThe user wants Paris.\n", "Paris.")
    assert qwen3.split("No thinking at all.") == (None, "No thinking at all.")  # thinking off
    assert r1.split("No thinking at all.") == ("No thinking at all.", "")  # cut before its end
    assert r1.split("plain words</think>\n\nthen an answer") == ("plain words", "then an answer")  # opened by the prompt
    assert qwen3.split("plain words</think>\n\nthen an answer") == (None, "plain words</think>\n\nthen an answer")
    assert qwen3.split("  <think>cut short") == ("cut short", "")
    assert r1.split("") == qwen3.split("") == (None, "")


THINKING = "The user asks for the weather; I will call the tool."
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
REPLY = f"<think>\n{THINKING}\n</think>\n\nChecking.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client(redis_url: str, tokenizer: Any) -> Iterator[openai.OpenAI]:
    prompts = PromptProcessor(tokenizer, max_model_len=2048, chat_template=load_chat_template("chatml-tools"))
    reply = list(tokenizer.encode(REPLY, add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001, "max_model_len": 2048},
                    tool_call_parser="hermes", reasoning_parser="qwen3", request_timeout_s=5.0) as (server, _):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20)


def test_thinking_then_a_tool_call_whole_and_streamed(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=300)
    message = response.choices[0].message
    assert message.reasoning_content == f"\n{THINKING}\n"  # type: ignore[attr-defined]
    assert message.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []] == [
        ("get_weather", {"city": "Paris"})]
    assert response.choices[0].finish_reason == "tool_calls"

    reasoning, content, names, finish_reason = "", "", [], None
    for chunk in client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=300, stream=True
    ):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            names += [p.function.name for p in choice.delta.tool_calls or [] if p.function and p.function.name]
            finish_reason = choice.finish_reason or finish_reason
    assert (reasoning, content, names, finish_reason) == (f"\n{THINKING}\n", "Checking.", ["get_weather"], "tool_calls")


def test_without_tools_the_answer_after_thinking_is_content(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=300)
    message = response.choices[0].message
    assert message.reasoning_content == f"\n{THINKING}\n"  # type: ignore[attr-defined]
    assert message.content == REPLY.split("</think>\n\n", 1)[1]
    assert message.tool_calls is None and response.choices[0].finish_reason == "stop"


def test_include_reasoning_false_leaves_the_thinking_out_whole_and_streamed(client: openai.OpenAI) -> None:
    extra = {"include_reasoning": False}
    response = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=300, extra_body=extra)
    message = response.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content == REPLY.split("</think>\n\n", 1)[1]
    chunks = list(client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=300, stream=True,
                                                 extra_body=extra))
    assert not any(getattr(c.delta, "reasoning_content", None) for chunk in chunks for c in chunk.choices)
    assert "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices) == message.content


def test_output_held_by_a_grammar_is_not_split(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, max_tokens=300, response_format={"type": "json_object"}
    )
    assert response.choices[0].message.content == REPLY
    assert getattr(response.choices[0].message, "reasoning_content", None) is None


def test_tags_the_tokenizer_marks_special_still_reach_the_parser(
    redis_url: str, tokenizer: Any, tokenizer_dir: Any
) -> None:
    assert PromptProcessor(tokenizer).lost_in_text(("<tool_call>", "<|im_end|>", "</think>")) == ["<|im_end|>"]
    # The default model's tokenizer with <think> and </think> made special tokens, as some reasoning
    # models have them: detokenizing would drop them, so these answers keep special tokens' text.
    special = type(tokenizer).from_pretrained(str(tokenizer_dir))
    special.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    prompts = PromptProcessor(special, max_model_len=2048)
    assert prompts.lost_in_text(("<think>", "</think>")) == ["<think>", "</think>"]
    reply = list(special.encode(f"<think>\n{THINKING}\n</think>\n\nParis.", add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001, "max_model_len": 2048},
                    reasoning_parser="qwen3", request_timeout_s=5.0) as (server, _):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20)
        message = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=300).choices[0].message
        assert (message.reasoning_content, message.content) == (f"\n{THINKING}\n", "Paris.")  # type: ignore[attr-defined]


def test_the_prompt_decides_for_deepseek_v3_glm_kimi_minimax_and_seed_oss() -> None:
    """Where the prompt's text ends with <think> the answer starts inside the thinking (deepseek_r1's reading), else
    the model opens it or there is none (qwen3's). Seed-OSS's the same with its own tags."""
    v3, seed = REASONING_PARSERS["deepseek_v3"], REASONING_PARSERS["seed_oss"]
    assert v3.prompt_opens("<|Assistant|><think>\n") and v3.prompt_opens("<think>")
    assert not v3.prompt_opens("<|Assistant|></think>") and not v3.prompt_opens("<think>\n\n</think>\n\n")
    assert seed.prompt_opens("assistant\n<seed:think>") and not seed.prompt_opens("<think>")
    for name in ("deepseek_v3", "glm45", "kimi_k2", "minimax_m2", "seed_oss"):
        parser = REASONING_PARSERS[name]
        for text in TEXTS:
            if name == "seed_oss":
                text = text.replace("think>", "seed:think>")
            r1, qwen3 = (replace(REASONING_PARSERS[n], open_tag=parser.open_tag, close_tag=parser.close_tag)
                         for n in ("deepseek_r1", "qwen3"))
            assert parser.split(text, prompt_opens=True) == r1.split(text), (name, text)
            assert parser.split(text) == qwen3.split(text), (name, text)
    assert seed.split("<seed:think>Plan.</seed:think>\n\nParis.") == ("Plan.", "Paris.")
    assert seed.split("<think>Plan.</think>Paris.") == (None, "<think>Plan.</think>Paris.")


def test_a_template_that_opens_the_thinking_when_asked(redis_url: str, tokenizer: Any) -> None:
    """DeepSeek-V3.1's way, through the router: ``chat_template_kwargs`` ``thinking: true`` ends the prompt with
    <think>, and the answer's text up to </think> is the thinking; without it the same parser reads the answer as
    content (``deepseek_r1`` would call all of it thinking)."""
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n{% if thinking %}<think>\n{% else %}</think>{% endif %}")
    prompts = PromptProcessor(tokenizer, max_model_len=2048, chat_template=template)
    reply = list(tokenizer.encode("Paris it is.</think>\n\nParis.", add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001, "max_model_len": 2048},
                    reasoning_parser="deepseek_v3", request_timeout_s=5.0) as (server, _):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20)
        for stream in (False, True):
            thinking = _chat(client, stream, {"chat_template_kwargs": {"thinking": True}})
            assert thinking == ("Paris it is.", "Paris.")
            assert _chat(client, stream, {}) == ("", "Paris it is.</think>\n\nParis.")


# (long enough that the prompt's start is not its end)
LONG_MESSAGES = [{"role": "user", "content": "Which city is the capital of France, and why? " * 8}]


def _chat(client: openai.OpenAI, stream: bool, extra: dict[str, Any]) -> tuple[str, str]:
    if not stream:
        message = client.chat.completions.create(model=SERVED_MODEL, messages=LONG_MESSAGES, max_tokens=300,
                                                 extra_body=extra).choices[0].message
        return getattr(message, "reasoning_content", None) or "", message.content or ""
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=SERVED_MODEL, messages=LONG_MESSAGES, max_tokens=300,
                                                stream=True, extra_body=extra):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    return reasoning, content
