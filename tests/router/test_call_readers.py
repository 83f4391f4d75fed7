"""Calls a format's structural tag held, read as they stream (``router/call_readers.py`` ``TaggedCalls``), against
the format's own parser over generated answers: whatever the arguments (strings with newlines, quotes, escapes,
``null``, text that starts like a closing tag; numbers; objects) and however the text is cut, the stream's pieces
join into the whole answer's reading, and that reading is the parser's (XML arguments as the same JSON text, JSON
ones as the same object)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from router.call_readers import ArgumentsPiece, CallStart, TaggedCalls, calls_reader, read_pieces
from router.tool_parsers import PARSERS, ToolCall

FUNCTION = {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "count": {"type": "integer"}, "options": {"type": "object"},
    "note": {"type": ["string", "null"]}}}}
_DS = ("<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581sep\uff5c>",
       "<\uff5ctool\u2581call\u2581end\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>")
_XML_CLOSE = {"qwen3_coder": "</parameter>", "seed_oss": "</parameter>", "minimax_m2": "</parameter>", "glm45": "</arg_value>"}

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


def _answer(name: str, calls: list[dict[str, Any]], text: str, ws: str = "", foreign: str | None = None) -> str:
    """Text, then the calls as the format's tag writes them; ``ws``: more whitespace where the format's parser takes
    it (around a block's calls, after a call's opening); ``foreign``: hermes calls laid out as the parser reads them
    but the tag does not write them, their keys the other way round or their arguments a JSON string."""
    if name == "hermes":
        def hermes(args: dict[str, Any]) -> str:
            obj = ({"arguments": args, "name": "edit"} if foreign == "reversed" else
                   {"name": "edit", "arguments": json.dumps(args) if foreign == "string" else args})
            return f"<tool_call>{ws}\n{json.dumps(obj, ensure_ascii=False)}\n{ws}</tool_call>"
        body = "".join(hermes(args) for args in calls)
    elif name in ("qwen3_coder", "seed_oss"):
        body = "".join(f"<tool_call>{ws}\n<function=edit>\n" + "".join(
            f"{ws}<parameter={k}>\n{_xml_text(v)}\n</parameter>\n" for k, v in args.items()) + "</function>\n</tool_call>"
            for args in calls)
        if name == "seed_oss":
            body = body.replace("tool_call>", "seed:tool_call>")
    elif name == "glm45":
        body = "".join(f"<tool_call>{ws}edit" + "".join(
            f"\n<arg_key>{k}</arg_key>\n<arg_value>{_xml_text(v)}</arg_value>" for k, v in args.items()) + "\n</tool_call>"
            for args in calls)
    elif name == "minimax_m2":
        body = "<minimax:tool_call>\n" + "\n".join(f'{ws}<invoke name="edit">\n' + "".join(
            f'<parameter name="{k}">{_xml_text(v)}</parameter>\n' for k, v in args.items()) + "</invoke>"
            for args in calls) + f"{ws}\n</minimax:tool_call>"
    elif name == "deepseek_v31":
        body = _DS[0] + "".join(f"{ws}{_DS[1]}edit{_DS[2]}{ws}{json.dumps(args)}{_DS[3]}" for args in calls) + ws + _DS[4]
    elif name == "deepseek_v3":
        body = _DS[0] + "".join(f"{ws}{_DS[1]}function{_DS[2]}edit\n```json\n{json.dumps(args, indent=1)}\n```{_DS[3]}"
                                for args in calls) + ws + _DS[4]
    elif name in ("mistral_array", "granite"):  # (Mistral's older tokenizers' form; Granite's two tags)
        tag = "[TOOL_CALLS]" if name == "mistral_array" else "<tool_call>" if ws == "\n" else "<|tool_call|>"
        body = tag + ws + json.dumps([{"name": "edit", "arguments": args} for args in calls],
                                               ensure_ascii=False, indent=1 if ws else None)
    elif name == "llama3_json":  # (the calls are the whole answer: text before them makes it all content)
        body = ("<|python_tag|>" if ws else "") + f"{ws};{ws}".join(
            json.dumps({"name": "edit", "parameters": args}, ensure_ascii=False) for args in calls)
    elif name == "mistral":  # (v11's form: its calls run to the answer's end)
        body = "".join(f"[TOOL_CALLS]{ws}edit[ARGS]{json.dumps(args, ensure_ascii=False)}" for args in calls)
    else:  # kimi_k2
        body = "<|tool_calls_section_begin|>" + "".join(
            f"{ws}<|tool_call_begin|>functions.edit:{i}<|tool_call_argument_begin|>{json.dumps(args, ensure_ascii=False)}"
            "<|tool_call_end|>" for i, args in enumerate(calls)) + ws + "<|tool_calls_section_end|>"
    return text + body


def _read(reader: Any, answer: str, cuts: list[int]) -> tuple[str | None, list[ToolCall], list[int]]:
    """The content and calls a reader's events give, the answer fed in pieces of the sizes ``cuts`` says, and how
    many pieces each call's arguments came in."""
    events, at = [], 0
    for size in [*cuts, len(answer)]:
        events += reader.feed(answer[at:at + size])
        at += size
    events += reader.finish()
    content, calls, pieces = "", [], []
    for event in events:
        if isinstance(event, CallStart):
            calls.append(ToolCall(event.name, "", event.call_id))
            pieces.append(0)
        elif isinstance(event, ArgumentsPiece):
            calls[-1] = ToolCall(calls[-1].name, calls[-1].arguments + event.text, calls[-1].id)
            pieces[-1] += 1
        else:
            content += event
    return content or None, calls, pieces


