"""Structured-output fields of a request (OpenAI's ``response_format``, vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, ``structural_tag`` and their newer form, the
``structured_outputs`` object) as the one ``StructuredOutput`` the engines enforce.

A structural tag leaves the output free but for what it constrains: in xgrammar's form
(``{"type": "structural_tag", "format": {...}}``) anything xgrammar's structural tags express, or in vLLM's
first form (``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``) free text in which each
trigger starts a tag whose JSON between ``begin`` and ``end`` follows its schema (``structural_tag``), as
vLLM compiles either with xgrammar.

``from_request`` reads the fields (400 for a malformed or second one); ``check_grammar`` builds the
grammar in a worker thread, so an invalid schema or regex is a 400 here and never reaches an engine
(which refuses it again, trusting no router). Both are pure functions of the request.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from typing import Any

from common.sampling_params import MAX_STRUCTURED_OUTPUT_CHARS, StructuredOutput
from common.structured_output import build_grammar, structural_tag_tokens
from router.errors import bad_request

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag")
# vLLM's ``structured_outputs`` object: its keys that constrain the output, as the ``guided_*`` field
# each one means.
_STRUCTURED_OUTPUTS_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                            "grammar": "guided_grammar", "structural_tag": "structural_tag"}
# Its keys that tune a backend and ask nothing this one does not do: JSON never has free whitespace
# here and an object schema admits no properties it does not list; there is no fallback backend.
_STRUCTURED_OUTPUTS_TUNING = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")


def _json_object(value: Any, param: str, what: str) -> dict[str, Any]:
    """``value``, an object or its JSON text, as the object; a 400 naming ``param`` for anything else."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise bad_request(f"{param} must be {what} (an object, or its JSON text)", param=param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be {what} object", param=param)
    return value


def _schema_text(schema: Any, param: str) -> str:
    return json.dumps(_json_object(schema, param, "a JSON schema"), ensure_ascii=False)


def structural_tag(value: Any, param: str) -> StructuredOutput:
    """A structural tag in either form (the object or its JSON text) as the one form the engines build:
    xgrammar's, vLLM's first form made the triggered tags it means. A 400 naming ``param`` for what is neither;
    xgrammar judges the rest (``check_grammar``)."""
    value = _json_object(value, param, "a structural tag")
    if value.get("type", "structural_tag") != "structural_tag":
        raise bad_request(f"{param}.type must be 'structural_tag'", param=param)
    if "structures" not in value:
        if "format" not in value:
            raise bad_request(f"{param} must have a format (xgrammar's form) or structures and triggers (vLLM's "
                              "first form)", param=param)
        tag = {**value, "type": "structural_tag"}
    else:
        structures, triggers = value["structures"], value.get("triggers")
        if set(value) - {"type", "structures", "triggers"}:
            raise bad_request(f"{param}: with structures, only triggers may be given beside them, not "
                              f"{sorted(set(value) - {'type', 'structures', 'triggers'})}", param=param)
        if not isinstance(structures, list) or not structures or not all(
            isinstance(s, dict) and isinstance(s.get("begin"), str) and s["begin"] and isinstance(s.get("end"), str)
            and isinstance(s.get("schema"), dict) for s in structures
        ):
            raise bad_request(f"{param}.structures must be a non-empty list of objects with a begin and an end "
                              "string and a JSON schema object", param=param)
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise bad_request(f"{param}.triggers must be a non-empty list of strings", param=param)
        tags = [{"begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]}, "end": s["end"]}
                for s in structures]
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
    return StructuredOutput(kind="structural_tag", spec=json.dumps(tag, ensure_ascii=False))


def _response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(kind="json_object")
    if kind == "structural_tag":
        return structural_tag(value, "response_format")
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag', got {kind!r}",
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


def _guided(field: str, value: Any, param: str) -> StructuredOutput:
    """``value`` of the ``guided_*`` field ``field`` (or the ``structured_outputs`` key meaning it,
    named ``param``) as a ``StructuredOutput``."""
    if field == "guided_json":
        return StructuredOutput(kind="json_schema", spec=_schema_text(value, param))
    if field == "structural_tag":
        return structural_tag(value, param)
    if field == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request(f"{param} must be a non-empty list of strings", param=param)
        return StructuredOutput(kind="choice", spec=json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param=param)
    return StructuredOutput(kind="regex" if field == "guided_regex" else "grammar", spec=value)


def _structured_outputs(value: Any) -> list[tuple[StructuredOutput, str]]:
    """What vLLM's ``structured_outputs`` object asks for: a key not implemented gets a 400 naming it."""
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", param="structured_outputs")
    found = []
    for key, item in value.items():
        param = f"structured_outputs.{key}"
        if key in _STRUCTURED_OUTPUTS_KEYS:
            if item is not None:
                found.append((_guided(_STRUCTURED_OUTPUTS_KEYS[key], item, param), param))
        elif key == "json_object":
            if not isinstance(item, bool) and item is not None:
                raise bad_request(f"{param} must be a boolean", param=param)
            if item:
                found.append((StructuredOutput(kind="json_object"), param))
        elif key in _STRUCTURED_OUTPUTS_TUNING:
            if not isinstance(item, bool) and item is not None:
                raise bad_request(f"{param} must be a boolean", param=param)
        elif item is not None:  # whitespace_pattern, and what this server does not know
            raise bad_request(f"{param} is not implemented", param=param)
    return found


def from_request(
    response_format: dict[str, Any] | None, guided: dict[str, Any]
) -> tuple[StructuredOutput, str] | None:
    """The request's structured output and the field that asked for it, or None; a 400 naming the
    field when it is malformed, too large, or not the only one. ``guided``: the ``guided_*`` fields
    and ``structured_outputs``."""
    found: list[tuple[StructuredOutput, str]] = []
    if response_format is not None:
        so = _response_format(response_format)
        if so is not None:
            found.append((so, "response_format"))
    for field in GUIDED_FIELDS:
        if guided.get(field) is not None:
            found.append((_guided(field, guided[field], field), field))
    if guided.get("structured_outputs") is not None:
        found += _structured_outputs(guided["structured_outputs"])
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(
            f"only one of response_format, {', '.join(GUIDED_FIELDS)} or a key of structured_outputs may "
            "constrain the output",
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


async def check_grammar(so: StructuredOutput, param: str, is_token: Callable[[str | int], bool]) -> None:
    """A 400 naming ``param`` when ``so``'s schema, regex or choices make no grammar, or a structural tag names a token
    that is none of the model's (``is_token``). Off the event loop: a large schema takes milliseconds to convert."""
    error = await asyncio.to_thread(_grammar_error, so)
    if error is None and so.kind == "structural_tag":
        unknown = sorted(map(str, (t for t in structural_tag_tokens(json.loads(so.spec)) if not is_token(t))))
        if unknown:
            error = f"{', '.join(map(repr, unknown[:5]))}: not a token of this model's tokenizer"
    if error is not None:
        raise bad_request(f"{param}: {error}", param=param)
