"""How a request's blocks are cut into data frames, and the receiver's check of their order.

A frame holds ``num_layers`` consecutive layers of ``num_blocks`` consecutive sent blocks, laid
out as ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``. Layer groups come
outermost; a group too large for one frame is cut along blocks. Frames arrive in plan order, so
the receiver checks each one against a cursor instead of tracking arbitrary rectangles.

A frame's bytes may come in several parts, up to ``MAX_DATA_PARTS``: a sender sends each long run
of consecutive block ids straight from its cache (one part per plane of the run) and gathers only
the rest. A plane is one layer's K or V of the frame's blocks; a block-plane is one block of a
plane. Every part holds whole block-planes, and the parts concatenate to the frame's layout.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from typing import NamedTuple

TARGET_FRAME_BYTES = 4 << 20  # big enough to amortise per-message costs, small enough to pipeline
MAX_DATA_PARTS = 1024  # raw parts of one Data message; a sender gathers more runs than fit


def auto_layers_per_frame(
    num_blocks: int, bytes_per_block_layer: int, target_bytes: int = TARGET_FRAME_BYTES
) -> int:
    """Layers per frame so that a frame of ``num_blocks`` blocks holds about ``target_bytes``."""
    return max(1, target_bytes // max(1, num_blocks * bytes_per_block_layer))


class FrameSpec(NamedTuple):
    layer_start: int
    num_layers: int
    block_start: int
    num_blocks: int


def layer_group(num_layers: int, layers_per_frame: int, bytes_per_block_layer: int, max_frame_bytes: int) -> int:
    """Layers per frame in ``plan_frames``: as asked, within the model and the frame limit."""
    return max(1, min(layers_per_frame, num_layers, max_frame_bytes // bytes_per_block_layer))


def plan_frames(
    num_layers: int,
    num_blocks: int,
    layers_per_frame: int,
    bytes_per_block_layer: int,
    max_frame_bytes: int,
) -> list[FrameSpec]:
    """Frames covering every layer of ``num_blocks`` blocks, each at most ``max_frame_bytes``."""
    if num_blocks == 0:
        return []
    if bytes_per_block_layer > max_frame_bytes:
        raise ValueError(f"one block of one layer ({bytes_per_block_layer} B) exceeds the frame limit")
    group = layer_group(num_layers, layers_per_frame, bytes_per_block_layer, max_frame_bytes)
    frames = []
    for layer_start in range(0, num_layers, group):
        layers = min(group, num_layers - layer_start)
        step = max(1, max_frame_bytes // (layers * bytes_per_block_layer))
        for block_start in range(0, num_blocks, step):
            frames.append(FrameSpec(layer_start, layers, block_start, min(step, num_blocks - block_start)))
    return frames


class BlockRuns:
    """A list of block ids and its runs of consecutive ids (``5, 6, 7`` is one run)."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = list(ids)
        self.starts = [i for i in range(len(self.ids)) if i == 0 or self.ids[i] != self.ids[i - 1] + 1]

    def runs(self, start: int = 0, count: int | None = None) -> list[tuple[int, int, int]]:
        """``(index, length, first id)`` of each run inside ``ids[start:start + count]``, in order."""
        end = len(self.ids) if count is None else start + count
        out = []
        i = bisect_right(self.starts, start) - 1
        pos = start
        while pos < end:
            nxt = self.starts[i + 1] if i + 1 < len(self.starts) else len(self.ids)
            stop = min(nxt, end)
            out.append((pos, stop - pos, self.ids[pos]))
            pos, i = stop, i + 1
        return out

    def num_runs(self, start: int, count: int) -> int:
        """How many runs ``ids[start:start + count]`` holds, without listing them (``count`` > 0)."""
        return bisect_left(self.starts, start + count) - bisect_right(self.starts, start) + 1


def check_parts(
    lengths: Sequence[int], spec: FrameSpec, bytes_per_block_layer: int, max_parts: int = MAX_DATA_PARTS
) -> str | None:
    """Why data parts of these lengths cannot carry the frame ``spec``, or ``None`` when they can."""
    block_plane = bytes_per_block_layer // 2
    expected = 2 * spec.num_layers * spec.num_blocks * block_plane
    if not 1 <= len(lengths) <= max_parts:
        return f"frame in {len(lengths)} parts, expected 1 to {max_parts}"
    if sum(lengths) != expected:
        return f"frame of {sum(lengths)} bytes, expected {expected}"
    if any(n <= 0 or n % block_plane for n in lengths):
        shown = list(lengths[:8]) + (["..."] if len(lengths) > 8 else [])
        return f"frame parts of {shown} bytes, expected whole block-planes of {block_plane}"
    return None


class FrameCursor:
    """Accepts only frames that continue the tiling where the previous one stopped."""

    def __init__(self, num_layers: int, num_blocks: int) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self._layer = 0
        self._group = 0  # layers in the current group, fixed by its first frame
        self._block = 0

    @property
    def done(self) -> bool:
        return self._layer >= self.num_layers or self.num_blocks == 0

    def check(self, spec: FrameSpec) -> str | None:
        """Why ``spec`` cannot come next, or ``None`` when it can. Does not advance."""
        if self.done:
            return "frame after the last one"
        if spec.layer_start != self._layer or spec.block_start != self._block:
            return (
                f"frame at layer {spec.layer_start} block {spec.block_start}, "
                f"expected layer {self._layer} block {self._block}"
            )
        if self._block and spec.num_layers != self._group:
            return f"frame of {spec.num_layers} layers inside a group of {self._group}"
        if spec.layer_start + spec.num_layers > self.num_layers:
            return f"layers up to {spec.layer_start + spec.num_layers} of {self.num_layers}"
        if spec.block_start + spec.num_blocks > self.num_blocks:
            return f"blocks up to {spec.block_start + spec.num_blocks} of {self.num_blocks}"
        return None

    def advance(self, spec: FrameSpec) -> None:
        """Move past ``spec``; call only after ``check(spec)`` returned ``None``."""
        self._group = spec.num_layers
        self._block += spec.num_blocks
        if self._block == self.num_blocks:
            self._layer += spec.num_layers
            self._block = 0
