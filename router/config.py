"""Router settings: one small dataclass, filled from the command line by ``router.main``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.lora_modules import LoRAModule
from common.protocol import MAX_IMAGES_PER_PROMPT
from common.sampling_params import MAX_N
from router import harmony
from router.images import DEFAULT_MAX_IMAGES_PER_PROMPT, ModelImages
from router.pooling import PoolingConfig
from router.reasoning import REASONING_PARSERS
from router.routing import POLICIES
from router.sampling_defaults import SamplingDefaults
from router.tool_parsers import PARSERS

if TYPE_CHECKING:
    from common.cluster_key import ClusterKey

# Two million tokens: any one prompt with the largest n (16) and no max_tokens fits a 128k context.
DEFAULT_MAX_TOTAL_TOKENS_PER_REQUEST = MAX_N * 131072


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for. Past a limit the request gets a 400 that names the flag.

    The defaults follow vLLM's server settings where it has one (1024 completion prompts, 4 stop
    strings, which is also OpenAI's documented limit); ``max_n`` cannot exceed what the engines
    accept (``MAX_N``).
    """

    max_prompts_per_request: int = 1024
    max_n: int = MAX_N
    max_stop_strings: int = 4
    max_stop_string_chars: int = 256
    # n x prompts x max_tokens: the most output tokens one request may ask for; 0 means unlimited.
    max_total_tokens_per_request: int = DEFAULT_MAX_TOTAL_TOKENS_PER_REQUEST
    # Whether a request may carry a ``priority``: the engines run ``--scheduling-policy priority``.
    priority_scheduling: bool = False
    # Images one prompt may hold (vLLM's ``--limit-mm-per-prompt '{"image": N}'``), for a model that takes them.
    max_images_per_prompt: int = DEFAULT_MAX_IMAGES_PER_PROMPT

    def __post_init__(self) -> None:
        for name in ("max_prompts_per_request", "max_stop_strings", "max_stop_string_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not 1 <= self.max_n <= MAX_N:
            raise ValueError(f"max_n must be between 1 and {MAX_N}")
        if self.max_total_tokens_per_request < 0:
            raise ValueError("max_total_tokens_per_request must be 0 (unlimited) or positive")
        if not 0 <= self.max_images_per_prompt <= MAX_IMAGES_PER_PROMPT:
            raise ValueError(f"max_images_per_prompt must be between 0 and {MAX_IMAGES_PER_PROMPT}")


@dataclass
class RouterConfig:
    served_model_names: list[str]
    redis_url: str | None = "redis://127.0.0.1:6379/0"
    namespace: str = "pdserve"
    api_keys: list[str] = field(default_factory=list)
    routing_policy: str = "prefix"
    prefix_alpha: float = 0.5
    kv_weight: float = 1.0
    max_body_bytes: int = 8 << 20
    max_inflight: int = 1024  # HTTP requests being served at once; 0 means unlimited
    # Fair admission (router/admission.py): engine requests (one per prompt, with its n choices) this router keeps out at
    # each decode instance at once; more wait in its fair queue, bounded by the next two. The
    # defaults let any request within ``RequestLimits`` into an empty queue.
    max_requests_per_instance: int = 256
    max_waiting_requests: int = 16384
    max_queued_tokens: int = 1 << 22
    request_timeout_s: float = 120.0  # longest wait for the next output of an engine request
    # An instance holding a request that sends no progress for this long is taken for dead and its
    # requests continue elsewhere (longer than the slowest engine step).
    engine_stall_timeout_s: float = 10.0
    reply_host: str = "127.0.0.1"  # the host engines use to reach the router's reply socket
    reply_port: int = 0  # 0: any free port
    # Prompts shorter than this go straight to a decode instance; 0 means "one block", -1 never.
    direct_prompt_tokens: int = 0
    refresh_interval_s: float = 0.5
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Authenticates the control and reply sockets and the registry entries (None: open, loopback).
    cluster_key: ClusterKey | None = None
    # How tool calls are read out of the chat template's format (``router/tool_parsers.py``; ``openai``: gpt-oss's
    # harmony format, ``router/harmony.py``); None: tool_choice "auto" is refused.
    tool_call_parser: str | None = None
    # How a reasoning model's thinking is split from its answer (``router/reasoning.py``); None: not.
    reasoning_parser: str | None = None
    # How long a stored Responses API response is kept (``router/response_store.py``); 0: none is.
    response_ttl_s: int = 3600
    # The Redis that keeps them; None: ``redis_url``'s.
    response_store_url: str | None = None
    # LoRA adapters the engines serve (their ``--lora-modules``): a request naming one as its model runs
    # with it; listed by /v1/models under the base model.
    lora_modules: list[LoRAModule] = field(default_factory=list)
    # vLLM's runtime LoRA updating: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (``router.lora_admin``).
    allow_runtime_lora_updating: bool = False
    # How POST /v1/embeddings pools and normalizes (``router.pooling``): the model folder's
    # sentence-transformers config, else the last token, normalized.
    pooling: PoolingConfig = field(default_factory=PoolingConfig)
    # What a request that leaves a sampling parameter unset samples with: the model's generation config's
    # recommendations (``router.sampling_defaults``; vLLM's ``--generation-config``), else OpenAI's defaults.
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # The model's architecture where its checkpoint is a base model without an output head (an embedding
    # model, ``common.model.loader.headless_architecture``): it serves /v1/embeddings only.
    headless_architecture: str | None = None
    # What the model does with a chat message's images (``router.images``): its processor where the engines
    # take them, else why they are refused.
    images: ModelImages = field(default_factory=ModelImages)
    # The model's identity (``common.model.loader.model_identity``): instances registered with another config
    # are ignored, never sent this model's requests. None: any instance's (a router before stand-ins).
    model_identity: str | None = None

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is required")
        clash = sorted({m.name for m in self.lora_modules} & set(self.served_model_names))
        if clash:
            raise ValueError(f"LoRA adapter name(s) {', '.join(clash)} are also served model names")
        if self.routing_policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        for name in ("max_requests_per_instance", "max_waiting_requests", "max_queued_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be positive")
        if self.engine_stall_timeout_s <= 0:
            raise ValueError("engine_stall_timeout_s must be positive")
        if self.tool_call_parser is not None and self.tool_call_parser not in (*PARSERS, harmony.TOOL_CALL_PARSER):
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, {harmony.TOOL_CALL_PARSER}")
        if self.response_ttl_s < 0:
            raise ValueError("response_ttl_s must be 0 (store nothing) or positive")
        if self.reasoning_parser is not None and self.reasoning_parser not in (*REASONING_PARSERS,
                                                                                harmony.REASONING_PARSER):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, {harmony.REASONING_PARSER}")
