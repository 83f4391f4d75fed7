"""Tool-call parsers: what ``extract`` reads out of whole answers, that streaming the same text in any
chunks gives the same content and calls, template detection, and that no input makes them raise."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from router.tool_parsers import PARSERS, ToolCall, ToolCallParser, detect_parser

HERMES = PARSERS["hermes"]
LLAMA = PARSERS["llama3_json"]
MISTRAL = PARSERS["mistral"]
QWEN3_CODER = PARSERS["qwen3_coder"]

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = (
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": [24, true]}}\n</tool_call>'
)
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
PARIS = ToolCall("get_weather", '{"city": "Paris"}')
LLAMA_CALL2 = '{"name": "get_time", "arguments": {"tz": "UTC"}}'


def _stream(parser: ToolCallParser, chunks: list[str]) -> tuple[str, list[ToolCall]]:
    """The joined content and the calls that streaming the chunks gives."""
    stream = parser.stream()
    events = [e for chunk in chunks for e in stream.feed(chunk)] + stream.finish()
    assert all(e for e in events if isinstance(e, str)), "empty content event"
    return "".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)]


def _split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _check_consistent(parser: ToolCallParser, text: str, rng: random.Random, every_position: bool) -> None:
    content, calls = parser.extract(text)
    assert content is None or (content and content == content.strip())
    expected = (content or "", calls)
    chunkings = [[text], list(text)]
    if every_position:
        chunkings += [_split(text, [i]) for i in range(len(text) + 1)]
    for _ in range(8):
        chunkings.append(_split(text, [rng.randint(0, len(text)) for _ in range(rng.randint(1, 6))]))
    for chunks in chunkings:
        assert _stream(parser, chunks) == expected, (text, chunks)


# -- hermes -------------------------------------------------------------------------------------------


def test_hermes_single_call() -> None:
    assert HERMES.extract(WEATHER) == (None, [ToolCall("get_weather", '{"city": "Paris"}')])


def test_hermes_several_calls_and_content_before() -> None:
    text = f"Let me check both.\n\n{WEATHER}\n{TIME}\n"
    content, calls = HERMES.extract(text)
    assert content == "Let me check both."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].arguments) == {"tz": "Europe/Paris", "fmt": [24, True]}


def test_hermes_content_around_calls_keeps_inner_text() -> None:
    content, calls = HERMES.extract(f"  Before {WEATHER} after.  ")
    assert content == "Before  after."
    assert len(calls) == 1


def test_hermes_plain_text() -> None:
    assert HERMES.extract("  Just an answer.\n") == ("Just an answer.", [])
    assert HERMES.extract(" \n\t") == (None, [])
    assert HERMES.extract("") == (None, [])


def test_hermes_invalid_calls_stay_content_verbatim() -> None:
    for body in (
        '{"name": "f", "arguments": {"x": 1}',  # unbalanced
        '{"arguments": {"x": 1}}',  # no name
        '{"name": 3, "arguments": {}}',
        '{"name": "", "arguments": {}}',
        '{"name": "f", "arguments": [1, 2]}',
        '{"name": "f", "arguments": "not json"}',
        '{"name": "f", "arguments": "[1]"}',
        '{"name": "f"}',
        '{"name": "f", "arguments": {"x": NaN}}',
        '{"name": "f", "arguments": {"x": 1e999}}',
        '{"name": "f", "arguments": {}} trailing',
        '["f", {}]',
    ):
        tag = f"<tool_call>{body}</tool_call>"
        assert HERMES.extract(f"Hi {tag} {WEATHER}") == (f"Hi {tag}", [PARIS])


def test_hermes_parameters_synonym_and_string_arguments() -> None:
    text = (
        '<tool_call>{"name": "f", "parameters": {"a": "é"}}</tool_call>'
        '<tool_call>{"name": "g", "arguments": "{\\"b\\": [1, 2]}"}</tool_call>'
    )
    assert HERMES.extract(text) == (None, [ToolCall("f", '{"a": "é"}'), ToolCall("g", '{"b": [1, 2]}')])


def test_hermes_unterminated_valid_call() -> None:
    assert HERMES.extract('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n') == (
        "Sure.",
        [ToolCall("f", '{"x": 1}')],
    )


def test_hermes_unterminated_invalid_stays_content() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "f", "argum'
    assert HERMES.extract(text) == (text, [])
    assert HERMES.extract("<tool_call>") == ("<tool_call>", [])


def test_hermes_stray_and_nested_tags_are_content() -> None:
    assert HERMES.extract(f"a </tool_call> b {WEATHER}") == ("a </tool_call> b", [PARIS])
    nested = f"<tool_call>{WEATHER}"
    assert HERMES.extract(nested) == (nested, [])


def test_hermes_stream_emits_content_early() -> None:
    stream = HERMES.stream()
    assert stream.feed("  Hello wor") == ["Hello wor"]
    assert stream.feed("ld <tool") == ["ld"]  # the space and the tag's start are held
    assert stream.feed('_call>{"name": "f", "arguments": {}}') == []
    assert stream.feed("</tool_call>\n") == [ToolCall("f", "{}")]
    assert stream.feed("\n Bye <") == [" \n\n Bye"]  # the whitespace around the call is released
    assert stream.finish() == [" <"]


def test_hermes_stream_joins_adjacent_content() -> None:
    stream = HERMES.stream()
    assert stream.feed("a <tool_call>bad</tool_call> b") == ["a <tool_call>bad</tool_call> b"]


def test_hermes_stream_drops_whitespace_around_calls() -> None:
    stream = HERMES.stream()
    assert stream.feed(f"\n{WEATHER}\n\n") == [ToolCall("get_weather", '{"city": "Paris"}')]
    assert stream.feed(" \n") == []
    assert stream.finish() == []


# -- llama3_json -----------------------------------------------------------------------------------------


def test_llama_single_and_several_calls() -> None:
    assert LLAMA.extract(f"  {LLAMA_CALL}\n") == (None, [ToolCall("get_weather", '{"city": "Paris"}')])
    assert LLAMA.extract(f"<|python_tag|>{LLAMA_CALL} ;\n {LLAMA_CALL2}") == (
        None,
        [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", '{"tz": "UTC"}')],
    )


def test_llama_string_arguments() -> None:
    assert LLAMA.extract('{"name": "f", "parameters": "{\\"x\\": 1}"}') == (None, [ToolCall("f", '{"x": 1}')])


def test_llama_anything_else_is_content() -> None:
    for text in (
        f"Here you go: {LLAMA_CALL}",
        f"{LLAMA_CALL} and some words",
        f"{LLAMA_CALL};",
        f"{LLAMA_CALL}; {{}}",
        '{"name": "f", "parameters": [1]}',
        '{"name": "f", "parameters": {"x": 1}',
        '{"city": "Paris"}',
        "<|python_tag|>",
        "<|python_tag|>print(1)",
    ):
        assert LLAMA.extract(f" {text}\n") == (text, []), text
    assert LLAMA.extract(" \n ") == (None, [])


def test_llama_stream_decides_early() -> None:
    stream = LLAMA.stream()
    assert stream.feed("  <|pyth") == []
    assert stream.feed("on") == []
    assert stream.feed("!") == ["<|python!"]
    assert stream.feed(" more ") == [" more"]
    assert stream.finish() == []

    stream = LLAMA.stream()
    assert stream.feed(" {") == []
    assert stream.feed('"name": "f", "parameters": {}}') == []
    assert stream.finish() == [ToolCall("f", "{}")]

    stream = LLAMA.stream()
    assert stream.feed("{ not json") == []
    assert stream.finish() == ["{ not json"]


# -- streaming matches extract --------------------------------------------------------------------------

HERMES_TEXTS = [
    WEATHER,
    f"Let me check.\n\n{WEATHER}\n{TIME}\n",
    f"  Before {WEATHER} after.  \n",
    f"{WEATHER}\n\nThe weather is nice.",
    'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n',
    'Sure.\n<tool_call>\n{"name": "f", "argum',
    f"<tool_call>{{bad}}</tool_call> {WEATHER} <tool_",
    f"a </tool_call> b <tool_call>{WEATHER}",
    "Ends with a lone <",
    "x < y <tool and <tool_cal > z",
    "  \n  ",
    "",
    "多语言 ✓ <tool_call>{\"name\": \"ü\", \"arguments\": \"{\\\"k\\\": \\\"ß\\\"}\"}</tool_call> 終",
    '<tool_call>{"name": "f", "parameters": {"n": 1e5}}</tool_call><tool_call>',
]

LLAMA_TEXTS = [
    LLAMA_CALL,
    f"  <|python_tag|>{LLAMA_CALL}; {LLAMA_CALL2}\n",
    f"{LLAMA_CALL} trailing words",
    "  The answer is 42.  \n",
    "  <|python_tag|> oops",
    "<|pyth",
    " <",
    "",
    "\n\n",
    '{"name": "f"',
    "Hello { not a call }",
]


def test_hermes_stream_matches_extract() -> None:
    rng = random.Random(1)
    for text in HERMES_TEXTS:
        _check_consistent(HERMES, text, rng, every_position=True)


def test_llama_stream_matches_extract() -> None:
    rng = random.Random(2)
    for text in LLAMA_TEXTS:
        _check_consistent(LLAMA, text, rng, every_position=True)


# -- mistral --------------------------------------------------------------------------------------------

MISTRAL_TEXTS = [
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    'Sure.\n[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {"tz": "UTC"}}]',
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}',
    '[TOOL_CALLS] [{"name": "get_weather", "argu',
    "[TOOL_CALLS]get_weather[ARGS]{oops",
    "No tools needed: [TOOL_CAL",
    "plain answer",
    "",
]


def test_mistral_both_formats_and_what_is_not_a_call() -> None:
    assert MISTRAL.extract(MISTRAL_TEXTS[0]) == (None, [PARIS])
    assert MISTRAL.extract(MISTRAL_TEXTS[1]) == ("Sure.", [PARIS, ToolCall("get_time", '{"tz": "UTC"}')])
    assert MISTRAL.extract(MISTRAL_TEXTS[2]) == (None, [PARIS, ToolCall("get_time", '{"tz": "UTC"}')])
    for text in MISTRAL_TEXTS[3:7]:
        assert MISTRAL.extract(text) == (text.strip() or None, [])
    rng = random.Random(4)
    for text in MISTRAL_TEXTS:
        _check_consistent(MISTRAL, text, rng, every_position=True)


def test_call_ids_are_the_kind_each_format_takes_back() -> None:
    ids = {MISTRAL.new_call_id("f", 0) for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)
    assert HERMES.new_call_id("f", 0).startswith("chatcmpl-tool-") and HERMES.new_call_id("f", 0) != HERMES.new_call_id("f", 0)
    assert PARSERS["kimi_k2"].new_call_id("get_weather", 1) == "functions.get_weather:1"


# -- detection ------------------------------------------------------------------------------------------

QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{{ tools | tojson }}</tools>\n"
    'For each function call, return a json object within <tool_call></tool_call> XML tags:\n'
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- endif %}"
)
LLAMA31_TEMPLATE = (
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{%- if builtin_tools is defined %}{{- '<|python_tag|>' + tool_call.name }}{%- endif %}"
)
LLAMA32_TEMPLATE = (
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}"
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and "
    "its value}.' }}"
)
CHATML_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
LLAMA_NO_TOOLS = "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content }}"


def test_detect_parser() -> None:
    assert detect_parser(QWEN_TEMPLATE) == "hermes"
    assert detect_parser(LLAMA31_TEMPLATE) == "llama3_json"
    assert detect_parser(LLAMA32_TEMPLATE) == "llama3_json"
    assert detect_parser(CHATML_TEMPLATE) is None
    assert detect_parser(LLAMA_NO_TOOLS) is None
    assert detect_parser("") is None
    assert detect_parser(None) is None
    assert detect_parser("{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
                         "{{- '[TOOL_CALLS]' + tool_calls|tojson }}") == "mistral"
    assert detect_parser(QWEN3_CODER_TEMPLATE) == "qwen3_coder"
    assert detect_parser(QWEN3_CODER_TEMPLATE.replace("<tool_call>", "<seed:tool_call>")) == "seed_oss"
    # Each format's tool-call lines, as its chat templates write them.
    assert detect_parser("{{- '<tool_call>' + tc.name }}{% for k, v in args %}<arg_key>{{ k }}</arg_key>\n"
                         "<arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>") == "glm45"
    assert detect_parser("<minimax:tool_call>\n<invoke name=\"{{ name }}\">") == "minimax_m2"
    assert detect_parser(DEEPSEEK_OPEN + "{{ tool['function']['name'] }}" + DEEPSEEK_SEP) == "deepseek_v31"
    assert detect_parser(DEEPSEEK_OPEN + "function" + DEEPSEEK_SEP + "{{ name }}\n```json\n") == "deepseek_v3"
    assert detect_parser("Respond in the format [func_name1(params_name1=params_value1), func_name2(params)]"
                         "{{- '<|start_header_id|>' }}") == "pythonic"
    assert detect_parser("[func_name1(params_name1=params_value1)] {{- '<|header_start|>' }}") == "llama4_pythonic"
    assert detect_parser("{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + message.tool_calls|tojson }}"
                         ) == "granite"
    assert set(PARSERS) == {"hermes", "qwen3_coder", "llama3_json", "mistral", "glm45", "glm47", "minimax_m2",
                            "deepseek_v3", "deepseek_v31", "kimi_k2", "pythonic", "llama4_pythonic", "granite",
                            "seed_oss"}
    assert all(PARSERS[name].name == name for name in PARSERS)


# -- never raising --------------------------------------------------------------------------------------

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "</tool", "<|python_tag|>", "<|py", "{", "}", "[", "]", '"name"',
    '"arguments"', '"parameters"', ":", ",", ";", '"f"', '"{}"', "1e999", "NaN", "-0", "12345678901234567890",
    " ", "\n", "\t", "\u00a0", "a", "Zz", "<", ">", "\\", '"', "\\ud800", "é", "🙂", "\u2028", "[TOOL_CALLS]", "[ARGS]",
    WEATHER, LLAMA_CALL, '{"name": "f", "arguments": {}}', '[TOOL_CALLS][{"name": "f", "arguments": {}}]',
    "<function=f>", "</function>", "<parameter=a>", "</parameter>", "<parameter=", "<function=",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<tool_call>f", "<minimax:tool_call>",
    "</minimax:tool_call>", '<invoke name="f">', "</invoke>", '<parameter name="a">', "<\uff5ctool\u2581calls\u2581begin\uff5c>",
    "<\uff5ctool\u2581calls\u2581end\uff5c>", "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>",
    "<\uff5ctool\u2581sep\uff5c>", "function", "\n```json\n", "\n```", "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>", "<|tool_call_begin|>", "functions.f:0", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    "[f(a=1)]", "(", ")", "=", "True", "None", "x=", "'s'", "<|python_start|>", "<|python_end|>", "1j", "{1}",
]

ADVERSARIAL = [
    "<tool_call>" + "[" * 50_000 + "</tool_call>",
    "<tool_call>" + '{"name": "f", "arguments": ' + "[" * 50_000,
    "{" * 50_000,
    '{"name": "f", "parameters": ' + '{"a": ' * 5_000 + "1" + "}" * 5_001,
    '<tool_call>{"name": "f", "arguments": {"n": ' + "9" * 10_000 + "}}</tool_call>",
    '{"name": "f", "parameters": {"n": ' + "9" * 10_000 + "}}",
    '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
    '{"name": "f", "parameters": {"s": "\\udfff"}}',
    "<tool_call><tool_call></tool_call></tool_call>",
    "</tool_call>" * 3,
    "<",
    "<|python_tag|><|python_tag|>",
    "[TOOL_CALLS]" + "[" * 50_000,
    "[TOOL_CALLS]" * 3,
]


def _check_calls(calls: list[ToolCall]) -> None:
    for call in calls:
        assert isinstance(call.name, str) and call.name
        args = json.loads(call.arguments)
        assert isinstance(args, dict)
        assert call.arguments == json.dumps(args, ensure_ascii=False)
        (call.name + call.arguments).encode("utf-8")


def test_no_input_raises() -> None:
    rng = random.Random(3)
    texts = [*ADVERSARIAL]
    for _ in range(300):
        texts.append("".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 12))))
    found = 0
    for parser in PARSERS.values():
        for text in texts:
            content, calls = parser.extract(text)
            _check_calls(calls)
            found += len(calls)
            chunks = _split(text, [rng.randint(0, len(text)) for _ in range(3)])
            assert _stream(parser, chunks) == (content or "", calls)
    assert found > 20  # the valid fragments were read as calls


def test_adversarial_inputs_are_content() -> None:
    for text in ADVERSARIAL[:3]:
        assert HERMES.extract(text) == (text, [])
        assert LLAMA.extract(text) == (text, [])
    assert LLAMA.extract(ADVERSARIAL[3])[1] == []  # deeper than the decoder goes
    assert HERMES.extract(ADVERSARIAL[4])[1] == []  # more digits than an int may have
    assert HERMES.extract(ADVERSARIAL[6]) == (ADVERSARIAL[6], [])  # a lone surrogate


# -- hermes, calls a strict function's structural tag held ---------------------------------------------------------


def _strict(chunks: list[str], max_calls: int | None = None) -> tuple[str, list[tuple[str, str]], int]:
    """Content, calls (name, arguments joined) and how many argument pieces streaming the chunks gives."""
    from router.call_readers import ArgumentsPiece, CallStart, calls_reader

    reader = calls_reader(HERMES, [], max_calls)
    assert reader is not None
    events = [e for chunk in chunks for e in reader.feed(chunk)] + reader.finish()
    assert all(e for e in events if isinstance(e, str)), "empty content event"
    calls: list[list[str]] = []
    pieces = 0
    for event in events:
        if isinstance(event, CallStart):
            calls.append([event.name, ""])
        elif isinstance(event, ArgumentsPiece):
            calls[-1][1] += event.text
            pieces += 1
    return "".join(e for e in events if isinstance(e, str)), [(n, a) for n, a in calls], pieces


def test_strict_calls_stream_their_arguments_as_written_and_read_as_the_hermes_parser_reads_them() -> None:
    """In the layout the structural tag writes, the content and calls are the hermes parser's (the arguments as
    written, here as json.dumps writes them), however the text is cut, and a call's arguments go out in pieces
    as they come, none of the call's end among them. The end is the layout's, a newline that JSON escapes in a
    string: "</tool_call>" inside an argument's string does not end the call."""
    rng = random.Random(3)
    compact = '<tool_call>\n{"name": "f", "arguments": {"a":{"b":[1,"}\\n</tool_call>"]}}}\n</tool_call>'
    for text in (WEATHER, f"Let me check.\n\n{WEATHER}\n{TIME}\n", f"  Before {WEATHER} after.  \n",
                 f"{WEATHER}\n\nThe weather is nice.", "No call at all. <tool", "", compact):
        content, calls = HERMES.extract(text)
        if text == compact:  # the hermes parser ends the tag at the </tool_call> inside a string: not a call there
            content, calls = "", [ToolCall("f", '{"a":{"b":[1,"}\\n</tool_call>"]}}')]
        expected = (content or "", [(c.name, c.arguments) for c in calls])
        chunkings = [[text], list(text), *(_split(text, [rng.randint(0, len(text))]) for _ in range(20))]
        for chunks in chunkings:
            assert _strict(chunks)[:2] == expected, (text, chunks)
    *_, pieces = _strict(list(WEATHER))
    assert pieces == len('{"city": "Paris"}')  # a character at a time, fed one at a time