_FORMATS = ["hermes", "qwen3_coder", "seed_oss", "glm45", "minimax_m2", "deepseek_v3", "deepseek_v31", "kimi_k2",
            "mistral", "mistral_array", "granite", "llama3_json"]


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(_FORMATS), held=st.booleans(), calls=st.lists(_ARGUMENTS, min_size=1, max_size=2),
       text=_TEXT, cuts=st.lists(st.integers(1, 9), max_size=40), ws=st.sampled_from(["", " ", "\n", "\n\t \n"]),
       foreign=st.sampled_from([None, "reversed", "string"]), tail=st.sampled_from(["", "\n", " Done.", "\n\nDone. <tool"]),
       one=st.booleans())
def test_calls_streamed_in_any_pieces_read_as_the_format_s_parser_reads_them(
        name: str, held: bool, calls: list[dict[str, Any]], text: str, cuts: list[int], ws: str, foreign: str | None,
        tail: str, one: bool) -> None:
    """Calls a tag held (in its layout), or the model wrote freely (with more whitespace; in hermes' format laid out
    otherwise too, which the parser reads whole; ``one``: with ``parallel_tool_calls: false``, where the calls past the
    first are left out, as the parser's are). A call in the layout streams: its arguments come in pieces."""
    parser = PARSERS["mistral" if name == "mistral_array" else name]
    close = _XML_CLOSE.get(name)
    if close is not None and any(close in _xml_text(v) for args in calls for v in args.values()):
        return  # (a value the grammar cannot write)
    held = held and name != "llama3_json"  # (its held calls are ``RequiredCalls``', tested with the tool calls)
    if held:
        ws, one = "", False
    max_calls = 1 if one else None
    foreign = foreign if not held and name == "hermes" else None
    answer = _answer(name, calls, text, ws, foreign)
    if "mistral" not in name and name not in ("granite", "llama3_json"):  # (calls that do not end the answer)
        answer += tail
    special = frozenset(parser.tags if name == "mistral" else ())  # (v11's [ARGS] a special token)
    reader = calls_reader(parser, [FUNCTION], max_calls, special, held)
    assert isinstance(reader, TaggedCalls)
    content, read = read_pieces(reader, answer)

    expected_content, expected = parser.extract(answer, [FUNCTION])
    expected = expected[:max_calls]
    assert content == expected_content
    if name in _XML_CLOSE or foreign:  # the same JSON text the parser makes
        assert read == expected
    else:  # as written, the same object
        assert [(c.name, json.loads(c.arguments), c.id) for c in read] == [
            (c.name, json.loads(c.arguments), c.id) for c in expected]

    # However it is cut, the stream gives the whole reading.
    streamed_content, streamed, pieces = _read(calls_reader(parser, [FUNCTION], max_calls, special, held), answer, cuts)
    assert (streamed_content, streamed) == (content, read)
    if foreign is None:  # (a call the parser reads comes whole, in one piece)
        assert all(n >= 2 for n in pieces), pieces


