"""Calls a format's structural tag held, read as they stream (``router/held_calls.py`` ``HeldTagCalls``), against
the format's own parser over generated answers: whatever the arguments (strings with newlines, quotes, escapes,
``null``, text that starts like a closing tag; numbers; objects) and however the text is cut, the stream's pieces
join into the whole answer's reading, and that reading is the parser's (XML arguments as the same JSON text, JSON
ones as the same object)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from router.held_calls import ArgumentsPiece, CallStart, HeldTagCalls, held_reader, read_pieces
from router.tool_parsers import PARSERS, ToolCall

FUNCTION = {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "count": {"type": "integer"}, "options": {"type": "object"},
    "note": {"type": ["string", "null"]}}}}
_DS = ("<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581sep\uff5c>",
       "<\uff5ctool\u2581call\u2581end\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>")
_XML_CLOSE = {"qwen3_coder": "</parameter>", "minimax_m2": "</parameter>", "glm45": "</arg_value>"}

# Text that stresses the reader: pieces of the layouts' tags, newlines, JSON's escapes, "null".
_TEXT = st.one_of(
    st.sampled_from(["null", "NULL", "Null", "nul", "null\n", "\nnull", "\n", ""]),
    st.text(alphabet=st.sampled_from(list('<>/=\n "\\nulNULparmetgvk_é{}[],:') + ["\u2028", "\U0001f600"]), max_size=24))
_VALUES = {"path": _TEXT, "note": _TEXT, "count": st.integers(-10**6, 10**6),
           "options": st.dictionaries(st.sampled_from(["a", "b"]), st.one_of(st.integers(0, 9), _TEXT), max_size=2)}
_ARGUMENTS = st.lists(st.sampled_from(sorted(_VALUES)), unique=True, max_size=4).flatmap(
    lambda keys: st.fixed_dictionaries({k: _VALUES[k] for k in keys}))


def _xml_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _answer(name: str, calls: list[dict[str, Any]], text: str) -> str:
    """Text, then the calls as the format's tag writes them."""
    if name == "qwen3_coder":
        body = "".join("<tool_call>\n<function=edit>\n" + "".join(
            f"<parameter={k}>\n{_xml_text(v)}\n</parameter>\n" for k, v in args.items()) + "</function>\n</tool_call>"
            for args in calls)
    elif name == "glm45":
        body = "".join("<tool_call>edit" + "".join(
            f"\n<arg_key>{k}</arg_key>\n<arg_value>{_xml_text(v)}</arg_value>" for k, v in args.items()) + "\n</tool_call>"
            for args in calls)
    elif name == "minimax_m2":
        body = "<minimax:tool_call>\n" + "\n".join('<invoke name="edit">\n' + "".join(
            f'<parameter name="{k}">{_xml_text(v)}</parameter>\n' for k, v in args.items()) + "</invoke>"
            for args in calls) + "\n</minimax:tool_call>"
    elif name == "deepseek_v31":
        body = _DS[0] + "".join(f"{_DS[1]}edit{_DS[2]}{json.dumps(args)}{_DS[3]}" for args in calls) + _DS[4]
    elif name == "deepseek_v3":
        body = _DS[0] + "".join(f"{_DS[1]}function{_DS[2]}edit\n```json\n{json.dumps(args, indent=1)}\n```{_DS[3]}"
                                for args in calls) + _DS[4]
    elif name == "mistral":  # (v11's form: its calls run to the answer's end)
        body = "".join(f"[TOOL_CALLS]edit[ARGS]{json.dumps(args, ensure_ascii=False)}" for args in calls)
    else:  # kimi_k2
        body = "<|tool_calls_section_begin|>" + "".join(
            f"<|tool_call_begin|>functions.edit:{i}<|tool_call_argument_begin|>{json.dumps(args, ensure_ascii=False)}"
            "<|tool_call_end|>" for i, args in enumerate(calls)) + "<|tool_calls_section_end|>"
    return text + body


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(["qwen3_coder", "glm45", "minimax_m2", "deepseek_v3", "deepseek_v31", "kimi_k2", "mistral"]),
       calls=st.lists(_ARGUMENTS, min_size=1, max_size=2), text=_TEXT, cuts=st.lists(st.integers(1, 9), max_size=40))
def test_held_calls_streamed_in_any_pieces_read_as_the_format_s_parser_reads_them(
        name: str, calls: list[dict[str, Any]], text: str, cuts: list[int]) -> None:
    parser = PARSERS[name]
    close = _XML_CLOSE.get(name)
    if close is not None and any(close in _xml_text(v) for args in calls for v in args.values()):
        return  # (a value the grammar cannot write)
    answer = _answer(name, calls, text)
    special = frozenset(parser.tags if name == "mistral" else ())  # (v11's [ARGS] a special token)
    reader = held_reader(parser, [FUNCTION], special=special)
    assert isinstance(reader, HeldTagCalls)
    content, held = read_pieces(reader, answer)

    expected_content, expected = parser.extract(answer, [FUNCTION])
    assert content == expected_content
    if name in _XML_CLOSE:  # the same JSON text the parser makes
        assert held == expected
    else:  # as written, the same object
        assert [(c.name, json.loads(c.arguments), c.id) for c in held] == [
            (c.name, json.loads(c.arguments), c.id) for c in expected]

    # However it is cut, the stream gives the whole reading.
    stream = held_reader(parser, [FUNCTION], special=special)
    assert stream is not None
    events, at = [], 0
    for size in [*cuts, len(answer)]:
        events += stream.feed(answer[at:at + size])
        at += size
    events += stream.finish()
    streamed_content, streamed = "", []
    for event in events:
        if isinstance(event, CallStart):
            streamed.append(ToolCall(event.name, "", event.call_id))
        elif isinstance(event, ArgumentsPiece):
            streamed[-1] = ToolCall(streamed[-1].name, streamed[-1].arguments + event.text, streamed[-1].id)
        else:
            streamed_content += event
    assert (streamed_content or None, streamed) == (content, held)
