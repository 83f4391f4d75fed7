"""``pdserve bench window``: what giving back the blocks out of a sliding window buys, beside an engine that keeps
every block, in one process.

A model windowed on every layer (Mistral 7B v0.1, Phi-3, StarCoder2) never reads a key more than its window back
again, so the KV cache gives such blocks back as sequences advance (``KVCacheManager.release_out_of_window``). The
baseline is the same engine with that turned off (every block kept to the end, as before). Both run the same
requests, greedy with EOS ignored, on the same pool of ``--num-blocks`` blocks, and report:

* the most blocks in use at once and the most requests running at once;
* preemptions (a request whose blocks the pool needed back, to be computed again);
* output tokens/s over the run's wall time;
* whether the two runs' tokens are identical (a released block is one no query reads: they must be, unless
  a different batching moved float rounding);
* a continuation of each conversation (its prompt, its answer and ``--follow-len`` new tokens) sent once all
  have finished: the prompt tokens found in the prefix cache. With a window a hit needs only the blocks of its
  last window to be cached, the earlier ones (given back first, so taken for others first) need not be;
* a prefill instance's side: ``--prefill-requests`` prompts of ``--prefill-len`` tokens computed for a KV
  hand-off, in chunks of ``--max-num-batched-tokens``, held until the transfer: the most blocks in use. It gives
  back, as its chunks go, the blocks the decode skips.

The default model is the bundled SmolLM2 read as a Mistral with a window (``--window``, by ``--hf-overrides``):
the same weights and layers, each attending to its window only.

    pdserve bench window --num-requests 16 --prompt-len 64 --max-tokens 512 --window 128 --num-blocks 200 \\
        --prefill-requests 4 --prefill-len 1024 --json ops/bench/results/window-cpu-DATE.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time
import uuid
from typing import Any

from common.config import EngineConfig
from common.engine.engine import LLMEngine
from common.sampling_params import SamplingParams
from ops.bench.engine_args import add_engine_args, result_header


def windowed_engine(config: EngineConfig, release: bool) -> LLMEngine:
    engine = LLMEngine(config)
    if engine.kv.sliding_window is None:
        raise SystemExit(f"{config.model or 'the default model'} has a layer without a window: nothing to release")
    if not release:
        engine.kv.sliding_window = None  # the baseline: every block kept until its request ends, whole-prefix hits
    return engine


def run_greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """``prompts`` run together, greedy: their outputs, prompt tokens found cached, the most blocks in use and
    requests running at once, and the seconds it took."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first = engine.scheduler.num_preemptions
    ids = [f"r{uuid.uuid4().hex}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[int]] = {request_id: [] for request_id in ids}
    hits = dict.fromkeys(ids, 0)
    most_used = most_running = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            hits[out.request_id] = max(hits[out.request_id], out.num_cached_tokens)
        most_used = max(most_used, engine.kv.pool.num_used_blocks)
        most_running = max(most_running, len(engine.scheduler.running))
    seconds = time.perf_counter() - start
    engine.check_integrity()
    return {"outputs": [outputs[i] for i in ids], "hit_tokens": sum(hits.values()), "peak_blocks_in_use": most_used,
            "peak_running_requests": most_running, "preemptions": engine.scheduler.num_preemptions - first,
            "seconds": seconds}


def run_one(config: EngineConfig, prompts: list[list[int]], max_tokens: int, release: bool,
            follow: list[list[int]]) -> dict[str, Any]:
    engine = windowed_engine(config, release)
    run = run_greedy(engine, prompts, max_tokens)
    tokens = sum(len(o) for o in run["outputs"])
    # The conversations go on, one after another, as users' next turns come.
    next_prompts = [p + o + f for p, o, f in zip(prompts, run["outputs"], follow, strict=True)]
    turns = [run_greedy(engine, [prompt], 4) for prompt in next_prompts]
    return {
        "release_out_of_window": release, "window": engine.runner.kv_window, "num_blocks": engine.kv.pool.num_blocks,
        "block_size": engine.block_size, "peak_blocks_in_use": run["peak_blocks_in_use"],
        "peak_running_requests": run["peak_running_requests"], "preemptions": run["preemptions"],
        "output_tokens": tokens, "seconds": run["seconds"], "tokens_per_s": tokens / run["seconds"],
        "continuation_prompt_tokens": sum(len(p) for p in next_prompts),
        "continuation_hit_tokens": sum(t["hit_tokens"] for t in turns),
        "outputs": run["outputs"] + [t["outputs"][0] for t in turns],
    }


def run_prefill(config: EngineConfig, prompts: list[list[int]], release: bool) -> dict[str, Any]:
    """A prefill instance's side: every prompt computed for a KV hand-off and held until its transfer ends
    (released here once all are computed, as if the transfers all ended then)."""
    engine = windowed_engine(config, release)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)  # more than one: it hands off
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params, kv_transfer=True)
    handed_off: set[str] = set()
    most_used = 0
    start = time.perf_counter()
    while len(handed_off) < len(prompts):
        outs = engine.step()
        assert outs or engine.has_unfinished_requests(), "a prompt ended without a hand-off"
        handed_off |= {out.request_id for out in outs if out.kv_handoff is not None}
        most_used = max(most_used, engine.kv.pool.num_used_blocks)
    seconds = time.perf_counter() - start
    for request_id in handed_off:
        engine.release_kv(request_id)
    engine.check_integrity()
    return {"peak_blocks_in_use": most_used, "preemptions": engine.scheduler.num_preemptions, "seconds": seconds,
            "prompt_tokens": sum(len(p) for p in prompts)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench window", description=__doc__.split("\n\n")[0])
    add_engine_args(parser, num_blocks=200, max_num_batched_tokens=256)
    parser.add_argument("--window", type=int, default=128,
                        help="read the model as a Mistral with this window on every layer (0: take the model as it is)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--follow-len", type=int, default=16, help="new tokens in each conversation's next turn")
    parser.add_argument("--prefill-requests", type=int, default=4, help="prompts computed for a KV hand-off (0: none)")
    parser.add_argument("--prefill-len", type=int, default=1024)
    args = parser.parse_args(argv)

    overrides = None if args.window == 0 else {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": args.window,
    }
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, num_blocks=args.num_blocks,
                          block_size=args.block_size, max_num_seqs=max(args.num_requests, args.prefill_requests, 1),
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=max(args.prompt_len + args.max_tokens + args.follow_len + 4, args.prefill_len + 32),
                          hf_overrides=overrides)
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    prompts = [tokens(args.prompt_len) for _ in range(args.num_requests)]
    follow = [tokens(args.follow_len) for _ in range(args.num_requests)]
    long_prompts = [tokens(args.prefill_len) for _ in range(args.prefill_requests)]
    modes = (("release", True), ("keep every block", False))
    runs = {name: run_one(config, prompts, args.max_tokens, release, follow) for name, release in modes}
    # The prefill's pool holds every prompt whole (the baseline keeps them all until their transfers end).
    prefill_config = dataclasses.replace(
        config, num_blocks=max(1, args.prefill_requests * -(-args.prefill_len // args.block_size)))
    prefill = {name: run_prefill(prefill_config, long_prompts, release) for name, release in modes
               } if args.prefill_requests else {}
    identical = sum(a == b for a, b in zip(runs["release"]["outputs"], runs["keep every block"]["outputs"],
                                           strict=True))
    result: dict[str, Any] = {
        **result_header("window", argv, args.device),
        "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "model": args.model or "default", "window": runs["release"]["window"]},
        "runs": {k: {key: v for key, v in r.items() if key != "outputs"} for k, r in runs.items()},
        "identical_sequences": identical,
        "prefill": {"requests": args.prefill_requests, "prompt_len": args.prefill_len,
                    "max_num_batched_tokens": args.max_num_batched_tokens,
                    "num_blocks": prefill_config.num_blocks, "runs": prefill},
    }
    for name, r in runs.items():
        print(f"{name:17s} window {r['window']}, {r['num_blocks']} blocks of {r['block_size']}: at most "
              f"{r['peak_blocks_in_use']} in use and {r['peak_running_requests']} requests running, "
              f"{r['preemptions']} preemptions; {r['output_tokens']} tokens in {r['seconds']:.2f} s = "
              f"{r['tokens_per_s']:.1f} tokens/s; next turns: {r['continuation_hit_tokens']} of "
              f"{r['continuation_prompt_tokens']} prompt tokens cached")
    print(f"identical sequences: {identical}/{2 * args.num_requests} (first turns and next turns)")
    for name, r in prefill.items():
        print(f"{name:17s} prefill of {args.prefill_requests} x {args.prefill_len} tokens held for their transfers, "
              f"chunks of {args.max_num_batched_tokens}: at most {r['peak_blocks_in_use']} blocks in use "
              f"({r['seconds']:.2f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0
