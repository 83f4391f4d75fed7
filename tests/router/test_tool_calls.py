"""Tool calling through the router: OpenAI client -> router -> fake engines over real ZMQ and Redis.

The fake engines answer with the tokens of a Hermes-format reply, so what is checked is the router's
part: the tools reach the chat template (and the engines' prompt), the answer's calls are read out
the same whether streamed or not, and requests the router cannot serve exactly get a 400 that says
why. That a grammar holds a "required" or named answer to the tools' schemas is checked on the
engine (``tests/engine/test_tool_call_grammar.py``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest

from router.tokenization import PromptProcessor, load_chat_template
from router.tool_parsers import ToolCall, detect_parser
from router.tools import ToolDeltas, ToolPlan
from tests.router.fake_engine import FakeCluster
from tests.router.router_harness import SERVED_MODEL, RouterServer, fake_stack, make_state

CONTENT = "Let me look that up."
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "Europe/Paris"})]
REPLY_TEXT = CONTENT + "\n" + "\n".join(
    f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>' for name, args in CALLS
)
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


@pytest.fixture(scope="module")
def tool_prompts(tokenizer: Any) -> PromptProcessor:
    return PromptProcessor(tokenizer, max_model_len=2048, chat_template=load_chat_template("chatml-tools"))


@pytest.fixture(scope="module")
def stack(redis_url: str, tokenizer: Any, tool_prompts: PromptProcessor) -> Iterator[tuple[RouterServer, FakeCluster]]:
    reply = list(tokenizer.encode(REPLY_TEXT, add_special_tokens=False))
    with fake_stack(redis_url, tool_prompts, reply, {"token_delay_s": 0.001, "max_model_len": 2048},
                    tool_call_parser="hermes", request_timeout_s=5.0) as stack:
        yield stack


@pytest.fixture
def client(stack: tuple[RouterServer, FakeCluster]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack[0].url}/v1", api_key="unused", max_retries=0, timeout=20)


@contextlib.contextmanager
def _answering(redis_url: str, prompts: PromptProcessor, tokenizer: Any, reply_text: str,
               parser: str) -> Iterator[tuple[openai.OpenAI, FakeCluster]]:
    """A router with ``--tool-call-parser parser`` before fake engines that answer ``reply_text``: a client, the
    engines."""
    reply = list(tokenizer.encode(reply_text, add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001, "max_model_len": 2048},
                    tool_call_parser=parser, request_timeout_s=5.0) as (server, cluster):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20), cluster


def _prompt_text(cluster: FakeCluster, tokenizer: Any, response_id: str) -> str:
    sent = [r for r in cluster.requests() if r.request_id.startswith(response_id)]
    assert sent, "no engine request"
    return str(tokenizer.decode(sent[0].prompt_token_ids))


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[dict[str, Any]], str | None, str]:
    """A streamed answer put together as a client does: content, calls by index (with how many deltas brought their
    arguments), finish reason, id."""
    content, calls, finish_reason, response_id = "", {}, None, ""
    for chunk in client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, stream=True, **kw):
        response_id = chunk.id
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for part in choice.delta.tool_calls or []:
                call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
                call["id"] = part.id or call["id"]
                if part.function is not None:
                    call["name"] += part.function.name or ""
                    call["arguments"] += part.function.arguments or ""
                    call["pieces"] += bool(part.function.arguments)
            finish_reason = choice.finish_reason or finish_reason
    return content, [calls[i] for i in sorted(calls)], finish_reason, response_id


def test_auto_reads_the_calls_out_and_the_model_saw_the_tools(
    client: openai.OpenAI, stack: Any, tokenizer: Any
) -> None:
    response = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == CONTENT
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLS
    assert all(c.type == "function" and c.id.startswith("chatcmpl-tool-") for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    prompt = _prompt_text(stack[1], tokenizer, response.id)
    assert '"name": "get_weather"' in prompt and "The local time in a time zone" in prompt and "<tool_call>" in prompt


def test_streamed_calls_equal_the_whole_answer(client: openai.OpenAI) -> None:
    """Under "auto" the calls the model writes freely stream their arguments as they are written (not each call whole
    once it closes), joining into the whole answer's, character for character."""
    whole = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200)
    content, calls, finish_reason, _ = _streamed(client, tools=TOOLS, max_tokens=200)
    assert finish_reason == "tool_calls"
    assert content == CONTENT
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == CALLS
    assert [c["arguments"] for c in calls] == [c.function.arguments for c in whole.choices[0].message.tool_calls or []]
    assert all(c["pieces"] >= 3 for c in calls), calls
    assert all(c["id"] and c["id"].startswith("chatcmpl-tool-") for c in calls)


def test_streamed_calls_with_logprobs_and_n(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, n=2, stream=True, logprobs=True
    )
    calls: dict[int, list[str]] = {0: [], 1: []}
    finish: dict[int, str | None] = {}
    for chunk in response:
        for choice in chunk.choices:
            calls[choice.index] += [p.function.name for p in choice.delta.tool_calls or [] if p.function and p.function.name]
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert calls == {0: ["get_weather", "get_time"], 1: ["get_weather", "get_time"]}
    assert finish == {0: "tool_calls", 1: "tool_calls"}


def test_parallel_tool_calls_false_keeps_the_first(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, parallel_tool_calls=False, max_tokens=200
    )
    assert [c.function.name for c in response.choices[0].message.tool_calls or []] == ["get_weather"]
    _, calls, _, _ = _streamed(client, tools=TOOLS, parallel_tool_calls=False, max_tokens=200)
    assert [c["name"] for c in calls] == ["get_weather"]


def test_auto_with_no_tools_is_a_plain_answer(stack: Any) -> None:
    body = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 200, "tools": [], "tool_choice": "auto"}
    response = httpx.post(f"{stack[0].url}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"] == {"role": "assistant", "content": REPLY_TEXT}