def test_strict_calls_off_the_layout_a_call_too_many_and_a_cut_answer() -> None:
    # A tag whose text leaves the layout (the engine did not hold it) is content, as written; reading goes on.
    off = f'Hi <tool_call>\n{{"arguments": {{}}}}\n</tool_call> then {WEATHER}'
    assert _strict([off])[:2] == ('Hi <tool_call>\n{"arguments": {}}\n</tool_call> then',
                                  [("get_weather", '{"city": "Paris"}')])
    assert _strict(['<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>'])[:2] == (
        '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>', [])
    # Without parallel calls, a second call is content.
    content, calls, _ = _strict([f"{WEATHER}\n{TIME}"], max_calls=1)
    assert calls == [("get_weather", '{"city": "Paris"}')] and content == TIME
    # Cut inside a call: its arguments end where they were certain (the end's start is held back, then dropped);
    # cut inside the tag before the name: the tag's text is content.
    assert _strict([WEATHER[: WEATHER.index("}\n</tool_call>") + 3]])[:2] == ("", [("get_weather", '{"city": "Paris"}')])
    assert _strict([WEATHER[:53]])[:2] == ("", [("get_weather", '{"ci')])
    assert _strict(["Sure. <tool_call>\n{\"na"])[:2] == ('Sure. <tool_call>\n{"na', [])


