"""Everything one router process holds, wired together; started and stopped by the app's lifespan."""

from __future__ import annotations

import logging

from common.registry import PrefixIndex, Registry, RuntimeAdapters
from router import harmony
from router.admission import RETRY_AFTER_S, Admission
from router.auth import ApiKeys
from router.background_responses import BackgroundResponses
from router.config import RouterConfig
from router.dispatcher import Dispatcher
from router.engine_client import EngineClient
from router.errors import APIError
from router.instance_pool import InstancePool
from router.metrics import RouterMetrics
from router.reasoning import REASONING_PARSERS
from router.reasoning_state import ReasoningSeal
from router.response_store import ResponseStore
from router.routing import make_policy
from router.tokenization import PromptProcessor
from router.tool_parsers import PARSERS

logger = logging.getLogger(__name__)


class RouterState:
    def __init__(self, config: RouterConfig, prompts: PromptProcessor) -> None:
        self.config = config
        self.prompts = prompts
        # Answers in gpt-oss's harmony format are read by their channels (``router/harmony.py``), whatever the parsers.
        self.harmony = harmony.check_parsers(prompts.template_text(), config.tool_call_parser, config.reasoning_parser)
        self.tool_parser = PARSERS.get(config.tool_call_parser or "")
        self.reasoning_parser = REASONING_PARSERS.get(config.reasoning_parser or "")
        # The parsers' tags that this tokenizer marks special (their answers keep special tokens' text).
        tags = [*(self.tool_parser.tags if self.tool_parser else ()),
                *(self.reasoning_parser.tags if self.reasoning_parser else ()), *(harmony.TAGS if self.harmony else ())]
        self.tags_lost_in_text = frozenset(prompts.lost_in_text(tuple(tags)))
        self.api_keys = ApiKeys(config.api_keys)
        self.registry = (
            Registry(config.redis_url, config.namespace, cluster_key=config.cluster_key) if config.redis_url else None
        )
        self.prefix_index = PrefixIndex(config.redis_url, config.namespace) if config.redis_url else None
        # The LoRA adapters loaded at run time, kept for engines that start later (``router.lora_admin``).
        self.runtime_adapters = (RuntimeAdapters(config.redis_url, config.namespace, config.cluster_key)
                                 if config.redis_url else None)
        store_url = config.response_store_url or config.redis_url
        self.responses = (
            ResponseStore(store_url, config.namespace, config.response_ttl_s, config.cluster_key)
            if store_url and config.response_ttl_s else None
        )
        self.background = BackgroundResponses()  # background responses this process runs
        self.reasoning_seal = ReasoningSeal(config.cluster_key)  # reasoning items' ``encrypted_content``
        self.client = EngineClient(config.reply_host, config.reply_port, config.cluster_key)
        self.pool = InstancePool(self.registry, self.client, config.refresh_interval_s, config.model_identity)
        self.num_inflight = 0
        self.metrics = RouterMetrics(
            self.pool.instances,
            lambda: self.num_inflight,
            lambda: self.registry.num_rejected_entries if self.registry is not None else 0,
        )
        self.client.observe_message = self.metrics.engine_message_seconds.observe
        if config.images.processor is not None:
            self.metrics.watch_image_cache(config.images.processor.cache)
        self.admission = Admission(
            lambda: config.max_requests_per_instance * len(self.pool.alive("decode")),
            config.max_waiting_requests,
            config.max_queued_tokens,
        )
        self.dispatcher = Dispatcher(
            self.client,
            self.pool,
            make_policy(config.routing_policy, config.prefix_alpha, config.kv_weight),
            self.prefix_index,
            self.metrics,
            request_timeout_s=config.request_timeout_s,
            direct_prompt_tokens=config.direct_prompt_tokens,
            stall_timeout_s=config.engine_stall_timeout_s,
        )

    async def start(self) -> None:
        await self.client.start()
        await self.pool.start()
        logger.info("router receiving engine outputs at %s", self.client.reply_address)

    async def stop(self) -> None:
        await self.background.stop()
        await self.pool.stop()
        await self.client.close()
        for redis_user in (self.registry, self.prefix_index, self.responses, self.runtime_adapters):
            if redis_user is not None:
                redis_user.close()

    def max_model_len(self) -> int:
        """The smallest context window the instances report, else the model's own."""
        return self.pool.max_model_len() or self.prompts.max_model_len

    def check_model(self, requested: str | None) -> str:
        """The served name to answer with; 404 for a model this router does not serve."""
        names = self.config.served_model_names
        if requested is None or requested in names or self.lora_name(requested) is not None:
            return requested or names[0]
        raise APIError(404, f"the model '{requested}' does not exist", param="model", code="model_not_found")

    def lora_name(self, model: str | None) -> str | None:
        """The LoRA adapter a request's model names (one of ``--lora-modules``, or one an instance says it
        serves: loaded at run time, or given to the engines only), None for the base model."""
        if model is None or model in self.config.served_model_names:
            return None
        return model if model in self.lora_names() else None

    def lora_names(self) -> list[str]:
        """The adapters this router names: its ``--lora-modules``, then those its live instances serve."""
        names = dict.fromkeys(m.name for m in self.config.lora_modules)
        for role in ("prefill", "decode"):
            for info in self.pool.alive(role):
                names.update(dict.fromkeys(info.lora_names))
        return list(names)

    def admit(self) -> None:
        """Count one more HTTP request in flight, or raise 429 past ``max_inflight``."""
        limit = self.config.max_inflight
        if limit and self.num_inflight >= limit:
            raise APIError(
                429, f"too many requests in flight (limit {limit}, --max-inflight); retry later",
                code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self.num_inflight += 1

    def leave(self) -> None:
        self.num_inflight -= 1