def test_tool_choice_none_leaves_the_text_as_it_is(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=200
    )
    assert response.choices[0].message.content == REPLY_TEXT
    assert response.choices[0].message.tool_calls is None
    assert response.choices[0].finish_reason == "stop"


def test_a_call_cut_short_stays_content(client: openai.OpenAI, tokenizer: Any) -> None:
    # Cut inside the first call's JSON: not a call, and the answer says it was cut.
    cut = len(tokenizer.encode(CONTENT + '\n<tool_call>\n{"name": "get_weather", "arg', add_special_tokens=False))
    response = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=cut)
    choice = response.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None
    assert choice.message.content is not None and choice.message.content.startswith(CONTENT + "\n<tool_call>")


def test_named_and_required_send_a_structural_tag_in_the_template_s_format(client: openai.OpenAI, stack: Any) -> None:
    """With a parser whose format has a structural tag (hermes), a named or "required" answer is held to calls in
    the format the chat template teaches, not to a JSON array the model was never shown: it opens with a call,
    each call's arguments held to its function's schema; a named answer's one call is to that function. (Formats
    whose tags are special tokens: ``test_mistral_calls_behind_a_special_token`` and ``test_tool_parsers.py``.)"""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    named = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    [sent] = [r for r in stack[1].requests() if r.request_id.startswith(named.id) and r.decode_target is not None]
    so = sent.sampling_params.structured_output
    assert so is not None and so.kind == "structural_tag"
    tag = json.loads(so.spec)["format"]
    assert tag["at_least_one"] is True and tag["stop_after_first"] is True
    assert [(t["begin"], t["content"]["json_schema"]) for t in tag["tags"]] == [
        ('<tool_call>\n{"name": "get_time", "arguments": ', TOOLS[1]["function"]["parameters"])]
    grammar = Grammar.from_structural_tag(so.spec)
    time_call = REPLY_TEXT[REPLY_TEXT.rindex("<tool_call>"):]
    assert accepts(grammar, time_call) and not accepts(grammar, CONTENT + "\n" + time_call)
    assert not accepts(grammar, REPLY_TEXT[len(CONTENT) + 1: REPLY_TEXT.index("</tool_call>") + 12])  # get_weather
    # The fake engine ignores the grammar: its reply is read in the format's layout, its first call kept.
    assert [c.function.name for c in named.choices[0].message.tool_calls or []] == ["get_weather"]
    assert named.choices[0].finish_reason == "stop"

    required = client.chat.completions.create(
        model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200, tool_choice="required",
    )
    [sent] = [r for r in stack[1].requests() if r.request_id.startswith(required.id) and r.decode_target is not None]
    so = sent.sampling_params.structured_output
    assert so is not None and so.kind == "structural_tag"
    tag = json.loads(so.spec)["format"]
    assert tag["at_least_one"] is True and tag["stop_after_first"] is False
    assert [t["content"]["json_schema"] for t in tag["tags"]] == [t["function"]["parameters"] for t in TOOLS]
    grammar = Grammar.from_structural_tag(so.spec)
    calls_only = REPLY_TEXT[len(CONTENT) + 1:]
    assert accepts(grammar, calls_only) and not accepts(grammar, REPLY_TEXT) and not accepts(grammar, CONTENT)
    calls = required.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLS
    assert required.choices[0].finish_reason == "tool_calls"


def test_strict_functions_under_auto_send_a_structural_tag_over_the_calls(client: openai.OpenAI, stack: Any) -> None:
    """OpenAI's ``strict``: under "auto" the engine gets a structural tag that holds each call the model writes in the
    template's format to an offered function, a strict one's arguments to its schema, the text around free (one call
    at most without parallel calls). The tag admits the fake reply's calls; xgrammar refuses an unknown function,
    arguments off the schema, and a second call where parallel calls are off. The answer is read as before."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]
    for parallel in (True, False):
        response = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=strict, max_tokens=200,
                                                  parallel_tool_calls=parallel)
        [sent] = [r for r in stack[1].requests() if r.request_id.startswith(response.id) and r.decode_target is not None]
        so = sent.sampling_params.structured_output
        assert so is not None and so.kind == "structural_tag"
        tag = json.loads(so.spec)["format"]
        assert tag["triggers"] == ["<tool_call>"] and tag["stop_after_first"] is not parallel
        assert [t["begin"] for t in tag["tags"]] == [f'<tool_call>\n{{"name": "{n}", "arguments": ' for n, _ in CALLS]
        assert [t["content"]["json_schema"] for t in tag["tags"]] == [TOOLS[0]["function"]["parameters"], {"type": "object"}]
        grammar = Grammar.from_structural_tag(so.spec)
        first = REPLY_TEXT[: REPLY_TEXT.index("</tool_call>") + len("</tool_call>")]
        assert accepts(grammar, first) and accepts(grammar, REPLY_TEXT) is parallel
        assert not accepts(grammar, first.replace("celsius", "kelvin"))
        assert not accepts(grammar, first.replace("get_weather", "get_stock"))
        calls = response.choices[0].message.tool_calls or []
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == CALLS[: None if parallel else 1]
    # Without a strict function, "auto" sends no grammar.
    plain = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200)
    [sent] = [r for r in stack[1].requests() if r.request_id.startswith(plain.id) and r.decode_target is not None]
    assert sent.sampling_params.structured_output is None
    # A strict function's calls and a grammar of the caller's own cannot both hold the output.
    body = {"model": SERVED_MODEL, "messages": MESSAGES, "tools": strict, "response_format": {"type": "json_object"}}
    response = httpx.post(f"{stack[0].url}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format", response.text


def test_allowed_tools_hold_the_calls_to_a_subset_while_the_template_shows_every_tool(
        client: openai.OpenAI, stack: Any) -> None:
    """OpenAI's ``tool_choice: {"type": "allowed_tools", ...}``: every tool still reaches the chat template (the
    prompt is a plain "auto" request's, so its cache serves both), and a structural tag holds the calls the model may
    write to the allowed functions: under "auto" the text around them free, under "required" a call first. A name
    not among the tools, or another mode, is refused by name."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    def sent(response_id: str) -> Any:
        [request] = [r for r in stack[1].requests() if r.request_id.startswith(response_id) and r.decode_target is not None]
        return request

    plain = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200)
    time_call = REPLY_TEXT[REPLY_TEXT.rindex("<tool_call>"):]
    weather_call = REPLY_TEXT[len(CONTENT) + 1: REPLY_TEXT.index("</tool_call>") + len("</tool_call>")]
    for mode in ("auto", "required"):
        choice = {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [
            {"type": "function", "function": {"name": "get_time"}}]}}
        response = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                  tool_choice=choice)  # type: ignore[arg-type]
        request = sent(response.id)
        assert request.prompt_token_ids == sent(plain.id).prompt_token_ids
        so = request.sampling_params.structured_output
        assert so is not None and so.kind == "structural_tag"
        tag = json.loads(so.spec)["format"]
        assert tag["at_least_one"] is (mode == "required")
        assert [t["begin"] for t in tag["tags"]] == ['<tool_call>\n{"name": "get_time", "arguments": ']
        grammar = Grammar.from_structural_tag(so.spec)
        assert accepts(grammar, time_call) and not accepts(grammar, weather_call)
        assert accepts(grammar, CONTENT) is (mode == "auto")
    for tool_choice, param in (
            ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
                {"type": "function", "function": {"name": "get_stock"}}]}}, "tool_choice.allowed_tools.tools.0"),
            ({"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": []}}, "tool_choice.allowed_tools.mode"),
            ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}, "tool_choice.allowed_tools.tools")):
        body = {"model": SERVED_MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice}
        refused = httpx.post(f"{stack[0].url}/v1/chat/completions", json=body, timeout=10)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


