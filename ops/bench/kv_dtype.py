"""``pdserve bench kv-dtype``: what an 8-bit KV cache (``--kv-cache-dtype fp8``, ``fp8_e5m2``) costs and gives,
beside the model's own dtype, in one process.

For each cache dtype (``auto``, then ``fp8`` and ``fp8_e5m2``), one ``LLMEngine`` on the same model, memory and
prompts:

* capacity: KV blocks (and tokens) that ``--kv-cache-memory`` holds, bytes per token;
* accuracy against ``auto``: the greedy continuations of ``--num-prompts`` chat prompts, EOS ignored,
  ``--max-tokens`` each. Sequences identical in full, the mean share of each sequence before its
  first different token, and the share of tokens at equal positions that agree;
* speed: output tokens/s over the generation's wall time (all prompts at once).

    pdserve bench kv-dtype --num-prompts 32 --max-tokens 64 --json ops/bench/results/kv-dtype.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from typing import Any

import torch

from common.config import EngineConfig
from common.engine.engine import LLMEngine
from common.sampling_params import SamplingParams

_QUESTIONS = [
    "What is the capital of France, and why is it famous?", "Explain photosynthesis to a child.",
    "Write a haiku about the sea.", "How do I boil an egg?", "What causes the seasons on Earth?",
    "Give three tips for learning a new language.", "Describe a cat in two sentences.",
    "Why is the sky blue?", "What is a prime number? Give examples.", "Tell me a short story about a robot.",
    "How does a bicycle stay upright?", "List the planets of the solar system.",
    "What is the difference between weather and climate?", "Suggest a name for a bakery.",
    "How do vaccines work?", "Write a polite email declining a meeting.",
]


def prompts(tokenizer: Any, num: int) -> list[list[int]]:
    """``num`` chat prompts (the questions, then again with a request for more detail), as token ids."""
    out = []
    for i in range(num):
        question = _QUESTIONS[i % len(_QUESTIONS)] + (" Please answer in detail." if i >= len(_QUESTIONS) else "")
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def run_one(config: EngineConfig, requests: list[list[int]], max_tokens: int) -> dict[str, Any]:
    engine = LLMEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = [choices[0] for choices in engine.generate(requests, params)]
    seconds = time.perf_counter() - start
    runner = engine.runner
    return {
        "kv_cache_dtype": config.kv_cache_dtype, "cache_torch_dtype": str(runner.kv_cache.dtype),
        "num_blocks": runner.num_blocks, "tokens_in_cache": runner.num_blocks * runner.block_size,
        "bytes_per_token": runner.bytes_per_block // runner.block_size,
        "output_tokens": sum(len(o) for o in outputs), "seconds": seconds,
        "tokens_per_s": sum(len(o) for o in outputs) / seconds, "outputs": outputs,
    }


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """How far ``other``'s sequences follow ``reference``'s."""
    def prefix(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    prefixes = [prefix(a, b) / max(1, len(a)) for a, b in zip(reference, other, strict=True)]
    same = sum(x == y for a, b in zip(reference, other, strict=True) for x, y in zip(a, b, strict=False))
    total = sum(len(a) for a in reference)
    return {
        "identical_sequences": sum(a == b for a, b in zip(reference, other, strict=True)),
        "num_sequences": len(reference),
        "mean_share_before_first_difference": sum(prefixes) / len(prefixes),
        "tokens_agreeing_at_equal_positions": same / max(1, total),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench kv-dtype", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder or id (default: the bundled SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="256M", help="the same for every cache (CPU)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="model dtypes, each run with its own cache and with each 8-bit one; the later ones' "
                             "own caches are also compared with the first's (how much plain rounding moves greedy "
                             "output)")
    parser.add_argument("--kv-dtypes", default="fp8,fp8_e5m2", help="the 8-bit caches to run beside the model's own")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from common.config import parse_size
    from common.model.loader import resolve_model_path

    requests = prompts(AutoTokenizer.from_pretrained(str(resolve_model_path(args.model))), args.num_prompts)
    dtypes = args.dtypes.split(",")
    runs: dict[str, dict[str, Any]] = {}
    # The context the workload needs: a cache of a few MiB need not hold the model's whole one.
    max_model_len = max(len(r) for r in requests) + args.max_tokens
    eight_bit = args.kv_dtypes.split(",")
    for dtype in dtypes:
        for kv in ("auto", *eight_bit):
            config = EngineConfig(model=args.model, device=args.device, dtype=dtype, kv_cache_dtype=kv,
                                  kv_cache_memory=parse_size(args.kv_cache_memory),
                                  max_num_seqs=max(8, args.num_prompts), max_model_len=max_model_len)
            runs[f"{dtype}/{kv}"] = run_one(config, requests, args.max_tokens)
    comparisons = {f"{d}/{kv} vs {d}/auto": (f"{d}/auto", f"{d}/{kv}") for d in dtypes for kv in eight_bit}
    comparisons |= {f"{d}/auto vs {dtypes[0]}/auto": (f"{dtypes[0]}/auto", f"{d}/auto") for d in dtypes[1:]}
    capacity = {f"{d}/{kv}": runs[f"{d}/{kv}"]["num_blocks"] / runs[f"{d}/auto"]["num_blocks"]
                for d in dtypes for kv in eight_bit}
    agreements = {name: agreement(runs[a]["outputs"], runs[b]["outputs"]) for name, (a, b) in comparisons.items()}
    result: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "command": "pdserve bench kv-dtype " + " ".join(argv or []),
        "environment": {"python": platform.python_version(), "torch": torch.__version__, "device": args.device,
                        "torch_threads": torch.get_num_threads()},
        "runs": {k: {key: v for key, v in r.items() if key != "outputs"} for k, r in runs.items()},
        "capacity_ratio": capacity,
        "greedy_agreement": agreements,
    }
    for name, r in runs.items():
        print(f"{name:18s} cache {r['cache_torch_dtype']:20s} {r['num_blocks']:6d} blocks = {r['tokens_in_cache']:7d} "
              f"tokens in {args.kv_cache_memory} ({r['bytes_per_token']} B/token); {r['output_tokens']} tokens in "
              f"{r['seconds']:.2f} s = {r['tokens_per_s']:.1f} tokens/s")
    for name, ratio in capacity.items():
        print(f"{name}: holds {ratio:.2f}x the tokens of the model's own dtype")
    for name, a in agreements.items():
        print(f"{name:34s} {a['identical_sequences']}/{a['num_sequences']} sequences identical, "
              f"{a['mean_share_before_first_difference']:.1%} of each before its first difference (mean), "
              f"{a['tokens_agreeing_at_equal_positions']:.1%} of tokens agree by position")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0
