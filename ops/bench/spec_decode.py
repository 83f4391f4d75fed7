"""``pdserve bench spec``: speculative decoding with n-gram drafts (``--speculative-config``) beside the
same engine without it, in one process, on the same prompts.

Two workloads of chat prompts, each greedy and sampled (temperature 0.7, top-p 0.95, a seed per
request), each run without drafts and with them:

* ``edit``: the answer restates text from the prompt (fix a line of code, reformat a list), the case
  n-gram drafts are for;
* ``open``: open questions, whose answers quote little of anything (drafts come only from the answer
  repeating itself).

Each runs one request at a time (``--batch 1``: a user's inter-token latency) and all at once. Reported:
output tokens/s, seconds per output token of a request on its own, drafts checked and kept (the share
kept, and the tokens a drafting step gives on average), and whether every output equals the run
without drafts (it must: each position is sampled as a step of its own samples it, and a seeded
draw depends on its seed, position and probabilities only). Beside them, the proposer's own host time
per step at larger batches and contexts (``--cost-batches``, ``--cost-contexts``): what a GPU would
wait on.

    pdserve bench spec --num-prompts 8 --max-tokens 96 --json ops/bench/results/spec-decode.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import time
from typing import Any

import torch

from common.config import EngineConfig, SpeculativeConfig
from common.engine.engine import LLMEngine
from common.sampling_params import SamplingParams

_SNIPPETS = [
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(valeus)\n",
    "def is_even(n):\n    if n % 2 = 0:\n        return True\n    return False\n",
    "for i in range(10):\n    print(i)\nprint('done'\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n    def norm(self):\n"
    "        return (self.x ** 2 + self.y ** 2) ** 0.5\n    def __repr__(self):\n        return f'Point({self.x}, {self.y}'\n",
]
_LISTS = [
    "apples, pears, plums, cherries, grapes, oranges, lemons, limes",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday",
    "red, orange, yellow, green, blue, indigo, violet",
    "Paris, Berlin, Madrid, Rome, Lisbon, Vienna, Prague, Warsaw",
]
_QUESTIONS = [
    "Why is the sky blue?", "How do vaccines work?", "Tell me a short story about a robot.",
    "What causes the seasons on Earth?", "Give three tips for learning a new language.",
    "How does a bicycle stay upright?", "Explain photosynthesis to a child.", "Describe a cat in two sentences.",
]


def edit_texts(num: int) -> list[str]:
    out = []
    for i in range(num):
        if i % 2 == 0:
            code = _SNIPPETS[(i // 2) % len(_SNIPPETS)]
            out.append(f"Fix the bug in this Python code and show the whole corrected code:\n\n{code}")
        else:
            items = _LISTS[(i // 2) % len(_LISTS)]
            out.append(f"Rewrite this list as a numbered list, one item per line: {items}")
    return out


def open_texts(num: int) -> list[str]:
    return [_QUESTIONS[i % len(_QUESTIONS)] + (" Answer in detail." if i >= len(_QUESTIONS) else "")
            for i in range(num)]


def chat_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    out = []
    for text in texts:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(tokenizer(chat, add_special_tokens=False)["input_ids"])
    return out


def sampling(mode: str, num: int, max_tokens: int) -> list[SamplingParams]:
    """Per request: ``greedy``; or ``seeded``, a chat's usual sampling with a seed of its own (whose
    tokens drafts must not change)."""
    if mode == "greedy":
        return [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * num
    return [SamplingParams(temperature=0.7, top_p=0.95, seed=1000 + i, max_tokens=max_tokens) for i in range(num)]


def run(engine: LLMEngine, requests: list[list[int]], params: list[SamplingParams], batch: int) -> dict[str, Any]:
    """The requests ``batch`` at a time; tokens, seconds and the engine's draft counts over them."""
    counts = (engine.spec_num_drafts, engine.spec_num_draft_tokens, engine.spec_num_accepted_tokens)
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for at in range(0, len(requests), batch):
        outputs += [choices[0] for choices in engine.generate(requests[at : at + batch], params[at : at + batch])]
    seconds = time.perf_counter() - start
    drafts, draft_tokens, accepted = (now - before for now, before in zip(
        (engine.spec_num_drafts, engine.spec_num_draft_tokens, engine.spec_num_accepted_tokens), counts, strict=True))
    num_tokens = sum(map(len, outputs))
    return {
        "batch": batch, "output_tokens": num_tokens, "seconds": seconds, "tokens_per_s": num_tokens / seconds,
        "seconds_per_token_per_request": seconds * min(batch, len(requests)) / num_tokens,
        "drafting_steps": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "tokens_per_drafting_step": 1 + accepted / drafts if drafts else None,
        "outputs": outputs,
    }