def test_earlier_calls_and_tool_results_reach_the_template(
    client: openai.OpenAI, stack: Any, tokenizer: Any
) -> None:
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees"},
    ]
    response = client.chat.completions.create(model=SERVED_MODEL, messages=messages, tools=TOOLS, max_tokens=5)
    prompt = _prompt_text(stack[1], tokenizer, response.id)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nSunny, 21 degrees\n</tool_response>" in prompt


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools.0"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools.0.function.parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}},
         "tool_choice.function.name"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
         "messages.1.tool_calls.0.function.arguments"),
    ],
)
def test_malformed_tool_requests_get_400(stack: Any, body: dict[str, Any], param: str) -> None:
    request = {"model": SERVED_MODEL, "messages": MESSAGES, "max_tokens": 4, **body}
    response = httpx.post(f"{stack[0].url}/v1/chat/completions", json=request, timeout=10)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_refused_where_the_model_would_not_see_the_tools_or_no_parser_reads_them(
    redis_url: str, prompts: PromptProcessor, tool_prompts: PromptProcessor
) -> None:
    # The default model's own template leaves tools out: any use of them is refused, "none" is not.
    assert not prompts.renders_tools and tool_prompts.renders_tools
    with RouterServer(make_state(prompts, redis_url=None, tool_call_parser="hermes")) as plain, \
            RouterServer(make_state(tool_prompts, redis_url=None)) as unparsed:
        url = f"{plain.url}/v1/chat/completions"
        for choice in ("auto", "required", {"type": "function", "function": {"name": "get_time"}}):
            body = {"model": SERVED_MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice}
            response = httpx.post(url, json=body, timeout=10)
            assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text
            assert "--chat-template" in response.json()["error"]["message"]
        tokenize = {"model": SERVED_MODEL, "messages": MESSAGES, "tools": TOOLS}
        response = httpx.post(f"{plain.url}/tokenize", json=tokenize, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text
        # (no engine: past validation, "none" waits for one and gets 503, not a 400)
        body = {"model": SERVED_MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}
        assert httpx.post(url, json=body, timeout=10).status_code != 400

        url = f"{unparsed.url}/v1/chat/completions"
        body = {"model": SERVED_MODEL, "messages": MESSAGES, "tools": TOOLS}
        response = httpx.post(url, json=body, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice", response.text
        assert "--tool-call-parser" in response.json()["error"]["message"]
        # Counting needs no parser: the same tools are rendered.
        assert httpx.post(f"{unparsed.url}/tokenize", json=tokenize, timeout=10).status_code == 200


def test_chat_templates_load_by_path_or_name(tmp_path: Any) -> None:
    assert load_chat_template(None) is None
    shipped = load_chat_template("chatml-tools")
    assert shipped is not None and "<tool_call>" in shipped
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="chatml-tools"):
        load_chat_template("no-such-template")


def _plan(choice: Any, parallel: bool | None = None) -> ToolPlan:
    plan = ToolPlan.from_request(TOOLS, choice, parallel)
    assert plan is not None
    return plan


def test_a_named_calls_arguments_stream_as_written_and_an_empty_answer_is_still_the_call() -> None:
    deltas = ToolDeltas.start(_plan({"type": "function", "function": {"name": "get_time"}}), None)
    pieces = [deltas.feed(text) for text in ['{"zone"', "", ': "UTC"}']] + [deltas.finish()]
    assert all(content == "" for content, _ in pieces)
    parts = [part for _, calls in pieces for part in calls]
    assert parts[0].id and parts[0].type == "function" and parts[0].function.name == "get_time"
    assert all(p.id is None and p.function.name is None and p.index == 0 for p in parts[1:])
    assert "".join(p.function.arguments or "" for p in parts) == '{"zone": "UTC"}'

    empty = ToolDeltas.start(_plan({"type": "function", "function": {"name": "get_time"}}), None)
    [(_, [call])] = [empty.finish()]
    assert call.function.name == "get_time" and call.function.arguments == ""


def test_a_required_answers_calls_stream_as_written_and_read_back_as_a_whole_response() -> None:
    answer = ('[{"name": "get_time", "arguments": {"zone": "U\\"}TC"}}, '
              '{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, {"a": 2}]}}]')
    whole = [ToolCall("get_time", '{"zone": "U\\"}TC"}'),
             ToolCall("get_weather", '{"city": "Oslo", "days": [1, {"a": 2}]}')]
    assert _plan("required").extract(answer, None) == (None, whole)
    for size in (1, 3, 7, len(answer)):  # however the text is cut, the same calls
        deltas = ToolDeltas.start(_plan("required"), None)
        pieces = [deltas.feed(answer[i:i + size]) for i in range(0, len(answer), size)] + [deltas.finish()]
        assert all(content == "" for content, _ in pieces)
        parts = [part for _, calls in pieces for part in calls]
        opened = [p for p in parts if p.id is not None]
        assert [(p.index, p.type, p.function.name) for p in opened] == [(0, "function", "get_time"),
                                                                         (1, "function", "get_weather")]
        assert all(p.function.name is None for p in parts if p.id is None)
        joined = ["".join(p.function.arguments or "" for p in parts if p.index == i) for i in (0, 1)]
        assert joined == [call.arguments for call in whole]
        assert deltas.num_calls == 2
    # The first call opens once its name is written, before its arguments are.
    early = ToolDeltas.start(_plan("required"), None)
    assert early.feed(answer[:19]) == ("", [])
    [(_, [first])] = [early.feed(answer[19:20])]  # the quote that closes "get_time"
    assert first.function.name == "get_time" and first.function.arguments == ""


def test_a_required_answer_cut_short_or_off_its_layout() -> None:
    answer = '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    # Cut inside the arguments: the call with its arguments so far, as a named call's (finish_reason length).
    assert _plan("required").extract(answer[:40], None) == (None, [ToolCall("get_time", '{"zon')])
    # Cut before any call opened: the text is the content, nothing lost.
    assert _plan("required").extract(answer[:12], None) == (answer[:12], [])
    # Cut in the second call's name: the first call whole, the rest content.
    cut = answer.index("get_weather") + 1
    assert _plan("required").extract(answer[:cut], None) == ('{"name": "g', [ToolCall("get_time", '{"zone": "UTC"}')])
    # Not the grammar's layout (an engine that did not apply it): content.
    assert _plan("required").extract("Hello [there]", None) == ("Hello [there]", [])
    # One call asked for: a second (which the grammar forbids) is content, not dropped.
    content, calls = _plan("required", parallel=False).extract(answer, None)
    assert calls == [ToolCall("get_time", '{"zone": "UTC"}')] and content == answer[answer.index('{"name": "get_w'):]
    stream = ToolDeltas.start(_plan("required", parallel=False), None)
    streamed = [stream.feed(answer[:50]), stream.feed(answer[50:]), stream.finish()]
    assert "".join(c for c, _ in streamed) == content and stream.num_calls == 1


def test_llama3_required_named_and_strict_calls_stream_as_written() -> None:
    """Llama 3's calls as its structural tag holds them (the whole answer, ``; `` apart) stream their arguments as
    written under "required", for a named function and for strict functions under "auto", however the text is cut;
    text off that layout is content, and under "auto" a text answer is content as the parser's stream gives it (its
    trailing whitespace out)."""
    from router.tool_parsers import PARSERS

    llama = PARSERS["llama3_json"]
    answer = ('{"name": "get_time", "parameters": {"zone": "U\\"}TC"}}; '
              '{"name": "get_weather", "parameters": {"city": "Oslo", "days": [1, {"a": 2}]}}')
    whole = [ToolCall("get_time", '{"zone": "U\\"}TC"}'),
             ToolCall("get_weather", '{"city": "Oslo", "days": [1, {"a": 2}]}')]
    required, named = (replace(_plan(choice), native=True) for choice in ("required", {
        "type": "function", "function": {"name": "get_time"}}))
    assert required.extract(answer, llama) == (None, whole)
    # A second call (which the grammar forbids) is content, as a "required" answer's past its one call.
    assert named.extract(answer, llama) == (answer[answer.index('{"name": "get_w'):], whole[:1])
    auto = replace(_plan("auto"), native=True)
    for plan, size in ((p, n) for p in (required, auto) for n in (1, 3, 7, len(answer))):
        deltas = ToolDeltas.start(plan, llama)
        pieces = [deltas.feed(answer[i:i + size]) for i in range(0, len(answer), size)] + [deltas.finish()]
        assert all(content == "" for content, _ in pieces)
        parts = [part for _, calls in pieces for part in calls]
        assert [p.function.name for p in parts if p.id is not None] == ["get_time", "get_weather"]
        assert ["".join(p.function.arguments or "" for p in parts if p.index == i) for i in (0, 1)] == [
            c.arguments for c in whole]
        if size == 1:  # in pieces, not whole at the end
            assert len([p for p in parts if p.index == 1 and p.function.arguments]) > 10
    assert required.extract("Hello {there}", llama) == ("Hello {there}", [])
    assert auto.extract(answer, llama) == (None, whole)
    text = "It is sunny in Paris.\n\n"
    assert auto.extract(text, llama) == llama.extract(text) == ("It is sunny in Paris.", [])
    deltas = ToolDeltas.start(auto, llama)
    assert "".join(deltas.feed(c)[0] for c in text) + deltas.finish()[0] == "It is sunny in Paris."


_DS_CALLS, _DS_CALL, _DS_SEP, _DS_END, _DS_CALLS_END = (
    "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581sep\uff5c>",
    "<\uff5ctool\u2581call\u2581end\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>")
# Each format's held calls as its structural tag writes them: text, a call of get_weather (its city a string
# argument, with a quote, a backslash and a line of its own; unit an enum), one of get_time, text.
HELD_ANSWERS = {
    "qwen3_coder": ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSt \"Denis\"\\\nnord\n</parameter>\n"
                    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call> Done."),
    "glm45": ("Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>St \"Denis\"\\\nnord</arg_value>\n"
              "<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call><tool_call>get_time"
              "<arg_key>zone</arg_key><arg_value>UTC</arg_value></tool_call> Done."),
    "minimax_m2": ('Checking.<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">St "Denis"\\\nnord'
                   '</parameter>\n<parameter name="unit">celsius</parameter>\n</invoke>\n<invoke name="get_time">\n'
                   '<parameter name="zone">UTC</parameter>\n</invoke>\n</minimax:tool_call> Done.'),
    "deepseek_v31": (f'Checking.{_DS_CALLS}{_DS_CALL}get_weather{_DS_SEP}{{"city": "St \\"Denis\\"\\\\\\nnord", '
                     f'"unit": "celsius"}}{_DS_END}{_DS_CALL}get_time{_DS_SEP}{{"zone": "UTC"}}{_DS_END}{_DS_CALLS_END} Done.'),
    "deepseek_v3": (f'Checking.{_DS_CALLS}{_DS_CALL}function{_DS_SEP}get_weather\n```json\n{{"city": "St \\"Denis\\"'
                    f'\\\\\\nnord", "unit": "celsius"}}\n```{_DS_END}{_DS_CALL}function{_DS_SEP}get_time\n```json\n'
                    f'{{"zone": "UTC"}}\n```{_DS_END}{_DS_CALLS_END} Done.'),
    # (v11's form, its tags special tokens; its calls run to the answer's end)
    "mistral": ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "St \\"Denis\\"\\\\\\nnord", "unit": "celsius"}'
                '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}'),
    "kimi_k2": ('Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": "St \\"Denis\\"\\\\\\nnord", "unit": "celsius"}<|tool_call_end|><|tool_call_begin|>'
                'functions.get_time:1<|tool_call_argument_begin|>{"zone": "UTC"}<|tool_call_end|>'
                '<|tool_calls_section_end|> Done.'),
}


