"""Decode steps replayed from CUDA graphs: one kernel launch per step instead of hundreds.

A decode step of a small model is a few milliseconds of GPU work cut into hundreds of kernels
(projections, norms, rotary, KV stores, attention, MLP in every layer); launched one by one from
Python, their launch cost is about as long as the work. A CUDA graph records the launches of one
forward once and replays them with one call. A graph replays fixed shapes and fixed addresses, so:

* Graphs are captured for a few batch sizes (``graph_batch_sizes``: 1, 2, 4, 8, then every 16 up
  to ``max_batch_size``), and a decode step of ``n`` sequences runs the smallest one that holds
  ``n``; the rows past ``n`` are padding.
* Every input lives in a static buffer sized for the largest graph, and a step copies its inputs
  there: token ids, positions, slots, context lengths and block tables. A padding row has slot -1
  (its K/V is not stored), context length 0 (its attention reads nothing and outputs zeros) and
  token 0 at position 0. Rows do not mix in any layer, so padding changes no real row.
* The block tables keep the full width (``max_model_len`` over the block size) whatever the step
  holds: the attention kernel sizes its work from that width (never from the lengths, which a
  graph could not read on the host), and a context shorter than it only reads its own blocks.

Only steps with one new token per sequence replay (decode steps, and a prompt's last one-token
chunk, whose rows are all a step like that needs); prefill chunks, mixed steps and steps with more
sequences than the largest graph run eagerly.

A graph runs the split-context attention kernel with as many splits as the full-width table allows,
where an eager step sizes them from its own table, so the two sum a row's attention in different
orders: their outputs can differ in the last bits, and a greedy token now and then. What a replay
must equal exactly is the same padded forward run eagerly (``capture=False``), and the GPU bench
checks that.

With LoRA adapters (``common.model.lora``), the graphs hold the adapted projections' mixed form: each
row's one-hot of its adapter slot is one more static buffer (zeros for a row of the base model, and for
padding), so a decode step with adapters replays too; one without them adds exact zeros.

Graphs need the Triton kernels (the torch reference reads lengths on the host, which a capture
cannot hold) and a CUDA device; ``--enforce-eager`` turns them off, as vLLM's flag does.

The same padded static-buffer forward runs eagerly where there is no CUDA (``capture=False``), so
the padding is tested on any machine; the capture and replay themselves only run on a GPU, in
``pdserve bench gpu``'s engine section (a replay against the padded forward run eagerly, and the
decode step time with graphs off and on).
"""

from __future__ import annotations

import bisect
import logging
from typing import Any

import torch
from torch import Tensor

from common.engine.input_batch import BatchInputs
from common.model.llama import AttentionMetadata
from common.model.lora import LoRAManager

logger = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 16
MAX_GRAPH_BATCH_SIZE = 512


def graph_batch_sizes(max_num_seqs: int, limit: int = MAX_GRAPH_BATCH_SIZE) -> list[int]:
    """The padded batch sizes to capture: 1, 2, 4, 8, 16, 32, ... up to ``min(max_num_seqs, limit)``,
    which is always one of them."""
    if max_num_seqs < 1 or limit < 1:
        raise ValueError(f"graph batch sizes need max_num_seqs and limit >= 1, got {max_num_seqs}, {limit}")
    top = min(max_num_seqs, limit)
    sizes = {s for s in SMALL_SIZES if s <= top} | set(range(SIZE_STEP, top + 1, SIZE_STEP)) | {top}
    return sorted(sizes)


