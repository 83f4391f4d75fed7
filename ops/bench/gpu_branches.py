"""The sampler's GPU branches taken on the CPU, its Triton kernels recorded instead of run.

A GPU runs the sampler's Triton path: one kernel each for the penalties, for top-k / top-p / min-p,
for every row's draw and for the logprob table; no block maxima and no chunks (those are the CPU's).
Within ``gpu_branches()`` a sampler built with ``kernel_backend="triton"`` takes those branches here:
each kernel is recorded (``pdserve_kernels.launch_recorder``) and runs nothing, and what the host reads
of their outputs is zeros (token 0 for every sampled row, a logprob table of zeros). What is left is
what the host does around the kernels, and the torch operations a GPU would run beside them: ``pdserve
bench overhead forward --cases sample`` counts them, and ``pdserve bench overhead`` times them over few
logits (the GPU path's host share).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import _disable_current_modes

from pdserve_kernels.launch_recorder import Launch, recording


@contextlib.contextmanager
def gpu_branches() -> Iterator[list[Launch]]:
    """Within it, samplers take a GPU's branches (see the module); yields the list of recorded launches,
    which the caller may clear between steps."""
    import common.engine.row_ops as row_ops
    import common.engine.sampler as sampler_module
    import pdserve_kernels.triton_logprobs as triton_logprobs
    import pdserve_kernels.triton_sampling as triton_sampling

    def zeroed(real: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> torch.Tensor:  # the recorded kernel wrote nothing: zeros, uncounted
            out: torch.Tensor = real(*args, **kwargs)
            with _disable_current_modes():
                return out.zero_()

        return run

    with contextlib.ExitStack() as stack:
        launches = stack.enter_context(recording())[0]
        stack.enter_context(mock.patch.object(row_ops, "blocks_pay", lambda x: False))
        stack.enter_context(mock.patch.object(sampler_module, "CPU_CHUNK_BYTES", 1 << 62))
        stack.enter_context(mock.patch.object(triton_sampling, "seeded_race", zeroed(triton_sampling.seeded_race)))
        stack.enter_context(mock.patch.object(triton_logprobs, "logprob_table", zeroed(triton_logprobs.logprob_table)))
        yield launches