@pytest.mark.parametrize("name", sorted(HELD_ANSWERS))
def test_calls_a_formats_tag_held_stream_their_arguments_as_the_whole_answer_reads_them(name: str) -> None:
    """Qwen3-Coder's, GLM's, MiniMax-M2's, DeepSeek's, Kimi K2's and Mistral's (v11) calls as their structural tags
    hold them ("required", named, strict under "auto") stream their arguments: each call opens once its head is read, and its
    arguments arrive in pieces however the text is cut, joining into the whole response's, which read as the
    format's parser reads the answer (XML arguments as the JSON it makes of them, a string's text as it comes)."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from router.tool_parsers import PARSERS

    parser, answer = PARSERS[name], HELD_ANSWERS[name]
    functions = [t["function"] for t in TOOLS]
    special = frozenset(parser.tags if name == "mistral" else ())
    if name != "mistral":  # (its v11 form, with tokens, is compiled in test_mistral_v11_calls_held_in_their_own_form)
        # The calls as the format's tag holds them (a "required" answer's, every argument held): the grammar takes them.
        tag = parser.call_tag(functions, frozenset(f["name"] for f in functions), True, True)
        calls_text = answer.removeprefix("Checking.").removesuffix(" Done.").lstrip()
        assert accepts(Grammar.from_structural_tag(json.dumps(tag)), calls_text)
    expected_content, expected_calls = parser.extract(answer, functions)
    assert expected_content in ("Checking. Done.", "Checking.\n\n Done.", "Checking.") and [c.name for c in expected_calls] == ["get_weather", "get_time"]
    assert json.loads(expected_calls[0].arguments) == {"city": 'St "Denis"\\\nnord', "unit": "celsius"}
    for choice in ("required", "auto"):
        plan = replace(_plan(choice), native=True, special=special)
        content, calls = plan.extract(answer, parser)
        assert content == expected_content
        assert [(c.name, json.loads(c.arguments), c.id) for c in calls] == [
            (c.name, json.loads(c.arguments), c.id) for c in expected_calls]
        if name in ("qwen3_coder", "glm45", "minimax_m2"):  # made as the parser makes it
            assert [c.arguments for c in calls] == [c.arguments for c in expected_calls]
        for size in (1, 3, 7, len(answer)):
            deltas = ToolDeltas.start(plan, parser)
            pieces = [deltas.feed(answer[i:i + size]) for i in range(0, len(answer), size)] + [deltas.finish()]
            assert "".join(text for text, _ in pieces) == content
            parts = [part for _, parts in pieces for part in parts]
            assert [(p.index, p.function.name) for p in parts if p.id is not None] == [(0, "get_weather"), (1, "get_time")]
            assert ["".join(p.function.arguments or "" for p in parts if p.index == i) for i in (0, 1)] == [
                c.arguments for c in calls]
            if name == "kimi_k2":  # the ids the model wrote
                assert [p.id for p in parts if p.id is not None] == ["functions.get_weather:0", "functions.get_time:1"]
            if size == 1:  # the city's text as it comes, not the arguments whole once the call closes
                assert len([p for p in parts if p.index == 0 and p.function.arguments]) > 10
    # The first call opens once its head is read, before its arguments end.
    deltas = ToolDeltas.start(replace(_plan("required"), native=True, special=special), parser)
    opened = deltas.feed(answer[: answer.index("Denis")])[1]
    assert [p.function.name for p in opened if p.id is not None] == ["get_weather"]


def test_held_xml_arguments_typed_trimmed_and_kept_apart_from_text() -> None:
    """Qwen3-Coder's XML arguments held by its tag: a string's value on lines of its own (those newlines the
    layout's), ``null`` (any case) as null even where a string is declared, other types whole once their element
    closes; a call too many, an opening off the layout and an answer cut short keep every character the model wrote
    or end the call where it was certain."""
    from router.call_readers import ArgumentsPiece, CallStart, TaggedCalls, read_pieces
    from router.tool_parsers import PARSERS

    parser = PARSERS["qwen3_coder"]
    assert parser.held_layout is not None
    functions = [{"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string"}, "n": {"type": ["integer", "null"]}, "o": {"type": "object"}}}}]

    def read(text: str, max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
        """The whole answer's reading, which a character at a time gives too."""
        assert parser.held_layout is not None
        whole = read_pieces(TaggedCalls(parser.held_layout, functions, max_calls), text)
        reader = TaggedCalls(parser.held_layout, functions, max_calls)
        content, calls = "", []
        for event in [e for c in text for e in reader.feed(c)] + reader.finish():
            if isinstance(event, CallStart):
                calls.append(ToolCall(event.name, ""))
            elif isinstance(event, ArgumentsPiece):
                calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + event.text)
            else:
                content += event
        assert (content or None, calls) == whole
        return whole

    def call(params: str) -> str:
        return f"<tool_call>\n<function=f>\n{params}</function>\n</tool_call>"

    cases = {
        "<parameter=s>\nNULL\n</parameter>\n": '{"s": null}',
        "<parameter=s>\nnull \n</parameter>\n": '{"s": "null "}',
        "<parameter=s>\n\nnul\n\n</parameter>\n": '{"s": "\\nnul\\n"}',
        "<parameter=s></parameter>\n": '{"s": ""}',
        "<parameter=n>\n 42 \n</parameter>\n<parameter=o>\n{\"a\": [1]}\n</parameter>\n": '{"n": 42, "o": {"a": [1]}}',
        "<parameter=x>\n7\n</parameter>\n": '{"x": "7"}',  # undeclared: its text
        "": "{}",
    }
    for params, arguments in cases.items():
        text = call(params)
        assert read(text) == (None, [ToolCall("f", arguments)]) == parser.extract(text, functions), params
    second = call("<parameter=s>\nb\n</parameter>\n")
    assert read(call("") + "\n" + second, max_calls=1) == (second, [ToolCall("f", "{}")])
    assert read("Hi <tool_call>\n{\"name\": 1}</tool_call>") == ('Hi <tool_call>\n{"name": 1}</tool_call>', [])
    assert read("Hi <tool_call>\n<func") == ("Hi <tool_call>\n<func", [])  # cut before a call opened
    cut = call("<parameter=s>\nabc\ndef\n</parameter>\n")
    assert read(cut[: cut.index("def") + 2]) == (None, [ToolCall("f", '{"s": "abc\\nde')])
    assert read(cut[: cut.index("<parameter") + 4]) == (None, [ToolCall("f", "{")])


