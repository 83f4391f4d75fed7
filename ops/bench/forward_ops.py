"""``pdserve bench overhead forward``: what one forward of the model launches, counted.

Beside a GPU every torch operation a forward dispatches is a kernel launch (or a cuBLAS call), and so
is every Triton kernel: run eagerly (prefill steps, ``--enforce-eager``) each costs the host its
launch, and in a CUDA graph's replay each still costs the device a few microseconds at a small
model's sizes. The count does not move with the host's load, and needs no GPU: the model is built on
the CPU with its real weights; with the Triton backend each of its Triton kernels is recorded
instead of run (what their wrappers dispatch around them still counts), so the outputs are not
meaningful, only what was launched. Views and allocations (``aten.empty*``), which launch nothing,
are left out.

Both backends in one invocation: ``torch`` is the reference formulas (the CPU's path), ``triton``
what a GPU runs. Cases: a decode step (``--batch`` sequences, one token each, ``--context`` tokens
in the cache), a prefill step (``--batch`` prompts of ``--context`` tokens), and the sampler's work in
a decode step of ``--batch`` requests with mixed parameters (``overhead``'s ``MIXED``: temperatures,
top-k, top-p, min-p, penalties, seeds, logprobs), over the model's vocabulary. The sampler's count
takes the branches a GPU takes (no block maxima, no chunks: those are the CPU's), and counts apart its
copies between host and device (``uploads``, ``downloads``), which on a GPU are launches too. With
LoRA adapters (``--lora-rank``: two random ones on every projection of every layer, as ``pdserve bench
lora`` writes them), two more decode cases: ``decode-lora`` (every sequence with one adapter) and
``decode-lora-mixed`` (sequences with either adapter or none), beside ``decode`` on the same model (its
adapted projections idle). A step with adapted rows runs eagerly on a GPU, outside the decode CUDA graphs.

    pdserve bench overhead forward --batch 8 --context 64
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import sys
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common.lora_modules import LoRAModule
from common.model.llama import AttentionMetadata, LlamaForCausalLM
from common.model.loader import model_identity, resolve_model_path
from common.model.lora import LoRAManager
from common.model.weights import load_hf_config, load_model
from ops.bench.lora import write_adapter
from pdserve_kernels import get_kernels
from pdserve_kernels.launch_recorder import Launch, recording

RESULTS_DIR = Path(__file__).parent / "results"
BACKENDS = ("torch", "triton")


class _Count(TorchDispatchMode):
    """The torch operations dispatched, by name: views and allocations apart."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func)
        if not func.is_view and not name.startswith("aten.empty"):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def step_inputs(model: LlamaForCausalLM, case: str, batch: int, context: int,
                block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """Token ids, positions, metadata and a KV cache for one step of ``case``."""
    blocks = -(-context // block_size)
    kv_cache = torch.zeros(len(model.model.layers), 2, batch * blocks, block_size, model.num_kv_heads,
                           model.head_size)
    tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.int32)
    if case == "decode":
        q_lens = [1] * batch
        positions = torch.full((batch,), context - 1)
        slots = tables[:, -1].long() * block_size + (context - 1) % block_size
    else:
        q_lens = [context] * batch
        positions = torch.arange(context).repeat(batch)
        slots = (tables.long()[:, :, None] * block_size + torch.arange(block_size)).flatten(1)[:, :context].flatten()
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, query_start_loc=starts, context_lens=lens,
                             max_query_len=max(q_lens))
    ids = torch.randint(0, int(model.config.vocab_size), (int(starts[-1]),), generator=torch.Generator().manual_seed(0))
    return ids, positions, meta, kv_cache


def count_forward(model: LlamaForCausalLM, backend: str, case: str, args: argparse.Namespace,
                  lora: LoRAManager | None = None) -> dict[str, Any]:
    ids, positions, meta, kv_cache = step_inputs(model, case.removesuffix("-lora-mixed").removesuffix("-lora"),
                                                 args.batch, args.context)
    if lora is not None:  # which adapter each sequence has: none, adapter 0 for all, or each in turn
        slots = {"decode-lora": [0] * args.batch, "decode-lora-mixed": [i % 3 - 1 for i in range(args.batch)]}
        lora.set_batch(slots.get(case, [-1] * args.batch), meta.query_start_loc, torch.device("cpu"))
    with contextlib.ExitStack() as stack, torch.inference_mode():
        launches: list[Launch] = stack.enter_context(recording())[0] if backend == "triton" else []
        model(ids, positions, meta, kv_cache)  # once first: anything done on a first call only is not counted
        launches.clear()
        count = _Count()
        with count:
            model(ids, positions, meta, kv_cache)
    by_kernel = collections.Counter(launch.name for launch in launches)
    ops, triton = sum(count.ops.values()), len(launches)
    return {"backend": backend, "case": case, "torch_ops": ops, "triton_launches": triton, "total": ops + triton,
            "per_layer": round((ops + triton) / len(model.model.layers), 1), "ops": dict(count.ops.most_common()),
            "launches": dict(by_kernel)}