def proposer_cost(config: SpeculativeConfig, batch: int, context: int, steps: int = 20) -> float:
    """The proposer's host time per step (ms, median of ``steps``) over ``batch`` decoding requests of
    ``context`` random tokens (of 32,000) that each grow by one token a step: what a GPU would wait on."""
    import random

    from common.engine.request import Request
    from common.engine.spec_decode import NgramProposer

    rng = random.Random(0)
    proposer = NgramProposer(dataclasses.replace(config, disable_by_batch_size=0), 1 << 30)  # every request drafts
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    requests = [Request(f"r{i}", [rng.randrange(32000) for _ in range(context)], params, block_size=16, model_id="m")
                for i in range(batch)]
    times = []
    for _ in range(steps + 1):
        for req in requests:
            req.append_output_token(rng.randrange(32000))
            req.num_computed_tokens = req.num_tokens - 1
        start = time.perf_counter()
        proposer.propose(requests)
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])  # the first fills each request's mirror
    return 1000 * times[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench spec", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder or id (default: the bundled SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=8, help="per workload")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batches", default="1,8", help="requests at a time, each a run")
    parser.add_argument("--modes", default="greedy,seeded",
                        help="sampling, each a run: greedy, and seeded (temperature 0.7, top-p 0.95, a seed each)")
    parser.add_argument("--speculative-config",
                        default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                '"prompt_lookup_min": 2}')
    parser.add_argument("--cost-batches", default="64,256", help="batches the proposer's host time is measured at")
    parser.add_argument("--cost-contexts", default="200,2000,8000", help="tokens per request for that measure")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    spec_config = SpeculativeConfig.parse(args.speculative_config)
    costs = [{"batch": int(b), "context": int(c), "propose_ms_per_step": proposer_cost(spec_config, int(b), int(c))}
             for b in args.cost_batches.split(",") if b for c in args.cost_contexts.split(",") if c]

    from transformers import AutoTokenizer

    from common.model.loader import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model)))
    workloads = {"edit": chat_ids(tokenizer, edit_texts(args.num_prompts)),
                 "open": chat_ids(tokenizer, open_texts(args.num_prompts))}
    batches = [int(b) for b in args.batches.split(",")]
    engines = {
        name: LLMEngine(EngineConfig(model=args.model, device=args.device, max_num_seqs=max(8, *batches),
                                     speculative_config=spec))
        for name, spec in (("baseline", None), ("ngram", args.speculative_config))
    }
    for engine in engines.values():  # the first steps' one-off costs, outside the timings
        engine.generate(workloads["open"][:1], SamplingParams(temperature=0.0, max_tokens=8))
    rows: list[dict[str, Any]] = []
    for workload, requests in workloads.items():
        for mode in args.modes.split(","):
            params = sampling(mode, len(requests), args.max_tokens)
            for batch in batches:
                # Alternated, so neither run has the host to itself more than the other.
                base = run(engines["baseline"], requests, params, batch)
                spec = run(engines["ngram"], requests, params, batch)
                for name, r in (("baseline", base), ("ngram", spec)):
                    rows.append({"workload": workload, "sampling": mode, "engine": name,
                                 **{k: v for k, v in r.items() if k != "outputs"}})
                rows[-1]["outputs_equal_baseline"] = spec["outputs"] == base["outputs"]
                rows[-1]["speedup"] = spec["tokens_per_s"] / base["tokens_per_s"]
    result = {
        "date": dt.date.today().isoformat(),
        "command": "pdserve bench spec " + " ".join(argv or []),
        "speculative_config": json.loads(args.speculative_config),
        "environment": {"python": platform.python_version(), "torch": torch.__version__, "device": args.device,
                        "torch_threads": torch.get_num_threads()},
        "runs": rows,
        "proposer_host_time": costs,
    }
    for r in rows:
        line = (f"{r['workload']:5s} {r['sampling']:7s} batch {r['batch']:3d} {r['engine']:8s} {r['output_tokens']:5d} tokens "
                f"{r['seconds']:7.2f} s {r['tokens_per_s']:7.1f} tok/s "
                f"{1000 * r['seconds_per_token_per_request']:6.1f} ms/token/request")
        if r["engine"] == "ngram":
            rate = r["acceptance_rate"]
            line += (f"  kept {r['accepted_tokens']}/{r['draft_tokens']} drafts"
                     f" ({'-' if rate is None else f'{rate:.0%}'}), {r['tokens_per_drafting_step'] or 1:.2f} "
                     f"tokens/drafting step, x{r['speedup']:.2f}, outputs equal: {r['outputs_equal_baseline']}")
        print(line)
    for c in costs:
        print(f"proposer, batch {c['batch']:3d}, {c['context']:5d} tokens each: {c['propose_ms_per_step']:.2f} ms of "
              "host time per step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if all(r.get("outputs_equal_baseline", True) for r in rows) else 1
