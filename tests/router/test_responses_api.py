"""``POST /v1/responses`` through the router with the openai client, before fake engines: plain text,
whole and streamed (the SDK's own stream helper checks the events add up to the response); a
reasoning model's thinking and a tool call as output items; the conversation's items (instructions,
messages, earlier calls and their outputs) as the chat template renders them; structured output;
an answer cut short; and what is not served refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from router.tokenization import PromptProcessor, load_chat_template
from tests.router.fake_engine import FakeCluster
from tests.router.router_harness import SERVED_MODEL, fake_stack

THINKING = "The user asks for the weather; I will call the tool."
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
REPLY = f"<think>\n{THINKING}\n</think>\n\nChecking.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def plain(redis_url: str, prompts: Any, tokenizer: Any) -> Iterator[tuple[openai.OpenAI, FakeCluster]]:
    reply = list(tokenizer.encode(" one two three four five six", add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001}, request_timeout_s=5.0) as (server, cluster):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20), cluster


@pytest.fixture(scope="module")
def thinking(redis_url: str, tokenizer: Any) -> Iterator[tuple[openai.OpenAI, FakeCluster]]:
    prompts = PromptProcessor(tokenizer, max_model_len=2048, chat_template=load_chat_template("chatml-tools"))
    reply = list(tokenizer.encode(REPLY, add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001, "max_model_len": 2048},
                    tool_call_parser="hermes", reasoning_parser="qwen3", request_timeout_s=5.0) as (server, cluster):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20), cluster


def test_text_whole_and_streamed(plain: tuple[openai.OpenAI, FakeCluster]) -> None:
    client, _ = plain
    whole = client.responses.create(model=SERVED_MODEL, input="Count.", max_output_tokens=100)
    assert whole.status == "completed" and whole.output_text == " one two three four five six"
    assert [item.type for item in whole.output] == ["message"]
    assert whole.usage is not None and whole.usage.output_tokens == 6
    assert whole.usage.total_tokens == whole.usage.input_tokens + 6 and whole.store is True
    with client.responses.stream(model=SERVED_MODEL, input="Count.", max_output_tokens=100) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.usage == whole.usage
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}


def test_the_output_text_s_logprobs_whole_streamed_and_stored(plain: tuple[openai.OpenAI, FakeCluster]) -> None:
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: each output token's log-probability and
    its alternatives on the output text, as the chat completion's (the fake engines give each token -0.25 and its
    alternatives -2.0), whole, on each streamed delta and its done event, and in the stored response; none asked for,
    none given. A reasoning model's answers (a parser reads them) are refused."""
    client, cluster = plain
    asked: dict[str, Any] = dict(model=SERVED_MODEL, input="Count.", max_output_tokens=100,
                                 include=["message.output_text.logprobs"], top_logprobs=2)
    whole = client.responses.create(**asked)
    [part] = whole.output[0].content  # type: ignore[union-attr]
    logprobs = part.logprobs  # type: ignore[union-attr]
    assert logprobs is not None and [e.token for e in logprobs] == [
        " one", " two", " three", " four", " five", " six"]
    assert all(e.logprob == -0.25 and [t.logprob for t in e.top_logprobs] == [-0.25, -2.0] for e in logprobs)
    assert logprobs[0].bytes == list(b" one")
    assert cluster.requests()[-1].sampling_params.logprobs == 2
    events = list(client.responses.create(**asked, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [e.token for d in deltas for e in d.logprobs] == [e.token for e in logprobs]  # type: ignore[union-attr]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [e.token for e in done.logprobs] == [e.token for e in logprobs]  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert [e.token for e in final.output[0].content[0].logprobs] == [e.token for e in logprobs]  # type: ignore[union-attr]
    stored = client.responses.retrieve(whole.id)
    assert stored.output[0].content[0].logprobs == logprobs  # type: ignore[union-attr]
    plain_answer = client.responses.create(model=SERVED_MODEL, input="Count.", max_output_tokens=100)
    assert plain_answer.output[0].content[0].logprobs == []  # type: ignore[union-attr]
    assert cluster.requests()[-1].sampling_params.logprobs is None


def test_logprobs_of_a_reasoning_model_s_answers_are_refused(thinking: tuple[openai.OpenAI, FakeCluster]) -> None:
    client, _ = thinking
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=SERVED_MODEL, input="Hi", include=["message.output_text.logprobs"])
    assert refused.value.body["param"] == "include", refused.value.body  # type: ignore[index]


def test_an_answer_cut_short_is_incomplete(plain: tuple[openai.OpenAI, FakeCluster]) -> None:
    client, _ = plain
    whole = client.responses.create(model=SERVED_MODEL, input="Count.", max_output_tokens=3)
    assert whole.status == "incomplete" and whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens" and whole.output_text == " one two three"
    events = list(client.responses.create(model=SERVED_MODEL, input="Count.", max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_thinking_and_a_tool_call_become_output_items_whole_and_streamed(
    thinking: tuple[openai.OpenAI, FakeCluster],
) -> None:
    client, _ = thinking
    kwargs: dict[str, Any] = dict(model=SERVED_MODEL, input="Weather in Paris?", tools=TOOLS, max_output_tokens=300)
    whole = client.responses.create(**kwargs)
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = whole.output
    assert reasoning.content is not None and reasoning.content[0].text == f"\n{THINKING}\n"  # type: ignore[union-attr]
    assert whole.output_text == "Checking."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})  # type: ignore[union-attr]
    assert call.call_id.startswith("chatcmpl-tool-")  # type: ignore[union-attr]
    assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Checking." and final.output[2].arguments == call.arguments  # type: ignore[union-attr]
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    assert kinds.count("response.function_call_arguments.delta") >= 3  # the arguments as the model writes them
    # max_tool_calls bounds calls to OpenAI's built-in tools (none here), not function calls.
    bounded = client.responses.create(**kwargs, max_tool_calls=0)
    assert bounded.max_tool_calls == 0 and [item.type for item in bounded.output][-1] == "function_call"


def test_a_strict_function_s_calls_are_held_and_the_thinking_still_split(
    thinking: tuple[openai.OpenAI, FakeCluster],
) -> None:
    """``strict: true`` on a Responses function tool: the engine gets the structural tag over its calls (the text and
    the thinking around them free), and the answer reads as before, the thinking split off into its item."""
    client, cluster = thinking
    strict = [{**TOOLS[0], "strict": True}]
    whole = client.responses.create(model=SERVED_MODEL, input="Weather in Paris?", tools=strict, max_output_tokens=300)
    structured = cluster.requests()[-1].sampling_params.structured_output
    assert structured is not None and structured.kind == "structural_tag"
    assert json.loads(structured.spec)["format"]["tags"][0]["content"]["json_schema"] == TOOLS[0]["parameters"]
    assert [item.type for item in whole.output] == ["reasoning", "message", "function_call"]
    assert (whole.output[2].name, json.loads(whole.output[2].arguments)) == ("get_weather", {"city": "Paris"})  # type: ignore[union-attr]
    client.responses.create(model=SERVED_MODEL, input="Weather in Paris?", tools=[{**TOOLS[0], "strict": False}],
                            max_output_tokens=5)
    assert cluster.requests()[-1].sampling_params.structured_output is None


def test_the_conversation_s_items_reach_the_template(thinking: tuple[openai.OpenAI, FakeCluster], tokenizer: Any) -> None:
    client, cluster = thinking
    items: list[Any] = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"},
    ]
    client.responses.create(model=SERVED_MODEL, instructions="You help with weather.", input=items, tools=TOOLS,
                            max_output_tokens=5)
    prompt = tokenizer.decode(cluster.requests()[-1].prompt_token_ids)
    for piece in ("You help with weather.", "Be brief.", "Weather in Paris?", "get_weather", "Sunny, 21 C"):
        assert piece in prompt, (piece, prompt)
    assert prompt.index("Weather in Paris?") < prompt.index('"city": "Paris"') < prompt.index("Sunny, 21 C")