# -- qwen3_coder ----------------------------------------------------------------------------------------------------

QWEN3_CODER_TEMPLATE = (  # the part of Qwen3-Coder's chat template that teaches the format
    "{%- if tools %}<tools>{% for tool in tools %}<function><name>{{ tool.function.name }}</name></function>"
    "{% endfor %}</tools>\nIf you choose to call a function ONLY reply in the following format:\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n"
    "</tool_call>{%- endif %}"
)
FUNCTIONS = [{"name": "search", "parameters": {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "ratio": {"type": "number"}, "exact": {"type": "boolean"},
    "filters": {"type": "object"}, "tags": {"type": ["array", "null"]}, "note": {"type": "string"}}}}]


def _xml_call(name: str, params: dict[str, str]) -> str:
    inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{inner}</function>\n</tool_call>"


def test_qwen3_coder_calls_take_their_types_from_the_schema() -> None:
    """Each value as its parameter's type says (a string stays as written, "42" and its spaces too); one the schema does not
    declare, and a call to a function it does not know, as text; the content around calls as the hermes parser
    gives it; the same whole or streamed, however cut."""
    text = ("Searching.\n" + _xml_call("search", {
        "query": "42", "limit": "10", "ratio": "0.5", "exact": "true", "filters": '{"lang": "en"}', "tags": "[1, 2]",
        "note": "  two\nlines ", "extra": "7"}) + "\n" + _xml_call("other", {"n": "3"}) + "\nDone.")
    content, calls = QWEN3_CODER.extract(text, FUNCTIONS)
    assert content == "Searching.\n\n\nDone."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("search", {"query": "42", "limit": 10, "ratio": 0.5, "exact": True, "filters": {"lang": "en"}, "tags": [1, 2],
                    "note": "  two\nlines ", "extra": "7"}),
        ("other", {"n": "3"}),
    ]
    rng = random.Random(5)
    for cuts in ([], *([rng.randint(0, len(text)) for _ in range(4)] for _ in range(20))):
        stream = QWEN3_CODER.stream(FUNCTIONS)
        events = [e for chunk in _split(text, cuts) for e in stream.feed(chunk)] + stream.finish()
        assert ("".join(e for e in events if isinstance(e, str)), [e for e in events if isinstance(e, ToolCall)]) == (
            content, calls)
    # Values a type cannot hold stay text; null is None; a number that is whole is an integer, as vLLM reads them.
    _, [call] = QWEN3_CODER.extract(_xml_call("search", {"limit": "ten", "exact": "maybe", "ratio": "2.0",
                                                         "tags": "null", "filters": "{oops"}), FUNCTIONS)
    assert json.loads(call.arguments) == {"limit": "ten", "exact": "maybe", "ratio": 2, "tags": None, "filters": "{oops"}


