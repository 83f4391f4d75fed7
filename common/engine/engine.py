"""The engine step loop: schedule, run the model, sample, retire; shared by every service.

``step()`` never blocks on anything but the forward pass. Requests with ``n > 1`` fork after the
prompt: child ``i`` has the id ``choice_request_id(request_id, i)`` and shares the prompt's blocks.
Disaggregated, the prefill instance samples every choice's first token and sends the prompt's KV
once; the decode instance forks the choices from it (``add_remote_request``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
from torch import Tensor

from common.config import EngineConfig
from common.engine.grammar import GrammarCache, GrammarState
from common.engine.host_tensors import long_tensor, to_host
from common.engine.model_runner import ModelRunner
from common.engine.request import FINISHED, Request, RequestStatus
from common.engine.sampler import NO_TOKEN_ERROR, SampledTokens, Sampler
from common.engine.scheduler import Scheduler, SchedulerOutput
from common.engine.spec_decode import NgramProposer, draft_rows
from common.glibc_env import set_malloc_thresholds
from common.kvcache.block_pool import KVBlock
from common.kvcache.hashing import BlockHash
from common.kvcache.kv_cache_manager import KVCacheManager
from common.lora_modules import LoRAModule
from common.model.loader import classifier_architecture, headless_architecture
from common.model.lora import LoRAManager
from common.protocol import (
    MAX_PROMPT_LOGPROB_ENTRIES,
    POOLING_KINDS,
    ImageInput,
    PositionLogprobs,
    PromptLogprob,
    choice_request_id,
)
from common.sampling_params import SamplingParams


@dataclass(frozen=True)
class KVHandoff:
    """A prefill-only request's KV, complete and held for a transfer until ``release_kv``.

    ``block_ids`` cover ``num_tokens`` (the prompt and any earlier output, not the token just
    sampled); ``block_hashes`` are those of its full blocks (the receiver's prefix-cache keys).
    """

    block_ids: list[int]
    block_hashes: list[BlockHash]
    num_tokens: int
    # Receiving side: leading blocks that already hold this KV (prefix-cache hits), not sent; the first
    # ``num_released_blocks`` of them are out of a sliding window, not held (placeholder ids).
    num_cached_blocks: int = 0
    num_released_blocks: int = 0
    # Sending side, n > 1: every choice's first token, in choice order.
    choice_token_ids: list[int] = field(default_factory=list)
    # Sending side, on a GPU: a CUDA event after which the blocks hold the KV (recorded when the step
    # that wrote it was sampled). With async scheduling the hand-off is built a step later, after the
    # next step was queued: a transfer that waited for the stream's end would wait for that one too.
    ready: Any | None = None


@dataclass(slots=True)
class EngineOutput:
    request_id: str
    new_token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    # A prefill-only request whose KV is complete and held for a transfer (see ``release_kv``).
    kv_handoff: KVHandoff | None = None
    # With the first token, when asked for (``SamplingParams.prompt_logprobs``).
    prompt_logprobs: list[PromptLogprob | None] | None = None
    # On a request's first token: seconds queued before its first schedule, and from then to the token.
    queue_time: float | None = None
    prefill_time: float | None = None
    # A pooling request's end: its pooled hidden state, float32 little-endian (``GenerateRequest.pooling``).
    embedding: bytes | None = None


@dataclass
class EngineStats:
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_tokens_held: int = 0
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class _Launched:
    """A step whose sampling is queued: its sampled rows' requests (in row order) and their tokens
    on the way to the host."""

    requests: list[Request]
    sampled: SampledTokens
    # Prefill of an n > 1 request whose KV is transferred: its other choices, sampled here only.
    sampled_only: dict[str, list[Request]]
    # Async scheduling: the requests that hold a placeholder for their token of this step.
    placeholders: list[Request] = field(default_factory=list)
    # The runner's step count after this step's forward (``ModelRunner.flush_prompt_logprobs``).
    step: int = 0
    # Speculative decoding: per decode with drafts, its first row and its drafts (its rows follow).
    drafts: dict[int, Sequence[int]] = field(default_factory=dict)


logger = logging.getLogger(__name__)

# A transfer may be reading or writing these requests' blocks: only ``release_kv`` frees them.
_TRANSFER_STATES = (RequestStatus.HELD_FOR_TRANSFER, RequestStatus.WAITING_FOR_REMOTE_KV)
NOT_FINITE_ERROR = "the model's logits for this request were not finite (NaN or infinity)"
NOT_FINITE = -1  # the sampled id of a row whose logits were not finite (``SampledTokens.result``)
# ``EngineStats.extra``'s keys of the drafts kept per position: this, a colon, the position (vLLM's name).
SPEC_PER_POS = "spec_decode_num_accepted_tokens_per_pos"
# ``EngineStats.extra`` keys ``lora_requests:<running|waiting>:<adapter>``: requests with each LoRA adapter.
LORA_REQUESTS = "lora_requests"

_FINISHED = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "error": RequestStatus.FINISHED_ERROR,
}


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        # Weights and KV cache in place: from now on large buffers come back step after step.
        set_malloc_thresholds()
        self.model_id = self.runner.model_id
        self.block_size = config.block_size
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.vocab_size
        # A base model saved without its output head serves pooling requests only (``headless_architecture``).
        self.headless = headless_architecture(self.runner.hf_config)
        self.classifier = classifier_architecture(self.runner.hf_config)  # a score head: pooling "classify"
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                 sliding_window=self.runner.kv_window, num_host_blocks=self.runner.num_host_blocks)
        self.kv.keep_freed = config.async_scheduling
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=config.scheduling_policy,  # type: ignore[arg-type]
        )
        self.eos_token_ids = self._eos_token_ids()
        self.sampler = Sampler(self.eos_token_ids, config.seed, self.runner.kernel_backend)
        self.sampler.warm_up(self.runner.device, self.vocab_size)
        # Structured output; the tokenizer loads with the first grammar.
        # (A function of the path, not a bound method: the cache does not hold the engine.)
        self.grammars = GrammarCache(
            functools.partial(_load_tokenizer, str(self.runner.model_path)), self.vocab_size,
            sorted(self.eos_token_ids),
        )
        self._pending: list[EngineOutput] = []
        self._in_flight: _Launched | None = None  # async scheduling: the step whose tokens are on their way
        # Called with the ids of the requests a step runs for the first time, before its forward:
        # a process that dies in that forward has told whoever listens which requests it was running.
        self.on_started: Callable[[list[str]], None] | None = None
        # Decode side, n > 1: first tokens of choices 1.. per request waiting for remote KV, and
        # the choices aborted before they exist; they fork when the KV has arrived.
        self._remote_choices: dict[str, list[int]] = {}
        self._aborted_choices: dict[str, set[int]] = {}
        self.peak_kv_tokens_held = 0
        self.peak_kv_slots_allocated = 0
        spec = config.speculative
        self.proposer = None if spec is None else NgramProposer(spec, self.max_model_len)
        # Speculative decoding, counted as vLLM counts it: decodes with drafts, draft tokens, and those
        # the model agreed with.
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        # Per draft position (0: a step's first draft), the drafts kept there: where acceptance falls off.
        self.spec_accepted_per_pos = [0] * (0 if spec is None else spec.num_speculative_tokens)

    def close(self) -> None:
        """Stop what the engine started beside its own process (a tensor-parallel engine's other ranks)."""
        self.runner.close()

    def _eos_token_ids(self) -> set[int]:
        """EOS ids from the model config and, where the checkpoint has one, its generation config."""
        sources = [getattr(self.runner.hf_config, "eos_token_id", None)]
        # Only where the file is (no "not found" error to raise and catch on every start).
        if (Path(self.runner.model_path) / "generation_config.json").exists():
            try:
                from transformers import GenerationConfig

                sources.append(GenerationConfig.from_pretrained(str(self.runner.model_path)).eos_token_id)
            except (OSError, ValueError):
                pass
        ids: set[int] = set()
        for eos in sources:
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
        # An id outside the vocabulary can never be sampled: kept, it would index past the logits where
        # min_tokens bans EOS (on a GPU a device-side assert, which ends the engine's CUDA context).
        outside = sorted(i for i in ids if not 0 <= i < self.vocab_size)
        if outside:
            logger.warning("EOS token ids %s of the model's config are outside its vocabulary of %d; ignored",
                           outside, self.vocab_size)
        return ids.difference(outside)

    def _grammar(self, params: SamplingParams, output_token_ids: list[int]) -> GrammarState | None:
        """The request's grammar state after its ``output_token_ids`` (a resumed request, or one whose
        first tokens were sampled elsewhere replays them); ``ValueError`` if they leave the grammar."""
        if params.structured_output is None:
            return None
        return self.grammars.new_state(params.structured_output, output_token_ids)

    # ----------------------------------------------------------------- requests in
    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, output_token_ids: list[int] | None = None
    ) -> None:
        """Raise ``ValueError`` naming the bad field; does nothing for a valid request."""
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        outputs = output_token_ids or []
        for name, ids in (("prompt", prompt_token_ids), ("output", outputs)):
            if not _ids_in_range(ids, self.vocab_size):
                raise ValueError(f"{name} token ids must be integers in [0, {self.vocab_size})")
        num_tokens = len(prompt_token_ids) + len(outputs)
        if num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt ({num_tokens} tokens) is too long: max_model_len is {self.max_model_len}"
            )
        params.validate(self.vocab_size)
        if params.priority != 0 and self.scheduler.policy != "priority":
            raise ValueError("priority needs the engine's --scheduling-policy priority")
        if params.prompt_logprobs is not None and not outputs:
            entries = len(prompt_token_ids) * (1 + params.prompt_logprobs)
            if entries > MAX_PROMPT_LOGPROB_ENTRIES:
                raise ValueError(
                    f"prompt_logprobs: {len(prompt_token_ids)} prompt tokens x {1 + params.prompt_logprobs} "
                    f"entries exceed {MAX_PROMPT_LOGPROB_ENTRIES}"
                )
        if len(outputs) >= params.max_tokens:
            raise ValueError(f"{len(outputs)} output tokens already reach max_tokens {params.max_tokens}")

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        kv_transfer: bool = False,
        arrival_time: float | None = None,
        output_token_ids: list[int] | None = None,
        lora_name: str | None = None,
        pooling: str | None = None,
        images: list[ImageInput] | None = None,
    ) -> None:
        """Queue a request; raises ``ValueError`` (nothing queued) when the input is bad.

        ``output_token_ids``: tokens the request already produced on a lost instance; it resumes
        after them (see ``GenerateRequest.output_token_ids``). ``lora_name``: the LoRA adapter to
        run it with (one of ``--lora-modules``), None for the base model. ``pooling``: no token, but in
        ``EngineOutput.embedding`` the prompt's last hidden state ("last": an embedding) or a sequence
        classifier's logits of it ("classify")."""
        if pooling is not None:
            _check_pooling(pooling, params, kv_transfer, output_token_ids)
            if pooling == "classify" and self.classifier is None:
                raise ValueError(f"pooling 'classify': the model ({self.headless or 'a causal LM'}) has no "
                                 "classification head (only a ...ForSequenceClassification checkpoint has)")
        elif self.headless is not None:
            raise ValueError(f"the model ({self.headless}, without a language-model output head) serves pooling "
                             "requests only")
        self.validate(prompt_token_ids, params, output_token_ids)
        lora_slot = self.lora_slot(lora_name)
        if params.n != 1 and output_token_ids:
            raise ValueError("n must be 1 for a continued request")
        if self.knows(request_id):
            raise ValueError(f"duplicate request_id {request_id!r}")
        req = Request(
            request_id, prompt_token_ids, params, block_size=self.block_size, model_id=self.model_id,
            cache_salt=cache_salt, arrival_time=arrival_time, kv_transfer=kv_transfer,
            output_token_ids=output_token_ids, lora_name=lora_name, lora_slot=lora_slot, pooling=pooling,
            images=images,
        )
        self.runner.check_images(req)
        req.grammar = self._grammar(params, req.output_token_ids)
        if params.prompt_logprobs is not None and not req.output_token_ids:  # a continuation sent them
            req.prompt_logprobs = [None]
        self.scheduler.add(req)

    def lora_slot(self, lora_name: str | None) -> int:
        """The runner's slot of a LoRA adapter (-1 for None: the base model); ``ValueError`` for one this
        engine does not serve."""
        return -1 if lora_name is None else self._lora(f"LoRA adapter {lora_name!r} requested, but").slot(lora_name)

    def _lora(self, what: str) -> LoRAManager:
        """The runner's adapters; ``ValueError`` (``what`` first) where this engine serves none."""
        if self.runner.lora is None:
            raise ValueError(f"{what} this engine serves none (--enable-lora --lora-modules)")
        return self.runner.lora

    def load_lora(self, module: LoRAModule) -> None:
        """Load a LoRA adapter at run time into a free slot (``--max-loras``); ``ValueError`` naming why
        not (nothing changed)."""
        self._lora("cannot load a LoRA adapter:").load(module)

    def unload_lora(self, name: str) -> None:
        """Unload a LoRA adapter; ``ValueError`` for one not loaded, or one a request here still has."""
        lora = self._lora("cannot unload a LoRA adapter:")
        using = sum(r.lora_name == name for r in self.scheduler.requests.values())
        if using:
            raise ValueError(f"LoRA adapter {name!r} is in use by {using} request(s) here; unload it when they end")
        lora.unload(name)

    def knows(self, request_id: str) -> bool:
        """The id is in use here: queued, running, held for a transfer or receiving one."""
        return request_id in self.scheduler.requests or request_id in self.kv.req_blocks

    def add_remote_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_id: int,
        params: SamplingParams,
        *,
        num_cached_tokens: int = 0,
        cache_salt: str | None = None,
        output_token_ids: list[int] | None = None,
        choice_token_ids: list[int] | None = None,
        lora_name: str | None = None,
        images: list[ImageInput] | None = None,
    ) -> KVHandoff | None:
        """Hold blocks for a request whose KV another instance computed (it waits for remote KV).

        The KV covers the prompt and ``output_token_ids`` (a continued request's earlier tokens);
        the prefill instance sampled ``first_token_id`` after them. With ``n > 1``,
        ``choice_token_ids`` holds every choice's first token (choice 0's is ``first_token_id``):
        the other choices fork from this request when the KV has arrived. Returns where the KV
        lands (its leading blocks already cached here are skipped by the sender), or None (nothing
        held) when the pool is full now; raises ``ValueError`` for a bad request. Then exactly one
        of ``remote_kv_arrived`` and ``release_kv``.
        """
        outputs = [*(output_token_ids or []), first_token_id]
        self.validate(prompt_token_ids, params, outputs[:-1])
        lora_slot = self.lora_slot(lora_name)
        choices = list(choice_token_ids or [first_token_id])
        if params.n != 1 and output_token_ids:
            raise ValueError("n must be 1 for a continued request")
        if len(choices) != params.n or choices[0] != first_token_id:
            raise ValueError(f"a request with n={params.n} needs the first token of each of its {params.n} choices")
        if any(not 0 <= t < self.vocab_size for t in choices):
            raise ValueError(f"first token ids must be in [0, {self.vocab_size})")
        if self.knows(request_id):
            raise ValueError(f"duplicate request_id {request_id!r}")
        req = Request(
            request_id, prompt_token_ids, params, block_size=self.block_size, model_id=self.model_id,
            cache_salt=cache_salt, output_token_ids=outputs, lora_name=lora_name, lora_slot=lora_slot, images=images,
        )
        self.runner.check_images(req)  # its images' tokens' KV arrives; a recompute after preemption encodes them
        req.forked = True  # the choices fork when the KV has arrived, not after a local prefill
        req.grammar = self._grammar(params, outputs)
        for token in choices[1:]:  # each choice's first token must fit the grammar too
            self._grammar(params, [token])
        num_kv_tokens = req.num_tokens - 1
        if not self.scheduler.add_remote(req, num_kv_tokens):
            return None
        self._copy_host_now()
        num_hit_blocks = req.num_computed_tokens // self.block_size
        req.num_cached_tokens = num_cached_tokens
        if len(choices) > 1:
            self._remote_choices[request_id] = choices[1:]
        return self._handoff(req, num_kv_tokens, num_hit_blocks)

    def remote_kv_arrived(self, request_id: str) -> None:
        """The KV of a request from ``add_remote_request`` is in its blocks: it joins the batch,
        and with n > 1 so does each other choice, sharing its blocks (copy-on-write). A choice
        whose first token already ends it finishes here with no new token."""
        req = self.scheduler.requests[request_id]
        self.scheduler.remote_kv_arrived(request_id, req.num_tokens - 1)
        now = time.monotonic()
        req.first_token_time = now  # sampled on the prefill instance
        choices = [req]
        aborted = self._aborted_choices.pop(request_id, set())
        for index, token in enumerate(self._remote_choices.pop(request_id, []), start=1):
            if index in aborted:
                continue
            child = Request(
                choice_request_id(request_id, index), req.prompt_token_ids, req.sampling_params,
                block_size=self.block_size, model_id=self.model_id, cache_salt=req.cache_salt,
                output_token_ids=[token], seed_offset=index, lora_name=req.lora_name, lora_slot=req.lora_slot,
                images=req.images,
            )
            child.mrope = req.mrope
            child.forked = True
            child.grammar = self._grammar(req.sampling_params, [token])  # checked by add_remote_request
            child.num_computed_tokens = req.num_computed_tokens
            child.num_cached_tokens, child.first_token_time = req.num_cached_tokens, now
            self.kv.fork(req, child)
            self.scheduler.add_waiting(child)
            choices.append(child)
        for choice in choices:
            reason = self._check_stop(choice, choice.output_token_ids[-1])
            if reason is not None:
                self.scheduler.finish(choice, _FINISHED[reason])
                self._pending.append(self._output(choice, [], None, reason))
        if 0 in aborted and not req.is_finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def abort_request(self, request_id: str) -> bool:
        """Drop a queued or running request; True if one was found.

        Before an n > 1 request has forked, its id stands for all its choices. On the decode side
        a choice of a request still waiting for its KV is remembered and never forks."""
        parent_id, _, index = request_id.rpartition("#")
        if parent_id in self._remote_choices and index.isdigit():
            self._aborted_choices.setdefault(parent_id, set()).add(int(index))
            return True
        if request_id in self._remote_choices:
            self._aborted_choices.setdefault(request_id, set()).add(0)
            return True
        found = False
        req = self.scheduler.requests.get(request_id)
        unforked = req is not None and req.sampling_params.n > 1 and not req.forked
        children = [r for r in self.scheduler.requests if r.startswith(request_id + "#")] if unforked else []
        for rid in [request_id, *children]:
            req = self.scheduler.requests.get(rid)
            if req is not None and req.status not in _TRANSFER_STATES:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                self._pending.append(self._output(req, [], None, "abort"))
                found = True
        # Blocks held for a KV transfer (either side) stay until the transfer's owner reports its
        # end (``release_kv``): the transfer may still be reading or writing them.
        return found

    def _handoff(self, req: Request, num_tokens: int, num_cached_blocks: int = 0, ready: Any | None = None) -> KVHandoff:
        block_ids = self.kv.block_ids(req.request_id)[: self.kv.cdiv(num_tokens)]
        return KVHandoff(block_ids, req.block_hashes[: num_tokens // self.block_size], num_tokens, num_cached_blocks,
                         num_released_blocks=self.kv.num_released(req.request_id), ready=ready)

    @property
    def num_blocks_in_use(self) -> int:
        """Blocks held by requests or transfers (cached, evictable blocks count as free)."""
        return self.kv.pool.num_used_blocks

    def _copy_host_now(self) -> None:
        """The host tier's copies queued outside a step (blocks taken for a KV transfer), done before this returns:
        the transfer writes those blocks as soon as the sender hears where they are, so the cached blocks they
        held must be in the host tier first (the wait includes a step still in flight, with async scheduling)."""
        copies = self.kv.take_host_copies()
        if copies:
            self.runner.copy_host(copies, wait=True)

    def drain_prefix_events(self) -> tuple[list[BlockHash], list[BlockHash]]:
        """(stored, evicted) block hashes since the last call, for the prefix index (a block in the host tier
        counts as stored)."""
        return self.kv.drain_events()

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every block hash the prefix cache holds now (a full republish), the host tier's too."""
        return self.kv.cached_hashes()

    @property
    def num_held_for_transfer(self) -> int:
        """Requests whose blocks a transfer may be using: held for sending or waiting for KV."""
        return sum(1 for r in self.scheduler.requests.values() if r.status in _TRANSFER_STATES)

    def unfinished_request_ids(self) -> list[str]:
        """Ids of every request queued or running (not those a transfer holds)."""
        return [r.request_id for r in (*self.scheduler.waiting, *self.scheduler.running)]

    def release_kv(self, request_id: str) -> bool:
        """Free a request a transfer held (held for sending, or waiting for remote KV) once the
        transfer ended, ok or not; False (nothing done) for any other id."""
        self._remote_choices.pop(request_id, None)
        self._aborted_choices.pop(request_id, None)
        return self.scheduler.release(request_id) is not None

    def kv_still_wanted(self, request_id: str) -> bool:
        """Decode side, n > 1: some choice of this request waiting for its KV is not aborted."""
        choices = self._remote_choices.get(request_id)
        return choices is not None and len(self._aborted_choices.get(request_id, ())) <= len(choices)

    # ----------------------------------------------------------------- the step
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending) or self._in_flight is not None

    def step(self) -> list[EngineOutput]:
        """Schedule, run and sample one step; the outputs of the step that finished.

        Synchronous (the default), that is this step: its tokens reach the host before ``step``
        returns. With ``async_scheduling`` the step is left in flight and the call returns the outputs
        of the one before, so the host schedules and prepares step N+1 while the device still runs
        step N (on a GPU kernel launches do not wait). Step N+1's input ids for the tokens N samples
        are read on the device from N's sampled ids (placeholders on the host until then); N's
        tokens come to the host after N+1's forward is queued and before N+1 samples, so stop checks,
        grammars, penalties and seeds see every token as in a synchronous step. A request N finishes
        was scheduled in N+1 for nothing: its row's forward is wasted and it is not sampled.
        """
        outputs, self._pending = self._pending, []
        prev, self._in_flight = self._in_flight, None
        if prev is None:  # nothing in flight: no request freed so far can have a step to resolve
            self.kv.take_freed()
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if sched.started_ids and self.on_started is not None:
            self.on_started(sched.started_ids)
        if self.runner.image_encoder is not None and any(s.request.images for s in sched.scheduled):
            outputs += self._encode_images(sched)
        if sched.is_empty:
            if sched.host_copies:  # taken for requests that all left the step (an image failed): done all the same
                self.runner.copy_host(sched.host_copies)
            if prev is not None:
                outputs += self._resolve(prev)
            return outputs
        logits = self.runner.execute(sched, prev.sampled.token_ids if prev is not None and prev.placeholders else None)
        if prev is not None:
            outputs += self._resolve(prev)
        launched = self._sample(sched, logits)
        if launched is None:
            return outputs
        if self.config.async_scheduling:
            self._leave_placeholders(launched)
            self._in_flight = launched
        else:
            outputs += self._resolve(launched)
        return outputs

    def _encode_images(self, sched: SchedulerOutput) -> list[EngineOutput]:
        """The images this step's chunks reach, encoded before its forward; a request whose vision tower raised
        leaves the step and fails alone (its blocks freed, an error output naming the failure), the others go on."""
        failed = self.runner.encode_images(sched)
        if not failed:
            return []
        sched.scheduled = [s for s in sched.scheduled if s.request.request_id not in failed]
        outputs = []
        for request_id, exc in failed.items():
            req = self.scheduler.requests[request_id]
            logger.error("request %s: its image could not be encoded: %r", request_id, exc)
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            outputs.append(self._output(req, [], None, "error", f"images: the vision tower failed: {exc!r}"))
        return outputs

    def _sample(self, sched: SchedulerOutput, logits: Tensor) -> _Launched | None:
        """After a forward: progress, forks, and the sampling of every row that completes (queued, not
        waited for); None when no row samples."""
        self.scheduler.update_after_step(sched)
        self._track_slot_use()
        rows: list[int] = []
        reqs: list[Request] = []
        # Prefill of an n > 1 request whose KV is transferred: its other choices are only sampled
        # here (their first tokens); they run on the decode instance.
        sampled_only: dict[str, list[Request]] = {}
        drafts: dict[int, Sequence[int]] = {}
        row = -1
        dropped = False
        for s in sched.scheduled:
            if not s.completes:
                continue
            row += 1
            req = s.request
            if req.status >= FINISHED:  # async: finished by the step resolved after this one was launched
                dropped = True
                row += len(s.spec_token_ids)
                continue
            if s.spec_token_ids:  # a row at its last token and one at each draft, to check them by
                drafts[len(rows)] = s.spec_token_ids
                rows += range(row, row + 1 + len(s.spec_token_ids))
                reqs += draft_rows(req, s.spec_token_ids)
                row += len(s.spec_token_ids)
                continue
            rows.append(row)
            reqs.append(req)
            if req.pooling is not None:  # copied before the step samples: ready with its token
                req.pooled = to_host(self.runner.pooled(row, req))
            if req.sampling_params.n > 1 and not req.forked:
                req.forked = True
                for i in range(1, req.sampling_params.n):
                    child = req.fork(choice_request_id(req.request_id, i), seed_offset=i)
                    if req.kv_transfer:
                        sampled_only.setdefault(req.request_id, []).append(child)
                    else:
                        self.kv.fork(req, child)
                        self.scheduler.add_running(child)
                    rows.append(row)
                    reqs.append(child)
        if not reqs:
            return None
        # Without n > 1 forks or dropped rows the rows are the logits' own, in order: no gathered copy.
        own = not dropped and len(rows) == len(logits)
        # The rows' index goes over as a tensor built here: indexing a GPU tensor with a list would copy
        # it from pageable memory, waiting for the forward queued before it.
        sampled = self.sampler.sample(logits if own else logits.index_select(0, long_tensor(rows, logits.device)), reqs)
        return _Launched(reqs, sampled, sampled_only, step=self.runner.num_steps, drafts=drafts)

    def _leave_placeholders(self, launched: _Launched) -> None:
        """Async scheduling: a placeholder for each sampled row's token, so that the next step schedules
        its request before the token is known; none where the token surely ends the request or hands
        it to a transfer (it sits the next step out)."""
        max_model_len = self.max_model_len
        for row, req in enumerate(launched.requests):
            if (
                req.kv_transfer or req.request_id not in self.scheduler.requests
                or len(req.output_token_ids) + 1 >= req.sampling_params.max_tokens
                or len(req.all_token_ids) + 1 >= max_model_len
            ):
                continue
            req.append_placeholder(row)
            launched.placeholders.append(req)

    def _resolve(self, launched: _Launched) -> list[EngineOutput]:
        """Wait for a launched step's tokens; append them, check stops, build its outputs."""
        result = launched.sampled.result()
        # Its prompts' logprobs (and earlier steps'), before a first token hands a request's list out.
        self.runner.flush_prompt_logprobs(launched.step)
        # Async: requests freed (aborted, preempted) since the step before resolved, with their blocks.
        freed = self.kv.take_freed()
        outputs: list[EngineOutput] = []
        now = time.monotonic()
        check_stop = self._check_stop
        drafts, skip = launched.drafts, 0
        for row, (req, token, lp) in enumerate(zip(launched.requests, result.token_ids, result.logprobs, strict=True)):
            if skip:  # a row of the drafts before, taken with them
                skip -= 1
                continue
            if drafts and row in drafts:
                skip = len(drafts[row])
                self._accept(req, result.token_ids[row : row + 1 + skip], result.logprobs[row : row + 1 + skip],
                             drafts[row], outputs)
                continue
            if req.status >= FINISHED:  # aborted while in flight: the token is dropped
                if token == NOT_FINITE:
                    self._scrub_freed(freed.get(req.request_id))
                continue
            if token < 0:  # no token: it fails, the batch goes on
                req.drop_placeholder()
                if token == NOT_FINITE:  # the model's logits for it were not finite: so may its KV be
                    self._scrub_kv(req)
                    self._scrub_freed(freed.get(req.request_id))  # async: preempted while in flight
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
                error = NOT_FINITE_ERROR if token == NOT_FINITE else NO_TOKEN_ERROR  # its bans left none
                outputs.append(self._output(req, [], None, "error", error))
                continue
            if req.has_placeholder:  # async: the one this row left (a request holds at most one)
                # Before the next step's progress is marked: a block this token fills is cached
                # then, under the hash this computes.
                req.resolve_placeholder(token)
            else:
                req.append_output_token(token)
            first = req.first_token_time is None
            if first:
                req.first_token_time = now
            reason = None if req.kv_transfer and req.sampling_params.n > 1 else check_stop(req, token)
            if req.pooling is not None:  # an embedding: its hidden state in place of the token
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                outputs.append(self._pooled_output(req))
            elif reason is not None:
                self.scheduler.finish(req, _FINISHED[reason])
                outputs.append(self._output(req, [token], lp, reason))
            elif req.kv_transfer and req.request_id in self.scheduler.requests:
                # Its KV leaves for the decode instance, once for all choices of an n > 1 request
                # (their first tokens go out now; the decode instance checks their stops).
                self.scheduler.hold_for_transfer(req)
                out = self._output(req, [token], lp, None)
                out.kv_handoff = self._handoff(req, req.num_computed_tokens, ready=launched.sampled.event)
                outputs.append(out)
            else:
                outputs.append(self._output(req, [token], lp, None))
            if first and req.prompt_logprobs is not None:
                outputs[-1].prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
            if first and req.scheduled_time is not None:
                outputs[-1].queue_time = req.scheduled_time - req.arrival_time
                outputs[-1].prefill_time = now - req.scheduled_time
        for out in outputs:
            children = launched.sampled_only.get(out.request_id)
            if children is not None and out.kv_handoff is not None:
                out.kv_handoff.choice_token_ids.extend(
                    [out.new_token_ids[0], *(c.output_token_ids[-1] for c in children)]
                )
        return outputs

    def _accept(
        self, req: Request, tokens: list[int], logprobs: list[PositionLogprobs | None], drafts: Sequence[int],
        outputs: list[EngineOutput],
    ) -> None:
        """A decode with drafts, sampled (synchronous steps only): ``tokens`` are the rows' tokens, after its
        last token and after each draft (``common.engine.spec_decode``). Its tokens are the drafts a row
        sampled, in order up to the first one it did not, then the token sampled there: stops checked
        after each, with their logprobs where asked. The KV of the drafts kept now counts as computed
        (their full blocks are cached); the slots of the others are written again by the next step."""
        if req.status >= FINISHED:
            return
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += len(drafts)
        if NOT_FINITE in tokens:
            # A draft's KV may be what is not finite: the torch attention weighs the slots a row may not see
            # by 0, and 0 times NaN is NaN, so a broken draft turns every row of the step NaN. Its blocks are
            # scrubbed and it is recomputed, drafting no more: if the fault is its own, that fails it as a
            # step of its own would have.
            self._scrub_kv(req)
            req.may_draft = False
            self.scheduler.recompute(req)
            return
        kept: list[int] = []
        reason: str | None = None
        for j, token in enumerate(tokens):
            if token < 0:  # no token left by its bans: it fails as a row of its own would
                reason = "error"
                break
            req.append_output_token(token)
            kept.append(token)
            reason = self._check_stop(req, token)
            if reason is not None or j == len(drafts) or token != drafts[j]:
                break
        # The leading tokens that are drafts (a stop may end the step on one).
        num_accepted = sum(map(int.__eq__, kept, drafts))
        self.spec_num_accepted_tokens += num_accepted
        per_pos = self.spec_accepted_per_pos
        for j in range(num_accepted):
            per_pos[j] += 1
        if reason is not None:
            self.scheduler.finish(req, _FINISHED[reason])
            out = self._output(req, kept, None, reason, NO_TOKEN_ERROR)
        else:
            req.num_computed_tokens += num_accepted
            self.kv.mark_computed(req)
            out = self._output(req, kept, None, None)
        if req.sampling_params.logprobs is not None:
            out.logprobs = [lp for lp in logprobs[: len(kept)] if lp is not None]
        outputs.append(out)

    def _scrub_kv(self, req: Request) -> None:
        """Zero, and drop from the prefix cache, the blocks only ``req`` holds: its logits were not finite,
        so its KV may hold NaN or infinities, which its blocks' next holders would read. Attention weighs
        a slot past a sequence's own tokens by 0 (the torch kernels read whole blocks), and 0 times NaN is
        NaN; a cached block would hand them to a prompt that shares the prefix. Blocks held by others
        hold what they computed too."""
        own = [block for block in self.kv.req_blocks.get(req.request_id, ()) if block.ref_cnt == 1]
        if own:
            self.runner.zero_blocks([block.block_id for block in own])
            self.kv.uncache(own)

    def _scrub_freed(self, freed: tuple[list[KVBlock], list[BlockHash]] | None) -> None:
        """Async scheduling: ``_scrub_kv`` for a request whose step wrote non-finite KV but which was freed
        (aborted, preempted) while that step was in flight. Of the blocks it held, those still free are
        zeroed and forgotten; those taken since (by the step just launched, say) are only forgotten by
        the prefix cache, no further hit finds them: their holder's step, queued after the one that
        wrote them, reads what it reads (the Triton kernels never load a slot past a sequence's
        length; the torch ones weigh it by 0), and its own logits say whether it failed. The host tier
        forgets the hashes they held when freed (one evicted since may have been copied there)."""
        if freed is None:
            return
        blocks, hashes = freed
        free = [block for block in blocks if block.ref_cnt == 0]
        if free:
            self.runner.zero_blocks([block.block_id for block in free])
        self.kv.uncache(blocks, hashes)

    def _check_stop(self, req: Request, token: int) -> str | None:
        p = req.sampling_params
        if req.grammar is not None:
            if req.grammar.rejected:  # never under the sampler's mask; a failed request, not a wrong output
                return "error"
            if req.grammar.terminated:  # the grammar is complete and its stop token was accepted
                return "stop"
        num_output = len(req.output_token_ids)
        if num_output >= p.min_tokens and (
            token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        ):
            return "stop"
        if num_output >= p.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return "length"
        return None

    def _output(
        self, req: Request, tokens: list[int], lp: PositionLogprobs | None, reason: str | None,
        error: str = "a sampled token left the request's grammar",
    ) -> EngineOutput:
        return EngineOutput(
            req.request_id, tokens, None if lp is None else [lp], reason, len(req.prompt_token_ids),
            req.num_cached_tokens if req.num_cached_tokens > 0 else 0, error if reason == "error" else None,
        )

    def _pooled_output(self, req: Request) -> EngineOutput:
        out = self._output(req, [], None, "stop")
        assert req.pooled is not None
        out.embedding, req.pooled = req.pooled.numpy().astype("<f4", copy=False).tobytes(), None
        return out

    def _track_slot_use(self) -> None:
        """Peak KV tokens held, each slot counted once (blocks are shared by prefix hits and n > 1);
        the KV cache manager keeps the count as requests advance, so this is O(1)."""
        held = self.kv.num_filled_slots
        if held > self.peak_kv_tokens_held:
            self.peak_kv_tokens_held = held
            self.peak_kv_slots_allocated = self.kv.pool.num_used_blocks * self.block_size

    def stats(self) -> EngineStats:
        """Read by the heartbeat thread while the engine's thread steps: the waiting queue is copied in
        one C call first (iterating the deque itself raised when a step changed it meanwhile)."""
        waiting = tuple(self.scheduler.waiting)
        extra = {"num_prompt_tokens_waiting": float(sum(r.num_tokens - r.num_computed_tokens for r in waiting))}
        if self.kv.host is not None:  # the prefix cache's host tier
            extra |= {"kv_offload_saved_blocks": float(self.kv.host.num_saved),
                      "kv_offload_loaded_blocks": float(self.kv.host.num_loaded),
                      "kv_offload_blocks": float(len(self.kv.host))}
        if self.proposer is not None:
            extra |= {"spec_decode_num_drafts": float(self.spec_num_drafts),
                      "spec_decode_num_draft_tokens": float(self.spec_num_draft_tokens),
                      "spec_decode_num_accepted_tokens": float(self.spec_num_accepted_tokens)}
            extra |= {f"{SPEC_PER_POS}:{j}": float(n) for j, n in enumerate(self.spec_accepted_per_pos)}
        if self.runner.lora is not None:  # requests per adapter served, running and waiting
            for kind, requests in (("running", tuple(self.scheduler.running)), ("waiting", waiting)):
                counts = dict.fromkeys(self.runner.lora.slots, 0.0)
                for req in requests:  # (an adapter loaded since the slots were read is counted too)
                    if req.lora_name is not None:
                        counts[req.lora_name] = counts.get(req.lora_name, 0.0) + 1
                extra |= {f"{LORA_REQUESTS}:{kind}:{name}": n for name, n in counts.items()}
        return EngineStats(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(waiting),
            kv_cache_usage_perc=self.kv.usage,
            num_blocks=self.kv.pool.num_blocks,
            num_free_blocks=self.kv.pool.num_free_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            extra=extra,
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    # ----------------------------------------------------------------- offline
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
        lora_names: list[str | None] | None = None,
    ) -> list[list[list[int]]]:
        """Run prompts to completion; per prompt, the output token ids of each of its n choices.
        ``lora_names``: per prompt, its LoRA adapter (None: the base model)."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p, lora in zip(ids, prompts, plist, lora_names or [None] * len(prompts), strict=True):
            self.add_request(rid, prompt, p, lora_name=lora)
        tokens: dict[str, list[int]] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.error or out.finish_reason == "abort":
                    raise RuntimeError(f"request {out.request_id} failed: {out.error or 'aborted'}")
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return [
            [tokens.get(choice_request_id(rid, i), []) for i in range(p.n)]
            for rid, p in zip(ids, plist, strict=True)
        ]


def _check_pooling(pooling: str, params: SamplingParams, kv_transfer: bool, output_token_ids: list[int] | None) -> None:
    """A pooling request is a prompt's forward whose one sampled token is dropped: refuse what would
    ask for more (``ValueError`` naming it)."""
    if pooling not in POOLING_KINDS:
        raise ValueError(f"pooling {pooling!r} is not implemented (only 'last': the last token's hidden state, "
                         "'classify': a sequence classifier's logits of it, and 'mean', 'max', 'cls', "
                         "'mean_sqrt_len' and 'weightedmean' of every prompt position's)")
    if kv_transfer or output_token_ids:
        raise ValueError("a pooling request runs whole, in one attempt: no KV transfer, no output tokens")
    if params.n != 1 or params.max_tokens != 1 or params.logprobs is not None or params.prompt_logprobs is not None:
        raise ValueError("a pooling request samples nothing: n and max_tokens 1, no logprobs")


def _load_tokenizer(model_path: str):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@functools.lru_cache(maxsize=8)
def _token_ids_type(vocab_size: int) -> Any:
    return list[Annotated[int, msgspec.Meta(ge=0, lt=vocab_size)]]


def _ids_in_range(ids: list[int], vocab_size: int) -> bool:
    """Every id an ``int`` (not a ``bool``, not a numpy integer) in ``[0, vocab_size)``: checked by
    msgspec in one C pass, about 12 ns an id where a Python loop took 100."""
    try:
        msgspec.convert(ids, _token_ids_type(vocab_size))
    except msgspec.ValidationError:
        return False
    return True
