"""How a request's blocks are cut into data frames, and the receiver's check of their order.

A frame holds ``num_layers`` consecutive layers of ``num_blocks`` consecutive sent blocks, packed
as ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``. Layer groups come
outermost; a group too large for one frame is cut along blocks. Frames arrive in plan order, so
the receiver checks each one against a cursor instead of tracking arbitrary rectangles.
"""

from __future__ import annotations

from typing import NamedTuple

TARGET_FRAME_BYTES = 4 << 20  # big enough to amortise per-message costs, small enough to pipeline


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


def plan_frames(
    num_layers: int, num_blocks: int, layers_per_frame: int, bytes_per_block_layer: int, max_frame_bytes: int
) -> list[FrameSpec]:
    """Frames covering every layer of ``num_blocks`` blocks, each at most ``max_frame_bytes``."""
    if num_blocks == 0:
        return []
    if bytes_per_block_layer > max_frame_bytes:
        raise ValueError(f"one block of one layer ({bytes_per_block_layer} B) exceeds the frame limit")
    group = max(1, min(layers_per_frame, num_layers, max_frame_bytes // bytes_per_block_layer))
    frames = []
    for layer_start in range(0, num_layers, group):
        layers = min(group, num_layers - layer_start)
        step = max(1, max_frame_bytes // (layers * bytes_per_block_layer))
        for block_start in range(0, num_blocks, step):
            frames.append(FrameSpec(layer_start, layers, block_start, min(step, num_blocks - block_start)))
    return frames


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
