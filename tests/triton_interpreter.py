"""A faster Triton interpreter for the suite: the language patched once per kernel launch, not again at
every call of a ``@triton.jit`` helper inside it.

Under ``TRITON_INTERPRET=1`` a kernel launch (``GridExecutor.__call__``) patches ``triton.language`` for the
interpreter and restores it afterwards; every call of a jitted helper from inside the kernel
(``InterpretedFunction.__call__``) patches it again, scanning the language's modules with
``inspect.getmembers`` (about 1.5 ms a call, never restored, finding nothing left to patch once the launch
has). A kernel that calls helpers per program spent most of its interpreted time there: the batched
sampler's chi-square test over 1,600 rows, the decode kernels of the CUDA-graph tests. Inside a launch a
helper patches at its module's first call, as before, and runs without patching again at the next ones; a
helper called outside any launch patches as before. What the kernels compute is unchanged: they run on the
same patched language.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_state = threading.local()


def install() -> None:
    """Patch the interpreter (idempotent); a no-op where Triton or its interpreter is missing."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    executor, function = interpreter.GridExecutor, interpreter.InterpretedFunction
    if getattr(executor.__call__, "_launch_depth", False):
        return
    if not hasattr(function, "rewrite"):  # another interpreter than the one this was written against
        return
    launch, helper_call = executor.__call__, function.__call__

    @functools.wraps(launch)
    def launch_counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(_state, "patched", None)
        _state.patched = set()  # the helper modules whose language this launch has patched
        try:
            return launch(self, *args, **kwargs)
        finally:
            _state.patched = outer

    @functools.wraps(helper_call)
    def helper_in_launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched = getattr(_state, "patched", None)
        key = id(self.fn.__globals__)
        if patched is None or key not in patched:  # outside a launch, or this module's first call in it
            if patched is not None:
                patched.add(key)
            return helper_call(self, *args, **kwargs)
        fn = self.rewrite()  # what the interpreter's own call runs once the language is patched
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    launch_counted._launch_depth = True  # type: ignore[attr-defined]
    executor.__call__ = launch_counted  # type: ignore[method-assign]
    function.__call__ = helper_in_launch  # type: ignore[method-assign]
