"""Structured output and logit_bias on the default model, inside engines.

The output of a request with a grammar parses and validates against its schema (or matches its
regex or choices) and ends with finish_reason "stop" when the grammar is complete; it is the same
after preemption, a prefix-cache hit, a continuation on another instance and the prefill -> decode
hand-off, where the tokens sampled elsewhere are replayed into a fresh grammar state.
"""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest

from common.sampling_params import SamplingParams, StructuredOutput
from ops.bench.structured import chat_prompt, check_outputs, make_schemas, run_batch
from tests.engine.conftest import drain_tokens, tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "student": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        # Short strings, two at most: the default model fills every tag with digits, a token each, and
        # the decode steps of these outputs are most of this file's time.
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "student", "color", "tags"],
}
PERSON_SPEC = StructuredOutput(kind="json_schema", spec=json.dumps(PERSON))


def _chat(text: str) -> list[int]:
    tok = tokenizer()
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return list(tok(rendered, add_special_tokens=False).input_ids)


@functools.cache
def _prompt() -> list[int]:
    """Built on first use, not at import: collecting the suite must not load (or convert) the model."""
    return _chat("Describe a student as JSON with name, age, student, color and tags.")


def _params(spec: StructuredOutput | None = PERSON_SPEC, **kw) -> SamplingParams:  # type: ignore[no-untyped-def]
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 96, "structured_output": spec, **kw})


def _text(ids: list[int]) -> str:
    return tokenizer().decode(ids, skip_special_tokens=True)


def _valid_person(ids: list[int]) -> dict:  # type: ignore[type-arg]
    value = json.loads(_text(ids))
    jsonschema.validate(value, PERSON)
    return value  # type: ignore[no-any-return]


def test_json_schema_output_validates_and_stops_while_a_free_request_in_the_batch_is_untouched(engine_factory):  # type: ignore[no-untyped-def]
    engine = engine_factory()
    engine.add_request("free-alone", _prompt(), _params(None, max_tokens=24, ignore_eos=True))
    alone, _ = drain_tokens(engine)
    engine.add_request("json", _prompt(), _params())
    engine.add_request("free", _prompt(), _params(None, max_tokens=24, ignore_eos=True))
    tokens, reasons = drain_tokens(engine)
    _valid_person(tokens["json"])
    assert reasons["json"] == "stop" and tokens["json"][-1] in engine.eos_token_ids
    assert tokens["free"] == alone["free-alone"]
    assert not _text(alone["free-alone"]).startswith("{")  # the grammar really changed the output


def test_json_object_regex_and_choice(engine_factory):  # type: ignore[no-untyped-def]
    engine = engine_factory()
    specs = {
        "object": StructuredOutput(kind="json_object"),
        "regex": StructuredOutput(kind="regex", spec=r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}\."),
        "choice": StructuredOutput(kind="choice", spec=json.dumps(["Paris", "London", "Rome \"the city\""])),
    }
    for name, spec in specs.items():
        engine.add_request(name, _chat("What is the capital of France? Answer briefly."), _params(spec, max_tokens=64))
    tokens, reasons = drain_tokens(engine)
    assert isinstance(json.loads(_text(tokens["object"])), dict)
    assert re.fullmatch(r"[A-Z][a-z]{2,8} (is|was) [0-9]{1,3}\.", _text(tokens["regex"]))
    assert _text(tokens["choice"]) in {"Paris", "London", 'Rome "the city"'}
    assert set(reasons.values()) == {"stop"}


# A sum of small numbers, spaced as written: text a regex could not pin to this shape's recursion.
SUM_GRAMMAR = """root ::= sum "."
sum ::= term (" + " term)*
term ::= [1-9] [0-9]? | "(" sum ")"
"""


def _is_sum(text: str) -> bool:
    """Whether ``text`` is in ``SUM_GRAMMAR``'s language (recursive descent)."""
    term = re.compile(r"[1-9][0-9]?")

    def parse_sum(i: int) -> int | None:  # the index after a sum starting at i, or None
        i = parse_term(i)  # type: ignore[assignment]
        while i is not None and text.startswith(" + ", i):
            i = parse_term(i + 3)  # type: ignore[assignment]
        return i

    def parse_term(i: int) -> int | None:
        if text.startswith("(", i):
            end = parse_sum(i + 1)
            return end + 1 if end is not None and text.startswith(")", end) else None
        m = term.match(text, i)
        return m.end() if m else None

    end = parse_sum(0)
    return end is not None and text[end:] == "."