def test_the_probe_finds_whether_a_template_shows_tools(tokenizer: Any) -> None:
    shows = "{% for t in tools %}{{ t.function.name }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    hides = "{% for m in messages %}{{ m.content }}{% endfor %}"
    fails = "{{ raise_exception('no tools here') if tools else '' }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert PromptProcessor(tokenizer, chat_template=shows).renders_tools
    assert not PromptProcessor(tokenizer, chat_template=hides).renders_tools
    assert not PromptProcessor(tokenizer, chat_template=fails).renders_tools
    assert detect_parser(load_chat_template("chatml-tools")) == "hermes"


def test_a_chat_completion_continues_the_final_message(client: openai.OpenAI, stack: Any, tokenizer: Any) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Let me"}]
    response = client.chat.completions.create(
        model=SERVED_MODEL, messages=messages, max_tokens=3,  # type: ignore[arg-type]
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert _prompt_text(stack[1], tokenizer, response.id).endswith("<|im_start|>assistant\nLet me")


def test_mistral_calls_behind_a_special_token(redis_url: str, tokenizer: Any, tokenizer_dir: Any) -> None:
    # Mistral's [TOOL_CALLS] is a special token, which detokenizing drops: these answers keep it.
    special = type(tokenizer).from_pretrained(str(tokenizer_dir))
    special.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    template = ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}")
    prompts = PromptProcessor(special, max_model_len=2048, chat_template=template)
    reply = list(special.encode('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                                add_special_tokens=False))
    assert special.decode(reply, skip_special_tokens=True).startswith("[{")  # the tag would be lost
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001, "max_model_len": 2048},
                    tool_call_parser="mistral", request_timeout_s=5.0) as (server, cluster):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20)
        choice = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS).choices[0]
        [call] = choice.message.tool_calls or []
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
        assert len(call.id) == 9 and call.id.isalnum()  # Mistral's templates take back no other id
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        parts = [p for chunk in client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS,
                                                               stream=True)
                 for c in chunk.choices for p in c.delta.tool_calls or []]
        assert [(p.function.name, len(p.id or "")) for p in parts if p.function and p.function.name] == [
            ("get_weather", 9)]
        pieces = [p.function.arguments for p in parts if p.function and p.function.arguments]
        assert "".join(pieces) == call.function.arguments and len(pieces) >= 3, pieces  # the array's calls stream too
        # Strict functions under "auto", and a "required" answer: a structural tag holds the calls from the
        # [TOOL_CALLS] token on, as that token, in this tokenizer's form (no [ARGS]: one JSON array of calls).
        strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
        for tools, choice in ((strict, "auto"), (TOOLS, "required")):
            answer = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=tools,  # type: ignore[arg-type]
                                                    tool_choice=choice, max_tokens=50)  # type: ignore[arg-type]
            [call] = answer.choices[0].message.tool_calls or []
            assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
            [sent] = [r for r in cluster.requests() if r.request_id.startswith(answer.id) and r.decode_target is not None]
            so = sent.sampling_params.structured_output
            assert so is not None and so.kind == "structural_tag", so
            form = json.loads(so.spec)["format"]
            assert (form["type"], form["trigger_tokens"], form["at_least_one"]) == (
                "token_triggered_tags", ["[TOOL_CALLS]"], choice == "required")
            [tag] = form["tags"]
            assert tag["begin"] == {"type": "token", "token": "[TOOL_CALLS]"}
            assert tag["content"]["json_schema"]["type"] == "array"


