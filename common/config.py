"""Engine configuration: one validated dataclass, flags named as vLLM names them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

import torch

from common.cli import HF_OVERRIDES_HELP, hf_overrides_arg, json_object
from common.lora_modules import LoRAModule, lora_module_arg

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The KV cache's dtype: the model's ("auto"), or 8-bit floats (e4m3 or e5m2, scale 1), as vLLM names them.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GiB' or a plain byte count -> bytes."""
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """``--speculative-config`` as vLLM reads it, for the one method built here: n-gram (prompt lookup)
    drafts, verified by the model in the step that decodes (``common.engine.spec_decode``).

    ``prompt_lookup_min`` / ``prompt_lookup_max``: the shortest and longest suffix of a request's tokens
    looked up earlier in them; one of the two given, the other takes its value; neither, both are 5
    (vLLM's defaults). ``disable_by_batch_size``: no drafts in a step whose running batch holds at least
    that many requests (0: always drafts), where a step is compute-bound and drafts the model rejects
    cost their compute."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 0

    @classmethod
    def parse(cls, value: str | dict[str, Any]) -> SpeculativeConfig:
        """From the flag's JSON (or a dict); ``ValueError`` naming what is not implemented or invalid."""
        if isinstance(value, str):
            value = json_object(value, "--speculative-config")
        if not isinstance(value, dict):
            raise ValueError("--speculative-config must be a JSON object")
        fields_ = {name: v for name, v in value.items() if v is not None}  # null: unset, as vLLM reads it
        method = fields_.pop("method", None)
        if method != "ngram":
            built = " (n-gram drafts from the request's own tokens)"
            if isinstance(method, str):  # eagle, eagle3, medusa, draft_model, mtp, suffix...
                raise ValueError(f"speculative method {method!r} is not implemented; only 'ngram'{built}")
            raise ValueError(f"--speculative-config needs \"method\": \"ngram\"{built}")
        unknown = sorted(set(fields_) - {"num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                                         "disable_by_batch_size"})
        if unknown:
            raise ValueError(f"speculative config field(s) {', '.join(unknown)} not implemented for ngram")
        for name, v in fields_.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative config {name} must be a positive integer, got {v!r}")
        k = fields_.get("num_speculative_tokens")
        if k is None:
            raise ValueError("speculative config needs num_speculative_tokens")
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens {k} exceeds {MAX_SPECULATIVE_TOKENS}")
        low, high = fields_.get("prompt_lookup_min"), fields_.get("prompt_lookup_max")
        low = low if low is not None else high if high is not None else 5
        high = high if high is not None else low
        if low > high:
            raise ValueError(f"prompt_lookup_min {low} exceeds prompt_lookup_max {high}")
        return cls("ngram", k, low, high, fields_.get("disable_by_batch_size", 0))


# Adapter ranks a ``--max-lora-rank`` may allow (vLLM's largest is 512).
MAX_LORA_RANK = 512
# Ranks one engine may split its model over (the GPUs of one host).
MAX_TENSOR_PARALLEL_SIZE = 64


@dataclass
class EngineConfig:
    model: str | None = None
    # vLLM's ``--hf-overrides``: keys set over the model's config.json (``common.model.loader.overridden_model``).
    hf_overrides: dict[str, Any] | None = None
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    # vLLM's ``--quantization``: the checkpoint's quantization method, checked against its config (the
    # weights are read as the config says either way; ``common.model.quantization.check_quantization``).
    quantization: str | None = None
    block_size: int = 16
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # > 0: at most this many prompt tokens per request per step
    kv_cache_memory: int = 1 << 30  # bytes for the KV cache on the CPU
    # vLLM's ``--kv-offloading-size``: GiB of host memory for the prefix cache's second tier (all ranks together;
    # 0: none), ``common/kvcache/host_tier.py``; ``--kv-offloading-backend``: only vLLM's ``native``.
    kv_offloading_size: float = 0.0
    kv_offloading_backend: str = "native"
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # overrides both sizings (tests, benchmarks)
    kernel_backend: str | None = None  # "torch" | "triton"; default by device
    enforce_eager: bool = False  # no CUDA graphs for decode steps (see common.engine.cuda_graphs)
    # Schedule step N+1 while step N runs (see ``LLMEngine.step``).
    async_scheduling: bool = False
    # The order waiting requests are taken in, and preempted (``common.engine.waiting_queue``).
    scheduling_policy: str = "fcfs"
    # Draft tokens verified each decode step (``SpeculativeConfig``; the flag's JSON is parsed here).
    speculative_config: SpeculativeConfig | str | None = None
    # LoRA adapters served beside the base model (``common.model.lora``), each under its own name.
    enable_lora: bool = False
    lora_modules: tuple[LoRAModule, ...] = ()
    max_loras: int | None = None  # adapters in one batch; every adapter is resident: at least their number
    max_lora_rank: int = 16
    # Ranks the model is split over (``common.engine.tensor_parallel``): this process and size - 1 workers.
    tensor_parallel_size: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: no limit)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        if not self.kv_offloading_size >= 0 or self.kv_offloading_size == float("inf"):
            raise ValueError(f"kv_offloading_size must be a finite number of GiB >= 0, got {self.kv_offloading_size}")
        if self.kv_offloading_backend != "native":
            raise ValueError(f"--kv-offloading-backend {self.kv_offloading_backend!r} is not implemented; only "
                             "native (this engine's own host tier of the prefix cache)")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("--kv-offloading-size needs prefix caching: the host tier holds cached blocks by "
                             "their hashes (drop --no-enable-prefix-caching)")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not implemented; "
                             f"expected one of {', '.join(KV_CACHE_DTYPES)}")
        if isinstance(self.speculative_config, str):
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and self.async_scheduling:
            raise ValueError("--speculative-config with --async-scheduling is not implemented: a step's "
                             "accepted drafts decide the next step's inputs; use one or the other")
        self.lora_modules = tuple(self.lora_modules or ())
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules: a name given twice in {names}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_lora_rank must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}")
        if self.max_loras is not None and self.max_loras < max(1, len(names)):
            # Adapters are not swapped in and out of the device: every one served holds a slot.
            raise ValueError(f"--max-loras {self.max_loras} is below the {len(names)} adapters of --lora-modules, "
                             "each of which stays resident (swapping adapters in and out is not implemented)")

        if not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL_SIZE:
            raise ValueError(f"tensor_parallel_size must be in [1, {MAX_TENSOR_PARALLEL_SIZE}], "
                             f"got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.enable_lora:
            raise ValueError("--enable-lora with --tensor-parallel-size > 1 is not implemented: adapters "
                             "adapt whole projections, which each rank holds a share of")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed ``speculative_config`` (``__post_init__`` parsed any string)."""
        assert not isinstance(self.speculative_config, str)
        return self.speculative_config

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    @property
    def torch_kv_cache_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, *, include_seed: bool = True) -> None:
        d = EngineConfig()
        parser.add_argument(
            "--model", default=None,
            help="checkpoint folder, .gguf or Hugging Face id (org/name); default SmolLM2-135M-Instruct",
        )
        parser.add_argument("--hf-overrides", default=None, type=hf_overrides_arg, metavar="JSON",
                            help=HF_OVERRIDES_HELP)
        parser.add_argument("--device", default=d.device)
        parser.add_argument("--dtype", default=d.dtype, choices=["auto", *_DTYPES])
        parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                            help="the KV cache's dtype: the model's (auto), or fp8 (= fp8_e4m3: scale 1, K and V "
                            "saturated at +-448), or fp8_e5m2 (scale 1, saturated at +-57344: more range, "
                            "less precision): half a 16-bit cache's memory, so twice the tokens; attention "
                            "still runs in the model's dtype. Prefill and decode must agree")
        parser.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                            help="the checkpoint's quantization (fp8, gptq, awq, compressed-tensors, mxfp4; "
                            "vLLM's gptq_marlin and awq_marlin name the same checkpoints): checked against its "
                            "config, which decides either way; quantizing an unquantized model is not implemented")
        parser.add_argument("--block-size", type=int, default=d.block_size)
        parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
        parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument(
            "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching
        )
        parser.add_argument(
            "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=d.enable_chunked_prefill
        )
        parser.add_argument(
            "--long-prefill-token-threshold",
            type=int,
            default=d.long_prefill_token_threshold,
            help="prefill at most this many tokens of one prompt per step, so short prompts are not "
            "held up behind a long one (0: no limit; needs chunked prefill, ignored without it)",
        )
        parser.add_argument("--kv-cache-memory", type=parse_size, default=d.kv_cache_memory,
                            help="KV cache size on the CPU, e.g. 512M, 2G")
        parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
        parser.add_argument("--kv-offloading-size", type=float, default=d.kv_offloading_size, metavar="GIB",
                            help="GiB of host memory (all tensor-parallel ranks together) for a second tier of "
                            "the prefix cache, as vLLM's flag: a cached block the KV cache takes back for "
                            "another request is copied there first, and a later prompt that shares it loads it "
                            "back instead of computing it again (0: none)")
        parser.add_argument("--kv-offloading-backend", default=d.kv_offloading_backend, choices=["native"],
                            help="what holds the offloaded blocks: native (this engine's host memory)")
        parser.add_argument("--num-blocks", type=int, default=None, help="fixed number of KV blocks")
        parser.add_argument("--kernel-backend", default=None, choices=["torch", "triton"])
        parser.add_argument("--enforce-eager", action="store_true",
                            help="run every step eagerly: no CUDA graphs for decode steps (on a GPU they "
                            "are captured at start for batch sizes 1, 2, 4, 8, 16, 32, ... up to "
                            "--max-num-seqs or 512)")
        parser.add_argument("--async-scheduling", action="store_true",
                            help="schedule and prepare each step while the device still runs the one "
                            "before (its sampled ids feed the next step's inputs on the device); a "
                            "step's tokens then leave one step later")
        parser.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=["fcfs", "priority"],
                            help="fcfs: requests in arrival order; priority: by each request's priority "
                            "(lower first, then arrival), and under memory pressure the running request "
                            "of the highest value is preempted first")
        parser.add_argument(
            "--speculative-config", default=None, type=_speculative_config_arg,
            help='speculative decoding, as vLLM\'s flag: a JSON object, e.g. {"method": "ngram", '
            '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}. Each decode step '
            "proposes up to that many tokens by finding the request's last tokens earlier in its prompt "
            "and output, and the model checks them in the same forward: each position is sampled as a step "
            "of its own would sample it, and every draft it samples is one more token from the step (greedy "
            "and seeded outputs are unchanged). Requests with penalties, bad words or a grammar, and those "
            "short of min_tokens, decode a token per step. \"disable_by_batch_size\": N drafts nothing in a step "
            "whose running batch holds N requests or more (a compute-bound step pays for rejected drafts). "
            "Only ngram is implemented; not with --async-scheduling",
        )
        parser.add_argument("--enable-lora", action="store_true",
                            help="serve LoRA adapters (--lora-modules) beside the base model")
        parser.add_argument(
            "--lora-modules", nargs="+", default=None, type=lora_module_arg, metavar="NAME=PATH",
            help="PEFT LoRA adapters to serve, as vLLM's flag: name=path, or a JSON object "
            '{"name": ..., "path": ..., "base_model_name": ...}; a request selects one by its name as '
            "the model. Adapters on the attention and MLP projections of the dense layers; every one "
            "stays loaded on the device. Needs --enable-lora")
        parser.add_argument("--max-loras", type=int, default=None,
                            help="adapters in one batch (default: as many as --lora-modules; none is swapped "
                            "out, so not fewer)")
        parser.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                            help="the largest adapter rank served (the device holds every adapter at this rank)")
        parser.add_argument(
            "--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
            help="split the model over this many processes (GPUs from --device's on: cuda:0 and cuda:1 "
            "for 2), as vLLM's flag: each holds its share of the attention heads, KV heads and MLP "
            "widths, and of every KV block. The heads and widths must divide by it. On the CPU the "
            "ranks share one KV cache in shared memory, and a prefill hands its blocks to a decode "
            "of the same size; KV transfer from a tensor-parallel engine on GPUs is not implemented")
        if include_seed:
            parser.add_argument("--seed", type=int, default=d.seed, help="seed for requests without one")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def _speculative_config_arg(text: str) -> SpeculativeConfig:
    """``--speculative-config``, refused at parse time (exit 2, the reason named) when it is not built."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None

