"""Typed, versioned wire messages between the router and the engine services.

Every message is a msgspec struct tagged by its type and encoded as msgpack; decoding validates
types and the size limits below before anything is built from it. No pickle, no extension types.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal, get_args

import msgspec

from common.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
MAX_PROMPT_TOKENS = 1 << 20
MAX_ID_LEN = 256
# A token id packs into at most 5 msgpack bytes (uint32). A router -> engine message carries a
# prompt and, when continued, the tokens already produced, each at most MAX_PROMPT_TOKENS; every
# socket that reads engine inputs refuses larger frames (ZMQ_MAXMSGSIZE) before buffering them.
_MAX_TOKEN_ID_BYTES = 5
# A prompt's images (``ImageInput``), their processed pixels all together: about four 1540 x 1540 images in
# float32, Mistral Small 3.1's largest.
MAX_IMAGE_BYTES = 128 << 20
MAX_IMAGES_PER_PROMPT = 64
MAX_MESSAGE_BYTES = 2 * MAX_PROMPT_TOKENS * _MAX_TOKEN_ID_BYTES + MAX_IMAGE_BYTES + (1 << 20)
# Engine -> router: one step's tokens of one request, with their logprobs (top 20 at most), or one
# step's outputs of every request a router owns (``OutputBatch``, split to stay under this bound).
MAX_OUTPUT_MESSAGE_BYTES = 4 << 20
# Prompt logprobs of one request: prompt tokens x (1 + top alternatives) entries at most, about
# 23 bytes each, so they fit one output message with room to spare.
MAX_PROMPT_LOGPROB_ENTRIES = 150_000
# A pooled hidden state (``RequestOutput.embedding``): float32 entries of a hidden size up to 65,536.
MAX_EMBEDDING_BYTES = 4 << 16
# Outputs in one ``OutputBatch``: more than any engine's ``max_num_seqs`` times its choices.
MAX_BATCH_OUTPUTS = 1 << 16

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
TokenIds = Annotated[list[int], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
FinishReason = Literal["stop", "length", "abort", "error"]
# A pooling request's answer (``GenerateRequest.pooling``): the prompt's last token's final hidden state, a
# sequence classifier's logits of it, or a reduction over every prompt token's (sentence-transformers'
# modes: their mean, their elementwise max, the first token's, their sum over the square root of their
# number, their mean weighed by position 1, 2, ...).
PoolingKind = Literal["last", "classify", "mean", "max", "cls", "mean_sqrt_len", "weightedmean"]
POOLING_KINDS: tuple[str, ...] = get_args(PoolingKind)
# The kinds that read every prompt position's hidden state: their prompts compute every position.
EVERY_TOKEN_POOLING = ("mean", "max", "cls", "mean_sqrt_len", "weightedmean")


class DecodeTarget(msgspec.Struct, frozen=True):
    """Where a prefill instance hands the request's KV blocks."""

    instance_id: str
    kv_address: str


class ImageInput(msgspec.Struct, kw_only=True):
    """One image of a prompt, as the router's image processor (the model folder's own) made it: the pixels the
    vision tower reads, float32 row-major in its family's layout (``ImageEncoder.pixel_count``: Pixtral's
    ``[3, height, width]``, Qwen's patches of the image resized to ``height`` x ``width``), and the span of prompt positions its tokens
    take (``offset``, ``length``): the model's image token at each position its features replace, in order,
    and whatever other tokens the processor put between them (Pixtral's row breaks and end). ``digest``
    (sha256 of the pixels and their shape, hex) is its identity in the block hashes of the blocks the span
    touches: the same tokens with another image are another prefix."""

    offset: Annotated[int, msgspec.Meta(ge=0, lt=MAX_PROMPT_TOKENS)]
    length: Annotated[int, msgspec.Meta(ge=1, le=MAX_PROMPT_TOKENS)]
    height: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    width: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    digest: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
    pixel_values: Annotated[bytes, msgspec.Meta(max_length=MAX_IMAGE_BYTES)]
    # LLaVA-OneVision's prompts of several images: each image its whole-image tile alone (``height`` x ``width``
    # its size as sent), not its grid of tiles.
    whole_image_only: bool = False


def image_spans(images: list[ImageInput]) -> list[tuple[int, int, str]]:
    """The images' spans and digests, as the block hashes take them (``compute_block_hashes(images=...)``)."""
    return [(image.offset, image.length, image.digest) for image in images]


def image_digest(pixels: bytes, height: int, width: int) -> str:
    """``ImageInput.digest``: what its blocks are hashed under."""
    return hashlib.sha256(b"pdserve/image/v1\0%d\0%d\0" % (height, width) + pixels).hexdigest()