def test_a_call_written_freely_that_slips_is_read_as_far_as_it_holds() -> None:
    """Under "auto" (the model unheld): a hermes call whose object misses its closing brace, or doubles it, is the
    call (its arguments were whole; no markup left in the content); one whose text leaves the format inside its
    arguments ends them there and the rest is content; one that leaves it before its arguments open is the parser's
    (here: content, as it reads a malformed call)."""
    hermes = PARSERS["hermes"]

    def read(text: str) -> tuple[str | None, list[ToolCall]]:
        reader = calls_reader(hermes, [FUNCTION], held=False)
        assert reader is not None
        return read_pieces(reader, text)

    call = '<tool_call>\n{"name": "edit", "arguments": {"path": "a.py"}'
    for end in ("\n</tool_call>", "}}\n</tool_call>", " } \n }</tool_call>"):
        assert read(f"Editing.\n{call}{end}\nDone.") == ("Editing.\n\nDone.", [ToolCall("edit", '{"path": "a.py"}')])
    assert read(f"{call}}}\n</tool_call>") == read(f"{call}}}\n</tool_call>\n") == (None, [ToolCall("edit", '{"path": "a.py"}')])
    # Left midway: the arguments end where the text left the format, the rest is content.
    assert read('<tool_call>\n{"name": "edit", "arguments": {"path": "a.py", "count": 1') == (
        None, [ToolCall("edit", '{"path": "a.py", "count": 1')])
    assert read(f'{call}, "note": 1}}\n</tool_call>') == (
        ', "note": 1}\n</tool_call>', [ToolCall("edit", '{"path": "a.py"}')])
    # Before the arguments: the parser's, whole.
    broken = '<tool_call>\n{"name": "edit", "arguments": [1]}\n</tool_call>'
    assert read(broken) == hermes.extract(broken) == (broken, [])


def test_a_string_argument_streams_as_it_comes_but_what_may_not_be_its_own() -> None:
    """Fed a character at a time: a string argument's text goes out as it comes, but its last newline (the layout's)
    and text that may still be all ``null`` (null, as the parser reads it) wait; a value that is no string waits for
    its end."""
    for held in (True, False):
        reader = calls_reader(PARSERS["qwen3_coder"], [FUNCTION], held=held)
        assert reader is not None
        answer = ("<tool_call>\n<function=edit>\n<parameter=note>\nNULL\n</parameter>\n<parameter=path>\nnul\n\n"
                  "</parameter>\n<parameter=count>\n12\n</parameter>\n</function>\n</tool_call>")
        pieces = [e.text for c in answer for e in reader.feed(c) if isinstance(e, ArgumentsPiece)]
        pieces += [e.text for e in reader.finish() if isinstance(e, ArgumentsPiece)]
        assert "".join(pieces) == '{"note": null, "path": "nul\\n", "count": 12}'
        assert pieces[:4] == ["{", '"note": ', "null", ', "path": ']
        assert pieces[4:6] == ['"nul\\n', '"'] and pieces[6:] == [', "count": ', "12", "}"], pieces


def test_an_opening_that_is_no_call_stays_content_as_written() -> None:
    """Where a tag held the calls (no parser to hand them to), an opening whose text is no call is content, as the
    model wrote it, whichever of the format's openings it was (Granite's two)."""
    for opening in ("<|tool_call|>", "<tool_call>"):
        reader = calls_reader(PARSERS["granite"], [FUNCTION], held=True)
        assert reader is not None
        assert read_pieces(reader, f"Use {opening} then [1, 2].") == (f"Use {opening} then [1, 2].", [])
