"""``pdserve bench quantized-weights``: the memory a quantized checkpoint's weights take in the engine, packed (the
Triton kernels: ``common.model.packed_linear``) beside widened (the torch kernels) and beside the unquantized model,
in one process, and what the freed bytes would hold as KV blocks.

The model (the bundled SmolLM2 by default; ``--moe-stand-in``, a random-weight Qwen3-MoE of 128 experts, whose
experts are quantized one by one as quantizers write them) is quantized here, to GPTQ's layout (``--format gptq``: round to nearest,
asymmetric, ``--bits`` per value in groups of ``--group`` inputs, ``gptq_v2``, no reordering) or to block-wise FP8
(``--format fp8``: e4m3, a scale per ``--group`` x ``--group`` block, its largest magnitude over 448), then loaded
three ways on the CPU: its unquantized checkpoint, the quantized one widened, and the quantized one packed. The
packed model's logits over a prompt, its products computed by the torch reference (the Triton kernels' reference,
which the kernel tests hold them to), must equal the widened model's; the unquantized model's greedy choices over
the prompt show what the quantization itself changes.

    pdserve bench quantized-weights --format gptq --bits 4 --group 64 --json ops/bench/results/quantized-weights.json
    pdserve bench quantized-weights --moe-stand-in --format fp8 --group 64
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from common.model.quantization import pack_words

# The weights quantized: every projection of the decoder layers, a mixture's experts' one by one (as quantizers
# write them).
_QUANTIZED = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?(gate|up|down)_proj)\.weight$")


def unstack_experts(state: dict[str, torch.Tensor]) -> None:
    """In place: a mixture's experts stacked as transformers saves them (``experts.gate_up_proj`` ``[E, 2I, H]``,
    ``experts.down_proj`` ``[E, H, I]``) written one weight per expert and projection (``experts.<e>.gate_proj.weight``,
    ``up_proj``, ``down_proj``), as released mixtures and their quantizations hold them."""
    for name in [n for n in state if n.endswith(".experts.gate_up_proj")]:
        prefix = name.removesuffix(".gate_up_proj")
        for expert, (gate, up) in enumerate(w.chunk(2) for w in state.pop(name)):
            state[f"{prefix}.{expert}.gate_proj.weight"] = gate.contiguous()
            state[f"{prefix}.{expert}.up_proj.weight"] = up.contiguous()
        for expert, down in enumerate(state.pop(f"{prefix}.down_proj")):
            state[f"{prefix}.{expert}.down_proj.weight"] = down.contiguous()


def _layers(state: dict[str, torch.Tensor], group: int) -> list[str]:
    """The weights of ``state`` to quantize (every projection of the decoder layers), each checked to split into
    groups of ``group`` inputs."""
    names = [n for n in state if _QUANTIZED.search(n)]
    for name in names:
        if state[name].shape[1] % group:
            raise SystemExit(f"--group {group} does not divide {name}'s {state[name].shape[1]} inputs")
    return names


def quantize_gptq(state: dict[str, torch.Tensor], bits: int, group: int) -> dict[str, Any]:
    """``state``'s projections in GPTQ's layout (v2: zero points as they are), round to nearest, asymmetric; the
    ``quantization_config`` that says so."""
    for name in _layers(state, group):
        weight = state.pop(name)
        rows, inputs = weight.shape
        w = weight.float().reshape(rows, inputs // group, group)
        low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = ((high - low) / ((1 << bits) - 1)).clamp(min=1e-8).to(torch.float16)
        zeros = torch.round(-low / scales.float()).clamp(0, (1 << bits) - 1)
        q = torch.clamp(torch.round(w / scales.float()[..., None]) + zeros[..., None], 0, (1 << bits) - 1)
        prefix = name.removesuffix(".weight")
        state[prefix + ".qweight"] = pack_words(q.reshape(rows, inputs), bits).T.contiguous()  # [in * bits / 32, out]
        state[prefix + ".qzeros"] = pack_words(zeros.to(torch.int64).T.contiguous(), bits)  # [groups, out * bits / 32]
        state[prefix + ".scales"] = scales.T.contiguous()  # [groups, out]
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False, "sym": False,
            "checkpoint_format": "gptq_v2"}


def quantize_fp8(state: dict[str, torch.Tensor], block: int) -> dict[str, Any]:
    """``state``'s projections as block-wise FP8 checkpoints hold them: e4m3, a scale per ``block x block`` (its
    largest magnitude over 448, ``weight_scale_inv``); the ``quantization_config`` that says so."""
    for name in _layers(state, block):
        weight = state[name]
        rows, cols = weight.shape
        if rows % block:
            raise SystemExit(f"--group {block} does not divide {name}'s {rows} outputs")
        blocks = weight.float().reshape(rows // block, block, cols // block, block)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
        state[name] = (blocks / scale[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
        state[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block]}


def quantize(source: Path, target: Path, args: argparse.Namespace) -> int:
    """``source``'s checkpoint written to ``target`` in ``args.format``; the number of weights quantized."""
    from safetensors.torch import load_file, save_file

    state = {name: tensor for file in sorted(source.glob("*.safetensors")) for name, tensor in load_file(str(file)).items()}
    unstack_experts(state)
    count = len(_layers(state, args.group))
    config_fields = quantize_gptq(state, args.bits, args.group) if args.format == "gptq" else quantize_fp8(state, args.group)
    target.mkdir(parents=True, exist_ok=True)
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    for extra in source.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name != "config.json":
            shutil.copy(extra, target / extra.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = config_fields
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return count


def _bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _products(model: torch.nn.Module) -> tuple[int, int]:
    """How many products over the layers' weights ``model`` computes (each projection; a mixture's experts' two
    stacks), and how many of them hold their weights packed."""
    from common.model.llama import Experts
    from common.model.packed_linear import Fp8Linear, IntLinear

    total = packed = 0
    for name, module in model.named_modules():
        if isinstance(module, (IntLinear, Fp8Linear)) or (isinstance(module, torch.nn.Linear) and name.endswith("_proj")):
            total, packed = total + 1, packed + isinstance(module, (IntLinear, Fp8Linear))
        elif isinstance(module, Experts):
            total, packed = total + len(Experts.PROJECTIONS), packed + len(module.bits) + len(module.fp8)
    return total, packed


def _source(args: argparse.Namespace) -> Path:
    """The checkpoint to quantize: ``--model``, or the mixture's stand-in the GPU benchmark's engine section runs."""
    from common.model.loader import cache_dir, resolve_model_path

    if not args.moe_stand_in:
        return resolve_model_path(args.model)
    from ops.bench.gpu_kernels import moe_stand_in

    return moe_stand_in(cache_dir() / "stand-in-qwen3-moe-128-experts")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from common.model.llama import AttentionMetadata
    from common.model.loader import resolve_model_path
    from common.model.weights import load_hf_config, load_model
    from pdserve_kernels import reference, triton_ops

    dtype = getattr(torch, args.dtype)
    source = _source(args)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / args.format
        layers = quantize(source, folder, args)
        cpu = torch.device("cpu")
        models = {"unquantized": load_model(source, load_hf_config(source), reference, dtype, cpu),
                  "widened": load_model(folder, load_hf_config(folder), reference, dtype, cpu),
                  "packed": load_model(folder, load_hf_config(folder), triton_ops, dtype, cpu)}
    products, packed = _products(models["packed"])
    for module in models["packed"].modules():  # every kernel the torch reference, on this CPU
        if hasattr(module, "kernels"):
            setattr(module, "kernels", reference)  # noqa: B010 - a module's attribute, not a tensor
    from transformers import AutoTokenizer

    text = ("The engine keeps a checkpoint's integer weights packed, four bits a value, and widens each tile of them "
            "as its product reads it. What a quantized model saves in memory is then saved on the GPU as well, and "
            "the key-value cache takes what the weights no longer need.")
    # A stand-in without a tokenizer: the default model's (whose vocabulary the stand-in's is).
    tokenizer = source if any(source.glob("tokenizer*")) else resolve_model_path(None)
    prompt = torch.tensor(AutoTokenizer.from_pretrained(str(tokenizer))(text)["input_ids"][: args.prompt_len])
    logits = {}
    for name, model in models.items():
        n, block = len(prompt), 16
        cache = torch.zeros(len(model.model.layers), 2, -(-n // block), block, model.num_kv_heads, model.head_size,
                            dtype=dtype)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n), block_tables=torch.arange(-(-n // block), dtype=torch.int32)[None],
            query_start_loc=torch.tensor([0, n], dtype=torch.int32), context_lens=torch.tensor([n], dtype=torch.int32),
            max_query_len=n)
        with torch.inference_mode():
            logits[name] = model.compute_logits(model(prompt, torch.arange(n), meta, cache)).float()
    head = models["unquantized"]
    block_bytes = len(head.model.layers) * 2 * 16 * head.num_kv_heads * head.head_size * torch.finfo(dtype).bits // 8
    sizes = {name: _bytes(model) for name, model in models.items()}
    return {
        "model": str(source.name), "dtype": args.dtype, "format": args.format,
        "bits": args.bits if args.format == "gptq" else 8, "group": args.group,
        "layers_quantized": layers, "products": products, "products_packed": packed, "bytes": sizes,
        "packed_vs_widened": round(sizes["packed"] / sizes["widened"], 4),
        "freed_bytes": sizes["widened"] - sizes["packed"],
        "freed_kv_blocks_of_16": (sizes["widened"] - sizes["packed"]) // block_bytes,
        "packed_equals_widened_max_abs": float((logits["packed"] - logits["widened"]).abs().max()),
        "quantized_vs_unquantized_greedy_agreement": float(
            (logits["widened"].argmax(-1) == logits["unquantized"].argmax(-1)).float().mean()),
        "prompt_len": len(prompt),
        "host": platform.node(), "date": dt.date.today().isoformat(), "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench quantized-weights", description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", default="gptq", choices=["gptq", "fp8"])
    parser.add_argument("--model", default=None, help="model folder or id (default: the bundled SmolLM2)")
    parser.add_argument("--moe-stand-in", action="store_true",
                        help="instead of --model, a random-weight Qwen3-MoE checkpoint (6 layers of 128 experts, 8 a "
                             "token, 256 wide; the GPU benchmark's mixture stand-in), its experts quantized one by one")
    parser.add_argument("--bits", type=int, default=4, choices=[2, 4, 8], help="GPTQ's bits per value")
    parser.add_argument("--group", type=int, default=64,
                        help="GPTQ: inputs per scale and zero point; FP8: a block's rows and columns")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--prompt-len", type=int, default=64, help="at most this many tokens of the prompt")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    result = run(args)
    mib = {name: round(n / 2**20, 1) for name, n in result["bytes"].items()}
    what = f"GPTQ {args.bits}-bit groups of {args.group}" if args.format == "gptq" else \
        f"FP8 blocks of {args.group} x {args.group}"
    print(f"{result['model']} {result['dtype']}, {what} "
          f"({result['layers_quantized']} projections quantized; {result['products_packed']} of the model's "
          f"{result['products']} products, q/k/v and gate/up stacked, a mixture's experts two, kept packed)")
    print(f"  weights: unquantized {mib['unquantized']} MiB | widened {mib['widened']} MiB | packed "
          f"{mib['packed']} MiB ({result['packed_vs_widened']:.2f}x of widened)")
    print(f"  freed: {result['freed_bytes'] / 2**20:.1f} MiB = {result['freed_kv_blocks_of_16']} KV blocks of 16 tokens")
    print(f"  packed logits vs widened: max |diff| {result['packed_equals_widened_max_abs']:.3g}; quantized greedy "
          f"agrees with unquantized at {result['quantized_vs_unquantized_greedy_agreement']:.1%} of positions")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    ok = result["packed_equals_widened_max_abs"] == 0.0 and result["products_packed"] == result["products"]
    return 0 if ok else 1
