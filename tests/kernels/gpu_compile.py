"""Compile every Triton kernel for an NVIDIA GPU ahead of time, without a GPU.

The interpreter runs the kernels' logic but never lowers them, so code that cannot compile for a real
GPU would pass the CPU tests. Here the public wrappers are called on CPU tensors with their kernels
swapped for recorders; each recorded launch is then compiled for the target (down to a cubin) with
the specialization the JIT would give it. Must run without ``TRITON_INTERPRET`` (a fresh process):
``python -m tests.kernels.gpu_compile [--arch 90]``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from typing import Any

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

from pdserve_kernels import (
    triton_act,
    triton_decode,
    triton_kv,
    triton_logprobs,
    triton_moe,
    triton_norm,
    triton_nucleus,
    triton_packed_linear,
    triton_penalties,
    triton_prefill,
    triton_rope,
    triton_sampling,
)
from pdserve_kernels.launch_recorder import Launch, recording
from pdserve_kernels.packed_weights import Fp8Weights, IntWeights, Mxfp4Weights

# The most shared memory one program may use (opt-in), per SM version: a launch over it is refused.
SHARED_MEMORY_LIMIT = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}


def record_launches() -> list[Launch]:
    """The launches of representative calls: Llama-8B-like bf16 shapes, and float32 / odd GQA ones."""
    bf16, f32 = torch.bfloat16, torch.float32
    with recording() as (launches, scenario):
        for dtype, group, head_size, block_size, num_splits in [(bf16, 4, 128, 16, 1), (bf16, 4, 128, 16, 4),
                                                                (f32, 3, 64, 32, 1), (bf16, 2, 256, 16, 2),
                                                                (f32, 1, 128, 16, 1)]:
            scenario[0] = f"decode {dtype} gqa{group} d{head_size} splits{num_splits}"
            kv = torch.empty(2, 64, block_size, 8, head_size, dtype=dtype)
            tables = torch.zeros(4, 16, dtype=torch.int32)
            lens = torch.ones(4, dtype=torch.int32)
            q = torch.empty(4, 8 * group, head_size, dtype=dtype)
            triton_decode.run_paged_decode(q, kv, tables, lens, 0.1, num_splits=num_splits)
        # A 256-wide head at 16 bits (Gemma 2 9B) and a float32 cache at 128: the default key tile's
        # shared memory is over what an sm86/sm89 GPU gives a program (see ``main``).
        for dtype, group, head_size in [(bf16, 4, 128), (f32, 3, 64), (bf16, 2, 256), (f32, 4, 128)]:
            scenario[0] = f"prefill {dtype} gqa{group} d{head_size}"
            kv = torch.empty(2, 64, 16, 8, head_size, dtype=dtype)
            q = torch.empty(40, 8 * group, head_size, dtype=dtype)
            starts = torch.tensor([0, 8, 40], dtype=torch.int32)
            lens = torch.tensor([20, 32], dtype=torch.int32)
            triton_prefill.paged_prefill_attention(q, kv, torch.zeros(2, 4, dtype=torch.int32), starts, lens, 0.1)
        scenario[0] = "decode bf16 sliding window + soft-cap (Gemma 2)"
        kv = torch.empty(2, 64, 16, 8, 128, dtype=bf16)
        q = torch.empty(4, 16, 128, dtype=bf16)
        triton_decode.run_paged_decode(q, kv, torch.zeros(4, 16, dtype=torch.int32), torch.ones(4, dtype=torch.int32),
                                       0.1, num_splits=2, sliding_window=4096, soft_cap=50.0)
        scenario[0] = "prefill bf16 sliding window + soft-cap (Gemma 2)"
        q = torch.empty(40, 16, 128, dtype=bf16)
        triton_prefill.paged_prefill_attention(q, kv, torch.zeros(2, 4, dtype=torch.int32),
                                               torch.tensor([0, 8, 40], dtype=torch.int32),
                                               torch.tensor([20, 32], dtype=torch.int32), 0.1,
                                               sliding_window=4096, soft_cap=50.0)
        for key_dtype in (bf16, f32):
            scenario[0] = f"store_kv {key_dtype} -> bf16"
            kv = torch.empty(2, 64, 16, 8, 128, dtype=bf16)
            key = torch.empty(5, 8, 128, dtype=key_dtype)
            triton_kv.store_kv(key, key, kv, torch.zeros(5, dtype=torch.long))
        cache = torch.empty(4, 2, 64, 16, 8, 128, dtype=bf16)
        ids = torch.tensor([1, 2], dtype=torch.int32)
        scenario[0] = "gather_blocks bf16"
        packed = triton_kv.gather_blocks(cache, ids)
        scenario[0] = "scatter_blocks f32 -> bf16"
        triton_kv.scatter_blocks(cache, ids, packed.float())
        scenario[0] = "copy_blocks bf16"
        triton_kv.copy_blocks(cache, ids, torch.tensor([5, 6]))
        scenario[0] = "seeded race, 128k vocabulary, whole rows"
        triton_sampling.seeded_race(torch.empty(4, 128256), torch.zeros(4, dtype=torch.long), num_splits=1)
        scenario[0] = "seeded race, 128k vocabulary, rows in ranges"
        triton_sampling.seeded_race(torch.empty(4, 128256), torch.zeros(4, dtype=torch.long), num_splits=33)
        for name, width, form in (("SmolLM2's hidden size, bf16", 576, 0), ("an 8B model's, Gemma's formula", 4096, 1),
                                  ("a row wider than one pass", 8192, 0), ("a 128-wide head (q/k norms)", 128, 0),
                                  ("OLMo's formula", 4096, 2), ("Cohere's LayerNorm", 8192, 3)):
            scenario[0] = f"rms_norm, {name}"
            triton_norm.rms_norm(torch.empty(4, width, dtype=bf16), torch.empty(width, dtype=bf16), 1e-6, form)
            scenario[0] = f"add_rms_norm, {name}"
            triton_norm.add_rms_norm(torch.empty(4, width, dtype=bf16), torch.empty(4, width, dtype=bf16),
                                     torch.empty(width, dtype=bf16), 1e-6, form)
        width = 6144  # StarCoder2-15B's hidden size
        scenario[0] = "rms_norm, torch's LayerNorm with a bias (StarCoder2)"
        triton_norm.rms_norm(torch.empty(4, width, dtype=bf16), torch.empty(width, dtype=bf16), 1e-5, 3,
                             torch.empty(width, dtype=bf16))
        scenario[0] = "add_rms_norm, torch's LayerNorm with a bias (StarCoder2)"
        triton_norm.add_rms_norm(torch.empty(4, width, dtype=bf16), torch.empty(4, width, dtype=bf16),
                                 torch.empty(width, dtype=bf16), 1e-5, 3, torch.empty(width, dtype=bf16))
        for name, q_heads, k_heads, head_size in (("SmolLM2's heads", 9, 3, 64), ("an 8B model's", 32, 8, 128)):
            scenario[0] = f"rope, {name}, bf16"
            cs = torch.empty(4, 1, head_size, dtype=bf16)
            triton_rope.rope(torch.empty(4, q_heads, head_size, dtype=bf16), torch.empty(4, k_heads, head_size, dtype=bf16),
                             cs, cs)
            scenario[0] = f"rope_and_store, {name}, bf16"
            kv = torch.empty(4, k_heads, head_size, dtype=bf16)
            triton_rope.rope_and_store(torch.empty(4, q_heads, head_size, dtype=bf16), kv, kv, cs, cs,
                                       torch.empty(2, 8, 16, k_heads, head_size, dtype=bf16), torch.arange(4))
        scenario[0] = "rope_and_store, GLM-4.5's partial RoPE (64 of 128), bf16"
        half = torch.empty(4, 1, 64, dtype=bf16)
        kv = torch.empty(4, 8, 128, dtype=bf16)
        triton_rope.rope_and_store(torch.empty(4, 96, 128, dtype=bf16), kv, kv, half, half,
                                   torch.empty(2, 8, 16, 8, 128, dtype=bf16), torch.arange(4))
        scenario[0] = "rope and rope_and_store, ERNIE 4.5's float32 tables for bf16 q and k (rounded once)"
        wide = torch.empty(4, 1, 128, dtype=f32)
        triton_rope.rope(torch.empty(4, 16, 128, dtype=bf16), kv, wide, wide)
        triton_rope.rope_and_store(torch.empty(4, 16, 128, dtype=bf16), kv, kv, wide, wide,
                                   torch.empty(2, 8, 16, 8, 128, dtype=bf16), torch.arange(4))
        zeros = torch.zeros(4, dtype=torch.long)
        scenario[0] = "seeded race with positions (the sampler's), whole rows"
        triton_sampling.seeded_race(torch.empty(4, 128256), zeros, num_splits=1, positions=zeros)
        scenario[0] = "seeded race with positions (the sampler's), rows in ranges"
        triton_sampling.seeded_race(torch.empty(4, 128256), zeros, num_splits=33, positions=zeros)
        for name, inter in (("SmolLM2's MLP", 1536), ("an 8B model's MLP (wider than one pass)", 14336)):
            scenario[0] = f"silu_mul, {name}, bf16"
            triton_act.silu_mul(torch.empty(4, 2 * inter, dtype=bf16))
        # 8-bit KV caches (--kv-cache-dtype fp8, fp8_e5m2): stored from bf16 and float32, read by bf16 queries.
        for fp8, form in ((torch.float8_e4m3fn, "fp8 e4m3"), (torch.float8_e5m2, "fp8 e5m2")):
            for key_dtype in (bf16, f32):
                scenario[0] = f"store_kv {key_dtype} -> {form}"
                key = torch.empty(5, 8, 128, dtype=key_dtype)
                triton_kv.store_kv(key, key, torch.empty(2, 64, 16, 8, 128, dtype=fp8), torch.zeros(5, dtype=torch.long))
            scenario[0] = f"rope_and_store bf16 -> {form}"
            cs = torch.empty(4, 1, 128, dtype=bf16)
            kv = torch.empty(4, 8, 128, dtype=bf16)
            triton_rope.rope_and_store(torch.empty(4, 32, 128, dtype=bf16), kv, kv, cs, cs,
                                       torch.empty(2, 8, 16, 8, 128, dtype=fp8), torch.arange(4))
            kv = torch.empty(2, 64, 16, 8, 128, dtype=fp8)
            for splits in (1, 4):
                scenario[0] = f"decode bf16 over an {form} cache, splits{splits}"
                triton_decode.run_paged_decode(torch.empty(4, 32, 128, dtype=bf16), kv, torch.zeros(4, 16, dtype=torch.int32),
                                               torch.ones(4, dtype=torch.int32), 0.1, num_splits=splits)
            scenario[0] = f"prefill bf16 over an {form} cache"
            triton_prefill.paged_prefill_attention(torch.empty(40, 32, 128, dtype=bf16), kv,
                                                   torch.zeros(2, 4, dtype=torch.int32),
                                                   torch.tensor([0, 8, 40], dtype=torch.int32),
                                                   torch.tensor([20, 32], dtype=torch.int32), 0.1)
            scenario[0] = f"gather / scatter / copy blocks {form}"
            cache8 = torch.empty(4, 2, 64, 16, 8, 128, dtype=fp8)
            triton_kv.scatter_blocks(cache8, ids, triton_kv.gather_blocks(cache8, ids))
            triton_kv.copy_blocks(cache8, ids, torch.tensor([5, 6]))
        # gpt-oss: attention sinks (decode whole and split, prefill), its experts' biases.
        kv = torch.empty(2, 64, 16, 8, 64, dtype=bf16)
        sinks = torch.empty(64, dtype=bf16)
        for splits in (1, 4):
            scenario[0] = f"decode bf16 with attention sinks, sliding window, splits{splits} (gpt-oss)"
            triton_decode.run_paged_decode(torch.empty(4, 64, 64, dtype=bf16), kv, torch.zeros(4, 16, dtype=torch.int32),
                                           torch.ones(4, dtype=torch.int32), 0.1, num_splits=splits,
                                           sliding_window=128, sinks=sinks)
        scenario[0] = "prefill bf16 with attention sinks (gpt-oss)"
        triton_prefill.paged_prefill_attention(torch.empty(40, 64, 64, dtype=bf16), kv,
                                               torch.zeros(2, 4, dtype=torch.int32),
                                               torch.tensor([0, 8, 40], dtype=torch.int32),
                                               torch.tensor([20, 32], dtype=torch.int32), 0.1, sinks=sinks)
        # DeepSeek-V3's latent (576 entries a token, 288 in each slot) read by 128 query heads (16 a rank of 8),
        # decode whole and split, prefill; over an 8-bit cache too.
        for cache_dtype, cache_name in ((bf16, "bf16"), (fp8, "fp8")):
            kv = torch.empty(2, 64, 16, 1, 288, dtype=cache_dtype)
            for heads, splits in ((128, 1), (16, 4)):
                scenario[0] = f"decode bf16 latent (DeepSeek-V3), {heads} heads, {cache_name} cache, splits{splits}"
                triton_decode.run_paged_decode(torch.empty(4, heads, 576, dtype=bf16), kv,
                                               torch.zeros(4, 16, dtype=torch.int32), torch.ones(4, dtype=torch.int32),
                                               0.1, num_splits=splits, latent=True)
            scenario[0] = f"prefill bf16 latent (DeepSeek-V3), {cache_name} cache"
            triton_prefill.paged_prefill_attention(torch.empty(40, 16, 576, dtype=bf16), kv,
                                                   torch.zeros(2, 4, dtype=torch.int32),
                                                   torch.tensor([0, 8, 40], dtype=torch.int32),
                                                   torch.tensor([20, 32], dtype=torch.int32), 0.1, latent=True)
        scenario[0] = "moe_experts with biases (gpt-oss-20b), bf16"
        ids = (torch.arange(64 * 4) % 32).view(64, 4)
        triton_moe.moe_experts(torch.empty(64, 2880, dtype=bf16), ids, torch.ones(64, 4, dtype=bf16),
                               torch.empty(32, 5760, 2880, dtype=bf16), torch.empty(32, 2880, 2880, dtype=bf16),
                               torch.empty(32, 5760, dtype=bf16), torch.empty(32, 2880, dtype=bf16), (1.702, 7.0))
        # Mixtures of experts: Qwen3-30B-A3B's experts (8 of 128, 768 wide) and Mixtral's (2 of 8, 14336
        # wide), over a decode step's tokens and a prefill chunk's (the other row tile); float32 too.
        # The weights are never touched here: their pages are not even allocated.
        for name, dtype, hidden, inter, experts, k, tokens in (
                ("Qwen3-30B-A3B, decode", bf16, 2048, 768, 128, 8, 64), ("Qwen3-30B-A3B, prefill", bf16, 2048, 768, 128, 8, 512),
                ("Mixtral, decode", bf16, 4096, 14336, 8, 2, 16), ("float32", f32, 256, 96, 8, 2, 16)):
            scenario[0] = f"moe_experts, {name}, {dtype}"
            ids = (torch.arange(tokens * k) % experts).view(tokens, k)
            triton_moe.moe_experts(torch.empty(tokens, hidden, dtype=dtype), ids, torch.ones(tokens, k),
                                   torch.empty(experts, 2 * inter, hidden, dtype=dtype),
                                   torch.empty(experts, hidden, inter, dtype=dtype))
        # Experts kept packed: Qwen3-30B-A3B's at 4 bits in groups of 128 (GPTQ, AWQ; fp16 scales), decode and
        # prefill; DeepSeek-V3's in FP8 blocks of 128 x 128 (8 of them, 2048 wide; 32 here, not its 256), decode.
        for name, tokens in (("decode", 64), ("prefill", 512)):
            scenario[0] = f"moe_experts, Qwen3-30B-A3B GPTQ 4-bit experts, {name}, bf16"
            ids = (torch.arange(tokens * 8) % 128).view(tokens, 8)
            triton_moe.moe_experts(torch.empty(tokens, 2048, dtype=bf16), ids, torch.ones(tokens, 8),
                                   *(IntWeights(torch.empty(128, out, inputs // 8, dtype=torch.int32),
                                                torch.empty(128, out, inputs // 128, dtype=torch.uint8),
                                                torch.empty(128, out, inputs // 128, dtype=torch.float16), 4)
                                     for out, inputs in ((1536, 2048), (2048, 768))))
        scenario[0] = "moe_experts, DeepSeek-V3 fp8 experts, decode, bf16"
        ids = (torch.arange(16 * 8) % 32).view(16, 8)
        triton_moe.moe_experts(torch.empty(16, 7168, dtype=bf16), ids, torch.ones(16, 8),
                               *(Fp8Weights(torch.empty(32, out, inputs, dtype=torch.float8_e4m3fn),
                                            torch.empty(32, out // 128, inputs // 128))
                                 for out, inputs in ((4096, 7168), (7168, 2048))))
        scenario[0] = "moe_experts, gpt-oss-20b MXFP4 experts with biases (120b's shapes too), decode, bf16"
        ids = (torch.arange(16 * 4) % 32).view(16, 4)
        triton_moe.moe_experts(torch.empty(16, 2880, dtype=bf16), ids, torch.ones(16, 4, dtype=bf16),
                               *(Mxfp4Weights(torch.empty(32, out, inputs // 2, dtype=torch.uint8),
                                              torch.empty(32, out, inputs // 32, dtype=torch.uint8))
                                 for out, inputs in ((5760, 2880), (2880, 2880))),
                               torch.empty(32, 5760, dtype=bf16), torch.empty(32, 2880, dtype=bf16), (1.702, 7.0))
        # Packed integer weights: Llama-8B's MLP down projection at 4 bits, groups of 128 (GPTQ, AWQ; fp16 scales),
        # over a decode step and a prefill chunk; 8 bits per channel (bf16 scales, W8A16); 2 bits with a bias.
        for name, dtype, bits, groups, scales, tokens, bias in (
                ("4-bit, decode", bf16, 4, 112, torch.float16, 8, False), ("4-bit, prefill", bf16, 4, 112, torch.float16, 512, False),
                ("8-bit per channel", bf16, 8, 1, bf16, 64, False), ("2-bit, float32, bias", f32, 2, 448, f32, 16, True)):
            scenario[0] = f"int_linear {name}, {dtype}"
            triton_packed_linear.int_linear(torch.empty(tokens, 14336, dtype=dtype),
                                         torch.empty(4096, 14336 * bits // 32, dtype=torch.int32),
                                         torch.empty(4096, groups, dtype=torch.uint8), torch.empty(4096, groups, dtype=scales),
                                         bits, torch.empty(4096, dtype=dtype) if bias else None)
        scenario[0] = "int_linear 4-bit, groups out of order (desc_act), decode, bf16"
        triton_packed_linear.int_linear(torch.empty(8, 4096, dtype=bf16), torch.empty(6144, 512, dtype=torch.int32),
                                        torch.empty(6144, 32, dtype=torch.uint8), torch.empty(6144, 32, dtype=torch.float16),
                                        4, g_idx=torch.empty(4096, dtype=torch.int32))
        for name, tokens in (("decode", 8), ("prefill", 512)):
            scenario[0] = f"fp8_linear 128 x 128 blocks (Qwen3-32B-FP8's down projection), {name}, bf16"
            triton_packed_linear.fp8_linear(torch.empty(tokens, 25600, dtype=bf16),
                                            torch.empty(5120, 25600, dtype=torch.float8_e4m3fn),
                                            torch.empty(40, 200, dtype=f32))
        for vocab in (49152, 128256):
            scenario[0] = f"top-p / min-p, {vocab} vocabulary"
            triton_nucleus.nucleus_filter(torch.empty(4, vocab), torch.ones(4), torch.zeros(4))
            scenario[0] = f"top-k / top-p / min-p, {vocab} vocabulary"
            triton_nucleus.nucleus_filter(torch.empty(4, vocab), torch.ones(4), torch.zeros(4),
                                          torch.zeros(4, dtype=torch.int32))
        rows, k = torch.arange(4), torch.zeros(4, dtype=torch.int32)
        store, counts = torch.zeros(8, 256, dtype=torch.long), torch.zeros(8, 256, dtype=torch.long)
        rep = (k, store, rows, rows, torch.ones(4))
        out = (k, store, counts, rows, rows, torch.ones(4), torch.ones(4))
        for name, both in (("repetition", (rep, None)), ("presence / frequency", (None, out)), ("both", (rep, out))):
            scenario[0] = f"penalties, {name}"
            triton_penalties.apply_penalties(torch.empty(4, 49152), rows, *both)
        for dtype, k in ((torch.float32, 0), (torch.float32, 20), (torch.float64, 5)):
            scenario[0] = f"logprob table, {dtype}, {k} alternatives"
            triton_logprobs.logprob_table(torch.empty(4, 49152), rows, rows, k, dtype)
    return launches


def compile_launch(launch: Launch, target: GPUTarget) -> Any:
    """Compile as the JIT would: ints equal to 1 become constants, 16-divisible values get hints, but
    for the kernel's ``do_not_specialize`` arguments."""
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    # Recorded on the CPU, where bfloat16 dots are widened for the interpreter; a GPU never widens.
    args = launch.args | ({"WIDEN_DOT": False} if "WIDEN_DOT" in launch.args else {})
    for i, param in enumerate(launch.fn.params):
        value = args[param.name]
        if param.is_constexpr:
            kind, hint = "constexpr", None
        else:
            kind, hint = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                                not param.do_not_specialize_on_alignment)
        if kind == "constexpr":
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        else:
            signature[param.name] = kind
            if hint == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options(dict(launch.options))
    src = ASTSource(fn=launch.fn, constexprs=constexprs, signature=signature, attrs=attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def resource_usage(cubin: bytes) -> str:
    """Registers / local memory (spills) per thread, from ``cuobjdump`` when Triton ships one."""
    tool = shutil.which("cuobjdump") or str(
        __import__("pathlib").Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        except OSError:
            return "?"
    for line in out.splitlines():
        if "REG:" in line:
            fields = dict(part.split(":", 1) for part in line.split() if ":" in part)
            return f"regs={fields.get('REG')} local={fields.get('LOCAL')} shared={fields.get('SHARED')}"
    return "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="SM version, e.g. 80, 89 or 90")
    args = parser.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    for launch in record_launches():
        name = f"{launch.scenario}: {launch.fn.__name__}"
        if "fp8" in launch.scenario and args.arch < 89:  # the engine refuses an 8-bit cache there
            print(f"skip {name} (float8 conversions need sm89 or later)")
            continue
        limit = SHARED_MEMORY_LIMIT.get(args.arch)
        try:
            compiled = compile_launch(launch, target)
            # What ``launch_fitting`` does at run time, where Triton refuses a tile the GPU cannot hold.
            while limit and compiled.metadata.shared > limit and launch.args.get("BLOCK_N", 0) > 16:
                launch = replace(launch, args=launch.args | {"BLOCK_N": launch.args["BLOCK_N"] // 2})
                compiled = compile_launch(launch, target)
        except Exception as exc:  # report every kernel, not just the first failure
            failures += 1
            print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:2000]}")
            continue
        shared = compiled.metadata.shared
        tile = f" BLOCK_N={launch.args['BLOCK_N']}" if "BLOCK_N" in launch.args else ""
        usage = f"{resource_usage(compiled.asm['cubin'])}, shared memory {shared} B{tile}"
        if limit and shared > limit:
            failures += 1
            print(f"FAIL {name}: needs {shared} B of shared memory, sm{args.arch} gives a program {limit} ({usage})")
            continue
        print(f"ok   {name} ({usage})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
