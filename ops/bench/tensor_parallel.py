"""``pdserve bench tp``: one engine split over ``--tensor-parallel-size`` ranks against the same engine on one,
on the same greedy prompts, run alternated in one invocation.

Reported per run: output tokens/s, and for the split engine its ratio to one rank's, whether every request's
tokens equal one rank's, what each rank holds (parameters and KV bytes per block, against one rank's), and
rank 0's host time per step spent handing the step to its workers (the inputs sent over ZeroMQ and the
input ids broadcast): what a GPU would wait on beside the forward. On this project's CPU hosts the ranks
share a few cores, so the speed says little of GPUs; the shares and the host time do.

    pdserve bench tp --tensor-parallel-size 3 --num-prompts 8 --max-tokens 32 --json ops/bench/results/tp.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from common.config import EngineConfig
from common.engine.engine import LLMEngine
from common.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
    "List three colors of the rainbow:", "The quick brown fox jumps over the lazy dog. " * 4,
    "Q: What is the boiling point of water at sea level?\nA:", "In machine learning, overfitting happens when",
    "SELECT name, age FROM users WHERE",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=3,
                   help="ranks of the split engine (the default model's 9 heads and 3 KV heads divide by 3)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="alternated runs of each engine")
    p.add_argument("--json", default=None, help="write the results here")
    return p


def _holdings(engine: LLMEngine) -> dict[str, int]:
    runner = engine.runner
    return {"parameter_bytes": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
            "kv_bytes_per_block": runner.bytes_per_block}


def _timed_steps(engine: LLMEngine) -> list[float]:
    """Rank 0's host time of each step's hand-over to the workers, recorded as the engine runs."""
    leader = engine.runner.tp_leader
    times: list[float] = []
    if leader is None:
        return times
    step = leader.step

    def timed(*args: Any) -> None:
        start = time.perf_counter()
        step(*args)
        times.append(time.perf_counter() - start)

    setattr(leader, "step", timed)  # noqa: B010 - a method replaced on this one object
    return times


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    base = {"model": args.model, "device": "cpu", "dtype": "float32", "max_num_seqs": args.num_prompts}
    engines = {"one rank": LLMEngine(EngineConfig(**base)),  # type: ignore[arg-type]
               "split": LLMEngine(EngineConfig(**base, tensor_parallel_size=args.tensor_parallel_size))}  # type: ignore[arg-type]
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(engines["one rank"].runner.model_path))
        prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.num_prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        hand_over = _timed_steps(engines["split"])
        rates: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                start = time.perf_counter()
                outs = engine.generate(prompts, params)
                elapsed = time.perf_counter() - start
                rates[name].append(sum(len(o[0]) for o in outs) / elapsed)
                tokens[name] = [o[0] for o in outs]
        one, split = (max(rates[name]) for name in engines)
        return {
            "bench": "tp", "date": dt.date.today().isoformat(), "host": platform.node(), "cpu_only": True,
            "model": str(engines["one rank"].runner.model_path.name), "tensor_parallel_size": args.tensor_parallel_size,
            "num_prompts": args.num_prompts, "max_tokens": args.max_tokens,
            "tokens_per_s": {name: [round(r, 1) for r in rs] for name, rs in rates.items()},
            "split_over_one": round(split / one, 3),
            "requests_with_equal_tokens": sum(a == b for a, b in zip(tokens["one rank"], tokens["split"], strict=True)),
            "holdings": {name: _holdings(engine) for name, engine in engines.items()},
            "hand_over_ms_per_step": {"median": round(statistics.median(hand_over) * 1e3, 3),
                                      "p99": round(sorted(hand_over)[int(0.99 * (len(hand_over) - 1))] * 1e3, 3),
                                      "steps": len(hand_over)} if hand_over else None,
        }
    finally:
        for engine in engines.values():
            engine.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args)
    one, split = result["holdings"]["one rank"], result["holdings"]["split"]
    print(f"tokens/s   one rank {result['tokens_per_s']['one rank']}   split over {args.tensor_parallel_size} "
          f"{result['tokens_per_s']['split']}   (x{result['split_over_one']})")
    print(f"requests with tokens equal to one rank's: {result['requests_with_equal_tokens']} of {args.num_prompts}")
    print(f"rank 0 holds {split['parameter_bytes'] / 2**20:.1f} MiB of parameters (one rank: "
          f"{one['parameter_bytes'] / 2**20:.1f}), {split['kv_bytes_per_block']} KV bytes a block "
          f"(one rank: {one['kv_bytes_per_block']})")
    if result["hand_over_ms_per_step"]:
        h = result["hand_over_ms_per_step"]
        print(f"rank 0's hand-over to its workers: {h['median']} ms a step (p99 {h['p99']}, {h['steps']} steps)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["requests_with_equal_tokens"] == args.num_prompts else 1
