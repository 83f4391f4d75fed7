"""A request inside an engine: its tokens, progress, status and sampling state."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from common.kvcache.hashing import BlockHash, adapter_model_key, compute_block_hashes
from common.protocol import EVERY_TOKEN_POOLING, image_spans
from common.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np
    from torch import Tensor

    from common.engine.grammar import GrammarState
    from common.protocol import ImageInput, PromptLogprob


class RequestStatus(enum.IntEnum):
    WAITING = 0
    # Decode side of a disaggregated request: blocks allocated, the prompt's KV still landing.
    WAITING_FOR_REMOTE_KV = 1
    RUNNING = 2
    PREEMPTED = 3
    # Prefill side: first token sampled, blocks held until the KV transfer ends (one release call).
    HELD_FOR_TRANSFER = 4
    # Finished states sort last.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


# The least finished status as a plain int: ``req.status >= FINISHED`` costs 0.02 us where
# ``req.is_finished`` costs 0.15 (two properties and an enum lookup), checked per request per step.
FINISHED = int(RequestStatus.FINISHED_STOPPED)


class Request:
    """Progress is one number: ``num_computed_tokens`` moves towards ``num_tokens``.

    A prompt being prefilled, a decode, a recompute after preemption and a request whose KV arrived
    from another instance all look the same to the scheduler.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        block_size: int,
        model_id: str,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        kv_transfer: bool = False,
        output_token_ids: list[int] | None = None,
        seed_offset: int = 0,
        lora_name: str | None = None,
        lora_slot: int = -1,
        pooling: str | None = None,
        images: list[ImageInput] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # Non-empty for a request continued from another instance: it resumes after these, exactly
        # as after a preemption (they are recomputed like the prompt, and counted as output).
        self.output_token_ids: list[int] = list(output_token_ids or [])
        self.all_token_ids = [*prompt_token_ids, *self.output_token_ids]
        self.sampling_params = sampling_params
        p = sampling_params
        # Its row is sampled by a bare argmax of the raw logits (the sampler's fast path) unless a
        # grammar is set: fixed by the parameters, so the sampler need not look at each of them per step.
        self.plain_greedy = (
            p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 and not p.logit_bias
            and not p.presence_penalty and not p.frequency_penalty and p.min_tokens == 0
            and p.allowed_token_ids is None and not p.bad_words_token_ids
        )
        # Its rows may check draft tokens (speculative decoding): each position's sampling depends on the
        # output before it only through the draw's index, so a row per draft samples what a step per
        # token would (penalties, bad words and grammars read the output itself; min_tokens is checked
        # as the request goes, ``NgramProposer.num_drafts``).
        self.may_draft = (
            not kv_transfer and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and not p.bad_words_token_ids
        )
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        # A prefill-only request stops after its first token and keeps its blocks for a transfer.
        self.kv_transfer = kv_transfer
        self.forked = False  # n > 1: the children exist (set on the parent and on each child)
        self.error: str | None = None
        self.scheduled_time: float | None = None  # first admission to the running batch
        self.first_token_time: float | None = None
        # A seeded request's draws are a function of this key, the draw's index and the token id
        # (``common.engine.seeded_draws.exponentials``): no generator state lives here.
        self.draw_seed: int | None = None
        # Structured output: where the output stands in its grammar; it advances with every
        # appended token and survives preemption (the tokens stay, so does the state).
        self.grammar: GrammarState | None = None
        # Prompt logprobs as the prompt's chunks compute them (position i: token i given those before
        # it); set while they are wanted and not yet sent with the first token.
        self.prompt_logprobs: list[PromptLogprob | None] | None = None
        # Async scheduling: the last token is a placeholder for one a step in flight samples.
        self.has_placeholder = False
        # Speculative decoding (``common.engine.spec_decode``): this step's draft tokens, and its tokens
        # mirrored in an array (the array, how many of its entries are written).
        self.spec_token_ids: list[int] = []
        self.spec_mirror: tuple[np.ndarray | None, int] = (None, 0)
        if sampling_params.seed is not None:
            # Choice i of an n > 1 request draws from seed + i (see ``fork``).
            self.draw_seed = sampling_params.seed + seed_offset
        # An embedding (``GenerateRequest.pooling``): the hidden state its prompt's last token ends with
        # replaces its one sampled token; ``pooled`` holds it (on its way to the host) from the step that
        # computed it to that step's outputs.
        self.pooling = pooling
        self.pooled: Tensor | None = None
        # A reduction over every prompt position (``EVERY_TOKEN_POOLING``), on the device, float32: the running
        # sum, max or first row of the positions computed so far (``ModelRunner.pool_positions``).
        self.pooling_state: Tensor | None = None
        # Its LoRA adapter (``common.model.lora``): its name, and its slot in the runner (-1: none).
        self.lora_name = lora_name
        self.lora_slot = lora_slot
        # An image-text model's prompt images (``GenerateRequest.images``, checked by the engine), and the
        # features of those a chunk reached, by index, until the prompt's positions pass them
        # (``ModelRunner.image_rows``).
        self.images: list[ImageInput] = images or []
        self.image_features: dict[int, Tensor] = {}
        # M-RoPE's positions of the prompt ``[3, num_prompt_tokens]`` and the shift of every position after it,
        # where its images make them differ from the tokens' indices (``ImageEncoder.rope_positions``).
        self.mrope: tuple[np.ndarray, int] | None = None
        # The prompt positions [first, end) of each image whose tokens attend to each other both ways (Gemma 3's;
        # ``ModelRunner.check_images``): a prompt chunk never ends inside one (``Scheduler``).
        self.image_groups: list[tuple[int, int]] = []
        self._block_size = block_size
        model_id = adapter_model_key(model_id, lora_name)
        self._model_id = model_id
        self.block_hashes: list[BlockHash] = compute_block_hashes(
            self.all_token_ids, block_size, model_id, cache_salt, images=image_spans(self.images)
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def computes_every_position(self) -> bool:
        """Prompt logprobs and the poolings over every position read each prompt position's hidden state:
        such a prompt takes no prefix-cache hits (their positions would not be computed)."""
        return self.prompt_logprobs is not None or self.pooling in EVERY_TOKEN_POOLING

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if len(self.all_token_ids) % self._block_size == 0:
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.extend(
                compute_block_hashes(
                    self.all_token_ids, self._block_size, self._model_id, self.cache_salt,
                    start=len(self.block_hashes), parent=parent,
                )
            )

    def append_placeholder(self, row: int) -> None:
        """Async scheduling: stand-in for the token that row ``row`` of the step in flight samples, so the
        next step can be scheduled (and its input read on the device) before the token is known. It
        is negative (``-1 - row``); only lengths may be read until ``resolve_placeholder``."""
        self.output_token_ids.append(-1 - row)
        self.all_token_ids.append(-1 - row)
        self.has_placeholder = True

    def drop_placeholder(self) -> None:
        """Async scheduling: take the placeholder back (its token will never come); nothing if none."""
        if self.has_placeholder:
            self.output_token_ids.pop()
            self.all_token_ids.pop()
            self.has_placeholder = False

    def resolve_placeholder(self, token_id: int) -> None:
        """The sampled token in place of the placeholder, taken as ``append_output_token`` takes one."""
        self.drop_placeholder()
        self.append_output_token(token_id)

    def fork(self, request_id: str, seed_offset: int) -> Request:
        """A copy with the same tokens and progress (n > 1); the caller shares the blocks."""
        params = self.sampling_params
        child = Request.__new__(Request)
        child.__dict__.update(self.__dict__)
        child.request_id = request_id
        child.forked = True
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        child.prompt_logprobs = None  # choice 0 carries them
        child.spec_token_ids = []
        child.spec_mirror = (None, 0)
        child.draw_seed = None if params.seed is None else params.seed + seed_offset
        return child

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.status.name}, computed={self.num_computed_tokens}/"
            f"{self.num_tokens})"
        )
