"""Turns a ``SchedulerOutput`` into tensors, runs the model and returns the logits to sample.

Input state persists between steps in an ``InputBatch`` (block table rows written only when a
request's table changes); the logits stay on the device, where the sampler runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections import deque
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from msgspec.structs import replace
from torch import Tensor

from common.config import EngineConfig
from common.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from common.engine.host_tensors import long_tensor, to_device_all, to_host
from common.engine.input_batch import BatchInputs, InputBatch
from common.engine.request import Request
from common.engine.sampler import Sampler
from common.engine.scheduler import SchedulerOutput
from common.engine.tensor_parallel import (
    HostCopies,
    StepHeader,
    TPLeader,
    ZeroBlocks,
    barrier,
    device_of_rank,
    shared_cache,
)
from common.kvcache.host_tier import SAVE, HostCopy, available_host_memory, copy_batches
from common.kvcache.kv_cache_manager import max_blocks_held
from common.model.arch import ModelArch
from common.model.llama import AttentionMetadata
from common.model.loader import model_identity, resolve_model_path
from common.model.lora import LoRAManager
from common.model.parallel import SINGLE, TensorParallel
from common.model.quantization import check_quantization
from common.model.vision import ImageEncoder, ImageEncoderRefused, load_image_encoder
from common.model.weights import load_hf_config, load_model
from common.protocol import EVERY_TOKEN_POOLING, ImageInput, PromptLogprob, TokenLogprob
from common.sampling_params import MAX_LOGPROBS, SamplingParams
from pdserve_kernels import get_kernels, resolve_backend
from pdserve_kernels.reference import FP8_CACHES, cache_bytes

logger = logging.getLogger(__name__)

# Kept free beyond the profiled peak (``profile_activations``): the decode CUDA graphs' memory pool,
# captured after the cache, fragmentation of torch's cache, and libraries that allocate outside it.
_GPU_ACTIVATION_HEADROOM = 1 << 30
# Blocks a copy to or from the host tier stages on the device at once (``copy_host``): 64 MiB for an 8B model's
# blocks of 16 tokens, within the headroom above.
HOST_COPY_STAGING_BLOCKS = 32

# Prompt logprobs are computed over at most this many positions at a time.
_PROMPT_LOGPROB_ROWS = 256


def gpu_kv_cache_bytes(total: int, free: int, own: int, utilization: float) -> int:
    """The KV cache's bytes on a GPU of ``total`` bytes with ``free`` free, for an engine that holds
    ``own`` (torch's reservation: weights, workspace, and the cached memory of its profiled peak step)
    and may use ``utilization`` of the GPU: its share less what it holds, never more than is free
    (other processes on the GPU), each less the headroom. The share is this engine's own, as vLLM's:
    two engines at 0.45 each fit on one GPU, whichever sizes its cache first."""
    return min(int(total * utilization) - own, free) - _GPU_ACTIVATION_HEADROOM


def _check_kv_dtype(kv_dtype: torch.dtype, device: torch.device) -> None:
    """An 8-bit cache on a GPU needs float8 conversions in hardware (compute capability 8.9: Ada, Hopper
    and later), which the Triton kernels compile to; refused by name elsewhere, not emulated."""
    if kv_dtype not in FP8_CACHES or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"an 8-bit KV cache ({str(kv_dtype).removeprefix('torch.')}) needs a GPU of compute "
                         f"capability 8.9 or later (float8 conversions); this one is {capability[0]}.{capability[1]}: "
                         "use --kv-cache-dtype auto")


class _PromptLogprobTable(NamedTuple):
    """One step's prompt logprobs on their way to the host: per position its logprob, rank and top
    ``k_max`` (values, then ids), for the ``owners`` (collecting list, positions, top k) in order."""

    step: int
    table: Tensor
    event: torch.cuda.Event | None
    owners: list[tuple[list[PromptLogprob | None], int, int]]
    targets: list[int]
    k_max: int


class _PromptLogprobsPending:
    """The tables not yet appended, oldest first, and per collecting list how many positions they hold
    for it (a recompute after preemption must not compute those again)."""

    def __init__(self) -> None:
        self.tables: deque[_PromptLogprobTable] = deque()
        self.positions: dict[int, int] = {}  # id of the list (alive while a table refers to it)

    def add(self, table: _PromptLogprobTable) -> None:
        self.tables.append(table)
        for collected, count, _ in table.owners:
            self.positions[id(collected)] = self.positions.get(id(collected), 0) + count

    def done(self, collected: list[PromptLogprob | None], count: int) -> None:
        left = self.positions.pop(id(collected)) - count
        if left:
            self.positions[id(collected)] = left


class ModelRunner:
    # Decode-step CUDA graphs, captured at start on a GPU (None: every step runs eagerly).
    decode_graphs: DecodeGraphs | None = None
    # Forwards run so far (``execute`` calls): which step computed what is on its way to the host.
    num_steps = 0
    # On a GPU sized by ``profile_activations``: the bytes its step allocated at the peak.
    profiled_peak_bytes = 0
    # LoRA adapters served (``--enable-lora``), None without.
    lora: LoRAManager | None = None
    # Rank 0 of a tensor-parallel engine: its handle on the other ranks (``common.engine.tensor_parallel``).
    tp_leader: TPLeader | None = None
    # The last step's hidden states of the rows it computed logits for, in their order.
    sampled_hidden: Tensor | None = None
    # An image-text checkpoint's vision tower and projector (``common.model.vision``); None: images are refused,
    # for the reason in ``images_refused``.
    image_encoder: ImageEncoder | None = None
    images_refused = "the model takes no images"

    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None, cache_path: Path | None = None) -> None:
        """``tp`` and ``cache_path``: given to a tensor-parallel worker rank (its group, and where rank 0's
        shared CPU cache lies); rank 0 starts its workers itself where ``tensor_parallel_size`` > 1."""
        self.config = config
        if tp is None and config.tensor_parallel_size > 1:
            # A model the ranks cannot share is refused here, before any worker starts (and fails alike).
            hf_config = load_hf_config(resolve_model_path(config.model, config.hf_overrides))
            ModelArch.from_config(hf_config).check_tensor_parallel(hf_config, config.tensor_parallel_size)
            # The workers first: they import and load their shares while this process loads its own.
            self.tp_leader = TPLeader(config, config.torch_device)
            tp, cache_path = self.tp_leader.tp, self.tp_leader.cache_path
        try:
            self._start(config, tp or SINGLE, cache_path)
        except BaseException:
            self.close()
            raise

    def _start(self, config: EngineConfig, tp: TensorParallel, cache_path: Path | None) -> None:
        self.tp = tp
        self.device = device_of_rank(config.torch_device, tp.rank)
        self.dtype = config.torch_dtype
        self.kv_dtype = config.torch_kv_cache_dtype
        _check_kv_dtype(self.kv_dtype, self.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches its kernels on the current device, not on their tensors': make it this one
            # (for this thread, the one that runs the engine's steps).
            torch.cuda.set_device(self.device)
        self.model_path = resolve_model_path(config.model, config.hf_overrides)
        self.model_id = model_identity(self.model_path)
        self.hf_config = load_hf_config(self.model_path)
        check_quantization(config.quantization, self.hf_config)
        limit = int(getattr(self.hf_config, "max_position_embeddings", 8192))
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's {limit} positions")
        self.max_model_len = config.max_model_len or limit
        self.kernel_backend = resolve_backend(self.device, config.kernel_backend)
        self.kernels = get_kernels(self.device, config.kernel_backend)
        self.model = load_model(
            self.model_path, self.hf_config, self.kernels, self.dtype, self.device, tp
        )
        # How far back any layer reads keys (``ModelArch.kv_window``): the KV cache gives back blocks past it.
        self.kv_window = self.model.arch.kv_window
        self._load_image_encoder()
        # LoRA adapters, resident from here, before the KV cache is sized after what is left.
        self.lora = (LoRAManager(self.model, config.lora_modules, config.max_lora_rank, config.max_loras)
                     if config.enable_lora else None)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.block_size = config.block_size
        self.num_layers = int(self.hf_config.num_hidden_layers)
        self.num_blocks = self._num_blocks()
        self._check_capacity()
        self.init_input_batch()
        self.kv_cache, self.transfer_cache = self._allocate_cache(cache_path)
        # The prefix cache's host tier (``--kv-offloading-size``): this rank's share of each block, a slot each.
        self.num_host_blocks = self._num_host_blocks()
        self.host_cache = torch.empty(  # a slot is read only after a save wrote it
            (self.num_host_blocks, *self.kv_cache[:, :, 0].shape), dtype=self.kv_dtype,
            pin_memory=self.device.type == "cuda" and self.num_host_blocks > 0,
        )
        self.decode_graphs = self._capture_decode_graphs()
        if self.decode_graphs is not None and self.profiled_peak_bytes:
            # Capturing emptied torch's cache: take the largest step's memory back into it now, as one
            # segment the steps split, rather than from whatever another process left free later.
            torch.empty(self.profiled_peak_bytes, dtype=torch.uint8, device=self.device)
        logger.info(
            "model %s on %s/%s, %d KV blocks of %d tokens (%.2f GiB, %s), kernels=%s",
            self.model_id, self.device, self.dtype, self.num_blocks, self.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**30, self.kv_dtype, self.kernel_backend,
        )

    def _load_image_encoder(self) -> None:
        """An image-text checkpoint's vision side, loaded before the KV cache is sized after what is left; where
        its images are not implemented (or the model is split over ranks) its text is served alone."""
        try:
            encoder = load_image_encoder(self.model_path, self.dtype, self.device)
        except ImageEncoderRefused as exc:
            self.images_refused = str(exc)
            return
        if encoder is not None and self.tp.size > 1:
            self.images_refused = "image input with --tensor-parallel-size above 1 is not implemented"
            return
        self.image_encoder = encoder

    def check_images(self, req: Request) -> None:
        """``ValueError`` naming what is wrong with a request's images (``GenerateRequest.images``): spans in
        order inside the prompt, pixels of the size said, and as many image tokens in each span as its image
        has features, none outside them."""
        if not req.images:
            return
        encoder = self.image_encoder
        if encoder is None:
            raise ValueError(f"images: {self.images_refused}")
        encoder.check_modes(req.images)
        prompt = req.prompt_token_ids
        token = encoder.image_token_id
        end = inside = 0
        for k, image in enumerate(req.images):
            if image.offset < end or image.offset + image.length > len(prompt):
                raise ValueError(f"images[{k}]: its span [{image.offset}, {image.offset + image.length}) overlaps "
                                 f"the one before or leaves the prompt of {len(prompt)} tokens")
            encoder.check_size(image.height, image.width)
            if len(image.pixel_values) != 4 * encoder.image_pixel_count(image):
                raise ValueError(f"images[{k}]: {len(image.pixel_values)} bytes of pixels for a float32 image of "
                                 f"{encoder.image_pixel_count(image)} values ({image.height} x {image.width} pixels)")
            count = prompt[image.offset:image.offset + image.length].count(token)
            if count != encoder.image_features(image):
                raise ValueError(f"images[{k}]: its span holds {count} image tokens (id {token}) for an image of "
                                 f"{encoder.image_features(image)} features")
            end = image.offset + image.length
            inside += count
        if prompt.count(token) != inside:
            raise ValueError(f"prompt: the image token (id {token}) outside its images' spans")
        req.mrope = encoder.rope_positions(len(prompt), req.images)
        if encoder.bidirectional:
            req.image_groups = [_image_group(prompt, image, token, k) for k, image in enumerate(req.images)]

    def encode_images(self, out: SchedulerOutput) -> dict[str, Exception]:
        """Encode each image a scheduled chunk reaches that its request does not hold the features of yet (the
        first chunk that reaches it, or a recompute's), before the step's forward, once for all of the step's
        requests with that image: the error of each request whose vision tower raised (a GPU out of memory, say),
        by id, so that it fails alone (``LLMEngine``)."""
        encoder = self.image_encoder
        failed: dict[str, Exception] = {}
        if encoder is None:
            return failed
        # The features the step's requests hold, by their image's digest: a request that reaches the same image
        # (the same pixels) takes them as they are, encoded once (no memory beyond what its holders keep).
        held = {s.request.images[k].digest: features for s in out.scheduled
                for k, features in s.request.image_features.items()}
        for s in out.scheduled:
            req = s.request
            start = req.num_computed_tokens
            end = start + s.num_new_tokens
            for k, image in enumerate(req.images):
                if k in req.image_features or image.offset >= end or image.offset + image.length <= start:
                    continue
                features = held.get(image.digest)
                if features is None:
                    try:
                        pixels = torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32).to(self.device)
                        features = held[image.digest] = encoder.encode_image(pixels, image)
                    except Exception as exc:  # noqa: BLE001 - whatever the tower raised fails its request alone
                        req.image_features.clear()
                        failed[req.request_id] = exc
                        break
                req.image_features[k] = features
        return failed

    def image_rows(self, out: SchedulerOutput, query_start: list[int]) -> tuple[Tensor, Tensor] | None:
        """The rows of this step's input that are image tokens, and the features that replace their embeddings
        (in the model's dtype, on the device): each image is encoded at the first chunk that reaches it
        (``encode_images``) and kept on its request until a chunk passes its end (a preemption's recompute
        encodes it again)."""
        encoder = self.image_encoder
        if encoder is None:
            return None
        rows: list[int] = []
        parts: list[Tensor] = []
        for i, s in enumerate(out.scheduled):
            req = s.request
            if not req.images:
                continue
            start = req.num_computed_tokens
            end = start + s.num_new_tokens
            for k, image in enumerate(req.images):
                lo, hi = max(start, image.offset), min(end, image.offset + image.length)
                if lo >= hi:
                    continue
                features = req.image_features.get(k)
                assert features is not None, "encode_images runs before the step's forward"
                span = req.prompt_token_ids[image.offset:image.offset + image.length]
                positions = [image.offset + j for j, t in enumerate(span) if t == encoder.image_token_id]
                chosen = [j for j, p in enumerate(positions) if lo <= p < hi]
                rows.extend(query_start[i] + positions[j] - start for j in chosen)
                parts.append(features[chosen[0]:chosen[-1] + 1] if chosen else features[:0])
                if hi == image.offset + image.length:
                    del req.image_features[k]
        if not rows:
            return None
        return long_tensor(rows, self.device), torch.cat(parts).to(self.dtype)

    def key_limits(self, out: SchedulerOutput, positions: Tensor, query_start: list[int]) -> Tensor | None:
        """Each of this step's tokens' last visible key where a prompt chunk holds tokens of an image that attend
        to each other both ways (``Request.image_groups``): the image's last token for those, else the token's own
        position (from ``positions``, the tokens' indices); None where no chunk holds any."""
        limits: Tensor | None = None
        for i, s in enumerate(out.scheduled):
            start = s.request.num_computed_tokens
            end = start + s.num_new_tokens
            for first, stop in s.request.image_groups:
                lo, hi = max(start, first), min(end, stop)
                if lo >= hi:
                    continue
                if limits is None:
                    limits = positions.clone()
                limits[query_start[i] + lo - start : query_start[i] + hi - start] = stop - 1
        return limits

    def rope_positions(self, out: SchedulerOutput, positions: Tensor, query_start: list[int]
                       ) -> tuple[Tensor | None, Tensor]:
        """M-RoPE's positions of this step's tokens where a request's images make them differ from its tokens'
        indices (``Request.mrope``): the positions after such a prompt shifted by its delta (on the host), and,
        where the step holds a position inside such a prompt, all three of each token ``[3, num_tokens]`` (the
        prompt's from its table); else None and the shifted positions alone, which a decode graph replays."""
        if not any(s.request.mrope is not None for s in out.scheduled):
            return None, positions
        shifted = positions.clone()
        inside: list[tuple[int, int, np.ndarray]] = []
        for i, s in enumerate(out.scheduled):
            if s.request.mrope is None:
                continue
            table, delta = s.request.mrope
            lo, hi = query_start[i], query_start[i + 1]
            index = positions[lo:hi]
            shifted[lo:hi] = torch.where(index >= table.shape[1], index + delta, index)
            if int(index[0]) < table.shape[1]:
                inside.append((lo, hi, table))
        if not inside:
            return None, shifted
        three = shifted.expand(3, -1).clone()
        for lo, hi, table in inside:
            at = positions[lo:hi].numpy()
            three[:, lo:hi] = torch.from_numpy(np.where(at < table.shape[1], table[:, np.minimum(at, table.shape[1] - 1)],
                                                        three[:, lo:hi].numpy()))
        return three, shifted

    def _allocate_cache(self, cache_path: Path | None) -> tuple[Tensor, Tensor | None]:
        """This rank's KV cache, and the cache a KV transfer moves blocks of (None: none can). One rank: the
        same tensor. Tensor-parallel on the CPU: every rank's share of one shared-memory tensor ``[ranks,
        layers, ...]``, which rank 0 creates and removes from the file system once all mapped it; its
        transfers see all of it as ``ranks x layers`` layers of a rank's heads. On GPUs each rank's own
        (a transfer from such an engine is not implemented)."""
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_size)
        tp = self.tp
        if tp.size == 1:
            cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            return cache, cache
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device), None
        assert cache_path is not None
        if tp.rank == 0:
            whole = shared_cache(cache_path, (tp.size, *shape), self.kv_dtype)
        barrier(tp, self.device)
        if tp.rank != 0:
            whole = shared_cache(cache_path, (tp.size, *shape), self.kv_dtype)
        barrier(tp, self.device)
        if tp.rank == 0:
            cache_path.unlink()  # mapped by every rank: the memory lives until the last of them ends
        return whole[tp.rank], whole.flatten(0, 1)

    def close(self) -> None:
        """Stop a tensor-parallel engine's other ranks (nothing to do for one rank)."""
        if self.tp_leader is not None:
            self.tp_leader.close()

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Overwrite these blocks' K and V with zeros, in every layer (queued after the steps before), on
        every rank."""
        if self.tp_leader is not None:
            self.tp_leader.send(ZeroBlocks(block_ids))
        cache_bytes(self.kv_cache).index_fill_(2, long_tensor(block_ids, self.device), 0)

    def _num_host_blocks(self) -> int:
        """Slots of the host tier: this rank's share of ``--kv-offloading-size`` over this rank's bytes a block."""
        size = self.config.kv_offloading_size
        if not size:
            return 0
        per_block = self.bytes_per_block
        num = int(size * 2**30 / self.tp.size) // per_block
        if num < 1:
            raise ValueError(f"--kv-offloading-size {size} GiB holds no KV block: one takes "
                             f"{per_block * self.tp.size} bytes over the {self.tp.size} rank(s)")
        available = available_host_memory()
        if available is not None and num * per_block > available:
            raise ValueError(f"--kv-offloading-size {size} GiB: this rank's {num * per_block / 2**30:.2f} GiB of it "
                             f"exceed the {available / 2**30:.2f} GiB of memory the host has available")
        logger.info("KV offloading: %d blocks in host memory (%.2f GiB)", num, num * per_block / 2**30)
        return num

    def copy_host(self, copies: list[HostCopy], wait: bool = False) -> None:
        """Copies between the KV cache and its host tier (``KVCacheManager.host_copies``), in order, queued on the
        device's stream (on every rank): a save through a staging gather on the device, then a block a slot into
        the host's pinned memory; a load a slot a block into a staging buffer, then scattered in one copy. With
        ``wait``, done on every rank when this returns (the device's stream waited for; the ranks meet after)."""
        if self.tp_leader is not None:
            self.tp_leader.send(HostCopies([(c.direction, c.block_id, c.slot) for c in copies], wait))
        dev = self.device
        kv, host = cache_bytes(self.kv_cache), cache_bytes(self.host_cache)
        for direction, block_ids, slots in copy_batches(copies, HOST_COPY_STAGING_BLOCKS):
            ids = long_tensor(block_ids, dev)
            if direction == SAVE:
                staged = kv.index_select(2, ids).movedim(2, 0).contiguous()
                for i, slot in enumerate(slots):
                    host[slot].copy_(staged[i], non_blocking=True)
            else:
                staged = torch.empty((len(slots), *host.shape[1:]), dtype=host.dtype, device=dev)
                for i, slot in enumerate(slots):
                    staged[i].copy_(host[slot], non_blocking=True)
                kv.index_copy_(2, ids, staged.movedim(0, 2))
        if wait and dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        if wait and self.tp.size > 1:
            barrier(self.tp, dev)

    @property
    def bytes_per_block(self) -> int:
        return (
            self.num_layers * 2 * self.block_size * self.model.num_kv_heads * self.model.head_size
            * torch.finfo(self.kv_dtype).bits // 8
        )

    def init_input_batch(self) -> None:
        """The persistent input state, sized for ``max_num_seqs`` requests of ``max_model_len`` tokens,
        and the prompt logprobs on their way to the host."""
        max_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.input_batch = InputBatch(self.config.max_num_seqs, max_blocks_per_req, self.block_size)
        self._prompt_logprobs_pending = _PromptLogprobsPending()

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs for decode steps, on a GPU with the Triton kernels unless ``enforce_eager``."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if self.kernel_backend != "triton":
            logger.warning("CUDA graphs off: the %s kernels read sequence lengths on the host, which a "
                           "graph cannot replay; decode steps run eagerly", self.kernel_backend)
            return None
        graphs = DecodeGraphs(
            self.model, self.kv_cache, graph_batch_sizes(self.config.max_num_seqs),
            self.input_batch.block_table.shape[1], lora=self.lora,
        )
        graphs.capture()
        return graphs

    def _check_capacity(self) -> None:
        """Where the cache was sized from memory (no ``--num-blocks``), ``ValueError`` unless it holds one request of
        ``max_model_len`` tokens, as vLLM refuses to start then: the model's own context length (Llama 4 Scout's
        10M tokens, say) is the default, and a request that long could never run. A model windowed on every layer
        holds only its window's blocks at once (``max_blocks_held``)."""
        capacity = self.num_blocks * self.block_size
        needed = max_blocks_held(self.max_model_len, self.block_size, self.kv_window, self.config.max_num_batched_tokens)
        if self.config.num_blocks is not None or needed <= self.num_blocks:
            return
        memory = "--gpu-memory-utilization" if self.device.type == "cuda" else "--kv-cache-memory"
        raise ValueError(
            f"the KV cache holds {capacity} tokens ({self.num_blocks} blocks of {self.block_size}), fewer than a "
            f"request of max_model_len {self.max_model_len} holds at once ({needed} blocks): it could never run. "
            "Pass --max-model-len "
            f"{capacity} or less, or give the cache more memory ({memory})")

    def _num_blocks(self) -> int:
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        if self.device.type == "cuda":
            # The largest step's activations and sampling temporaries, allocated and freed first: their
            # memory stays in torch's cache, counted below as this engine's own, and the steps reuse it.
            peak = self.profiled_peak_bytes = self.profile_activations()
            free, total = torch.cuda.mem_get_info(self.device)
            own = torch.cuda.memory_reserved(self.device)
            logger.info("largest step's activations and sampling: %.2f GiB at peak", peak / 2**30)
            util = self.config.gpu_memory_utilization
            num = gpu_kv_cache_bytes(total, free, own, util) // self.bytes_per_block
            if self.tp.size > 1:  # block ids mean the same blocks on every rank: the fewest any rank holds
                import torch.distributed as dist

                fewest = torch.tensor([num], device=self.device)
                dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=self.tp.group)
                num = int(fewest.item())
            if num < 1:
                raise ValueError(
                    f"not enough GPU memory for a single KV block ({self.bytes_per_block} bytes): "
                    f"--gpu-memory-utilization {util:g} of {total / 2**30:.1f} GiB, of which this engine holds "
                    f"{own / 2**30:.2f} GiB (weights, workspace, the largest step's activations) and keeps "
                    f"{_GPU_ACTIVATION_HEADROOM / 2**30:g} GiB more; {free / 2**30:.2f} GiB free (other processes "
                    "hold the rest). Raise --gpu-memory-utilization, or give this engine a GPU of its own")
            return int(num)
        num = self.config.kv_cache_memory // self.bytes_per_block
        if num < 1:
            raise ValueError(f"--kv-cache-memory {self.config.kv_cache_memory} bytes holds no KV block "
                             f"({self.bytes_per_block} bytes); raise it")
        return int(num)

    @torch.inference_mode()
    def profile_activations(self) -> int:
        """Run the largest step the engine may run, against a one-block stand-in cache that nothing is
        stored to: a forward over ``max_num_batched_tokens`` tokens (in sequences of at most
        ``max_model_len``), then logits and a sampling pass over ``max_num_seqs`` rows with every
        sampling feature on (half of them seeded; the penalties over a prompt and an output each as
        long as a request may have); the bytes they allocated at their peak (on the CPU,
        0: nothing measures it). The KV cache is sized after it, as vLLM sizes its cache after a
        profiling run: sampling alone takes several ``[rows, vocab]`` temporaries, gigabytes at 512 rows
        of a 128k vocabulary."""
        dev, config = self.device, self.config
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev) if cuda else 0
        lens = [self.max_model_len] * (config.max_num_batched_tokens // self.max_model_len)
        lens = [*lens, config.max_num_batched_tokens % self.max_model_len][: config.max_num_seqs]
        lens = [n for n in lens if n > 0]
        num_tokens = sum(lens)
        cache = torch.zeros((self.num_layers, 2, 1, self.block_size, self.model.num_kv_heads, self.model.head_size),
                            dtype=self.kv_dtype, device=dev)
        starts = [0, *itertools.accumulate(lens)]
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=dev),
            block_tables=torch.zeros((len(lens), -(-max(lens) // self.block_size)), dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            max_query_len=max(lens),
        )
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        features = None
        encoder = self.image_encoder
        if encoder is not None:  # the largest image's encoding; its features live through the step
            height, width = encoder.largest()
            features = encoder.encode(torch.zeros(encoder.pixel_count(height, width), device=dev), height, width)
        hidden = self.model(torch.zeros(num_tokens, dtype=torch.long, device=dev), positions, meta, cache)
        del features
        rows = config.max_num_seqs
        logits = self.model.compute_logits(hidden[torch.arange(rows, device=dev) % num_tokens])
        del hidden
        params = SamplingParams(
            temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
            frequency_penalty=0.3, logprobs=MAX_LOGPROBS, max_tokens=2, ignore_eos=True,
        )
        # The penalties pad the rows' tokens to the longest sequence's: one as long as a prompt may be, one
        # with as many outputs as a request may have.
        longest = max(1, self.max_model_len - 2)
        lengths = [(longest, 1), (1, longest)] + [(16, 1)] * (rows - 2)
        requests = [
            Request(f"profile-{i}", [i % self.vocab_size] * num_prompt, replace(params, seed=i if i % 2 else None),
                    block_size=self.block_size, model_id=self.model_id, output_token_ids=[0] * num_output)
            for i, (num_prompt, num_output) in enumerate(lengths[:rows])
        ]
        if self.tp.rank == 0:  # only rank 0 samples
            Sampler(set(), seed=0, kernel_backend=self.kernel_backend).sample(logits, requests).result()
        if not cuda:
            return 0
        torch.cuda.synchronize(dev)
        return int(torch.cuda.max_memory_allocated(dev) - base)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, prev_token_ids: Tensor | None = None) -> Tensor:
        """Run one forward; logits ``[num_completing, vocab]``, on the runner's device, for requests that
        finish their tokens.

        Performs pending copies to and from the host tier first, then copy-on-write block copies, then stores
        this step's K/V. With async
        scheduling, input ids that are placeholders (``Request.append_placeholder``: ``-1 - row``) are
        read on the device from ``prev_token_ids``, the step in flight's sampled ids: nothing waits.
        """
        dev = self.device
        self.num_steps += 1
        if out.host_copies:
            self.copy_host(out.host_copies)
        if out.block_copies:
            src, dst = zip(*out.block_copies, strict=True)
            self.kernels.copy_blocks(self.kv_cache, long_tensor(src, dev), long_tensor(dst, dev))
        inputs = self.input_batch.prepare(out.scheduled)
        graphs = self.decode_graphs
        images = rope = limits = None
        if self.image_encoder is not None and any(s.request.images for s in out.scheduled):
            query_start = inputs.query_start_loc.tolist()
            images = self.image_rows(out, query_start)
            if self.image_encoder.bidirectional:
                limits = self.key_limits(out, inputs.positions, query_start)
            rope, positions = self.rope_positions(out, inputs.positions, query_start)
            if positions is not inputs.positions:  # only the rotation reads them (the slots are computed)
                inputs = dataclasses.replace(inputs, positions=positions)
        # One token per sequence (decode, or a prompt's last one-token chunk) is replayed from a graph.
        replay = graphs is not None and images is None and rope is None and graphs.fits(inputs)
        # Which adapter each token has, for the adapted projections (a replay reads the rows' one-hot).
        adapted = self.lora is not None and self.lora.set_batch(
            [s.request.lora_slot for s in out.scheduled], inputs.query_start_loc, dev, one_hot=replay)
        # Every input goes up in one copy; a graph's replay reads neither the query starts nor the rows
        # to sample (every row is one).
        on_device = to_device_all(
            [inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.context_lens, inputs.block_tables,
             *(() if replay else (inputs.query_start_loc, inputs.sample_idx))], dev,
        )
        input_ids = on_device[0]
        if prev_token_ids is not None:
            # A few tensor operations whether or not any id is a placeholder: no branch on the data.
            rows = (-1 - input_ids).clamp_(min=0)
            input_ids = torch.where(input_ids < 0, prev_token_ids.index_select(0, rows), input_ids)
        lora_select = self.lora.batch.select if adapted and self.lora is not None else None
        if self.tp_leader is None:
            hidden = self._forward(inputs, input_ids, on_device[1:], replay, lora_select, images,
                                   None if rope is None else rope.to(dev), None if limits is None else limits.to(dev))
        else:  # the other ranks run the same forward on their shares, in step with this one
            with self.tp_leader.in_step():
                self.tp_leader.step(
                    StepHeader(inputs.input_ids.shape[0], inputs.context_lens.shape[0], inputs.block_tables.shape[1],
                               inputs.max_query_len, list(out.block_copies)),
                    [inputs.positions, inputs.slot_mapping, inputs.context_lens, inputs.block_tables,
                     inputs.query_start_loc], input_ids)
                hidden = self._forward(inputs, input_ids, on_device[1:], replay, lora_select)
        if any(s.request.prompt_logprobs is not None for s in out.scheduled):
            self._prompt_logprobs(out, hidden, inputs.query_start_loc.tolist())
        if any(s.request.pooling in EVERY_TOKEN_POOLING for s in out.scheduled):
            self.pool_positions(out, hidden, inputs.query_start_loc.tolist())
        num_sampled = len(inputs.sample_idx)
        if num_sampled == 0:
            return torch.empty(0, self.vocab_size, device=dev)
        # Only the completing rows' logits are computed, and they stay on the device: the sampler
        # runs there and only the sampled ids (and requested logprobs) cross to the host. The rows to
        # sample ascend, so as many as the hidden rows are all of them (a replay's, or decode's).
        if num_sampled != hidden.shape[0]:
            hidden = hidden.index_select(0, on_device[6])
        self.sampled_hidden = hidden  # the logits' rows' hidden states: a pooling request's (``LLMEngine``)
        logits: Tensor = self.model.compute_logits(hidden)
        return logits

    def pooled(self, row: int, req: Request) -> Tensor:
        """A pooling request's answer (float32, on the device) from the last step, which computed its prompt's
        last position, sampled at row ``row``: its final hidden state ("last"), the sequence classifier's
        logits of it ("classify"), or the reduction over every prompt position (``pool_positions``)."""
        if req.pooling in EVERY_TOKEN_POOLING:
            assert req.pooling_state is not None
            n = req.num_prompt_tokens
            divisor = {"mean": n, "mean_sqrt_len": math.sqrt(n), "weightedmean": n * (n + 1) / 2}.get(req.pooling)
            return req.pooling_state if divisor is None else req.pooling_state / divisor
        assert self.sampled_hidden is not None
        hidden = self.sampled_hidden[row]
        if req.pooling == "classify":
            with torch.inference_mode():
                return self.model.classify(hidden[None])[0]
        return hidden.to(torch.float32, copy=True)

    def pool_positions(self, out: SchedulerOutput, hidden: Tensor, query_start: list[int]) -> None:
        """Fold this step's prompt positions into each every-position pooling request's state (float32, on the
        device, nothing read back): their sum ("mean", "mean_sqrt_len": divided at the end by the prompt's
        length or its square root), their sum weighed by position + 1 ("weightedmean", divided by the
        weights' sum), their elementwise max ("max"), or the first position's ("cls"). A chunk from position
        0 (the first, or a recompute's after preemption) starts the state afresh; positions past the prompt
        pool nothing."""
        for i, s in enumerate(out.scheduled):
            req = s.request
            if req.pooling not in EVERY_TOKEN_POOLING:
                continue
            start = req.num_computed_tokens
            end = min(start + s.num_new_tokens, req.num_prompt_tokens)
            if end <= start:
                continue
            rows = hidden[query_start[i] : query_start[i] + end - start].float()
            if req.pooling == "cls":
                if start == 0:
                    req.pooling_state = rows[0].clone()
                continue
            if req.pooling == "max":
                part = rows.amax(dim=0)
            elif req.pooling == "weightedmean":
                weights = torch.arange(start + 1, end + 1, dtype=torch.float32, device=rows.device)
                part = weights @ rows
            else:
                part = rows.sum(dim=0)
            if start == 0 or req.pooling_state is None:
                req.pooling_state = part
            elif req.pooling == "max":
                torch.maximum(req.pooling_state, part, out=req.pooling_state)
            else:
                req.pooling_state += part

    def _forward(self, inputs: BatchInputs, input_ids: Tensor, on_device: list[Tensor], replay: bool,
                 lora_select: Tensor | None, images: tuple[Tensor, Tensor] | None = None,
                 rope: Tensor | None = None, key_limits: Tensor | None = None) -> Tensor:
        """The hidden states of a step whose inputs are on the device (``on_device``: positions, slot
        mapping, context lengths, block tables and, unless it replays a decode graph, query starts; ``key_limits``:
        ``key_limits``'s)."""
        positions, slot_mapping, context_lens, block_tables = on_device[:4]
        if replay:
            assert self.decode_graphs is not None
            # Its hidden rows are the real rows only, all a step with one token per sequence needs.
            return self.decode_graphs.run(dataclasses.replace(
                inputs, input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                context_lens=context_lens, block_tables=block_tables), lora_select)
        meta = AttentionMetadata(slot_mapping=slot_mapping, block_tables=block_tables, query_start_loc=on_device[4],
                                 context_lens=context_lens, max_query_len=inputs.max_query_len,
                                 host_query_start_loc=inputs.query_start_loc, host_context_lens=inputs.context_lens,
                                 key_limits=key_limits)
        if images is not None or rope is not None:
            hidden: Tensor = self.model(input_ids, positions, meta, self.kv_cache, images, rope)
        else:
            hidden = self.model(input_ids, positions, meta, self.kv_cache)
        return hidden

    @torch.inference_mode()
    def execute_worker_step(self, header: StepHeader, host: dict[str, Tensor]) -> None:
        """A tensor-parallel worker's share of the forward rank 0 runs (``execute``): its block copies, its
        input ids from rank 0, then the same forward (decode graph or not, as rank 0 decides from the same
        inputs). Nothing is sampled here."""
        dev = self.device
        self.num_steps += 1
        if header.copies:
            src, dst = zip(*header.copies, strict=True)
            self.kernels.copy_blocks(self.kv_cache, long_tensor(src, dev), long_tensor(dst, dev))
        input_ids = self.tp.broadcast(torch.empty(header.num_tokens, dtype=torch.long, device=dev))
        inputs = BatchInputs(input_ids=input_ids, positions=host["positions"], slot_mapping=host["slot_mapping"],
                             block_tables=host["block_tables"], query_start_loc=host["query_start_loc"],
                             context_lens=host["context_lens"], max_query_len=header.max_query_len,
                             sample_idx=torch.empty(0, dtype=torch.long))
        replay = self.decode_graphs is not None and self.decode_graphs.fits(inputs)
        on_device = to_device_all([inputs.positions, inputs.slot_mapping, inputs.context_lens, inputs.block_tables,
                                   *(() if replay else (inputs.query_start_loc,))], dev)
        self._forward(inputs, input_ids, on_device, replay, None)

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: Tensor, query_start: list[int]) -> None:
        """Compute, for each collecting request, the logprobs of the prompt tokens this step's chunk
        predicts (position p's hidden state gives token p + 1), skipping positions a recompute after
        preemption already gave; they go to the host without waiting and join the request's
        ``prompt_logprobs`` in ``flush_prompt_logprobs`` (a read here would wait for this step's
        forward, which under async scheduling the host is meant to run ahead of)."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[tuple[list[PromptLogprob | None], int, int]] = []  # (list, positions, top k)
        pending = self._prompt_logprobs_pending
        for i, s in enumerate(out.scheduled):
            req = s.request
            collected = req.prompt_logprobs
            if collected is None:
                continue
            start = req.num_computed_tokens
            end = min(start + s.num_new_tokens, req.num_prompt_tokens - 1)
            first = max(start, len(collected) + pending.positions.get(id(collected), 0) - 1)
            if first >= end:
                continue
            rows += range(query_start[i] + first - start, query_start[i] + end - start)
            targets += req.all_token_ids[first + 1 : end + 1]
            owners.append((collected, end - first, req.sampling_params.prompt_logprobs or 0))
        if not rows:
            return
        k_max = max(k for _, _, k in owners)
        tables: list[Tensor] = []
        for at in range(0, len(rows), _PROMPT_LOGPROB_ROWS):  # bounded [rows, vocab] temporaries
            idx = long_tensor(rows[at : at + _PROMPT_LOGPROB_ROWS], hidden.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[idx]).float(), dim=-1)
            target = long_tensor(targets[at : at + _PROMPT_LOGPROB_ROWS], hidden.device)
            chosen = logprobs.gather(1, target.unsqueeze(1))
            parts = [chosen, (logprobs > chosen).sum(dim=1, keepdim=True) + 1]
            if k_max:
                top = logprobs.topk(k_max, dim=-1)
                parts += [top.values, top.indices]
            tables.append(torch.cat([p.double() for p in parts], dim=1))  # float64: ids stay exact
        table = to_host(tables[0] if len(tables) == 1 else torch.cat(tables))
        event = None
        if hidden.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        pending.add(_PromptLogprobTable(self.num_steps, table, event, owners, targets, k_max))

    def flush_prompt_logprobs(self, up_to_step: int) -> None:
        """Append to their requests' ``prompt_logprobs`` the entries computed by steps up to
        ``up_to_step`` (``num_steps`` after that step's ``execute``), in step order, waiting for their
        copies; those of later steps stay on their way."""
        pending = self._prompt_logprobs_pending
        while pending.tables and pending.tables[0].step <= up_to_step:
            entry = pending.tables.popleft()
            if entry.event is not None:
                entry.event.synchronize()
            lines: list[list[float]] = entry.table.tolist()
            k_max, at = entry.k_max, 0
            for collected, count, k in entry.owners:
                for line, token in zip(lines[at : at + count], entry.targets[at : at + count], strict=True):
                    alts = [TokenLogprob(int(line[2 + k_max + j]), line[2 + j]) for j in range(k)]
                    collected.append(PromptLogprob(token, line[0], int(line[1]), alts))
                at += count
                pending.done(collected, count)


def _image_group(prompt: list[int], image: ImageInput, token: int, k: int) -> tuple[int, int]:
    """The positions [first, end) of an image's tokens (``token``) in its span, which must be one run."""
    span = prompt[image.offset:image.offset + image.length]
    first = span.index(token)
    end = first + span[first:].count(token)
    if span[first:end].count(token) != end - first:
        raise ValueError(f"images[{k}]: its image tokens (id {token}) must be one run in its span")
    return image.offset + first, image.offset + end