def count_sample(vocab: int, backend: str, args: argparse.Namespace) -> dict[str, Any]:
    """The operations of one steady decode step's sampling (the second of two, a token appended between:
    the batch's plan and the penalty stores' rows are built at the first)."""
    import common.engine.host_tensors as host_tensors
    import common.engine.sampler as sampler_module
    from common.engine.request import Request
    from ops.bench.gpu_branches import gpu_branches
    from ops.bench.overhead import MIXED

    count = _Count()
    reqs = []
    for i in range(args.batch):
        req = Request(f"r{i}", [(7 * i + j) % vocab for j in range(args.context)], MIXED[i % len(MIXED)],
                      block_size=16, model_id="m")
        for token in (3, 5, 3):
            req.append_output_token(token)
        reqs.append(req)
    logits = torch.randn(args.batch, vocab, generator=torch.Generator().manual_seed(0)) * 3
    sampler = sampler_module.Sampler({2}, kernel_backend=backend)
    with contextlib.ExitStack() as stack:
        launches: list[Launch] = stack.enter_context(gpu_branches()) if backend == "triton" else []
        sampler.sample(logits, reqs).result()
        for req in reqs:
            req.append_output_token(5)
        launches.clear()
        # Each host-device copy counted where it is made (on the CPU they copy nothing).
        uploads = stack.enter_context(mock.patch.object(host_tensors, "to_device_all", wraps=host_tensors.to_device_all))
        downloads = stack.enter_context(mock.patch.object(sampler_module, "to_host", wraps=sampler_module.to_host))
        with count:
            sampler.sample(logits, reqs).result()
    by_kernel = collections.Counter(launch.name for launch in launches)
    ops, triton = sum(count.ops.values()), len(launches)
    copies = {"uploads": uploads.call_count, "downloads": downloads.call_count} if backend == "triton" else {}
    total = ops + triton + sum(copies.values())
    return {"backend": backend, "case": "sample", "torch_ops": ops, "triton_launches": triton, **copies,
            "total": total, "per_layer": None, "ops": dict(count.ops.most_common()), "launches": dict(by_kernel)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench overhead forward", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint folder; default: the default model")
    p.add_argument("--batch", type=int, default=8, help="sequences in the step")
    p.add_argument("--context", type=int, default=64, help="tokens in the cache (decode), or in each prompt (prefill)")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--cases", default="decode,prefill,sample",
                   help="decode, prefill, sample; with --lora-rank also decode-lora, decode-lora-mixed")
    p.add_argument("--lora-rank", type=int, default=0, help="serve two random LoRA adapters of this rank (0: none)")
    p.add_argument("--json", default=None, help="default: ops/bench/results/forward-ops-<date>.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    cases = [c for c in args.cases.split(",") if c]
    if not set(backends) <= set(BACKENDS) or not backends:
        raise SystemExit(f"--backends takes a comma-separated list of {', '.join(BACKENDS)}")
    lora_cases = {"decode-lora", "decode-lora-mixed"}
    if not set(cases) <= {"decode", "prefill", "sample", *lora_cases} or not cases:
        raise SystemExit("--cases takes a comma-separated list of decode, prefill, sample, decode-lora, decode-lora-mixed")
    if set(cases) & lora_cases and args.lora_rank < 1:
        raise SystemExit("the decode-lora cases need --lora-rank")
    if args.batch < 1 or args.context < 1:
        raise SystemExit("--batch and --context must be positive")
    path = resolve_model_path(args.model)
    config = load_hf_config(path)
    results = []
    lora: LoRAManager | None = None
    with tempfile.TemporaryDirectory() as adapters:  # read as each model is built
        lora_modules = tuple(LoRAModule(f"a{i}", str(write_adapter(Path(adapters) / f"a{i}", config, args.lora_rank, i)))
                             for i in range(2 if args.lora_rank else 0))
        for backend in backends:
            if set(cases) - {"sample"}:
                model = load_model(path, config, get_kernels("cpu", backend), torch.float32, torch.device("cpu"))
                lora = LoRAManager(model, lora_modules, args.lora_rank) if lora_modules else None
            results += [count_forward(model, backend, case, args, lora) if case != "sample"
                        else count_sample(int(config.vocab_size), backend, args) for case in cases]
    report = {"date": datetime.date.today().isoformat(),
              "command": " ".join(["pdserve bench overhead forward", *(argv if argv is not None else sys.argv[1:])]),
              "model": path.name, "model_id": model_identity(path), "config": vars(args), "results": results}
    print(f"one forward (or sampling step) of {report['model']}: torch operations (views and allocations apart), Triton "
          "launches, and the sampler's copies between host and device")
    print(f"{'case':17} {'backend':8} {'torch ops':>10} {'launches':>9} {'copies':>7} {'total':>7} {'per layer':>10}")
    for r in results:
        copies = r.get("uploads", 0) + r.get("downloads", 0)
        print(f"{r['case']:17} {r['backend']:8} {r['torch_ops']:>10} {r['triton_launches']:>9} {copies:>7} "
              f"{r['total']:>7} {r['per_layer'] if r['per_layer'] is not None else '':>10}")
    out = Path(args.json) if args.json else RESULTS_DIR / f"forward-ops-{report['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
