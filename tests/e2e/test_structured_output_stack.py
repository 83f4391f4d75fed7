"""Structured output (structural tags too), logit_bias, allowed_token_ids and bad_words through the real stack with the openai client: router ->
prefill (first token under the grammar) -> KV transfer -> decode (the rest), and a short prompt the
router sends straight to the decode instance. A bad schema is a 400 from the router. Tool calls forced
by tool_choice, through a second router in front of the same engines, started with a chat template
that shows the model its tools."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.e2e.stack import prefill_decode_stack
from tests.engine.conftest import model_path, tokenizer

pytestmark = pytest.mark.timeout(600)

MODEL = "SmolLM2-135M-Instruct"
DIRECT_PROMPT_TOKENS = 40  # shorter prompts go straight to the decode instance
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
}
LONG = ("You are a careful assistant that always answers in JSON. The user is writing a short story about "
        "a family and needs characters. ") * 2


@pytest.fixture(scope="module")
def stack(redis_url):  # type: ignore[no-untyped-def]
    with prefill_decode_stack(redis_url, model_path(), ["--direct-prompt-tokens", str(DIRECT_PROMPT_TOKENS)]) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _num_chat_tokens(content: str) -> int:
    text = tokenizer().apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=False)
    return len(tokenizer()(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("content", [LONG + "Describe one character.", "A person?"], ids=["disaggregated", "direct"])
def test_json_schema_chat_validates_streaming_or_not(client, content):  # type: ignore[no-untyped-def]
    assert (_num_chat_tokens(content) < DIRECT_PROMPT_TOKENS) == (content == "A person?")
    kwargs = {
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 80, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
    }
    done = client.chat.completions.create(**kwargs)
    jsonschema.validate(json.loads(done.choices[0].message.content), SCHEMA)
    assert done.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == done.choices[0].message.content


def test_guided_fields_and_json_object_on_completions(client):  # type: ignore[no-untyped-def]
    prompt = LONG + "Is the sky blue? Answer:"
    choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                       extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.choices[0].text in {"yes", "no", "maybe"} and choice.choices[0].finish_reason == "stop"
    regex = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0.7, seed=1,
                                      extra_body={"guided_regex": "(Yes|No), [a-z]{2,10}\\."})
    assert re.fullmatch(r"(Yes|No), [a-z]{2,10}\.", regex.choices[0].text)
    guided = client.completions.create(model=MODEL, prompt=prompt, max_tokens=80, temperature=0, n=2,
                                       extra_body={"guided_json": SCHEMA})
    for c in guided.choices:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    grammar = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0.7, seed=2,
                                        extra_body={"guided_grammar": 'root ::= ("Yes" | "No") ", " [a-z]+ "."'})
    assert re.fullmatch(r"(Yes|No), [a-z]+\.", grammar.choices[0].text), grammar.choices[0].text
    newer = client.chat.completions.create(  # vLLM's newer form of the same fields
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"], "disable_any_whitespace": True}})
    assert newer.choices[0].message.content in {"yes", "no"}
    obj = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=60,
                                         temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


PERSON_TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "<person>"}, {"type": "json_schema", "json_schema": SCHEMA},
    {"type": "const_string", "value": "</person>"}]}}


@pytest.mark.parametrize("content", [LONG + "Describe one character.", "A person?"], ids=["disaggregated", "direct"])
def test_structural_tags_constrain_what_they_say_and_leave_the_rest_free(client, content):  # type: ignore[no-untyped-def]
    """xgrammar's form, as response_format: the answer is the tag around JSON of the schema, streamed or not. vLLM's
    first form, as structured_outputs.structural_tag: free text, but from its trigger on (a space, which any
    answer holds) the tag: `<person>`, JSON of the schema, `</person>`."""
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 80, "temperature": 0}
    done = client.chat.completions.create(**kwargs, response_format=PERSON_TAG)
    text = done.choices[0].message.content
    match = re.fullmatch(r"<person>(.*)</person>", text, re.S)
    assert match and done.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(match[1]), SCHEMA)
    chunks = list(client.chat.completions.create(**kwargs, response_format=PERSON_TAG, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    first_form = {"structures": [{"begin": " <person>", "schema": SCHEMA, "end": "</person>"}], "triggers": [" "]}
    free = client.chat.completions.create(
        **kwargs, extra_body={"structured_outputs": {"structural_tag": json.dumps(first_form)}})
    text = free.choices[0].message.content
    _, space, rest = text.partition(" ")
    assert space and rest.startswith("<person>"), text
    body, end, _ = rest.removeprefix("<person>").partition("</person>")
    assert end, text
    jsonschema.validate(json.loads(body), SCHEMA)


def test_logit_bias_bans_and_forces_tokens(client):  # type: ignore[no-untyped-def]
    prompt = LONG + "The capital of France is"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=2)
    top = base.choices[0].logprobs.top_logprobs[0]
    [first, second] = sorted(top, key=top.get, reverse=True)[:2]
    ids = {t: tokenizer().convert_tokens_to_ids(tokenizer().tokenize(t)) for t in (first, second)}
    if len(ids[first]) != 1:
        pytest.skip("the greedy token does not round-trip through its text")
    banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(ids[first][0]): -100})
    assert banned.choices[0].text == second
    forced_id = tokenizer()(" banana", add_special_tokens=False).input_ids[0]
    forced = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                       logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == tokenizer().decode([forced_id, forced_id])


def test_allowed_token_ids_and_bad_words(client):  # type: ignore[no-untyped-def]
    """Through prefill -> KV -> decode (the long prompt) and straight to decode (the short one)."""
    tok = tokenizer()
    for prompt in (LONG + "The capital of France is", "The capital of France is"):
        allowed = tok(" Paris Rome London and or", add_special_tokens=False).input_ids
        assert len(allowed) == 5  # a word a token
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.9, seed=5,
                                        extra_body={"allowed_token_ids": allowed})
        assert re.fullmatch(r"( (Paris|Rome|London|and|or)){12}", out.choices[0].text), out.choices[0].text
        # The greedy answer's first word, then banned: the answer no longer holds it, nor its tokens after it.
        free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        word = free.choices[0].text.split()[0]
        banned = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                           extra_body={"bad_words": [word]})
        assert banned.choices[0].text != free.choices[0].text
        assert word not in banned.choices[0].text.split(), (word, banned.choices[0].text)
    # Contradicting constraints that only sampling can find: an error naming them, not a made-up token.
    with pytest.raises(openai.InternalServerError, match="no token may be sampled"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=5,
                                  extra_body={"allowed_token_ids": allowed[:1], "bad_words": ["Paris"]})


def test_invalid_schema_and_regex_get_400(client):  # type: ignore[no-untyped-def]
    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}},
        )
    assert err.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, extra_body={"guided_regex": "(a"})
    assert err.value.body["param"] == "guided_regex"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def tools_client(stack):  # type: ignore[no-untyped-def]
    url = stack.add_router("router-tools", ["--chat-template", "chatml-tools", "--direct-prompt-tokens",
                                            str(DIRECT_PROMPT_TOKENS)])
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_forced_tool_calls_through_the_stack(stack, tools_client):  # type: ignore[no-untyped-def]
    # (the tools' descriptions make any prompt long: prefill -> transfer -> decode)
    schema = WEATHER["function"]["parameters"]
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
              "max_tokens": 60,
              "temperature": 0, "tools": [WEATHER]}
    named = tools_client.chat.completions.create(
        **kwargs, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and named.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), schema)
    streamed = list(tools_client.chat.completions.create(
        **kwargs, stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    parts = [p for c in streamed if c.choices for p in c.choices[0].delta.tool_calls or []]
    assert parts[0].function.name == "get_weather" and parts[0].id
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments

    required = tools_client.chat.completions.create(**kwargs, tool_choice="required", parallel_tool_calls=False,
                                                    extra_body={"return_token_ids": True})
    [call] = required.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and required.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # Written in the format the template teaches (hermes), not as a JSON array.
    written = tokenizer().decode(required.choices[0].token_ids)
    assert written.startswith('<tool_call>\n{"name": "get_weather", "arguments": '), written
    # Streamed, the call opens with its name and its arguments come in pieces that join into the same text.
    streamed = list(tools_client.chat.completions.create(
        **kwargs, stream=True, tool_choice="required", parallel_tool_calls=False))
    parts = [p for c in streamed if c.choices for p in c.choices[0].delta.tool_calls or []]
    assert parts[0].function.name == "get_weather" and parts[0].id and len(parts) > 2
    assert all(p.index == 0 and p.id is None for p in parts[1:])
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    # allowed_tools: both tools in the prompt, the grammar lets the model call only get_time, though it was asked
    # about the weather.
    clock = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                             "required": ["city"]}}}
    allowed = tools_client.chat.completions.create(**{**kwargs, "tools": [WEATHER, clock]}, tool_choice={
        "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
            {"type": "function", "function": {"name": "get_time"}}]}}, parallel_tool_calls=False)
    [call] = allowed.choices[0].message.tool_calls
    assert call.function.name == "get_time" and allowed.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), clock["function"]["parameters"])
    # The first router's template (the model's own) does not show the model its tools: refused there.
    with pytest.raises(openai.BadRequestError) as err:
        openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
            **kwargs, tool_choice="required")
    assert err.value.body["param"] == "tools"


def test_strict_function_calls_under_auto_hold_to_the_schema(tools_client):  # type: ignore[no-untyped-def]
    """OpenAI's strict function under "auto", on the real model through the stack. Shown a few calls with "celsius",
    the model calls the tool the same way; the schema allows only "kelvin". Not strict, the call it writes is off the
    schema (the control: this test sees the difference); strict, a structural tag holds the call to the schema, and
    without parallel calls the answer ends after it; streamed, its arguments come in pieces as they are written, as
    the loose call's do (the model writing it freely)."""
    shots = "".join(f'Q: weather in {city}?\nA: <tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}", '
                    '"unit": "celsius"}}\n</tool_call>\n' for city in ("Rome", "Oslo", "Lima", "Kyiv"))
    schema = {**WEATHER["function"]["parameters"],
              "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["kelvin"]}}}
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": shots + "Q: weather in Paris?\nA:"}],
              "max_tokens": 60, "temperature": 0}

    def tool(strict: bool) -> dict:  # type: ignore[type-arg]
        return {"type": "function", "function": {**WEATHER["function"], "parameters": schema, "strict": strict}}

    loose = tools_client.chat.completions.create(**kwargs, tools=[tool(False)])
    [call, *_] = loose.choices[0].message.tool_calls
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(call.function.arguments), schema)
    streamed = list(tools_client.chat.completions.create(**kwargs, tools=[tool(False)], stream=True))
    parts = [p for c in streamed if c.choices for p in c.choices[0].delta.tool_calls or [] if p.index == 0]
    assert parts[0].function.name == "get_weather" and len(parts) > 2  # the arguments in pieces
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    held = tools_client.chat.completions.create(**kwargs, tools=[tool(True)], parallel_tool_calls=False)
    [call] = held.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and held.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), schema)
    streamed = list(tools_client.chat.completions.create(**kwargs, tools=[tool(True)], parallel_tool_calls=False,
                                                         stream=True))
    parts = [p for c in streamed if c.choices for p in c.choices[0].delta.tool_calls or []]
    assert parts[0].function.name == "get_weather" and parts[0].id and len(parts) > 2  # the arguments in pieces
    assert all(p.index == 0 and p.id is None for p in parts[1:])
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