def test_an_ebnf_grammar_holds_the_output_to_its_language(engine_factory):  # type: ignore[no-untyped-def]
    assert _is_sum("(1 + 23) + 4.") and not _is_sum("(1 + 2.") and not _is_sum("1 +2.")  # the checker itself
    engine = engine_factory()
    spec = StructuredOutput(kind="grammar", spec=SUM_GRAMMAR)
    engine.add_request("free", _chat("Write a sum of three numbers."), _params(None, max_tokens=24))
    engine.add_request("sum", _chat("Write a sum of three numbers."), _params(spec, max_tokens=48))
    tokens, reasons = drain_tokens(engine)
    text = _text(tokens["sum"])
    assert reasons["sum"] == "stop" and text.endswith("."), text
    assert _is_sum(text), text
    assert _text(tokens["free"]) != text  # the grammar really changed the output


def test_the_grammar_ends_the_request_even_with_ignore_eos(engine_factory):  # type: ignore[no-untyped-def]
    engine = engine_factory()
    spec = StructuredOutput(kind="choice", spec=json.dumps(["yes", "no"]))
    engine.add_request("r", _chat("Is water wet?"), _params(spec, ignore_eos=True, min_tokens=5))
    tokens, reasons = drain_tokens(engine)
    assert reasons["r"] == "stop" and _text(tokens["r"]) in {"yes", "no"}


def test_seeded_sampling_and_n_choices_each_follow_the_grammar(engine_factory):  # type: ignore[no-untyped-def]
    engine = engine_factory()
    engine.add_request("r", _prompt(), _params(temperature=1.0, seed=5, n=3, max_tokens=128))
    tokens, reasons = drain_tokens(engine)
    assert set(tokens) == {"r", "r#1", "r#2"}
    values = [_valid_person(tokens[k]) for k in sorted(tokens)]
    assert set(reasons.values()) == {"stop"}
    assert len({json.dumps(v) for v in values}) > 1  # each choice drew its own tokens


def test_the_same_outputs_under_preemption_and_on_a_prefix_cache_hit(engine_factory):  # type: ignore[no-untyped-def]
    """Grammar states live on the request: preemption (recompute) and cached prefix blocks change nothing."""
    prompts = [_chat(f"Describe student number {i} as JSON.") for i in range(4)]
    roomy = engine_factory()
    for i, p in enumerate(prompts):
        roomy.add_request(f"r{i}", p, _params(max_tokens=80))
    expected, _ = drain_tokens(roomy)
    for i, p in enumerate(prompts):  # again: every prompt's full blocks are prefix-cache hits now
        roomy.add_request(f"again{i}", p, _params(max_tokens=80))
    hits_before = roomy.kv.prefix_cache_hits
    again, _ = drain_tokens(roomy)
    assert roomy.kv.prefix_cache_hits > hits_before
    assert [again[f"again{i}"] for i in range(4)] == [expected[f"r{i}"] for i in range(4)]

    tight = engine_factory(num_blocks=14)  # 4 requests of ~3 blocks each must take turns
    for i, p in enumerate(prompts):
        tight.add_request(f"r{i}", p, _params(max_tokens=80))
    tokens, reasons = drain_tokens(tight)
    assert tight.scheduler.num_preemptions > 0
    assert tokens == expected
    for ids in tokens.values():
        _valid_person(ids)


def test_a_continued_request_replays_its_tokens_into_the_grammar(engine_factory):  # type: ignore[no-untyped-def]
    engine = engine_factory()
    engine.add_request("full", _prompt(), _params())
    full = drain_tokens(engine)[0]["full"]
    cut = 7
    engine.add_request("rest", _prompt(), _params(), output_token_ids=full[:cut])
    rest = drain_tokens(engine)[0]["rest"]
    assert full[:cut] + rest == full
    # Tokens already produced that the grammar cannot have produced: refused, nothing queued.
    not_json = list(tokenizer()("Hello there", add_special_tokens=False).input_ids)
    with pytest.raises(ValueError, match="does not match"):
        engine.add_request("bad", _prompt(), _params(), output_token_ids=not_json)
    assert not engine.knows("bad")


def test_invalid_specs_are_refused_by_the_engine(engine_factory):  # type: ignore[no-untyped-def]
    engine = engine_factory()
    for spec in (StructuredOutput(kind="json_schema", spec='{"type": "nope"}'),
                 StructuredOutput(kind="json_schema", spec="{not json"),
                 StructuredOutput(kind="regex", spec="[a-"),
                 StructuredOutput(kind="choice", spec="[]"),
                 StructuredOutput(kind="choice", spec='"yes"'),
                 StructuredOutput(kind="structural_tag", spec='{"type": "structural_tag", "format": {"type": "nope"}}'),
                 StructuredOutput(kind="structural_tag", spec='{"type": "structural_tag"}'),
                 StructuredOutput(kind="structural_tag", spec="{not json"),
                 StructuredOutput(kind="structural_tag", spec='{"format": ' * 70 + "{}" + "}" * 70)):
        with pytest.raises(ValueError, match=f"invalid {spec.kind}"):
            engine.add_request("r", _prompt(), _params(spec))
        assert not engine.knows("r")


