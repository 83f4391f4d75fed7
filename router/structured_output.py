"""Structured-output fields of a request (OpenAI's ``response_format``, vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``) as the one ``StructuredOutput`` the engines enforce.

``from_request`` reads the fields (400 for a malformed or second one); ``check_grammar`` builds the
grammar in a worker thread, so an invalid schema or regex is a 400 here and never reaches an engine
(which refuses it again, trusting no router). Both are pure functions of the request.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from common.sampling_params import MAX_STRUCTURED_OUTPUT_CHARS, StructuredOutput
from common.structured_output import build_grammar
from router.errors import bad_request

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice")


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            raise bad_request(f"{param} must be a JSON schema (an object, or its JSON text)", param=param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema object", param=param)
    return json.dumps(schema, ensure_ascii=False)


def _response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(kind="json_object")
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            param="response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object", param="response_format")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("response_format.json_schema.name must be a string", param="response_format")
    if spec.get("schema") is None:  # OpenAI lets the schema out: then any JSON object
        return StructuredOutput(kind="json_object")
    return StructuredOutput(kind="json_schema", spec=_schema_text(spec["schema"], "response_format"))


def from_request(
    response_format: dict[str, Any] | None, guided: dict[str, Any]
) -> tuple[StructuredOutput, str] | None:
    """The request's structured output and the field that asked for it, or None; a 400 naming the
    field when it is malformed, too large, or not the only one."""
    found: list[tuple[StructuredOutput, str]] = []
    if response_format is not None:
        so = _response_format(response_format)
        if so is not None:
            found.append((so, "response_format"))
    if guided.get("guided_json") is not None:
        found.append((StructuredOutput(kind="json_schema", spec=_schema_text(guided["guided_json"], "guided_json")),
                      "guided_json"))
    regex = guided.get("guided_regex")
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise bad_request("guided_regex must be a non-empty string", param="guided_regex")
        found.append((StructuredOutput(kind="regex", spec=regex), "guided_regex"))
    choice = guided.get("guided_choice")
    if choice is not None:
        if not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice):
            raise bad_request("guided_choice must be a non-empty list of strings", param="guided_choice")
        found.append((StructuredOutput(kind="choice", spec=json.dumps(choice, ensure_ascii=False)), "guided_choice"))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(
            f"only one of response_format, {', '.join(GUIDED_FIELDS)} may constrain the output",
            param=found[1][1],
        )
    so, param = found[0]
    if len(so.spec) > MAX_STRUCTURED_OUTPUT_CHARS:
        raise bad_request(f"{param} is longer than {MAX_STRUCTURED_OUTPUT_CHARS} characters", param=param)
    return so, param


@functools.lru_cache(maxsize=256)
def _grammar_error(so: StructuredOutput) -> str | None:
    try:
        build_grammar(so)
    except ValueError as exc:
        return str(exc)
    return None


async def check_grammar(so: StructuredOutput, param: str) -> None:
    """A 400 naming ``param`` when ``so``'s schema, regex or choices make no grammar. Off the event
    loop: a large schema takes milliseconds to convert."""
    error = await asyncio.to_thread(_grammar_error, so)
    if error is not None:
        raise bad_request(f"{param}: {error}", param=param)