def test_qwen3_coder_bodies_that_are_no_call_stay_content() -> None:
    for body in ("<function=f>\n<parameter=a>\n1\n</function>",  # a parameter left open
                 "<function=f>\nstray text\n<parameter=a>\n1\n</parameter>\n</function>",
                 '{"name": "f", "arguments": {}}',  # hermes's form, not this one
                 "<function=>\n</function>"):
        text = f"Hi <tool_call>\n{body}\n</tool_call>"
        assert QWEN3_CODER.extract(text, FUNCTIONS) == (text, []), body
    assert QWEN3_CODER.extract(_xml_call("f", {}))[1] == [ToolCall("f", "{}")]  # no arguments is a call


# -- GLM, MiniMax-M2, DeepSeek -------------------------------------------------------------------------------------

DEEPSEEK_OPEN, DEEPSEEK_CLOSE = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
DEEPSEEK_CALL, DEEPSEEK_CALL_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
DEEPSEEK_SEP = "<\uff5ctool\u2581sep\uff5c>"
SEARCH = {"query": "42", "limit": 10, "exact": True, "filters": {"lang": "en"}, "note": " two\nlines"}


def _glm(name: str, params: dict[str, str], newlines: bool) -> str:
    nl = "\n" if newlines else ""
    return f"<tool_call>{name}{nl}" + "".join(
        f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in params.items()) + "</tool_call>"


