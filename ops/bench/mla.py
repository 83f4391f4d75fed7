"""``pdserve bench mla``: DeepSeek's latent attention prefill, expanded against absorbed, in one process.

A DeepSeek-V3-shaped model (V3's latent dims: ``kv_lora_rank`` 512, ``qk_nope_head_dim`` 128, ``qk_rope_head_dim``
64, ``v_head_dim`` 128; ``--heads`` query heads, ``--layers`` dense layers, random weights) prefills one prompt
of each ``--prompt-lens`` in a single step:

* ``expanded``: what the engine runs (``common.model.mla.MLAttention.expands``): each context token's latent
  carried out to every head's key and value, then plain attention (transformers' form);
* ``absorbed``: the baseline, every chunk in the latent space as decode steps run.

Reported: milliseconds per prefill (median of ``--repeats``), the ratio, and the largest difference between
the two forms' final hidden states (float rounding only). Beside them, the KV cache bytes a token takes per
layer: the latent once (``kv_lora_rank + qk_rope_head_dim`` entries), against the 2 x 128 heads x 192 entries
a cache of expanded keys and values would take.

    pdserve bench mla --prompt-lens 512,2048 --json ops/bench/results/mla-cpu.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def build_model(folder: Path, heads: int, layers: int, seed: int = 0) -> Any:
    """A random DeepSeek-V3-shaped checkpoint saved by transformers, loaded as the engine loads it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from common.model.weights import load_hf_config, load_model
    from pdserve_kernels import reference

    config = DeepseekV3Config(
        vocab_size=1024, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
        num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=heads,
        num_key_value_heads=heads, kv_lora_rank=512, q_lora_rank=768, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        max_position_embeddings=16384, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    DeepseekV3ForCausalLM(config).save_pretrained(str(folder))
    return load_model(folder, load_hf_config(folder), reference, torch.float32, torch.device("cpu"))


def prefill_ms(model: Any, prompt_len: int, expanded: bool, repeats: int) -> tuple[float, torch.Tensor]:
    """Median milliseconds of one step prefilling a ``prompt_len`` prompt, and its hidden states."""
    from common.model import mla
    from common.model.llama import AttentionMetadata

    block_size = 16
    num_blocks = -(-prompt_len // block_size)
    cache = torch.zeros(len(model.model.layers), 2, num_blocks, block_size, model.num_kv_heads, model.head_size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(prompt_len), block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, prompt_len], dtype=torch.int32),
        context_lens=torch.tensor([prompt_len], dtype=torch.int32), max_query_len=prompt_len,
    )
    ids = torch.randint(0, 1024, (prompt_len,), generator=torch.Generator().manual_seed(1))
    mla.EXPANDED_PREFILL = expanded
    times = []
    try:
        with torch.inference_mode():
            for _ in range(repeats):
                start = time.perf_counter()
                hidden = model(ids, torch.arange(prompt_len), meta, cache)
                times.append((time.perf_counter() - start) * 1e3)
    finally:
        mla.EXPANDED_PREFILL = True
    return statistics.median(times), hidden


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-mla-") as tmp:
        model = build_model(Path(tmp), args.heads, args.layers)
    attn = model.model.layers[0].self_attn
    rows = []
    for prompt_len in args.prompt_lens:
        prefill_ms(model, min(prompt_len, 64), True, 1)  # warm-up
        expanded_ms, expanded_hidden = prefill_ms(model, prompt_len, True, args.repeats)
        absorbed_ms, absorbed_hidden = prefill_ms(model, prompt_len, False, args.repeats)
        rows.append({
            "prompt_len": prompt_len, "expands": attn.expands(prompt_len, prompt_len, prompt_len),
            "expanded_ms": round(expanded_ms, 1), "absorbed_ms": round(absorbed_ms, 1),
            "speedup": round(absorbed_ms / expanded_ms, 2),
            "max_hidden_diff": float((expanded_hidden - absorbed_hidden).abs().max()),
        })
    latent = attn.kv_lora_rank + attn.rope_dim
    return {
        "bench": "mla", "date": dt.date.today().isoformat(), "host": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(), "heads": args.heads, "layers": args.layers,
        "dims": {"kv_lora_rank": attn.kv_lora_rank, "qk_nope_head_dim": attn.nope_dim, "qk_rope_head_dim": attn.rope_dim,
                 "v_head_dim": attn.v_dim},
        "kv_cache_entries_per_token_layer": {"latent": latent,
                                             "expanded_128_heads": 128 * (attn.nope_dim + attn.rope_dim + attn.v_dim)},
        "prefill": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench mla", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048])
    parser.add_argument("--heads", type=int, default=16, help="query heads (DeepSeek-V3's 128 over 8 ranks: 16)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    result = run(args)
    print(f"{'prompt':>7} {'form':>9} {'expanded ms':>12} {'absorbed ms':>12} {'speedup':>8} {'max diff':>10}")
    for row in result["prefill"]:
        form = "expanded" if row["expands"] else "absorbed"
        print(f"{row['prompt_len']:>7} {form:>9} {row['expanded_ms']:>12.1f} {row['absorbed_ms']:>12.1f} "
              f"{row['speedup']:>7.2f}x {row['max_hidden_diff']:>10.2e}")
    cache = result["kv_cache_entries_per_token_layer"]
    print(f"KV cache entries per token and layer: {cache['latent']} (the latent) against "
          f"{cache['expanded_128_heads']} (128 heads' keys and values)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
