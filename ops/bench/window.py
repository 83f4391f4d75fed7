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
  a different batching moved float rounding).

The default model is the bundled SmolLM2 read as a Mistral with a window (``--window``, by ``--hf-overrides``):
the same weights and layers, each attending to its window only.

    pdserve bench window --num-requests 16 --prompt-len 64 --max-tokens 512 --window 128 --num-blocks 200 \\
        --json ops/bench/results/window-cpu-DATE.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import time
from typing import Any

import torch

from common.config import EngineConfig
from common.engine.engine import LLMEngine
from common.sampling_params import SamplingParams


def run_one(config: EngineConfig, prompts: list[list[int]], max_tokens: int, release: bool) -> dict[str, Any]:
    engine = LLMEngine(config)
    window = engine.kv.sliding_window
    if window is None:
        raise SystemExit(f"{config.model or 'the default model'} has a layer without a window: nothing to release")
    if not release:
        engine.kv.sliding_window = None  # the baseline: every block kept until its request ends
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    most_used = most_running = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        most_used = max(most_used, engine.kv.pool.num_used_blocks)
        most_running = max(most_running, len(engine.scheduler.running))
    seconds = time.perf_counter() - start
    engine.check_integrity()
    tokens = sum(len(o) for o in outputs.values())
    return {
        "release_out_of_window": release, "window": window, "num_blocks": engine.kv.pool.num_blocks,
        "block_size": engine.block_size, "peak_blocks_in_use": most_used, "peak_running_requests": most_running,
        "preemptions": engine.scheduler.num_preemptions, "output_tokens": tokens, "seconds": seconds,
        "tokens_per_s": tokens / seconds, "outputs": [outputs[f"r{i}"] for i in range(len(prompts))],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench window", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder or id (default: the bundled SmolLM2)")
    parser.add_argument("--window", type=int, default=128,
                        help="read the model as a Mistral with this window on every layer (0: take the model as it is)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--num-blocks", type=int, default=200)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    overrides = None if args.window == 0 else {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": args.window,
    }
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, num_blocks=args.num_blocks,
                          block_size=args.block_size, max_num_seqs=args.num_requests,
                          max_model_len=args.prompt_len + args.max_tokens, hf_overrides=overrides)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    runs = {name: run_one(config, prompts, args.max_tokens, release) for name, release in
            (("release", True), ("keep every block", False))}
    identical = sum(a == b for a, b in zip(runs["release"]["outputs"], runs["keep every block"]["outputs"],
                                           strict=True))
    result: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "command": "pdserve bench window " + " ".join(argv or []),
        "environment": {"python": platform.python_version(), "torch": torch.__version__, "device": args.device,
                        "torch_threads": torch.get_num_threads()},
        "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "model": args.model or "default", "window": runs["release"]["window"]},
        "runs": {k: {key: v for key, v in r.items() if key != "outputs"} for k, r in runs.items()},
        "identical_sequences": identical,
    }
    for name, r in runs.items():
        print(f"{name:17s} window {r['window']}, {r['num_blocks']} blocks of {r['block_size']}: at most "
              f"{r['peak_blocks_in_use']} in use and {r['peak_running_requests']} requests running, "
              f"{r['preemptions']} preemptions; {r['output_tokens']} tokens in {r['seconds']:.2f} s = "
              f"{r['tokens_per_s']:.1f} tokens/s")
    print(f"identical sequences: {identical}/{args.num_requests}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0