def _check_whole_and_streamed(parser: ToolCallParser, text: str, content: str | None,
                              calls: list[tuple[str, dict[str, object]]]) -> None:
    got_content, got_calls = parser.extract(text, FUNCTIONS)
    assert (got_content, [(c.name, json.loads(c.arguments)) for c in got_calls]) == (content, calls)
    rng = random.Random(text)
    for cuts in ([], *([rng.randint(0, len(text)) for _ in range(4)] for _ in range(20))):
        stream = parser.stream(FUNCTIONS)
        events = [e for chunk in _split(text, cuts) for e in stream.feed(chunk)] + stream.finish()
        assert ("".join(e for e in events if isinstance(e, str)) or None,
                [e for e in events if isinstance(e, ToolCall)]) == (got_content, got_calls)


def test_glm_calls_in_both_layouts_typed_by_the_schema() -> None:
    """GLM-4.5's layout (a line each) and GLM-4.7's (side by side) read alike; values typed as Qwen3-Coder's are; a
    call with no arguments; a body that is no such call (hermes's JSON, stray text, a pair left open) is content."""
    params = {"query": "42", "limit": "10", "exact": "true", "filters": '{"lang": "en"}', "note": " two\nlines"}
    for newlines in (True, False):
        text = "Looking.\n" + _glm("search", params, newlines) + _glm("get_time", {}, newlines) + " Done."
        _check_whole_and_streamed(PARSERS["glm45"], text, "Looking.\n Done.", [("search", SEARCH), ("get_time", {})])
    for body in ('{"name": "f", "arguments": {}}', "f\nstray<arg_key>a</arg_key><arg_value>1</arg_value>",
                 "f<arg_key>a</arg_key><arg_value>1", "<arg_key>a</arg_key><arg_value>1</arg_value>",
                 "f<arg_key>a</arg_key><arg_value>1</arg_value>junk<arg_key>b</arg_key><arg_value>2</arg_value>"):
        text = f"Hi <tool_call>{body}</tool_call>"
        assert PARSERS["glm47"].extract(text, FUNCTIONS) == (text, []), body