def test_text_format_constrains_the_output(plain: tuple[openai.OpenAI, FakeCluster]) -> None:
    client, cluster = plain
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    client.responses.create(model=SERVED_MODEL, input="A number.", max_output_tokens=5,
                            text={"format": {"type": "json_schema", "name": "n", "schema": schema}})
    structured = cluster.requests()[-1].sampling_params.structured_output
    assert structured is not None and structured.kind == "json_schema" and json.loads(structured.spec) == schema


def test_allowed_tools_in_the_responses_form(thinking: tuple[openai.OpenAI, FakeCluster]) -> None:
    """``tool_choice: {"type": "allowed_tools", "mode": ..., "tools": [{"type": "function", "name": ...}]}`` (the
    Responses API's form) holds the calls to the allowed functions, as the chat completion's does; a name not among
    the tools is refused as ``tool_choice.tools.N``."""
    client, cluster = thinking
    tools = [*TOOLS, {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}]
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_time"}]}
    client.responses.create(model=SERVED_MODEL, input="Weather?", tools=tools, tool_choice=choice)  # type: ignore[arg-type]
    structured = cluster.requests()[-1].sampling_params.structured_output
    assert structured is not None and structured.kind == "structural_tag"
    tag = json.loads(structured.spec)["format"]
    assert tag["at_least_one"] is True and [t["begin"] for t in tag["tags"]] == [
        '<tool_call>\n{"name": "get_time", "arguments": ']
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=SERVED_MODEL, input="Weather?", tools=tools, tool_choice={  # type: ignore[arg-type]
            "type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "get_stock"}]})
    assert refused.value.body["param"] == "tool_choice.tools.0"  # type: ignore[index]


def test_truncation_auto_drops_the_conversation_s_first_items_until_it_fits(
        plain: tuple[openai.OpenAI, FakeCluster], tokenizer: Any) -> None:
    """``truncation: "auto"``: a conversation too long for the context (256 tokens here, with the room
    ``max_output_tokens`` asks for) is shown to the model from a later user message on, as few items dropped as let
    it fit; the instructions and developer messages stay. Disabled (the default), the same conversation is a 400; a
    last user message too long alone is a 400 either way."""
    client, cluster = plain
    first, second = " apple" * 150, " pear" * 120

    def prompt() -> str:
        return str(tokenizer.decode(cluster.requests()[-1].prompt_token_ids))

    items: list[Any] = [{"role": "developer", "content": "Speak French."}, {"role": "user", "content": first},
                        {"role": "assistant", "content": "Noted."}, {"role": "user", "content": second}]
    asked: dict[str, Any] = dict(model=SERVED_MODEL, instructions="Be brief.", input=items, max_output_tokens=16)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**asked)
    assert refused.value.code == "context_length_exceeded"
    cut = client.responses.create(**asked, truncation="auto")
    assert cut.status == "completed" and cut.truncation == "auto" and cut.usage is not None
    assert cut.usage.input_tokens + 16 <= 256
    seen = prompt()
    assert "Be brief." in seen and "Speak French." in seen and seen.count("pear") == 120
    assert "apple" not in seen and "Noted." not in seen
    # As few turns dropped as let it fit: the second turn stays.
    turns = [*items[:3], {"role": "user", "content": " plum" * 20}, {"role": "assistant", "content": "Sure."},
             {"role": "user", "content": " pear" * 60}]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**{**asked, "input": turns})
    client.responses.create(**{**asked, "input": turns}, truncation="auto")
    assert "apple" not in prompt() and "Noted." not in prompt() and prompt().count("plum") == 20 and "Sure." in prompt()

    # A conversation continued (previous_response_id): the earlier response's items are dropped first.
    earlier = client.responses.create(model=SERVED_MODEL, input=first, max_output_tokens=16)
    assert earlier.status == "completed"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=SERVED_MODEL, input=second, previous_response_id=earlier.id, max_output_tokens=16)
    later = client.responses.create(model=SERVED_MODEL, input=second, previous_response_id=earlier.id,
                                    max_output_tokens=16, truncation="auto")
    assert later.status == "completed" and "apple" not in prompt() and prompt().count("pear") == 120

    # Too long on its own: nothing left to drop.
    with pytest.raises(openai.BadRequestError) as alone:
        client.responses.create(model=SERVED_MODEL, input=" pear" * 300, max_output_tokens=16, truncation="auto")
    assert alone.value.code == "context_length_exceeded"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),  # never stored
        ({"previous_response_id": 1}, "previous_response_id"),
        ({"background": True, "stream": True, "store": False}, "background"),  # nowhere to log its events
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # a template that takes none
        ({"reasoning": {"summary": "concise"}}, "reasoning.summary"),  # (no second call condenses the thinking)
        ({"reasoning": {"generate_summary": "concise"}}, "reasoning.generate_summary"),
        ({"reasoning": "high"}, "reasoning"),
        ({"truncation": "middle"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        # The default model is a text model: the image part is refused by name.
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
        ({"input": None}, "input"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"include": ["code_interpreter_call.outputs"]}, "include.0"),
        ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "include.1"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without the logprobs asked for
        ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"], "tools": TOOLS}, "include"),
        ({"max_tool_calls": -1}, "max_tool_calls"),
        ({"max_tool_calls": "3"}, "max_tool_calls"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ],
)
def test_what_is_not_served_is_refused_by_name(plain: tuple[openai.OpenAI, FakeCluster], body: dict[str, Any],
                                               param: str) -> None:
    client, _ = plain
    request = {"model": SERVED_MODEL, "input": "Hi", **body}
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/responses", body=request, cast_to=object)
    assert refused.value.body["param"] == param, refused.value.body  # type: ignore[index]