def test_compiled_grammars_are_cached_by_spec(engine_factory):  # type: ignore[no-untyped-def]
    engine = engine_factory()
    engine.grammars.max_entries = 2
    specs = [StructuredOutput(kind="regex", spec=f"a{{{i}}}") for i in range(1, 4)]
    for spec in [specs[0], specs[0], specs[1], specs[0], specs[2], specs[0]]:
        engine.grammars.compile(spec)
    # specs[0] stayed the most recent: compiled once; specs[2] pushed specs[1] out.
    assert engine.grammars.num_compiled == 3
    engine.grammars.compile(specs[1])
    assert engine.grammars.num_compiled == 4


def _handoff(prefill, decode, prompt, params, output_token_ids=None):  # type: ignore[no-untyped-def]
    """Prefill in one engine, the KV copied by hand into the other (see test_disaggregated_lifecycle)."""
    prefill.add_request("r", prompt, params, kv_transfer=True, output_token_ids=output_token_ids)
    outs: list = []  # type: ignore[type-arg]
    while not outs:
        outs = prefill.step()
    [out] = [o for o in outs if o.request_id == "r"]  # n > 1: the other choices' first tokens come too
    if out.kv_handoff is None:  # the grammar ended it at its first token
        return out, None
    handoff = decode.add_remote_request(
        "r", prompt, out.new_token_ids[0], params, output_token_ids=output_token_ids,
        choice_token_ids=out.kv_handoff.choice_token_ids or None,
    )
    assert handoff is not None
    decode.runner.kv_cache[:, :, handoff.block_ids] = prefill.runner.kv_cache[:, :, out.kv_handoff.block_ids]
    assert prefill.release_kv("r")
    decode.remote_kv_arrived("r")
    return out, handoff


@pytest.mark.parametrize("resumed", [0, 6], ids=["fresh", "continued"])
def test_prefill_samples_the_first_token_under_the_grammar_and_decode_replays_it(engine_factory, resumed):  # type: ignore[no-untyped-def]
    single = engine_factory()
    single.add_request("r", _prompt(), _params())
    expected = drain_tokens(single)[0]["r"]
    prefill, decode = engine_factory(), engine_factory()
    earlier = expected[:resumed] or None
    out, _ = _handoff(prefill, decode, _prompt(), _params(), earlier)
    assert decode.scheduler.requests["r"].grammar is not None
    rest, reasons = drain_tokens(decode)
    assert expected[:resumed] + out.new_token_ids + rest["r"] == expected
    assert reasons["r"] == "stop"
    _valid_person(expected)


def test_disaggregated_n_choices_fork_with_their_own_grammar_states(engine_factory):  # type: ignore[no-untyped-def]
    params = _params(temperature=1.0, seed=9, n=2, max_tokens=128)
    single = engine_factory()
    single.add_request("r", _prompt(), params)
    expected = drain_tokens(single)[0]
    prefill, decode = engine_factory(), engine_factory()
    out, _ = _handoff(prefill, decode, _prompt(), params)
    rest = drain_tokens(decode)[0]
    firsts = out.kv_handoff.choice_token_ids
    assert {"r": [firsts[0], *rest["r"]], "r#1": [firsts[1], *rest["r#1"]]} == expected
    for ids in expected.values():
        _valid_person(ids)


def test_decode_refuses_a_first_token_outside_the_grammar(engine_factory):  # type: ignore[no-untyped-def]
    decode = engine_factory()
    letter = tokenizer()("x", add_special_tokens=False).input_ids[0]
    with pytest.raises(ValueError, match="does not match"):
        decode.add_remote_request("r", _prompt(), letter, _params())
    assert not decode.knows("r")


def test_generated_schemas_all_give_schema_valid_json(engine_factory):  # type: ignore[no-untyped-def]
    """A short version of ``pdserve bench structured``: varied generated schemas, one batch."""
    engine = engine_factory()
    schemas = make_schemas(6, seed=1)
    prompts = [chat_prompt(tokenizer(), s, i) for i, s in enumerate(schemas)]
    params = [_params(StructuredOutput(kind="json_schema", spec=json.dumps(s)), max_tokens=200) for s in schemas]
    result = run_batch(engine, prompts, params)
    checks = check_outputs(tokenizer(), schemas, result.outputs, result.finish_reasons)
    assert [c.error for c in checks] == [None] * len(schemas)
    assert all(c.valid for c in checks)