def test_minimax_m2_blocks_of_invokes() -> None:
    def invoke(name: str, params: dict[str, str]) -> str:
        return f'<invoke name="{name}">\n' + "".join(
            f'<parameter name="{k}">{v}</parameter>\n' for k, v in params.items()) + "</invoke>\n"

    params = {"query": "42", "limit": "10", "exact": "true", "filters": '{"lang": "en"}', "note": " two\nlines"}
    text = "Two calls.\n<minimax:tool_call>\n" + invoke("search", params) + invoke("get_time", {}) + "</minimax:tool_call>"
    _check_whole_and_streamed(PARSERS["minimax_m2"], text, "Two calls.", [("search", SEARCH), ("get_time", {})])
    for body in ("\n", "text", invoke("f", {}) + "stray", '<invoke name="f"><parameter name="a">1</invoke>'):
        text = f"Hi <minimax:tool_call>{body}</minimax:tool_call>"
        assert PARSERS["minimax_m2"].extract(text, FUNCTIONS) == (text, []), body


def test_deepseek_v3_and_v31_calls() -> None:
    v3 = f"{DEEPSEEK_CALL}function{DEEPSEEK_SEP}search\n```json\n{json.dumps(SEARCH)}\n```{DEEPSEEK_CALL_END}"
    v31 = f"{DEEPSEEK_CALL}get_time{DEEPSEEK_SEP}{{}}{DEEPSEEK_CALL_END}"
    text = f"Calling.{DEEPSEEK_OPEN}{v3}\n{v31}{DEEPSEEK_CLOSE}"
    for name in ("deepseek_v3", "deepseek_v31"):
        _check_whole_and_streamed(PARSERS[name], text, "Calling.", [("search", SEARCH), ("get_time", {})])
    for body in ("", "text", f"{DEEPSEEK_CALL}f{DEEPSEEK_SEP}not json{DEEPSEEK_CALL_END}",
                 f"{DEEPSEEK_CALL}function{DEEPSEEK_SEP}f\n```json\n[1]\n```{DEEPSEEK_CALL_END}"):
        text = f"Hi {DEEPSEEK_OPEN}{body}{DEEPSEEK_CLOSE}"
        assert PARSERS["deepseek_v3"].extract(text, FUNCTIONS) == (text, []), body


def test_kimi_k2_sections_keep_the_ids_the_model_wrote() -> None:
    from router.tools import ToolDeltas, ToolPlan, tool_calls_out

    kimi = PARSERS["kimi_k2"]
    section = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.search:3<|tool_call_argument_begin|>"
               f"{json.dumps(SEARCH)}<|tool_call_end|>\n<|tool_call_begin|>functions.get_time:4"
               "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")
    text = "Checking." + section
    _check_whole_and_streamed(kimi, text, "Checking.", [("search", SEARCH), ("get_time", {})])
    _, calls = kimi.extract(text)
    assert [c.id for c in calls] == ["functions.search:3", "functions.get_time:4"]
    assert [c.id for c in tool_calls_out(calls, kimi)] == ["functions.search:3", "functions.get_time:4"]
    plan = ToolPlan.from_request([{"type": "function", "function": {"name": n}} for n in ("search", "get_time")],
                                 "auto", None)
    assert plan is not None
    deltas = ToolDeltas.start(plan, kimi)
    streamed = [d.id for piece in (text[:20], text[20:]) for d in deltas.feed(piece)[1] if d.id] + [
        d.id for d in deltas.finish()[1] if d.id]
    assert streamed == ["functions.search:3", "functions.get_time:4"]
    # Calls the model did not write take ids of the same form.
    assert [c.id for c in tool_calls_out([ToolCall("f", "{}")], kimi)] == ["functions.f:0"]
    assert detect_parser("{{ '<|tool_calls_section_begin|>' }}{%- for tc in tool_calls %}") == "kimi_k2"
    for body in ("", "<|tool_call_begin|>search:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
                 "<|tool_call_begin|>functions.f:x<|tool_call_argument_begin|>{}<|tool_call_end|>",
                 "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[]<|tool_call_end|>"):
        bad = f"Hi <|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"
        assert kimi.extract(bad) == (bad, []), body


