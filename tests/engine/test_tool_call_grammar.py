"""Tool calls forced by ``tool_choice``, on the default model inside an engine: the grammar a
"required" or named answer gets (``router/tools.py``) makes outputs that read back as calls of the
request's tools with arguments valid against their schemas, and that end on their own."""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
import pytest

from common.sampling_params import SamplingParams
from router.tokenization import load_chat_template
from router.tools import ToolPlan
from tests.engine.conftest import drain_tokens, tokenizer

# Bounded strings: the default model tends to fill a string until it may not, a decode step a token.
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city now",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "The sum of two integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@functools.cache
def _prompt() -> list[int]:
    tok = tokenizer()
    messages = [{"role": "user", "content": "What is the weather in Paris? And what is 12 plus 30?"}]
    text = tok.apply_chat_template(messages, tools=TOOLS, chat_template=load_chat_template("chatml-tools"),
                                   add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False).input_ids)


def _run(engine: Any, plans: dict[str, ToolPlan]) -> dict[str, tuple[str, str]]:
    for request_id, plan in plans.items():
        params = SamplingParams(temperature=0.0, max_tokens=160, structured_output=plan.structured_output())
        engine.add_request(request_id, _prompt(), params)
    tokens, reasons = drain_tokens(engine)
    return {rid: (tokenizer().decode(ids, skip_special_tokens=True), reasons[rid]) for rid, ids in tokens.items()}


def test_required_and_named_answers_are_valid_calls(engine_factory: Any) -> None:
    plans = {
        "required": ToolPlan.from_request(TOOLS, "required", None),
        "required-one": ToolPlan.from_request(TOOLS, "required", False),
        "named": ToolPlan.from_request(TOOLS, {"type": "function", "function": {"name": "add"}}, None),
    }
    assert all(plan is not None for plan in plans.values())
    results = _run(engine_factory(), plans)  # type: ignore[arg-type]
    for request_id, (text, finish_reason) in results.items():
        plan = plans[request_id]
        assert plan is not None
        if request_id == "required" and finish_reason == "length":
            # Free to call as often as it likes, this small model repeats its calls until cut: the
            # calls before the cut are whole, the last is cut short as OpenAI's are, and the client
            # sees "length".
            content, calls = plan.extract(text, None)
            assert text.startswith('[{"name": "') and len(calls) >= 2, text
            for call in calls[:-1]:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            assert content is None or text.endswith(content)
            assert plan.finish_reason(finish_reason, True) == "length"
            continue
        assert finish_reason == "stop", (request_id, text)
        content, calls = plan.extract(text, None)
        assert content is None and calls, (request_id, text)
        if request_id == "required-one":
            assert len(calls) == 1
        if request_id == "named":
            assert [c.name for c in calls] == ["add"]
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert plan.finish_reason(finish_reason, True) == ("stop" if request_id == "named" else "tool_calls")


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_unforced_choices_add_no_grammar(choice: str) -> None:
    plan = ToolPlan.from_request(TOOLS, choice, None)
    assert plan is not None and plan.structured_output() is None