def test_mistral_v11_calls_held_in_their_own_form(redis_url: str, tokenizer_dir: Any) -> None:
    """A tokenizer with [ARGS] among its special tokens (Mistral's v11 on) writes each call as
    ``[TOOL_CALLS]NAME[ARGS]{...}``: forced and strict calls are held in that form, both tags as tokens, and read back."""
    from transformers import AutoTokenizer

    special = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    special.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    template = ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}")
    prompts = PromptProcessor(special, max_model_len=2048, chat_template=template)
    reply = list(special.encode('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}',
                                add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001, "max_model_len": 2048},
                    tool_call_parser="mistral", request_timeout_s=5.0) as (server, cluster):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20)
        answer = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in answer.choices[0].message.tool_calls or []] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
        [sent] = [r for r in cluster.requests() if r.request_id.startswith(answer.id) and r.decode_target is not None]
        so = sent.sampling_params.structured_output
        assert so is not None and so.kind == "structural_tag"
        tags = json.loads(so.spec)["format"]["tags"]
        assert [t["content"]["elements"][:2] for t in tags] == [
            [{"type": "const_string", "value": name}, {"type": "token", "token": "[ARGS]"}]
            for name in ("get_weather", "get_time")]
        # A structural tag of the request's own naming a token this tokenizer lacks: a 400 naming it.
        body = {"model": SERVED_MODEL, "messages": MESSAGES, "response_format": {"type": "structural_tag", "format": {
            "type": "token_triggered_tags", "trigger_tokens": ["[NOPE]"], "tags": [
                {"type": "tag", "begin": {"type": "token", "token": "[NOPE]"}, "content": {"type": "const_string", "value": "x"},
                 "end": ""}]}}}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=10)
        assert response.status_code == 400 and "'[NOPE]': not a token of this model's tokenizer" in response.text


