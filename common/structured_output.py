"""Structured output's grammars: a JSON schema, a regex, a list of choices, an EBNF grammar or a structural tag
(free text where JSON or other formats go between given tags) as an xgrammar ``Grammar``.

The router builds a request's grammar to refuse a bad schema with a 400; each engine builds it again
to compile it against its tokenizer (``common/engine/grammar.py``), trusting no router. xgrammar
(which loads torch) is imported on first use: a process that never sees a grammar never loads it.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from common.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import xgrammar

# xgrammar's messages start with a timestamp, a C++ source location and an assertion: not the user's business.
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
_OBJECT_SCHEMA = '{"type": "object"}'
# Nesting of a JSON schema document (objects and arrays). Real schemas stay far below; the grammar of
# a 300-deep one is 600 KB and takes seconds to build, and an engine compiles it in its step loop.
MAX_SCHEMA_DEPTH = 64


def json_depth(value: object) -> int:
    """How deep ``value``'s objects and arrays nest (a scalar: 0), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def structural_tag_tokens(spec: object) -> set[str | int]:
    """The tokens a structural tag names to be matched as tokens (by string or id): its ``token`` formats,
    ``trigger_tokens`` and ``exclude_tokens``. A special token is seen only so, never as text."""
    found: set[str | int] = set()
    stack = [spec]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("type") == "token" and isinstance(node.get("token"), (str, int)):
                found.add(node["token"])
            for key in ("trigger_tokens", "exclude_tokens"):
                found.update(t for t in node.get(key) or [] if isinstance(t, (str, int)))
            stack.extend(node.values())
    return found


def _token_text(token: object) -> str:
    return token if isinstance(token, str) else f"<token {token}>"


def _as_text(node: object) -> object:
    """A structural tag with its token-level formats made text-level ones of the same shape: what can be checked
    without a tokenizer (a token as its text, a token trigger as a text one, any tokens as any text)."""
    if isinstance(node, list):
        return [_as_text(item) for item in node]
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if kind == "token":
        return {"type": "const_string", "value": _token_text(node.get("token"))}
    if kind == "exclude_token":
        return {"type": "const_string", "value": "x"}
    if kind == "any_tokens":
        return {"type": "any_text"}
    out: dict[str, Any] = {key: _as_text(value) for key, value in node.items()}
    if kind == "token_triggered_tags":
        out = {"type": "triggered_tags", "triggers": [_token_text(t) for t in node.get("trigger_tokens") or []],
               "tags": out.get("tags", []), "at_least_one": node.get("at_least_one", False),
               "stop_after_first": node.get("stop_after_first", False)}
    if kind == "tag":
        for key in ("begin", "end"):
            if isinstance(out.get(key), dict) and out[key].get("type") == "const_string":
                out[key] = out[key]["value"]
    return out


def clean_error(exc: Exception) -> str:
    """xgrammar's message for a bad input, without its C++ location."""
    text = str(exc).strip()
    return _NOISE.sub("", text.splitlines()[0]) if text else type(exc).__name__


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def build_grammar(so: StructuredOutput) -> xgrammar.Grammar:
    """The grammar ``so`` describes; ``ValueError`` saying what is wrong with it. Needs no tokenizer: a structural
    tag that matches tokens as tokens (``structural_tag_tokens``) gives the grammar of its text-level twin, for its
    checks; an engine compiles the tag itself against its tokenizer.

    JSON comes without free whitespace (``", "`` and ``": "`` between items): a small model let
    loose on optional whitespace may emit it forever."""
    import xgrammar as xgr

    try:
        if so.kind == "json_object":
            return xgr.Grammar.from_json_schema(_OBJECT_SCHEMA, any_whitespace=False)
        if so.kind == "json_schema":
            if json_depth(json.loads(so.spec)) > MAX_SCHEMA_DEPTH:
                raise ValueError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
            return xgr.Grammar.from_json_schema(so.spec, any_whitespace=False, strict_mode=True)
        if so.kind == "regex":
            return xgr.Grammar.from_regex(so.spec)
        if so.kind == "structural_tag":
            spec = json.loads(so.spec)
            if json_depth(spec) > MAX_SCHEMA_DEPTH:
                raise ValueError(f"the structural tag nests deeper than {MAX_SCHEMA_DEPTH} levels")
            if structural_tag_tokens(spec):  # checked as text here; compiled against a tokenizer by the engines
                return xgr.Grammar.from_structural_tag(json.dumps(_as_text(spec)))
            return xgr.Grammar.from_structural_tag(so.spec)
        if so.kind == "grammar":
            if "::=" not in so.spec:  # say, a Lark grammar (``rule: ...``), which is not converted
                raise ValueError(
                    "the grammar must be EBNF in the GBNF form (rules `name ::= ...`, starting from `root`); "
                    "Lark grammars are not converted"
                )
            return xgr.Grammar.from_ebnf(so.spec)
        choices = json.loads(so.spec)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choice must be a non-empty list of strings")
        return xgr.Grammar.from_ebnf(choice_ebnf(choices))
    except RecursionError:  # ``json.loads`` of a document nested thousands deep
        raise ValueError(f"invalid {so.kind}: nested too deep") from None
    except (RuntimeError, ValueError) as exc:  # xgrammar reports a bad input as RuntimeError
        raise ValueError(f"invalid {so.kind}: {clean_error(exc)}") from None
