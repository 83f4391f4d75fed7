"""``common.engine.host_tensors`` on the CPU: lists become tensors of the right dtype and values, and
sending tensors to the CPU hands them back unchanged, not copies; the pinned ring's packing. Its upload is
checked on a GPU by ``pdserve bench gpu`` (``check_staging``: uploads behind a held-back stream)."""

from __future__ import annotations

import torch

from common.engine.host_tensors import (
    bool_tensor,
    float_tensor,
    int_tensor,
    long_tensor,
    long_tensors,
    pack,
    to_device_all,
)


def test_each_list_becomes_the_tensor_torch_tensor_would_make() -> None:
    for make, values, dtype in ((long_tensor, [3, -1, 2**40], torch.long), (int_tensor, [7, -2], torch.int32),
                                (float_tensor, [0.5, -1.25], torch.float32), (bool_tensor, [True, False], torch.bool)):
        t = make(values)
        assert t.dtype == dtype and t.tolist() == values
        assert make([]).shape == (0,) and make([]).dtype == dtype


def test_several_lists_go_together_in_their_order_empty_ones_included() -> None:
    lists = [[1, 2, 3], [], [2**50], list(range(100))]
    tensors = long_tensors(lists)
    assert [t.tolist() for t in tensors] == lists
    assert all(t.dtype == torch.long for t in tensors)


def test_to_the_cpu_the_tensors_are_handed_back_themselves() -> None:
    a, b = torch.arange(6).view(2, 3), torch.ones(4, dtype=torch.int32)
    out = to_device_all([a, b], "cpu")
    assert out[0] is a and out[1] is b


def test_packing_puts_each_tensors_bytes_at_its_offset_contiguous_or_not_and_nothing_else() -> None:
    """What the pinned ring sends up in one copy (``pack``): each tensor's bytes at its offset, read back
    through a view of its dtype and shape; a strided one too; the bytes between them untouched."""
    buffer = torch.full((256,), 0xAB, dtype=torch.uint8)
    grid = torch.arange(24, dtype=torch.int32).view(4, 6)
    tensors = [torch.tensor([7, -1, 2**40]), grid[:, ::2], torch.tensor([True, False, True]), torch.empty(0),
               torch.tensor([0.5, -2.0])]
    offsets = [0, 32, 96, 112, 128]
    pack(tensors, buffer, offsets)
    for t, offset in zip(tensors, offsets, strict=True):
        n = t.numel() * t.element_size()
        assert torch.equal(buffer[offset : offset + n].view(t.dtype).view(t.shape), t)
    written = {i for t, o in zip(tensors, offsets, strict=True) for i in range(o, o + t.numel() * t.element_size())}
    assert all(int(buffer[i]) == 0xAB for i in range(256) if i not in written)