def test_models_retrieve_and_a_response_never_stored(plain: tuple[openai.OpenAI, FakeCluster]) -> None:
    client, _ = plain
    assert client.models.retrieve(SERVED_MODEL).id == SERVED_MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve("resp_123")
    assert "never stored" in str(missing.value)


# A template that shows an assistant message's thinking, as reasoning models' templates do.
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>"
                     "{{ m.reasoning_content }}</think>{% endif %}{{ m.content or '' }}<|im_end|>\n{% endfor %}"
                     "<|im_start|>assistant\n")


def test_the_thinking_a_client_keeps_comes_back_to_the_model(redis_url: str, tokenizer: Any) -> None:
    """``include: ["reasoning.encrypted_content"]`` (Codex's way, with ``store: false``): each reasoning item carries
    its thinking in ``encrypted_content``, whole and streamed; handed back alone (no ``content``) in the next
    request's input, it is the thinking the template shows the model before that answer. A string this deployment
    did not make is refused by name."""
    prompts = PromptProcessor(tokenizer, max_model_len=2048, chat_template=THINKING_TEMPLATE)
    reply = list(tokenizer.encode(f"<think>\n{THINKING}\n</think>\n\nParis.", add_special_tokens=False))
    with fake_stack(redis_url, prompts, reply, {"token_delay_s": 0.001, "max_model_len": 2048},
                    reasoning_parser="qwen3", request_timeout_s=5.0) as (server, cluster):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20)
        kwargs: dict[str, Any] = dict(model=SERVED_MODEL, input="Capital of France?", store=False, max_output_tokens=100)
        plain = client.responses.create(**kwargs)
        assert plain.output[0].type == "reasoning" and plain.output[0].encrypted_content is None  # not asked for
        whole = client.responses.create(**kwargs, include=["reasoning.encrypted_content"])
        reasoning = whole.output[0]
        assert reasoning.type == "reasoning" and isinstance(reasoning.encrypted_content, str)
        with client.responses.stream(**kwargs, include=["reasoning.encrypted_content"]) as stream:
            done = [e.item for e in stream if e.type == "response.output_item.done" and e.item.type == "reasoning"]
        assert len(done) == 1 and done[0].encrypted_content is not None
        assert stream.get_final_response().output[0].encrypted_content == done[0].encrypted_content

        kept = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
        follow_up = [{"role": "user", "content": "Capital of France?"}, kept,
                     {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
        client.responses.create(**{**kwargs, "input": follow_up})
        [prompt] = {p for p in (tokenizer.decode(r.prompt_token_ids) for r in cluster.requests()) if "Italy" in p}
        assert f"<think>\n{THINKING}\n</think>Paris." in prompt, prompt
        for forged in ("pdserve.rs1.bm90IHpsaWI=.", "gAAAAABpZtK3mH8xYz2k", 7):
            with pytest.raises(openai.BadRequestError) as refused:
                client.responses.create(**{**kwargs, "input": [*follow_up[:1], {**kept, "encrypted_content": forged},
                                                               *follow_up[2:]]})
            assert refused.value.body["param"] == "input.1.encrypted_content"  # type: ignore[index]



def test_a_summary_asked_for_is_the_thinking_whole(thinking: tuple[openai.OpenAI, FakeCluster]) -> None:
    """``reasoning.summary`` "auto" or "detailed" (the most detailed summary): each reasoning item's summary is its
    thinking, whole, and streamed as OpenAI streams summaries (a part added, its text's deltas, done); "concise" is
    refused by name (no second model call condenses the thinking here)."""
    client, _ = thinking
    kwargs: dict[str, Any] = dict(model=SERVED_MODEL, input="Weather in Paris?", tools=TOOLS, max_output_tokens=300)
    assert client.responses.create(**kwargs).output[0].summary == []  # type: ignore[union-attr]
    for summary in ("auto", "detailed"):
        whole = client.responses.create(**kwargs, reasoning={"summary": summary})  # type: ignore[arg-type]
        assert [(p.type, p.text) for p in whole.output[0].summary] == [("summary_text", f"\n{THINKING}\n")]  # type: ignore[union-attr]
    with client.responses.stream(**kwargs, reasoning={"summary": "auto"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    added, done = kinds.index("response.reasoning_summary_part.added"), kinds.index("response.reasoning_summary_part.done")
    assert kinds.index("response.output_item.added") < added < kinds.index("response.reasoning_summary_text.done") < done
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")  # type: ignore[union-attr]
    assert deltas == f"\n{THINKING}\n" == final.output[0].summary[0].text  # type: ignore[union-attr]