# --------------------------------------------------------------------------- logit_bias
def test_logit_bias_moves_greedy_output_to_the_next_best_and_plus_100_forces_a_token(engine_factory):  # type: ignore[no-untyped-def]
    engine = engine_factory()
    prompt = list(tokenizer()("The capital of France is").input_ids)
    base = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    engine.add_request("base", prompt, base)
    tokens, _ = drain_tokens(engine)
    first = tokens["base"][0]
    # The model's second-best first token, from its own logprobs.
    engine.add_request("lp", prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=2))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    [top] = [o.logprobs[0].top for o in outs if o.logprobs]
    assert top[0].token_id == first
    second = top[1].token_id

    engine.add_request("banned", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                        logit_bias={first: -100.0}))
    forced = tokenizer()(" banana", add_special_tokens=False).input_ids[0]
    engine.add_request("forced", prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                                        logit_bias={forced: 100.0}))
    engine.add_request("sampled", prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=3, ignore_eos=True,
                                                         logit_bias={forced: 100.0}))
    tokens, _ = drain_tokens(engine)
    assert tokens["banned"][0] == second
    assert first not in tokens["banned"]
    assert tokens["forced"] == [forced] * 3 and tokens["sampled"] == [forced] * 3


def test_max_tokens_cuts_a_grammar_request_short_with_length(engine_factory):  # type: ignore[no-untyped-def]
    engine = engine_factory()
    engine.add_request("r", _prompt(), _params(max_tokens=3))
    tokens, reasons = drain_tokens(engine)
    assert reasons["r"] == "length" and len(tokens["r"]) == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(_text(tokens["r"]))  # the grammar could not finish it


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_bans_that_leave_no_token_fail_that_request_and_the_batch_goes_on(engine_factory, async_scheduling):  # type: ignore[no-untyped-def]
    """A choice the allowed tokens cannot begin, and a bad word that becomes the only way on after a
    few tokens: each fails, saying why, where a token that means nothing would have been made up."""
    from common.engine.sampler import NO_TOKEN_ERROR

    engine = engine_factory(async_scheduling=async_scheduling)
    london = tokenizer()(" London", add_special_tokens=False).input_ids
    paris = tokenizer()(" Paris and", add_special_tokens=False).input_ids
    choice = StructuredOutput(kind="choice", spec=json.dumps(["Paris"]))
    engine.add_request("free", _prompt(), _params(None, max_tokens=12, ignore_eos=True))
    engine.add_request("at-once", _prompt(), _params(choice, allowed_token_ids=london))
    # " Paris" first (its bias), after which the bad words " Paris Paris" and " Paris and" ban both allowed tokens.
    bad_words = [[paris[0], paris[0]], paris]
    engine.add_request("later", _prompt(), _params(None, max_tokens=12, ignore_eos=True, allowed_token_ids=paris,
                                                   logit_bias={paris[0]: 100.0}, bad_words_token_ids=bad_words))
    errors: dict[str, tuple[int, str]] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.error is not None:
                errors[out.request_id] = (len(tokens[out.request_id]), out.error)
    assert errors == {"at-once": (0, NO_TOKEN_ERROR), "later": (1, NO_TOKEN_ERROR)}
    assert tokens["later"] == paris[:1] and len(tokens["free"]) == 12


def test_a_structural_tag_holds_a_special_token_as_that_token(engine_factory):  # type: ignore[no-untyped-def]
    """A tag that names a token (xgrammar's token formats, as a tool-call format whose tags are special tokens uses
    them: Mistral's [TOOL_CALLS]) is compiled against the engine's tokenizer: the output opens with that token's id,
    which no text-level grammar could ask for, then the tag's content. A token the tokenizer lacks is refused."""
    marker = "<|im_start|>"
    marker_id = tokenizer().convert_tokens_to_ids(marker)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}

    def tag(token: str) -> StructuredOutput:
        return StructuredOutput(kind="structural_tag", spec=json.dumps({"type": "structural_tag", "format": {
            "type": "token_triggered_tags", "trigger_tokens": [token], "at_least_one": True, "stop_after_first": True,
            "tags": [{"type": "tag", "begin": {"type": "token", "token": token}, "end": "", "content": {
                "type": "sequence", "elements": [{"type": "const_string", "value": "n="},
                                                 {"type": "json_schema", "json_schema": schema,
                                                  "max_whitespace_cnt": 1}]}}]}}))  # (the model would loop on it)

    engine = engine_factory()
    engine.add_request("tagged", _chat("Pick a number."), _params(tag(marker), max_tokens=24))
    tokens, reasons = drain_tokens(engine)
    ids = tokens["tagged"]
    assert reasons["tagged"] == "stop" and ids[0] == marker_id, ids
    text = tokenizer().decode(ids[1:], skip_special_tokens=True)
    assert text.startswith("n=") and jsonschema.validate(json.loads(text[2:]), schema) is None, text
    with pytest.raises(ValueError, match="invalid structural_tag"):
        engine.add_request("r", _prompt(), _params(tag("[NOT_A_TOKEN_HERE]")))
    assert not engine.knows("r")
