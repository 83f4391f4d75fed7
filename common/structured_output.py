"""Structured output's grammars: a JSON schema, a regex, a list of choices, an EBNF grammar or a structural tag
(free text where JSON or other formats go between given tags) as an xgrammar ``Grammar``.

The router builds a request's grammar to refuse a bad schema with a 400; each engine builds it again
to compile it against its tokenizer (``common/engine/grammar.py``), trusting no router. xgrammar
(which loads torch) is imported on first use: a process that never sees a grammar never loads it.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

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


def clean_error(exc: Exception) -> str:
    """xgrammar's message for a bad input, without its C++ location."""
    text = str(exc).strip()
    return _NOISE.sub("", text.splitlines()[0]) if text else type(exc).__name__


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def build_grammar(so: StructuredOutput) -> xgrammar.Grammar:
    """The grammar ``so`` describes; ``ValueError`` saying what is wrong with it. Needs no tokenizer.

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
            if json_depth(json.loads(so.spec)) > MAX_SCHEMA_DEPTH:
                raise ValueError(f"the structural tag nests deeper than {MAX_SCHEMA_DEPTH} levels")
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