def test_mistral_call_tags_hold_calls_in_each_tokenizer_s_form(tokenizer_dir: object) -> None:
    """Mistral's structural tags, compiled by xgrammar against a tokenizer whose tags are special tokens (as an engine
    compiles them): a call in the tokenizer's form is taken, token for token, after text under "auto" and only at the
    start under "required"; arguments off a held schema are not; with [TOOL_CALLS] plain text, the same as text."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from common.sampling_params import StructuredOutput
    from common.structured_output import build_grammar

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok),
                                                                      stop_token_ids=[tok.eos_token_id]))
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"], "additionalProperties": False}},
                 {"name": "f"}]

    def takes(tag: dict[str, object], text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
        return all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and (
            matcher.accept_token(tok.eos_token_id))

    for special in (frozenset({"[TOOL_CALLS]", "[ARGS]"}), frozenset({"[TOOL_CALLS]"}), frozenset()):
        v11 = "[ARGS]" in special
        call = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}' if v11
                else '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]')
        for required in (False, True):
            tag = MISTRAL.call_tag(functions, frozenset({"get_weather"}), True, required, special)
            assert tag is not None
            build_grammar(StructuredOutput(kind="structural_tag", spec=json.dumps(tag)))  # the router's check
            assert takes(tag, call) and not takes(tag, call.replace("city", "town"))
            assert takes(tag, "Sure. " + call) != required and takes(tag, "Just text.") != required
        if v11:  # each call its own [TOOL_CALLS]; one call only without parallel calls
            two = call + '[TOOL_CALLS]f[ARGS]{"x": 1}'
            assert takes(MISTRAL.call_tag(functions, frozenset({"get_weather"}), True, True, special), two)
            assert not takes(MISTRAL.call_tag(functions, frozenset({"get_weather"}), False, True, special), two)


def _glm_native(calls: list[tuple[str, str]]) -> str:
    return "".join(f"<tool_call>{n}\n<arg_key>city</arg_key>\n<arg_value>{c}</arg_value>\n</tool_call>" for n, c in calls)


def _minimax_native(calls: list[tuple[str, str]]) -> str:
    return "<minimax:tool_call>\n" + "\n".join(
        f'<invoke name="{n}">\n<parameter name="city">{c}</parameter>\n</invoke>' for n, c in calls) + "\n</minimax:tool_call>"


def _deepseek_native(v3: bool) -> Any:
    def text(calls: list[tuple[str, str]]) -> str:
        body = "".join(
            f"{DEEPSEEK_CALL}function{DEEPSEEK_SEP}{n}\n```json\n{json.dumps({'city': c})}\n```{DEEPSEEK_CALL_END}" if v3
            else f"{DEEPSEEK_CALL}{n}{DEEPSEEK_SEP}{json.dumps({'city': c})}{DEEPSEEK_CALL_END}" for n, c in calls)
        return DEEPSEEK_OPEN + body + DEEPSEEK_CLOSE
    return text


def _kimi_native(calls: list[tuple[str, str]]) -> str:
    return "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps({'city': c})}<|tool_call_end|>"
        for i, (n, c) in enumerate(calls)) + "<|tool_calls_section_end|>"


def _hermes_native(calls: list[tuple[str, str]]) -> str:
    return "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {json.dumps({"city": c})}}}\n</tool_call>'
                   for n, c in calls)


def _seed_oss_native(calls: list[tuple[str, str]]) -> str:
    return _qwen3_coder_native(calls).replace("tool_call>", "seed:tool_call>")


def _granite_native(calls: list[tuple[str, str]]) -> str:
    return "<|tool_call|>" + json.dumps([{"name": n, "arguments": {"city": c}} for n, c in calls])


def _qwen3_coder_native(calls: list[tuple[str, str]]) -> str:
    return "".join(f"<tool_call>\n<function={n}>\n<parameter=city>\n{c}\n</parameter>\n</function>\n</tool_call>"
                   for n, c in calls)


@pytest.mark.parametrize(("name", "native"), [
    ("hermes", _hermes_native), ("qwen3_coder", _qwen3_coder_native), ("glm45", _glm_native), ("minimax_m2", _minimax_native), ("deepseek_v3", _deepseek_native(True)),
    ("deepseek_v31", _deepseek_native(False)), ("kimi_k2", _kimi_native), ("granite", _granite_native),
    ("seed_oss", _seed_oss_native)])
@pytest.mark.parametrize("tags_special", [True, False])
def test_each_format_s_call_tag_holds_its_own_calls(tokenizer_dir: object, name: str, native: Any,
                                                    tags_special: bool) -> None:
    """Each format's structural tag, compiled by xgrammar against a tokenizer (its tags special tokens, as the models'
    tokenizers make them, or plain text): its own calls are taken and read back by its parser, token for token;
    arguments off a held schema are not; text before a call only under "auto"; a second call only with parallel calls."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    parser = PARSERS[name]
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if tags_special:
        tok.add_special_tokens({"additional_special_tokens": list(parser.tags)})
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok),
                                                                      stop_token_ids=[tok.eos_token_id]))
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"], "additionalProperties": False}},
                 {"name": "get_time", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    special = frozenset(parser.tags) if tags_special else frozenset()

    def takes(parallel: bool, required: bool, text: str) -> bool:
        tag = parser.call_tag(functions, frozenset({"get_weather"}), parallel, required, special)
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
        return all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and (
            matcher.accept_token(tok.eos_token_id))

    one, two = native([("get_weather", "Paris")]), native([("get_weather", "Paris"), ("get_time", "Rome")])
    assert [(c.name, json.loads(c.arguments)) for c in parser.extract(two, functions)[1]] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"city": "Rome"})]
    for required in (False, True):
        assert takes(True, required, one) and takes(True, required, two)
        assert not takes(True, required, native([("get_weather", "Paris")]).replace("city", "town"))
        assert takes(True, required, "Let me check. " + one) != required
        assert not takes(False, required, two)


