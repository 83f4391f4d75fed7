"""``pdserve bench offload``: what a host tier of the prefix cache (``--kv-offloading-size``) buys, beside the same
engine without one, in one process.

The workload is what fills a prefix cache past its device memory: ``--conversations`` users, each with a document
of its own (``--doc-len`` tokens: a system prompt, a file, a retrieved context), come back turn after turn, one
after another (round robin, ``--rounds`` times), each turn the document and a new question (``--question-len``).
The device pool (``--num-blocks``) holds a few documents, fewer than the users: without a host tier each turn finds
its document taken back for the others and computes it again; with one, it loads it back from host memory. Both
engines run the same turns, greedy, one at a time, and report:

* prompt tokens found cached, and computed;
* time to first token per turn (p50, p90) and the run's wall time;
* blocks saved to and loaded from the host tier, and what the copies cost (the engine's host-copy time);
* whether every turn's tokens are the same in both runs.

On the CPU the two tiers are the same memory, so a copy costs a memcpy; on a GPU each block crosses PCIe, which this
does not measure.

    pdserve bench offload --conversations 8 --rounds 3 --doc-len 512 --num-blocks 80 --offload-gib 0.25 \\
        --json ops/bench/results/offload-cpu-DATE.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from typing import Any

from common.config import EngineConfig
from common.engine.engine import LLMEngine
from common.sampling_params import SamplingParams
from ops.bench.engine_args import add_engine_args, result_header


def run_turns(config: EngineConfig, turns: list[list[int]], max_tokens: int, first_round: int) -> dict[str, Any]:
    """``turns`` one after another on a new engine: each one's tokens, time to first token and cached tokens (the
    first ``first_round`` turns are each conversation's first)."""
    engine = LLMEngine(config)
    copy_seconds = 0.0
    copy_host = engine.runner.copy_host

    def timed_copy(*args: Any, **kwargs: Any) -> None:
        nonlocal copy_seconds
        start = time.perf_counter()
        copy_host(*args, **kwargs)
        copy_seconds += time.perf_counter() - start

    engine.runner.copy_host = timed_copy  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs, ttfts, cached = [], [], []
    start = time.perf_counter()
    for i, prompt in enumerate(turns):
        sent = time.perf_counter()
        engine.add_request(f"t{i}", prompt, params)
        tokens: list[int] = []
        first = None
        hit = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if first is None and out.new_token_ids:
                    first = time.perf_counter() - sent
                tokens += out.new_token_ids
                hit = max(hit, out.num_cached_tokens)
        outputs.append(tokens)
        ttfts.append(first or 0.0)
        cached.append(hit)
    seconds = time.perf_counter() - start
    engine.check_integrity()
    host = engine.kv.host
    prompt_tokens = sum(len(t) for t in turns)
    return {
        "num_blocks": engine.kv.pool.num_blocks, "host_blocks": 0 if host is None else host.num_slots,
        "prompt_tokens": prompt_tokens, "cached_tokens": sum(cached), "computed_tokens": prompt_tokens - sum(cached),
        "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": statistics.quantiles(ttfts, n=10)[-1],
        "later_rounds_ttft_p50_s": statistics.median(ttfts[first_round:]),
        "seconds": seconds, "saved_blocks": 0 if host is None else host.num_saved,
        "loaded_blocks": 0 if host is None else host.num_loaded, "host_copy_seconds": copy_seconds,
        "outputs": outputs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench offload", description=__doc__.split("\n\n")[0])
    add_engine_args(parser, num_blocks=80, max_num_batched_tokens=1024, num_blocks_help="the device pool, in blocks")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--doc-len", type=int, default=512, help="each conversation's own leading tokens")
    parser.add_argument("--question-len", type=int, default=16, help="new tokens of each turn")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--offload-gib", type=float, default=0.25, help="the host tier (--kv-offloading-size)")
    args = parser.parse_args(argv)
    if args.conversations < 1 or args.rounds < 2 or args.offload_gib <= 0:
        raise SystemExit("need --conversations >= 1, --rounds >= 2 and --offload-gib > 0")

    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    docs = [tokens(args.doc_len) for _ in range(args.conversations)]
    turns = [docs[c] + tokens(args.question_len) for _ in range(args.rounds) for c in range(args.conversations)]
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, num_blocks=args.num_blocks,
                          block_size=args.block_size, max_num_seqs=4, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.doc_len + args.question_len + args.max_tokens + 8)
    runs = {
        "host tier": run_turns(dataclasses.replace(config, kv_offloading_size=args.offload_gib), turns, args.max_tokens,
                               args.conversations),
        "device only": run_turns(config, turns, args.max_tokens, args.conversations),
    }
    identical = sum(a == b for a, b in zip(runs["host tier"]["outputs"], runs["device only"]["outputs"], strict=True))
    result: dict[str, Any] = {
        **result_header("offload", argv, args.device),
        "workload": {"conversations": args.conversations, "rounds": args.rounds, "doc_len": args.doc_len,
                     "question_len": args.question_len, "max_tokens": args.max_tokens,
                     "model": args.model or "default", "offload_gib": args.offload_gib},
        "runs": {k: {key: v for key, v in r.items() if key != "outputs"} for k, r in runs.items()},
        "identical_turns": identical, "turns": len(turns),
    }
    for name, r in runs.items():
        print(f"{name:12s} {r['num_blocks']} device blocks + {r['host_blocks']} host: {r['cached_tokens']} of "
              f"{r['prompt_tokens']} prompt tokens cached; TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms (later rounds "
              f"{r['later_rounds_ttft_p50_s'] * 1e3:.0f} ms), p90 {r['ttft_p90_s'] * 1e3:.0f} ms; {r['seconds']:.2f} s "
              f"in all; {r['saved_blocks']} blocks saved, {r['loaded_blocks']} loaded "
              f"({r['host_copy_seconds'] * 1e3:.0f} ms copying)")
    print(f"identical turns: {identical}/{len(turns)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0