class GenerateRequest(msgspec.Struct, tag="generate", kw_only=True):
    """Router -> engine. With ``decode_target`` set, a prefill instance computes the prompt, sends
    the first token to ``reply_to`` and the KV to the decode target; without it the receiving
    engine runs the whole request."""

    version: int = PROTOCOL_VERSION
    request_id: RequestId
    prompt_token_ids: TokenIds
    sampling_params: SamplingParams
    reply_to: Annotated[str, msgspec.Meta(max_length=512)]
    cache_salt: str | None = None
    decode_target: DecodeTarget | None = None
    arrival_time: float = 0.0
    # A request continued after its instance was lost: the tokens it already produced (and the
    # client already has). The engine resumes after them as after a preemption: ``max_tokens``,
    # ``min_tokens``, penalties and a seed's draws count them, so the output is the uninterrupted one.
    output_token_ids: TokenIds = msgspec.field(default_factory=list)
    # The LoRA adapter to run it with (a name of the engines' ``--lora-modules``); None: the base model.
    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)] | None = None
    # A pooling request, answered in ``RequestOutput.embedding`` instead of a token: the prompt's final
    # hidden state at its last token ("last": ``POST /v1/embeddings``), or a sequence classifier's logits of
    # it ("classify": ``/classify``, ``/score``, ``/rerank``).
    pooling: PoolingKind | None = None
    # The prompt's images (an image-text model's): their features replace their tokens' embeddings.
    images: Annotated[list[ImageInput], msgspec.Meta(max_length=MAX_IMAGES_PER_PROMPT)] = msgspec.field(
        default_factory=list)


class AbortRequest(msgspec.Struct, tag="abort", kw_only=True):
    """Router -> engine: drop the request and free its blocks; unknown ids are ignored."""

    version: int = PROTOCOL_VERSION
    request_id: RequestId


class LoRAUpdate(msgspec.Struct, tag="lora_update", kw_only=True):
    """Router -> engine: load the LoRA adapter at ``lora_path`` under ``lora_name`` into a free slot, or
    (``lora_path`` None) unload ``lora_name``. The engine answers with a ``RequestOutput`` for
    ``request_id`` at ``reply_to``: ``finish_reason`` "stop" when done, "error" with the reason."""

    version: int = PROTOCOL_VERSION
    request_id: RequestId
    reply_to: Annotated[str, msgspec.Meta(max_length=512)]
    lora_name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
    lora_path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)] | None = None


class RouterHeartbeat(msgspec.Struct, tag="router_heartbeat", kw_only=True):
    """Router -> engine, every second: the router at ``reply_to`` is alive (its lease is renewed).

    An engine that hears nothing from a router for its lease time aborts that router's requests."""

    version: int = PROTOCOL_VERSION
    reply_to: Annotated[str, msgspec.Meta(max_length=512)]


class EngineProgress(msgspec.Struct, tag="progress", kw_only=True):
    """Engine -> router, from the step loop about every half second: the engine is not stuck.

    ``num_steps`` counts finished engine steps; a router that stops hearing this from an instance
    holding its requests takes it for dead and continues them elsewhere."""

    version: int = PROTOCOL_VERSION
    instance_id: RequestId
    num_steps: int = 0
    draining: bool = False


class RequestsStarted(msgspec.Struct, tag="started", kw_only=True):
    """Engine -> router, before the step that first computes them: these requests (every choice of
    each) left the waiting queue on ``instance_id``. The router counts a loss of that instance
    against them from then on; one lost while it only waited there, which it cannot have caused,
    is continued elsewhere without using up its migrations (``router/dispatcher.py``)."""

    version: int = PROTOCOL_VERSION
    instance_id: RequestId
    request_ids: list[RequestId]


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class PositionLogprobs(msgspec.Struct, array_like=True):
    """The sampled token's logprob and the top alternatives at one position."""

    token_id: int
    logprob: float
    top: list[TokenLogprob]


class PromptLogprob(msgspec.Struct, array_like=True):
    """A prompt token's logprob given the tokens before it, its rank in the vocabulary (1 = the most
    likely) and the top alternatives there."""

    token_id: int
    logprob: float
    rank: int
    top: list[TokenLogprob]