def test_llama3_json_strict_forced_and_named_calls_in_its_own_format(redis_url: str, tokenizer: Any) -> None:
    """Llama 3's JSON calls (the whole answer): strict functions under "auto", "required" and a named function each
    send a structural tag over the whole answer in that format (text instead only under "auto"), and the answer's
    calls are read back."""
    template = ("{% if tools %}Respond in the format {\"name\": function name, \"parameters\": dictionary}. "
                "{{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m.content }}\n{% endfor %}")
    prompts = PromptProcessor(tokenizer, max_model_len=2048, chat_template=template)
    reply = list(tokenizer.encode('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                                  '{"name": "get_time", "parameters": {"zone": "UTC"}}', add_special_tokens=False))
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    named = {"type": "function", "function": {"name": "get_weather"}}
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001, "max_model_len": 2048},
                    tool_call_parser="llama3_json", request_timeout_s=5.0) as (server, cluster):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20)
        for tools, choice in ((strict, "auto"), (TOOLS, "required"), (TOOLS, named)):
            answer = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=tools,  # type: ignore[arg-type]
                                                    tool_choice=choice)  # type: ignore[arg-type]
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in answer.choices[0].message.tool_calls or []]
            # (a named answer is its one call)
            assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})][:1 if choice == named else 2]
            [sent] = [r for r in cluster.requests() if r.request_id.startswith(answer.id) and r.decode_target is not None]
            so = sent.sampling_params.structured_output
            assert so is not None and so.kind == "structural_tag", so
            form = json.loads(so.spec)["format"]
            if choice == "auto":
                calls_form, text = form["elements"]
                assert form["type"] == "or" and text["type"] == "regex"
            else:
                calls_form = form
            assert calls_form["type"] == "tags_with_separator" and calls_form["separator"] == "; "
            assert [t["begin"] for t in calls_form["tags"]] == [
                f'{{"name": "{n}", "parameters": ' for n in (["get_weather"] if choice == named else ["get_weather", "get_time"])]
            assert calls_form["stop_after_first"] == (choice == named)


def test_tokenize_counts_the_tools_as_the_chat_completion_sends_them(
    client: openai.OpenAI, stack: Any, tokenizer: Any
) -> None:
    counted = httpx.post(f"{stack[0].url}/tokenize", json={"model": SERVED_MODEL, "messages": MESSAGES, "tools": TOOLS},
                         timeout=10)
    assert counted.status_code == 200, counted.text
    response = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=5)
    [sent] = [r for r in stack[1].requests() if r.request_id.startswith(response.id) and r.decode_target is not None]
    assert counted.json()["tokens"] == list(sent.prompt_token_ids)
    assert "The local time in a time zone" in tokenizer.decode(counted.json()["tokens"])
    bad = httpx.post(f"{stack[0].url}/tokenize", json={"model": SERVED_MODEL, "prompt": "hi", "tools": TOOLS}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


def test_qwen3_coder_calls_through_the_router(redis_url: str, tokenizer: Any, tool_prompts: PromptProcessor) -> None:
    """``--tool-call-parser qwen3_coder``: the calls Qwen3-Coder writes in its XML form come out as OpenAI's, each
    argument typed by the function's schema, the same whole or streamed. Strict functions under "auto" and a
    "required" answer get a structural tag in the same form (xgrammar's ``qwen_xml`` style), which admits the reply
    and refuses an argument off its schema; the calls it held stream their arguments as they are written."""
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string as accepts

    reply_text = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>")
    tools = [TOOLS[0], {"type": "function", "function": {"name": "get_count", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}}]
    with _answering(redis_url, tool_prompts, tokenizer, reply_text, "qwen3_coder") as (client, cluster):
        choice = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=tools).choices[0]
        [call] = choice.message.tool_calls or []
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather", {"city": "Paris", "unit": "celsius"})
        assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
        content, calls, finish_reason, _ = _streamed(client, tools=tools)
        assert (content, [(c["name"], c["arguments"]) for c in calls], finish_reason) == (
            "Checking.", [("get_weather", call.function.arguments)], "tool_calls")
        assert calls[0]["pieces"] >= 3, calls  # written freely, it streams too
        strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, tools[1]]
        for choice in ("auto", "required"):
            answer = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=strict,
                                                    tool_choice=choice)
            [sent] = [r for r in cluster.requests() if r.request_id.startswith(answer.id) and r.decode_target is not None]
            so = sent.sampling_params.structured_output
            assert so is not None and so.kind == "structural_tag"
            tag = json.loads(so.spec)["format"]
            assert tag["triggers"] == ["<tool_call>\n<function="] and tag["at_least_one"] is (choice == "required")
            assert [t["content"]["style"] for t in tag["tags"]] == ["qwen_xml", "qwen_xml"]
            grammar = Grammar.from_structural_tag(so.spec)
            call_text = reply_text[reply_text.index("<tool_call>"):]
            assert accepts(grammar, call_text) and not accepts(grammar, call_text.replace("celsius", "kelvin"))
            assert accepts(grammar, reply_text) is (choice == "auto")  # "required" opens with its call
            [held] = answer.choices[0].message.tool_calls or []
            assert (held.function.name, json.loads(held.function.arguments)) == (
                "get_weather", {"city": "Paris", "unit": "celsius"})
            # Streamed, the held call's arguments arrive as they are written, joining into the whole answer's.
            pieces = [part.function.arguments for chunk in client.chat.completions.create(
                model=SERVED_MODEL, messages=MESSAGES, tools=strict, tool_choice=choice, stream=True)
                for c in chunk.choices for part in c.delta.tool_calls or [] if part.function and part.function.arguments]
            assert "".join(pieces) == held.function.arguments and len(pieces) >= 3, pieces