def test_llama3_json_call_tag_holds_the_whole_answer(tokenizer_dir: object) -> None:
    """Llama 3's JSON calls are the whole answer, so its structural tag holds the whole answer, compiled by xgrammar
    against a tokenizer: ``{"name": ..., "parameters": ...}`` calls as its templates ask for them, read back by the
    parser, a held function's arguments to its schema, several a ``; `` apart only with parallel calls; under "auto"
    text instead, though not text the parser would read calls out of (opening with ``{``, whitespace or ``<|``), and
    text before a call stays content; under "required" calls only."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from common.sampling_params import StructuredOutput
    from common.structured_output import build_grammar

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok),
                                                                      stop_token_ids=[tok.eos_token_id]))
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"], "additionalProperties": False}},
                 {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}]

    def takes(parallel: bool, required: bool, text: str) -> bool:
        tag = LLAMA.call_tag(functions, frozenset({"get_weather"}), parallel, required)
        assert tag is not None
        build_grammar(StructuredOutput(kind="structural_tag", spec=json.dumps(tag)))  # the router's check
        matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
        return all(matcher.accept_token(t) for t in tok.encode(text, add_special_tokens=False)) and (
            matcher.accept_token(tok.eos_token_id))

    time_call = '{"name": "get_time", "parameters": {"tz": "UTC"}}'
    two = f"{LLAMA_CALL}; {time_call}"
    assert LLAMA.extract(two, functions)[1] == [ToolCall("get_weather", '{"city": "Paris"}'),
                                                 ToolCall("get_time", '{"tz": "UTC"}')]
    for required in (False, True):
        assert takes(False, required, LLAMA_CALL) and takes(True, required, two) and not takes(False, required, two)
        assert not takes(True, required, LLAMA_CALL.replace("city", "town"))  # held to its schema
        assert takes(True, required, time_call.replace("tz", "zone"))  # not held: any object
        for text in ("Just text.", "It is <b>sunny</b>.", "<b>Sunny</b>", "", "Let me check. " + LLAMA_CALL):
            assert takes(True, required, text) != required, text
            assert not LLAMA.extract(text, functions)[1]  # no call read out of what "auto" takes as text
        for text in (' {"city": "Paris"}', '{"answer": 1}', "<|python_tag|>" + LLAMA_CALL, "\n" + LLAMA_CALL):
            assert not takes(True, required, text), text


# -- pythonic -------------------------------------------------------------------------------------------

PYTHONIC = PARSERS["pythonic"]
PYTHONIC_TEXTS = [
    '[get_weather(city="Paris", unit=\'celsius\'), get_time()]',
    '  <|python_start|>[get_time(zone="UTC", fmt=[24, True], extra={"a": None, "b": (1, 2.5)})]<|python_end|>\n',
    "[f(s='it\\'s \\u00e9 \\n', n=-3, big=12345678901234567890)]",
    "[1] The first source says so.",
    "The answer is [f(a=1)].",
    "[f(1)]",
    "[f(a=b)]",
    "[f(a={1, 2})]",
    "[f(a=1j)]",
    "[f(a=1e999)]",
    "[f(**kw)]",
    "[obj.method(a=1)]",
    "[]",
    "[f(a=1)] trailing",
    "[f(a=1)",
    "<|python_start|>",
    "<|pyth",
    "",
]


def test_pythonic_calls_are_the_whole_answer_a_list_of_calls_of_literals() -> None:
    """Keyword arguments of Python literals come out as JSON; anything else (text around the list, a positional
    argument, a name or an expression for a value, a value JSON cannot write) is content, and nothing is run."""
    assert PYTHONIC.extract(PYTHONIC_TEXTS[0]) == (None, [
        ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}'), ToolCall("get_time", "{}")])
    assert PYTHONIC.extract(PYTHONIC_TEXTS[1]) == (None, [
        ToolCall("get_time", '{"zone": "UTC", "fmt": [24, true], "extra": {"a": null, "b": [1, 2.5]}}')])
    [call] = PYTHONIC.extract(PYTHONIC_TEXTS[2])[1]
    assert json.loads(call.arguments) == {"s": "it's \u00e9 \n", "n": -3, "big": 12345678901234567890}
    for text in PYTHONIC_TEXTS[3:]:
        assert PYTHONIC.extract(text) == (text.strip() or None, []), text
    assert PARSERS["llama4_pythonic"].extract(PYTHONIC_TEXTS[1]) == PYTHONIC.extract(PYTHONIC_TEXTS[1])
    assert PYTHONIC.extract("[__import__('os').system(x='echo hi')]") == ("[__import__('os').system(x='echo hi')]", [])


def test_pythonic_stream_holds_an_answer_that_opens_like_calls_and_matches_extract() -> None:
    stream = PYTHONIC.stream()
    assert stream.feed(" <|python") == []
    assert stream.feed("_start|>[f(a=") == []
    assert stream.feed("1)]") == []
    assert stream.finish() == [ToolCall("f", '{"a": 1}')]
    stream = PYTHONIC.stream()
    assert stream.feed("It is ") == ["It is"]
    assert stream.finish() == []
    rng = random.Random(4)
    for text in PYTHONIC_TEXTS:
        _check_consistent(PYTHONIC, text, rng, every_position=True)


# -- granite --------------------------------------------------------------------------------------------

GRANITE = PARSERS["granite"]
GRANITE_TEXTS = [
    '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
    'Let me check.\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}] and more',
    '<|tool_call|>[{"name": "get_weather"}]',
    "<|tool_call|>",
    "Plain <|tool_ca",
    "",
]


def test_granite_calls_are_a_json_array_after_its_tag() -> None:
    """After ``<|tool_call|>`` (or ``<tool_call>``) a JSON array of calls to the answer's end; the text before it is
    content; an array that is not one is content, its tag kept."""
    assert GRANITE.extract(GRANITE_TEXTS[0]) == (None, [PARIS, ToolCall("get_time", "{}")])
    assert GRANITE.extract(GRANITE_TEXTS[1]) == ("Let me check.", [PARIS])
    tagged = '<|tool_call|>[{"name": "f", "arguments": {"s": "<tool_call>"}}]'  # (the first tag opens the calls)
    assert GRANITE.extract(tagged) == (None, [ToolCall("f", '{"s": "<tool_call>"}')])
    for text in GRANITE_TEXTS[2:]:
        assert GRANITE.extract(text) == (text.strip() or None, []), text
    stream = GRANITE.stream()
    assert stream.feed("Checking <|tool") == ["Checking"]
    assert stream.feed('_call|>[{"name": "get_weather", ') == []
    assert stream.feed('"arguments": {"city": "Paris"}}]') == []
    assert stream.finish() == [PARIS]
    rng = random.Random(5)
    for text in GRANITE_TEXTS:
        _check_consistent(GRANITE, text, rng, every_position=True)