class RequestOutput(msgspec.Struct, tag="output", kw_only=True):
    """Engine -> router: new tokens of one request (incremental), and its end when finished."""

    version: int = PROTOCOL_VERSION
    request_id: RequestId
    new_token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    # With the first token, when asked for: one per prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[PromptLogprob | None] | None = None
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    instance_id: str = ""
    # Which phase sent it: "prefill" sends only the first token; "decode" everything after it.
    phase: Literal["prefill", "decode", "full"] = "full"
    # With ``finish_reason="error"``: the instance failed the request (it died, drains, or lost the
    # KV transfer), not the request itself; the router continues it on another instance.
    retryable: bool = False
    # With ``finish_reason="error"``: the instance refused a new request because its waiting queue
    # is full, or it is draining; nothing was started, the router sends it again later (or
    # elsewhere), not a migration.
    overloaded: bool = False
    # A pooling request's end (``GenerateRequest.pooling``): the pooled hidden state, or a classifier's
    # logits, float32 little-endian.
    embedding: Annotated[bytes, msgspec.Meta(max_length=MAX_EMBEDDING_BYTES)] | None = None


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One output for two consecutive ones of a request: the tokens (and logprobs) of both, the
    end, error and state of the second (an engine holding tokens back, a router reader behind)."""
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = [*(first.logprobs or []), *(then.logprobs or [])]
    return msgspec.structs.replace(
        then,
        new_token_ids=[*first.new_token_ids, *then.new_token_ids],
        logprobs=logprobs,
        prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None else then.prompt_logprobs,
        num_cached_tokens=then.num_cached_tokens or first.num_cached_tokens,
    )


class OutputBatch(msgspec.Struct, tag="output_batch", kw_only=True):
    """Engine -> router: one step's outputs for every request of one router, in one message.

    Each request appears in the order its outputs were produced; the router handles them as if
    they had come one by one. ``instance_id`` names the sender (the router's liveness record)."""

    version: int = PROTOCOL_VERSION
    instance_id: str = ""
    outputs: Annotated[list[RequestOutput], msgspec.Meta(max_length=MAX_BATCH_OUTPUTS)]


class TransferMeta(msgspec.Struct, tag="transfer_meta", kw_only=True):
    """Prefill -> decode, inside a KV transfer offer: the request and its first sampled token."""

    version: int = PROTOCOL_VERSION
    request: GenerateRequest
    first_token_id: int
    first_logprobs: PositionLogprobs | None = None
    num_cached_tokens: int = 0
    # n > 1: the first token of every choice, in choice order (``first_token_id`` is choice 0's).
    # The decode instance forks the choices from this one transfer; they share the prompt's blocks.
    choice_token_ids: TokenIds = msgspec.field(default_factory=list)


def choice_request_id(request_id: str, index: int) -> str:
    """The id under which an engine reports choice ``index`` of an n > 1 request (0: its own id)."""
    return request_id if index == 0 else f"{request_id}#{index}"


def choice_request_ids(request_id: str, n: int) -> list[str]:
    return [choice_request_id(request_id, i) for i in range(n)]


EngineInput = GenerateRequest | AbortRequest | RouterHeartbeat | LoRAUpdate
EngineMessage = RequestOutput | OutputBatch | EngineProgress | RequestsStarted

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(EngineInput)
_output_decoder = msgspec.msgpack.Decoder(EngineMessage)
_meta_decoder = msgspec.msgpack.Decoder(TransferMeta)


class ProtocolError(ValueError):
    """A message that failed validation; it is dropped, the process carries on."""


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_checked(
    decoder: msgspec.msgpack.Decoder[Any], raw: bytes | memoryview, *, max_bytes: int, version: int, what: str,
    protocol: str = "pdserve",
) -> Any:
    """Size check, typed decode, version check; anything wrong is a ``ProtocolError``, nothing else.

    Shared by every wire format of the project (engine messages here, KV transfer headers).
    """
    if len(raw) > max_bytes:
        raise ProtocolError(f"{what} of {len(raw)} bytes exceeds {max_bytes}")
    try:
        msg = decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"malformed {what}: {exc}") from None
    if msg.version != version:
        raise ProtocolError(f"unsupported {protocol} version {msg.version} (expected {version})")
    return msg


def _decode(decoder: msgspec.msgpack.Decoder[Any], raw: bytes, what: str) -> Any:
    return decode_checked(decoder, raw, max_bytes=MAX_MESSAGE_BYTES, version=PROTOCOL_VERSION, what=what)


def decode_input(raw: bytes) -> EngineInput:
    return _decode(_input_decoder, raw, "engine input")  # type: ignore[no-any-return]


def decode_output(raw: bytes) -> EngineMessage:
    msg = decode_checked(
        _output_decoder, raw, max_bytes=MAX_OUTPUT_MESSAGE_BYTES, version=PROTOCOL_VERSION, what="engine output"
    )
    if isinstance(msg, OutputBatch):
        for out in msg.outputs:  # each output carries its own version too
            if out.version != PROTOCOL_VERSION:
                raise ProtocolError(f"unsupported pdserve version {out.version} in an output batch")
    return msg  # type: ignore[no-any-return]


def request_outputs(msg: EngineMessage) -> list[RequestOutput]:
    """The request outputs one engine message carries, in order: itself, a batch's, or none."""
    if isinstance(msg, OutputBatch):
        return msg.outputs
    return [msg] if isinstance(msg, RequestOutput) else []


def encode_output_batches(outputs: list[RequestOutput], instance_id: str = "",
                          max_bytes: int = MAX_OUTPUT_MESSAGE_BYTES) -> list[bytes]:
    """``outputs`` encoded as few ``OutputBatch`` messages as fit ``max_bytes`` each, in order.

    Halves a batch that comes out too large (one encode in the usual case); a single output too
    large on its own is still sent, alone, and the receiver refuses it as it would unbatched."""
    if not outputs:
        return []
    if len(outputs) <= MAX_BATCH_OUTPUTS:
        raw = _encoder.encode(OutputBatch(instance_id=instance_id, outputs=outputs))
        if len(raw) <= max_bytes or len(outputs) == 1:
            return [raw]
    half = len(outputs) // 2
    return [*encode_output_batches(outputs[:half], instance_id, max_bytes),
            *encode_output_batches(outputs[half:], instance_id, max_bytes)]


def decode_transfer_meta(raw: bytes) -> TransferMeta:
    return _decode(_meta_decoder, raw, "transfer meta")  # type: ignore[no-any-return]