class DecodeGraphs:
    """Static input buffers for decode steps of up to ``max(sizes)`` sequences, and one graph per
    size once ``capture`` ran (on CUDA). ``run`` takes a decode-only step's inputs and returns the
    hidden states of its real rows."""

    def __init__(
        self, model: Any, kv_cache: Tensor, sizes: list[int], max_blocks_per_seq: int, capture: bool = True,
        lora: LoRAManager | None = None,
    ) -> None:
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"graph batch sizes must be ascending positive integers, got {sizes}")
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sizes
        self.use_graphs = capture
        if capture and kv_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the KV cache is on {kv_cache.device}")
        dev = kv_cache.device
        top = sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.long, device=dev)
        self.context_lens = torch.zeros(top, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(top, max(1, max_blocks_per_seq), dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=dev)
        # LoRA: each row's adapter slot, one-hot (``LoRABatch.select``); all zeros for none.
        self.lora = lora
        self.lora_select = (None if lora is None else
                            torch.zeros(top, len(lora.adapters), 1, dtype=lora.dtype, device=dev))
        self.hidden: Tensor | None = None  # [top, hidden], written by every replay
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_runs = 0  # steps run through the static buffers (replayed, or eagerly without capture)

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def padded_size(self, num_seqs: int) -> int | None:
        """The graph that holds ``num_seqs`` sequences; None when none does."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def fits(self, inputs: BatchInputs) -> bool:
        """Whether this step replays: decode only, within the largest graph, its tables within the width."""
        num_seqs = inputs.context_lens.shape[0]
        return (
            inputs.max_query_len == 1 and inputs.input_ids.shape[0] == num_seqs
            and 0 < num_seqs <= self.max_batch_size and inputs.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1], context_lens=self.context_lens[:size], max_query_len=1,
        )

    def _forward(self, size: int) -> Tensor:
        if self.lora is not None and self.lora_select is not None:  # the adapted projections read the static rows
            self.lora.batch.whole, self.lora.batch.select = None, self.lora_select[:size]
        return self.model(self.input_ids[:size], self.positions[:size], self._meta(size), self.kv_cache)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per size, the largest first, all in one memory pool (a replay's temporaries
        share it: steps run one at a time). Each size runs once before its capture, which compiles
        the kernels and settles their allocations; each graph ends by writing its rows of one shared
        output buffer."""
        assert self.use_graphs
        dev = self.kv_cache.device
        with torch.cuda.device(dev):  # the capture stream and Triton's launches on the cache's device
            self.hidden = torch.empty_like(self._forward(self.max_batch_size))
            pool = None
            for size in reversed(self.sizes):
                self._forward(size)  # warm-up, outside the graph
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.hidden[:size].copy_(self._forward(size))
                self.graphs[size] = graph
                pool = graph.pool()
            torch.cuda.synchronize(dev)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def load(self, inputs: BatchInputs, size: int, lora_select: Tensor | None = None) -> None:
        """Copy a step's inputs, already on the buffers' device (the runner sends them up in one copy,
        through pinned memory: ``host_tensors.to_device_all``), into the static buffers' first rows; rows
        up to ``size`` become padding. ``lora_select``: the rows' adapter slots, one-hot (None: none)."""
        n = inputs.context_lens.shape[0]
        width = inputs.block_tables.shape[1]
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(inputs.slot_mapping, non_blocking=True)
        self.context_lens[:n].copy_(inputs.context_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(inputs.block_tables, non_blocking=True)
        if self.lora_select is not None:
            if lora_select is None:
                self.lora_select[:size].zero_()
            else:
                self.lora_select[:n].copy_(lora_select, non_blocking=True)
                self.lora_select[n:size].zero_()
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.context_lens[n:size].zero_()

    @torch.inference_mode()
    def run(self, inputs: BatchInputs, lora_select: Tensor | None = None) -> Tensor:
        """Hidden states ``[num_seqs, hidden]`` of a step that ``fits``: replayed from its graph, or (no
        capture) the same padded forward run eagerly. ``lora_select``: as ``load``'s."""
        n = inputs.context_lens.shape[0]
        size = self.padded_size(n)  # the caller checked ``fits``
        assert size is not None, "run() takes only decode steps that fit a graph"
        self.load(inputs, size, lora_select)
        self.num_runs += 1
        if not self.use_graphs:
            return self._forward(size)[:n]
        with torch.cuda.device(self.kv_cache.device):
            self.graphs[size].replay()
        assert self.hidden is not None
        return self.hidden[:n]
