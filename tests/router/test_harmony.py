"""gpt-oss's harmony format (``router/harmony.py``): the reader over every chunking of an answer, and through the
router (OpenAI client -> router -> fake engines over real ZMQ and Redis) with a tokenizer whose harmony tags are
special tokens, as gpt-oss's are: thinking, content and calls, whole and streamed; forced calls and structured
outputs whose header the prompt ends with; refusals; ``reasoning_effort``; the Responses API.

The chat template here is a stand-in written for these tests: it writes the format's messages as gpt-oss's
template does (system, developer with the tools, each message, an earlier answer's ``thinking`` (transformers gives a
message's ``reasoning_content`` to templates under that name too), its calls
addressed in the role, tool results), not its wording."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from router.harmony import (
    TAGS,
    ArgumentsPiece,
    CallStart,
    HarmonyEvent,
    HarmonyStream,
    Thinking,
    check_parsers,
    read_harmony,
    writes_harmony,
)
from router.tokenization import PromptProcessor, load_chat_template
from router.tool_parsers import detect_parser
from tests.router.fake_engine import FakeCluster
from tests.router.router_harness import SERVED_MODEL, RouterServer, fake_stack

TEMPLATE = (
    '{{- "<|start|>system<|message|>A test model.\\nReasoning: " + (reasoning_effort | default("medium")) '
    '+ "\\n\\n# Valid channels: analysis, commentary, final.<|end|>" -}}'
    '{%- if tools -%}{{- "<|start|>developer<|message|># Tools\\n\\nnamespace functions {\\n" -}}'
    '{%- for tool in tools -%}{{- "type " + tool.function.name + " = (_: " + (tool.function.parameters | tojson) '
    '+ ") => any;\\n" -}}{%- endfor -%}{{- "} // namespace functions<|end|>" -}}{%- endif -%}'
    '{%- for message in messages -%}'
    '{%- if message.role == "assistant" -%}'
    '{%- if message.thinking is defined -%}'
    '{{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" -}}{%- endif -%}'
    '{%- if message.tool_calls is defined and message.tool_calls -%}{%- for call in message.tool_calls -%}'
    '{{- "<|start|>assistant to=functions." + call.function.name + "<|channel|>commentary json<|message|>" '
    '+ (call.function.arguments | tojson) + "<|call|>" -}}{%- endfor -%}'
    '{%- else -%}{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" -}}{%- endif -%}'
    '{%- elif message.role == "tool" -%}'
    '{{- "<|start|>functions.tool to=assistant<|channel|>commentary<|message|>" + message.content + "<|end|>" -}}'
    '{%- else -%}{{- "<|start|>" + message.role + "<|message|>" + message.content + "<|end|>" -}}{%- endif -%}'
    '{%- endfor -%}'
    '{%- if add_generation_prompt -%}{{- "<|start|>assistant" -}}{%- endif -%}'
)
THINKING = "The user wants the weather in Paris. Call get_weather."
CALL = '{"city": "Paris", "unit": "celsius"}'
CALL_REPLY = (f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>commentary "
              f"to=functions.get_weather <|constrain|>json<|message|>{CALL}<|call|>")
ANSWER_REPLY = (f"<|channel|>analysis<|message|>{THINKING}<|end|>"
                "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]

# Answers, and what each becomes.
CASES: list[tuple[str, list[HarmonyEvent]]] = [
    (CALL_REPLY, [Thinking(THINKING), CallStart("get_weather"), ArgumentsPiece(CALL)]),
    (ANSWER_REPLY, [Thinking(THINKING), "It is sunny in Paris."]),
    # The recipient after the role, with the content type as a word; a preamble on commentary is content.
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.f<|channel|>commentary json"
     "<|message|>{}<|call|>", ["Checking.", CallStart("f"), ArgumentsPiece("{}")]),
    # An answer that starts with its recipient (the prompt ended with the role).
    (" to=functions.f<|channel|>commentary <|constrain|>json<|message|>{\"a\": 1}", [CallStart("f"), ArgumentsPiece('{"a": 1}')]),
    # Two analysis messages joined by a newline; a built-in tool's call is thinking.
    ("<|channel|>analysis<|message|>A<|end|><|start|>assistant<|channel|>analysis to=browser.search<|message|>"
     "{\"q\": 1}<|call|>", [Thinking('A\n{"q": 1}')]),
    # Text before any header (an answer going on from the assistant's content) and a body cut short.
    ("plain words<|end|><|start|>assistant<|channel|>final<|message|>and more", ["plain words\nand more"]),
    # A header cut short wrote nothing; an answer with no text is nothing.
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>fin", [Thinking("x")]),
    ("", []),
    # A body whose end the model left out, the next message starting.
    ("<|channel|>analysis<|message|>t<|start|>assistant<|channel|>final<|message|>ok", [Thinking("t"), "ok"]),
    # Text that only looks like a tag's start stays text.
    ("<|channel|>final<|message|>a <| b <|e", ["a <| b <|e"]),
]


def _merged(events: list[HarmonyEvent]) -> list[HarmonyEvent]:
    """Adjacent pieces of one kind joined (a stream cuts them where its chunks fall)."""
    out: list[HarmonyEvent] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, str) and isinstance(last, str):
            out[-1] = last + event
        elif isinstance(event, Thinking) and isinstance(last, Thinking):
            out[-1] = Thinking(last.text + event.text)
        elif isinstance(event, ArgumentsPiece) and isinstance(last, ArgumentsPiece):
            out[-1] = ArgumentsPiece(last.text + event.text)
        else:
            out.append(event)
    return out


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_what_each_answer_is_whole_and_in_any_chunking(text: str, expected: list[HarmonyEvent]) -> None:
    assert _merged(read_harmony(text)) == expected
    rng = random.Random(text)
    for _ in range(60):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        stream, events, start = HarmonyStream(), [], 0
        for cut in [*cuts, len(text)]:
            events += stream.feed(text[start:cut])
            start = cut
        assert _merged(events + stream.finish()) == expected, cuts


def test_calls_past_max_calls_are_left_out() -> None:
    two = CALL_REPLY + "<|start|>assistant<|channel|>commentary to=functions.g<|message|>{}<|call|>"
    assert _merged(read_harmony(two, max_calls=1)) == [Thinking(THINKING), CallStart("get_weather"), ArgumentsPiece(CALL)]
    assert [e for e in read_harmony(two) if isinstance(e, CallStart)] == [CallStart("get_weather"), CallStart("g")]


def test_the_format_is_found_from_the_template_and_parsers_that_do_not_fit_are_refused() -> None:
    chatml = load_chat_template("chatml-tools")
    assert writes_harmony(TEMPLATE) and not writes_harmony(chatml) and not writes_harmony(None)
    assert detect_parser(TEMPLATE) is None  # the router's auto-detection names it "openai" before the others
    assert check_parsers(TEMPLATE, "openai", "openai_gptoss") and check_parsers(TEMPLATE, None, None)
    assert not check_parsers(chatml, "hermes", "qwen3")
    with pytest.raises(ValueError, match="--tool-call-parser openai reads gpt-oss's harmony format"):
        check_parsers(chatml, "openai", None)
    with pytest.raises(ValueError, match="--reasoning-parser openai_gptoss reads"):
        check_parsers(chatml, None, "openai_gptoss")
    with pytest.raises(ValueError, match="--reasoning-parser openai_gptoss reads it, not qwen3"):
        check_parsers(TEMPLATE, None, "qwen3")
    with pytest.raises(ValueError, match="--tool-call-parser openai reads it, not hermes"):
        check_parsers(TEMPLATE, "hermes", None)


@pytest.fixture(scope="module")
def harmony_tokenizer(tokenizer_dir: Any) -> Any:
    from transformers import AutoTokenizer

    special = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    special.add_special_tokens({"additional_special_tokens": list(TAGS)})
    return special


@pytest.fixture(scope="module")
def stack(redis_url: str, harmony_tokenizer: Any) -> Iterator[tuple[RouterServer, FakeCluster]]:
    prompts = PromptProcessor(harmony_tokenizer, max_model_len=2048, chat_template=TEMPLATE)
    assert prompts.lost_in_text(TAGS) == list(TAGS)  # special tokens: only kept text shows them
    with fake_stack(redis_url, prompts, _ids(harmony_tokenizer, CALL_REPLY), {"token_delay_s": 0.001, "max_model_len": 2048},
                    tool_call_parser="openai", request_timeout_s=5.0) as stack:
        yield stack


@pytest.fixture
def client(stack: tuple[RouterServer, FakeCluster]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack[0].url}/v1", api_key="unused", max_retries=0, timeout=20)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _answering(stack: tuple[RouterServer, FakeCluster], tokens: list[int]) -> None:
    for engine in stack[1].peers.values():
        engine.reply_tokens = tokens


def _new_request(stack: tuple[RouterServer, FakeCluster], before: int) -> Any:
    requests = [r for engine in stack[1].peers.values() for r in engine.requests]
    assert len(requests) > before
    return requests[-1] if len(requests) == before + 1 else next(r for r in requests if r not in requests[:before])


def _num_requests(stack: tuple[RouterServer, FakeCluster]) -> int:
    return sum(len(engine.requests) for engine in stack[1].peers.values())


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, str, list[tuple[str, str]], str | None, int]:
    reasoning, content, calls, finish_reason, num_argument_pieces = "", "", [], None, 0
    for chunk in client.chat.completions.create(model=SERVED_MODEL, stream=True, **kw):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                if part.function and part.function.name:
                    calls.append((part.function.name, part.function.arguments or ""))
                elif part.function and part.function.arguments:
                    calls[-1] = (calls[-1][0], calls[-1][1] + part.function.arguments)
                    num_argument_pieces += 1
            finish_reason = choice.finish_reason or finish_reason
    return reasoning, content, calls, finish_reason, num_argument_pieces


def test_thinking_then_a_call_whole_and_streamed(
    stack: tuple[RouterServer, FakeCluster], client: openai.OpenAI, harmony_tokenizer: Any
) -> None:
    _answering(stack, _ids(harmony_tokenizer, CALL_REPLY))
    before = _num_requests(stack)
    response = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=300)
    message = response.choices[0].message
    assert message.reasoning_content == THINKING  # type: ignore[attr-defined]
    assert message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == [("get_weather", CALL)]
    assert response.choices[0].finish_reason == "tool_calls"
    prompt = harmony_tokenizer.decode(_new_request(stack, before).prompt_token_ids)
    assert "type get_weather = (_: " in prompt and prompt.endswith("<|start|>user<|message|>Weather in Paris?<|end|>"
                                                                     "<|start|>assistant")
    reasoning, content, calls, finish_reason, pieces = _streamed(client, messages=MESSAGES, tools=TOOLS, max_tokens=300)
    assert (reasoning, content, calls, finish_reason) == (THINKING, "", [("get_weather", CALL)], "tool_calls")
    assert pieces > 1  # the arguments stream as they are written


def test_thinking_then_the_final_answer_and_include_reasoning(
    stack: tuple[RouterServer, FakeCluster], client: openai.OpenAI, harmony_tokenizer: Any
) -> None:
    _answering(stack, _ids(harmony_tokenizer, ANSWER_REPLY))
    for tools in (TOOLS, None):
        kw: dict[str, Any] = {"tools": tools} if tools else {}
        message = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=300, **kw).choices[0]
        assert (message.message.reasoning_content, message.message.content) == (  # type: ignore[attr-defined]
            THINKING, "It is sunny in Paris.")
        assert message.finish_reason == "stop" and not message.message.tool_calls
        assert _streamed(client, messages=MESSAGES, max_tokens=300, **kw)[:4] == (
            THINKING, "It is sunny in Paris.", [], "stop")
    hidden = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=300,
                                            extra_body={"include_reasoning": False}).choices[0].message
    assert getattr(hidden, "reasoning_content", None) is None and hidden.content == "It is sunny in Paris."
    # Cut short inside the thinking: all of it is thinking, none of the tags is text.
    short = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=8).choices[0]
    assert short.finish_reason == "length" and short.message.content is None
    assert THINKING.startswith(short.message.reasoning_content)  # type: ignore[attr-defined]


def test_a_call_the_request_did_not_offer_stays_content(
    stack: tuple[RouterServer, FakeCluster], client: openai.OpenAI, harmony_tokenizer: Any
) -> None:
    _answering(stack, _ids(harmony_tokenizer, CALL_REPLY))
    message = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=300).choices[0].message
    assert (message.content, message.tool_calls) == (CALL, None)
    none = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=300).choices[0]
    assert (none.message.content, none.message.tool_calls, none.finish_reason) == (CALL, None, "stop")


def test_a_named_call_and_a_structured_output_open_their_message_in_the_prompt(
    stack: tuple[RouterServer, FakeCluster], client: openai.OpenAI, harmony_tokenizer: Any
) -> None:
    _answering(stack, _ids(harmony_tokenizer, CALL))
    before = _num_requests(stack)
    choice = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=300,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == [("get_weather", CALL)]
    sent = _new_request(stack, before)
    assert harmony_tokenizer.decode(sent.prompt_token_ids).endswith(
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>")
    assert sent.sampling_params.structured_output.kind == "json_schema"
    assert json.loads(sent.sampling_params.structured_output.spec) == TOOLS[0]["function"]["parameters"]

    before = _num_requests(stack)
    answer = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, max_tokens=300,
                                            response_format={"type": "json_object"}).choices[0].message
    assert (answer.content, getattr(answer, "reasoning_content", None)) == (CALL, None)
    sent = _new_request(stack, before)
    assert harmony_tokenizer.decode(sent.prompt_token_ids).endswith("<|start|>assistant<|channel|>final<|message|>")
    assert sent.sampling_params.structured_output.kind == "json_object"


def test_required_and_strict_calls_are_held_over_the_whole_answer(
    stack: tuple[RouterServer, FakeCluster], client: openai.OpenAI, harmony_tokenizer: Any
) -> None:
    """A "required" answer, and "auto" with strict functions, get a structural tag over the whole answer (its
    messages, their tags as tokens); the answer is read by its channels as any other."""
    _answering(stack, _ids(harmony_tokenizer, CALL_REPLY))
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
    for tools, choice in ((TOOLS, "required"), (strict, "auto")):
        before = _num_requests(stack)
        answer = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=tools,  # type: ignore[arg-type]
                                                tool_choice=choice, max_tokens=300)  # type: ignore[arg-type]
        message = answer.choices[0].message
        assert message.reasoning_content == THINKING  # type: ignore[attr-defined]
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == [("get_weather", CALL)]
        assert answer.choices[0].finish_reason == "tool_calls"
        sent = _new_request(stack, before)
        so = sent.sampling_params.structured_output
        assert so is not None and so.kind == "structural_tag" and '"token": "<|channel|>"' in so.spec
        assert harmony_tokenizer.decode(sent.prompt_token_ids).endswith("<|start|>assistant")  # no header forced
        reasoning, _, calls, finish_reason, _ = _streamed(client, messages=MESSAGES, tools=tools, tool_choice=choice,
                                                          max_tokens=300)
        assert (reasoning, calls, finish_reason) == (THINKING, [("get_weather", CALL)], "tool_calls")
    r = httpx.post(f"{stack[0].url}/v1/chat/completions", timeout=20,
                   json={"model": SERVED_MODEL, "messages": MESSAGES, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


def test_the_whole_answer_tag_takes_thinking_then_a_held_call(harmony_tokenizer: Any) -> None:
    """The tag a "required" or strict answer gets, compiled by xgrammar against a tokenizer whose harmony tags are
    special tokens (as gpt-oss's) and whose ends of sequence are <|return|> and <|call|>: thinking and preambles then
    a call held to its schema; under "auto" a final answer too; never a call off the schema, nor thinking alone. A
    tokenizer without the tags special gets a 400."""
    import xgrammar as xgr

    from router.errors import APIError
    from router.harmony import call_tag
    from router.tools import ToolPlan

    tok = harmony_tokenizer
    stops = [tok.convert_tokens_to_ids("<|return|>"), tok.convert_tokens_to_ids("<|call|>")]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok), stop_token_ids=stops))
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}},
              {"type": "function", "function": {"name": "free", "parameters": {
                  "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
                  "additionalProperties": False}}}]
    plans = {"required": ToolPlan.from_request(TOOLS, "required", None), "auto": ToolPlan.from_request(strict, "auto", None)}
    thinking = f"<|channel|>analysis<|message|>{THINKING} <| x<|end|><|start|>assistant"
    preamble = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
    call = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{CALL}"
    final = "<|channel|>final<|message|>It is sunny."

    for choice, plan in plans.items():
        assert plan is not None
        so = call_tag(plan, frozenset(TAGS))
        assert so is not None

        def takes(text: str, stop: int, so: Any = so) -> bool:
            matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(so.spec))
            return all(matcher.accept_token(t) for t in _ids(tok, text)) and matcher.accept_token(stop)

        assert takes(call, stops[1]) and takes(thinking + call, stops[1]) and takes(thinking + preamble + call, stops[1])
        assert not takes(thinking + call.replace("city", "town"), stops[1])
        assert takes(thinking + final, stops[0]) == (choice == "auto")
        assert not takes(thinking[:-len("<|start|>assistant")], stops[0])
        with pytest.raises(APIError, match="need its tags to be special tokens"):
            call_tag(plan, frozenset())
    free_call = "<|channel|>commentary to=functions.free <|constrain|>json<|message|>{\"any\": [1]}"
    auto = call_tag(plans["auto"], frozenset(TAGS))  # type: ignore[arg-type]
    assert auto is not None
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(auto.spec))
    assert all(matcher.accept_token(t) for t in _ids(tok, free_call))  # not strict: any object, off its schema
    assert call_tag(ToolPlan.from_request(TOOLS, "auto", None), frozenset(TAGS)) is None  # type: ignore[arg-type]
    # allowed_tools under "auto": a tag, though no function is strict; a call of a function not allowed is refused.
    only_free = ToolPlan.from_request([TOOLS[0], strict[1]], {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "free"}}]}}, None)
    assert only_free is not None
    held = call_tag(only_free, frozenset(TAGS))
    assert held is not None

    def allowed_takes(text: str, stop: int) -> bool:
        assert held is not None
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(held.spec))
        return all(matcher.accept_token(t) for t in _ids(tok, text)) and matcher.accept_token(stop)

    assert allowed_takes(free_call, stops[1]) and allowed_takes(thinking + final, stops[0])
    assert not allowed_takes(call, stops[1])


def test_reasoning_effort_and_earlier_thinking_reach_the_template(
    stack: tuple[RouterServer, FakeCluster], client: openai.OpenAI, harmony_tokenizer: Any
) -> None:
    _answering(stack, _ids(harmony_tokenizer, ANSWER_REPLY))
    before = _num_requests(stack)
    conversation = [*MESSAGES, {"role": "assistant", "reasoning_content": "Earlier thought.", "content": None,
                                "tool_calls": [{"id": "c1", "type": "function",
                                                "function": {"name": "get_weather", "arguments": CALL}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    client.chat.completions.create(model=SERVED_MODEL, messages=conversation, tools=TOOLS,  # type: ignore[arg-type]
                                   max_tokens=300, reasoning_effort="high")
    prompt = harmony_tokenizer.decode(_new_request(stack, before).prompt_token_ids)
    assert "Reasoning: high\n" in prompt
    assert ("<|start|>assistant<|channel|>analysis<|message|>Earlier thought.<|end|><|start|>assistant "
            "to=functions.get_weather<|channel|>commentary json<|message|>") in prompt
    assert prompt.endswith("<|message|>sunny<|end|><|start|>assistant")


def test_reasoning_effort_where_the_template_takes_none_is_refused(redis_url: str, tokenizer: Any) -> None:
    prompts = PromptProcessor(tokenizer, max_model_len=2048)
    with fake_stack(redis_url, prompts, _ids(tokenizer, "Hi"), {"token_delay_s": 0.001, "max_model_len": 2048},
                    request_timeout_s=5.0) as (server, _):
        for path, body in (("chat/completions", {"messages": MESSAGES, "reasoning_effort": "low"}),
                           ("responses", {"input": "Hi", "reasoning": {"effort": "low"}})):
            r = httpx.post(f"{server.url}/v1/{path}", json={"model": SERVED_MODEL, **body}, timeout=20)
            assert r.status_code == 400, r.text
            assert "takes no reasoning effort" in r.json()["error"]["message"]
            assert r.json()["error"]["param"] == ("reasoning_effort" if path.startswith("chat") else "reasoning.effort")


def test_the_responses_api_reads_the_format_and_sets_the_effort(
    stack: tuple[RouterServer, FakeCluster], client: openai.OpenAI, harmony_tokenizer: Any
) -> None:
    _answering(stack, _ids(harmony_tokenizer, CALL_REPLY))
    before = _num_requests(stack)
    response = client.responses.create(
        model=SERVED_MODEL, input="Weather in Paris?", max_output_tokens=300, reasoning={"effort": "low"},
        tools=[{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"],
                "strict": False}])
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    call = response.output[1]
    assert (call.name, call.arguments) == ("get_weather", CALL)  # type: ignore[union-attr]
    assert "Reasoning: low\n" in harmony_tokenizer.decode(_new_request(stack, before).prompt_token_ids)
    r = httpx.post(f"{stack[0].url}/v1/responses", timeout=20, json={
        "model": SERVED_MODEL, "input": "Hi", "reasoning": {"effort": "low", "summary": "concise"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.summary"
