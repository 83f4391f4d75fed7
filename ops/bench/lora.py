"""``pdserve bench lora``: LoRA adapters beside the base model, in one engine, on the same prompts.

The engine serves ``--num-adapters`` random adapters (PEFT's format, written here: rank ``--rank`` on
q, k, v, o, gate, up and down of every layer). The same greedy requests run, alternated, ``--batch`` at a
time:

* ``base``: no adapter (the baseline: what serving adapters costs the base model's requests is nothing
  but this run's figure against an engine without ``--enable-lora``, measured too as ``no-lora``);
* ``one``: every request with adapter 0;
* ``mixed``: request i with adapter i mod N, so every step groups its tokens by adapter.

Reported: output tokens/s of each run and its ratio to ``base``, and whether each request's tokens in
``mixed`` equal its tokens run with its adapter alone (they must: a row's adapter is its own whatever
shares the batch). Beside them, the host time of grouping a step's tokens by adapter
(``LoRAManager.set_batch``) at larger decode batches: what a GPU would wait on.

    pdserve bench lora --num-prompts 16 --max-tokens 64 --json ops/bench/results/lora.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common.config import EngineConfig
from common.engine.engine import LLMEngine
from common.lora_modules import LoRAModule
from common.model.lora import LoRAManager
from common.sampling_params import SamplingParams

_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")


def write_adapter(folder: Path, config: Any, rank: int, seed: int) -> Path:
    """A random LoRA adapter for a Llama-layout model's config, as PEFT saves one (B small: the text stays
    the model's kind of text, with tokens of its own)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    shapes = {"self_attn.q_proj": (hidden, heads * head_dim), "self_attn.k_proj": (hidden, kv),
              "self_attn.v_proj": (hidden, kv), "self_attn.o_proj": (heads * head_dim, hidden),
              "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden)}
    weights = {}
    for layer in range(config.num_hidden_layers):
        for name in _PROJECTIONS:
            fan_in, fan_out = shapes[name]
            key = f"base_model.model.model.layers.{layer}.{name}"
            weights[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
            weights[f"{key}.lora_B.weight"] = 0.02 * torch.randn(fan_out, rank, generator=gen)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "task_type": "CAUSAL_LM",
        "target_modules": [n.rpartition(".")[2] for n in _PROJECTIONS]}))
    return folder


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, loras: list[str | None],
        batch: int) -> dict[str, Any]:
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for at in range(0, len(prompts), batch):
        outputs += [c[0] for c in engine.generate(prompts[at : at + batch], params, loras[at : at + batch])]
    seconds = time.perf_counter() - start
    tokens = sum(map(len, outputs))
    return {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "outputs": outputs}


def grouping_cost(manager: LoRAManager, batch: int, num_adapters: int, steps: int = 50) -> float:
    """Host time (ms, median) to group a decode step of ``batch`` requests, round-robin over the adapters and
    the base model, by adapter."""
    slots = [i % (num_adapters + 1) - 1 for i in range(batch)]
    starts = torch.arange(batch + 1, dtype=torch.int32)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        manager.set_batch(slots, starts, torch.device("cpu"))
        times.append(time.perf_counter() - start)
    manager.set_batch([], starts[:1], torch.device("cpu"))
    return 1000 * sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench lora", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder or id (default: the bundled SmolLM2)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="requests at a time")
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--cost-batches", default="64,256", help="decode batches the grouping's host time is measured at")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from common.model.loader import resolve_model_path
    from common.model.weights import load_hf_config
    from ops.bench.spec_decode import chat_ids, open_texts

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = chat_ids(tokenizer, open_texts(args.num_prompts))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        config = load_hf_config(path)
        modules = tuple(LoRAModule(f"adapter-{i}", str(write_adapter(Path(tmp) / f"a{i}", config, args.rank, i)))
                        for i in range(args.num_adapters))
        common = {"model": args.model, "device": args.device, "max_num_seqs": max(8, args.batch)}
        plain = LLMEngine(EngineConfig(**common))
        engine = LLMEngine(EngineConfig(**common, enable_lora=True, lora_modules=modules, max_lora_rank=args.rank))
    names = [m.name for m in modules]
    cases: dict[str, list[str | None]] = {
        "base": [None] * len(prompts), "one": [names[0]] * len(prompts),
        "mixed": [names[i % len(names)] for i in range(len(prompts))],
    }
    for e in (plain, engine):  # the first steps' one-off costs, outside the timings
        e.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), [None])
    results: dict[str, dict[str, Any]] = {}
    results["no-lora"] = run(plain, prompts, params, [None] * len(prompts), args.batch)
    for name, loras in cases.items():
        results[name] = run(engine, prompts, params, loras, args.batch)
    # Each adapter's requests alone: the tokens the mixed run must give them.
    alone = {name: run(engine, prompts, params, [name] * len(prompts), args.batch)["outputs"] for name in names}
    mixed_equal = all(results["mixed"]["outputs"][i] == alone[names[i % len(names)]][i] for i in range(len(prompts)))
    base_equal = results["base"]["outputs"] == results["no-lora"]["outputs"]
    assert engine.runner.lora is not None
    costs = [{"batch": int(b), "adapters": args.num_adapters,
              "group_ms_per_step": grouping_cost(engine.runner.lora, int(b), args.num_adapters)}
             for b in args.cost_batches.split(",") if b]
    base_rate = results["base"]["tokens_per_s"]
    rows = [{"run": name, **{k: v for k, v in r.items() if k != "outputs"}, "vs_base": r["tokens_per_s"] / base_rate}
            for name, r in results.items()]
    for r in rows:
        print(f"{r['run']:8s} batch {args.batch:3d} {r['output_tokens']:5d} tokens {r['seconds']:7.2f} s "
              f"{r['tokens_per_s']:7.1f} tok/s  x{r['vs_base']:.2f} of base")
    print(f"mixed batch tokens equal each adapter's alone: {mixed_equal}; base model's tokens equal the engine "
          f"without --enable-lora: {base_equal}")
    for c in costs:
        print(f"grouping a decode step of {c['batch']} requests over {c['adapters']} adapters and the base model: "
              f"{c['group_ms_per_step']:.3f} ms of host time")
    if args.json:
        result = {
            "date": dt.date.today().isoformat(), "command": "pdserve bench lora " + " ".join(argv or []),
            "environment": {"python": platform.python_version(), "torch": torch.__version__, "device": args.device,
                            "torch_threads": torch.get_num_threads()},
            "num_adapters": args.num_adapters, "rank": args.rank, "batch": args.batch, "runs": rows,
            "mixed_equal_alone": mixed_equal, "base_equal_no_lora": base_equal, "grouping_host_time": costs,
        }
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0 if mixed_equal and base_equal else 1
