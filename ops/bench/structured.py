"""``pdserve bench structured``: JSON-schema-constrained generation, checked and timed.

Workload: ``--num-schemas`` generated JSON schemas of varied shapes (objects with required string,
integer, number, boolean and enum fields, bounded strings and integers, arrays with min/max items,
nested objects and arrays of objects), each in a chat prompt asking for such an object, greedy, up
to ``--max-tokens`` tokens. Everything runs in this process on one ``LLMEngine``:

* constrained: every prompt at once with its schema; each output must parse as JSON and validate
  against its schema (``jsonschema``), and must have ended by itself (finish_reason "stop").
* free: the same prompts at once, no grammar, each generating exactly as many tokens as it did
  under its grammar (EOS ignored), so both runs have the same batch shape at every step.

Both report output tokens/s over the wall time of their run (and over this process's CPU time,
which other processes on a shared machine move far less), measured in the same process, the two
runs alternating ``--repeats`` times; the fastest of each counts (the machine may be shared). The
grammars compile before the timed runs; their compile time is reported apart, and so is the
grammar's own host cost, timed alone: filling a bitmask row and accepting the token, per output
token, and masking a whole batch of rows.

    pdserve bench structured --num-schemas 20 --json structured.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from common.config import EngineConfig
from common.engine.engine import LLMEngine
from common.sampling_params import SamplingParams, StructuredOutput

_THINGS = ["a person", "a book", "a car", "a city", "a product", "a pet", "a movie", "a song", "a team", "a recipe"]
# Field names that fit their types, as in schemas people write (a model asked for an integer "city"
# has nothing sensible to say and may write digits until max_tokens). Numbers carry a range, as
# schemas for real data mostly do: under greedy decoding this small model, allowed any number of
# digits, now and then writes digits until max_tokens (seen with an unbounded "weight").
_NAMES = {
    "string": ["name", "title", "city", "owner", "brand", "author"],
    "bounded_string": ["code", "nickname", "label", "country"],
    "integer": ["year", "count", "pages", "population"],
    "bounded_integer": ["age", "rating", "level", "floors"],
    "number": ["price", "weight", "height", "score"],
    "boolean": ["active", "available", "verified", "married"],
    "enum": ["color", "size", "status", "priority"],
    "array": ["tags", "genres", "numbers", "grades"],
    "object": ["address", "details", "maker", "location"],
    "array_of_objects": ["members", "items", "reviews", "parts"],
}


def _field(rng: random.Random, kind: str, depth: int) -> dict[str, Any]:
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "new", "old", "high", "low"], 3)}
    if kind == "bounded_string":
        return {"type": "string", "minLength": 1, "maxLength": rng.choice([8, 16, 24])}
    if kind == "bounded_integer":
        low = rng.choice([0, 1, 18])
        return {"type": "integer", "minimum": low, "maximum": low + rng.choice([10, 100])}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": rng.choice([3000, 10**6, 10**9])}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([100, 10000])}
    if kind == "array":
        item = rng.choice([{"type": "string", "maxLength": 12}, {"type": "integer", "minimum": -100, "maximum": 100},
                           {"enum": ["a", "b", "c"]}])
        low = rng.choice([0, 1, 2])
        return {"type": "array", "items": item, "minItems": low, "maxItems": low + rng.choice([1, 2, 3])}
    if kind == "object":
        return _object(rng, depth + 1, rng.randint(1, 3))
    if kind == "array_of_objects":
        return {"type": "array", "items": _object(rng, depth + 1, 2), "minItems": 1, "maxItems": 2}
    return {"type": kind}


def _object(rng: random.Random, depth: int, num_fields: int) -> dict[str, Any]:
    kinds = [k for k in _NAMES if depth < 1 or k not in ("object", "array_of_objects")]
    props: dict[str, Any] = {}
    while len(props) < num_fields:
        kind = rng.choice(kinds)
        name = rng.choice(_NAMES[kind])
        if name not in props:
            props[name] = _field(rng, kind, depth)
    names = list(props)
    required = [n for n in names if rng.random() < 0.8] or names[:1]
    return {"type": "object", "properties": props, "required": required}


def make_schemas(num: int, seed: int = 0) -> list[dict[str, Any]]:
    """``num`` JSON schemas of varied shapes, the same for a given ``seed``."""
    rng = random.Random(seed)
    return [_object(rng, 0, rng.randint(2, 5)) for _ in range(num)]


def chat_prompt(tokenizer: Any, schema: dict[str, Any], index: int) -> list[int]:
    thing = _THINGS[index % len(_THINGS)]
    content = f"Describe {thing} as a JSON object with these fields: {', '.join(schema['properties'])}."
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


@dataclass
class RunResult:
    num_output_tokens: int
    seconds: float
    cpu_seconds: float  # this process's CPU time: what other processes on a shared machine barely move
    outputs: list[list[int]]
    finish_reasons: list[str | None]

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.num_output_tokens / self.cpu_seconds if self.cpu_seconds else 0.0


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> RunResult:
    """Queue every prompt at once and step until all finish."""
    ids = [f"structured-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    start, cpu_start = time.perf_counter(), time.process_time()
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    reasons: dict[str, str | None] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    outputs = [tokens[rid] for rid in ids]
    return RunResult(sum(map(len, outputs)), seconds, cpu_seconds, outputs, [reasons.get(rid) for rid in ids])


@dataclass
class SchemaCheck:
    index: int
    valid: bool
    finish_reason: str | None
    num_tokens: int
    error: str | None
    text: str


def check_outputs(
    tokenizer: Any, schemas: list[dict[str, Any]], outputs: list[list[int]], reasons: list[str | None]
) -> list[SchemaCheck]:
    """Parse each output as JSON and validate it against its schema."""
    import jsonschema

    checks = []
    for i, (schema, ids, reason) in enumerate(zip(schemas, outputs, reasons, strict=True)):
        text = tokenizer.decode(ids, skip_special_tokens=True)
        error = None
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        checks.append(SchemaCheck(i, error is None and reason == "stop", reason, len(ids), error, text))
    return checks


def _figures(r: RunResult) -> dict[str, float]:
    return {"output_tokens": r.num_output_tokens, "seconds": r.seconds, "cpu_seconds": r.cpu_seconds,
            "tokens_per_s": r.tokens_per_s, "tokens_per_cpu_s": r.tokens_per_cpu_s}


def grammar_host_cost(engine: LLMEngine, specs: list[StructuredOutput], outputs: list[list[int]]) -> dict[str, float]:
    """The grammar's own work, timed alone: per output token, filling its bitmask row and accepting
    it; per step, masking one row per spec in one batched op."""
    from common.engine.grammar import apply_token_bitmask

    bitmask = torch.empty(len(specs), -(-engine.vocab_size // 32), dtype=torch.int32)
    fill_s = accept_s = 0.0
    num_tokens = 0
    for spec, ids in zip(specs, outputs, strict=True):
        state = engine.grammars.new_state(spec)
        for token in ids:
            t0 = time.perf_counter()
            state.fill_bitmask(bitmask, 0)
            t1 = time.perf_counter()
            state.accept(token)
            accept_s += time.perf_counter() - t1
            fill_s += t1 - t0
            num_tokens += 1
    logits = torch.randn(len(specs), engine.vocab_size)
    bitmask.fill_(-1)
    rows = list(range(len(specs)))
    start = time.perf_counter()
    for _ in range(20):
        apply_token_bitmask(logits, bitmask, rows)
    return {
        "fill_bitmask_us_per_token": 1e6 * fill_s / max(num_tokens, 1),
        "accept_us_per_token": 1e6 * accept_s / max(num_tokens, 1),
        "apply_mask_ms_per_step": 1e3 * (time.perf_counter() - start) / 20,
        "rows_per_step": len(specs),
    }


def run(
    engine: LLMEngine, tokenizer: Any, num_schemas: int, max_tokens: int, seed: int = 0, repeats: int = 1
) -> dict[str, Any]:
    schemas = make_schemas(num_schemas, seed)
    prompts = [chat_prompt(tokenizer, s, i) for i, s in enumerate(schemas)]
    specs = [StructuredOutput(kind="json_schema", spec=json.dumps(s)) for s in schemas]
    start = time.perf_counter()
    for spec in specs:
        engine.grammars.compile(spec)
    compile_s = time.perf_counter() - start
    constrained = [SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_output=s) for s in specs]
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    run_batch(engine, prompts[:2], [warm, warm])  # warm-up: first-step allocations, thread pools
    with_runs: list[RunResult] = []
    without_runs: list[RunResult] = []
    for _ in range(repeats):
        with_runs.append(run_batch(engine, prompts, constrained))
        # The same prompts, each running exactly as many steps as with its grammar: the batch has
        # the same shape step after step, so the difference is the grammar's own cost.
        free = [SamplingParams(temperature=0.0, max_tokens=max(1, len(out)), ignore_eos=True)
                for out in with_runs[0].outputs]
        without_runs.append(run_batch(engine, prompts, free))
    with_grammar = min(with_runs, key=lambda r: r.seconds)
    without = min(without_runs, key=lambda r: r.seconds)
    assert all(r.outputs == with_grammar.outputs for r in with_runs), "greedy outputs changed between runs"
    checks = check_outputs(tokenizer, schemas, with_grammar.outputs, with_grammar.finish_reasons)
    num_valid = sum(c.valid for c in checks)
    return {
        "num_schemas": num_schemas,
        "max_tokens": max_tokens,
        "num_schema_valid": num_valid,
        "schema_valid_rate": num_valid / num_schemas,
        "grammar_compile_s_total": compile_s,
        "with_grammar": _figures(with_grammar),
        "without_grammar": _figures(without),
        "tokens_per_s_ratio": with_grammar.tokens_per_s / without.tokens_per_s if without.tokens_per_s else 0.0,
        "tokens_per_cpu_s_ratio": (with_grammar.tokens_per_cpu_s / without.tokens_per_cpu_s
                                   if without.tokens_per_cpu_s else 0.0),
        "all_runs": {"with_grammar": [_figures(r) for r in with_runs],
                     "without_grammar": [_figures(r) for r in without_runs]},
        "grammar_host_cost": grammar_host_cost(engine, specs, with_grammar.outputs),
        "checks": [asdict(c) for c in checks],
        "schemas": schemas,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench structured", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder or id (default: the bundled SmolLM2)")
    parser.add_argument("--num-schemas", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each; the best counts")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, max_num_seqs=max(args.num_schemas, 8)))
    tokenizer = AutoTokenizer.from_pretrained(str(engine.runner.model_path))
    result = run(engine, tokenizer, args.num_schemas, args.max_tokens, args.seed, args.repeats)
    result["environment"] = {
        "python": platform.python_version(), "torch": torch.__version__, "device": args.device,
        "torch_threads": torch.get_num_threads(), "model": engine.model_id,
    }
    print(f"schema-valid: {result['num_schema_valid']}/{args.num_schemas}")
    for c in result["checks"]:
        if not c["valid"]:
            print(f"  schema {c['index']}: {c['finish_reason']} {c['error']} {c['text'][:120]!r}")
    for name in ("with_grammar", "without_grammar"):
        r = result[name]
        print(f"{name:16s} {r['output_tokens']:6d} tokens in {r['seconds']:7.2f} s = {r['tokens_per_s']:8.1f} tokens/s "
              f"({r['tokens_per_cpu_s']:.1f} per CPU second)")
    print(f"ratio with/without: {result['tokens_per_s_ratio']:.3f} wall, {result['tokens_per_cpu_s_ratio']:.3f} CPU; grammar compile {result['grammar_compile_s_total']:.2f} s "
          f"for {args.num_schemas} schemas (the first loads the tokenizer)")
    cost = result["grammar_host_cost"]
    print(f"grammar host cost: fill {cost['fill_bitmask_us_per_token']:.1f} us + accept "
          f"{cost['accept_us_per_token']:.1f} us per token, mask {cost['apply_mask_ms_per_step']:.3f} ms per step "
          f"of {cost['rows_per_step']} rows")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["num_schema_valid"] == args.num_schemas else 1


if __name__ == "__main__":
    sys.exit(main())