def test_glm_calls_through_the_router_with_its_tags_special_tokens(redis_url: str, tokenizer_dir: Any) -> None:
    """GLM's format (``--tool-call-parser glm45``) behind the router, its tags special tokens as GLM's tokenizers make
    them: the answer keeps their text for the parser, and the calls come back typed by the schema, whole and streamed."""
    from transformers import AutoTokenizer

    special = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    special.add_special_tokens({"additional_special_tokens": [
        "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]})
    prompts = PromptProcessor(special, max_model_len=2048, chat_template=load_chat_template("chatml-tools"))
    reply = ("Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
             "</tool_call><tool_call>get_time<arg_key>zone</arg_key><arg_value>Europe/Paris</arg_value></tool_call>")
    with fake_stack(redis_url, prompts, list(special.encode(reply, add_special_tokens=False)),
                    {"token_delay_s": 0.001, "max_model_len": 2048}, tool_call_parser="glm45",
                    request_timeout_s=5.0) as (server, _):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20)
        expected = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "Europe/Paris"})]
        choice = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=300).choices[0]
        assert choice.message.content == "Let me check." and choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []] == expected
        content, streamed, _, _ = _streamed(client, tools=TOOLS, max_tokens=300)
        assert (content, [(c["name"], json.loads(c["arguments"])) for c in streamed]) == ("Let me check.", expected)


def test_pythonic_calls_through_the_router(redis_url: str, tokenizer: Any, tool_prompts: PromptProcessor) -> None:
    """``--tool-call-parser pythonic`` (Llama 3.2's and Llama 4's pythonic templates): an answer that is a Python list
    of calls comes out as OpenAI's calls, whole and streamed (whole once the answer ends); a strict function under
    "auto" is refused by name, the format having no structural tag."""
    reply_text = "[get_weather(city='Paris', unit=\"celsius\"), get_time(zone='Europe/Paris')]"
    with _answering(redis_url, tool_prompts, tokenizer, reply_text, "pythonic") as (client, _):
        choice = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS).choices[0]
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []] == CALLS[:1] + [
            ("get_time", {"zone": "Europe/Paris"})]
        content, calls, finish_reason, _ = _streamed(client, tools=TOOLS)
        assert (content, finish_reason) == ("", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}]
        with pytest.raises(openai.BadRequestError, match="pythonic"):
            client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=strict)


def test_granite_calls_through_the_router(redis_url: str, tokenizer: Any, tool_prompts: PromptProcessor) -> None:
    """``--tool-call-parser granite`` (Granite 3): the JSON array after ``<|tool_call|>`` comes out as OpenAI's calls,
    whole and streamed, the text before it content; strict functions under "auto" send a structural tag from that tag
    on, one array of calls."""
    reply_text = 'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'
    with _answering(redis_url, tool_prompts, tokenizer, reply_text, "granite") as (client, cluster):
        choice = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS).choices[0]
        assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []] == CALLS[:1]
        content, calls, finish_reason, _ = _streamed(client, tools=TOOLS)
        assert (content, [(c["name"], json.loads(c["arguments"])) for c in calls], finish_reason) == (
            "Checking.", CALLS[:1], "tool_calls")
        strict = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]
        answer = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=strict)
        [sent] = [r for r in cluster.requests() if r.request_id.startswith(answer.id) and r.decode_target is not None]
        so = sent.sampling_params.structured_output
        assert so is not None and so.kind == "structural_tag"
        assert json.loads(so.spec)["format"]["triggers"] == ["<|tool_call|>"]
        assert [c.function.name for c in answer.choices[0].message.tool_calls or []] == ["get_weather"]


def test_llama3_calls_written_freely_stream_as_written(redis_url: str, tokenizer: Any,
                                                       tool_prompts: PromptProcessor) -> None:
    """``--tool-call-parser llama3_json`` under "auto" (not held): Llama 3's calls, the whole answer a ``; `` apart,
    stream their arguments as the model writes them, joining into the whole answer's."""
    reply_text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                  '{"name": "get_time", "parameters": {"zone": "Europe/Paris"}}')
    with _answering(redis_url, tool_prompts, tokenizer, reply_text, "llama3_json") as (client, _):
        choice = client.chat.completions.create(model=SERVED_MODEL, messages=MESSAGES, tools=TOOLS).choices[0]
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []] == CALLS
        content, calls, finish_reason, _ = _streamed(client, tools=TOOLS)
        assert (content, finish_reason) == ("", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert all(c["pieces"] >= 3 for c in calls), calls
