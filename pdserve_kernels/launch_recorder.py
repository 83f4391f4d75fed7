"""Every Triton kernel of the package stood in by a recorder: ``kernel[grid](*args, **kwargs)`` records
the launch (its arguments bound by name, its launch options apart) and runs nothing.

Two users: the ahead-of-time compile check compiles each recorded launch for a GPU it does not have,
and ``pdserve bench overhead forward`` counts what a forward launches. Works for kernels compiled by
the JIT and for kernels under Triton's interpreter alike.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# The modules that define the package's Triton kernels (each imports triton).
TRITON_MODULES = ("triton_act", "triton_decode", "triton_packed_linear", "triton_kv", "triton_logprobs", "triton_moe", "triton_norm", "triton_nucleus",
                  "triton_penalties", "triton_prefill", "triton_rope", "triton_sampling")
# Keyword arguments of a launch that are options, not the kernel's arguments.
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion")


@dataclass
class Launch:
    scenario: str  # what the recording's caller was doing (``recording``'s ``scenario[0]`` at the launch)
    fn: Any  # the JITFunction (or InterpretedFunction)
    args: dict[str, Any]
    options: dict[str, Any]

    @property
    def name(self) -> str:
        return str(getattr(self.fn, "__name__", self.fn))


class Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch instead."""

    def __init__(self, fn: Any, launches: list[Launch], scenario: list[str]) -> None:
        self.fn, self.launches, self.scenario = fn, launches, scenario

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
            bound = dict(zip(self.fn.arg_names, args, strict=False)) | kwargs
            self.launches.append(Launch(self.scenario[0], self.fn, bound, options))

        return record


@contextlib.contextmanager
def recording() -> Iterator[tuple[list[Launch], list[str]]]:
    """Within it, every ``*_kernel`` of ``TRITON_MODULES`` records its launches into the list it yields
    (with the scenario string the caller keeps in the one-element list it yields beside)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    scenario = [""]
    swapped = []
    for module in (importlib.import_module(f"pdserve_kernels.{name}") for name in TRITON_MODULES):
        for name, value in vars(module).items():
            if isinstance(value, (JITFunction, InterpretedFunction)) and name.endswith("_kernel"):
                swapped.append((module, name, value))
                setattr(module, name, Recorder(value, launches, scenario))
    try:
        yield launches, scenario
    finally:
        for module, name, value in swapped:
            setattr(module, name, value)
