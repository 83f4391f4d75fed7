"""Structured output inside an engine: compiled grammars, each request's state, the batched mask.

Each engine compiles a request's grammar (``common/structured_output.py``) against its own tokenizer
once per spec (``GrammarCache``, least recently used out first) and gives every constrained request
its own ``GrammarState``. The sampler has each constrained row's state fill its row of a token
bitmask, then masks all those rows in one batched op (``apply_token_bitmask``); the request advances
its state with every token it appends, and a state that accepted a stop token has ended the request.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from common.engine.host_tensors import long_tensor, to_device
from common.sampling_params import StructuredOutput
from common.structured_output import build_grammar, clean_error, structural_tag_tokens

if TYPE_CHECKING:
    import xgrammar

# Compiled grammars kept per engine; a JSON schema's is tens to hundreds of KB.
MAX_CACHED_GRAMMARS = 64


class GrammarState:
    """One request's position in its grammar. ``fork`` copies it (n > 1 choices)."""

    __slots__ = ("_matcher", "rejected")

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self._matcher = matcher
        self.rejected = False  # a token outside the grammar was appended: the request is failed

    def accept(self, token_id: int) -> bool:
        if not self._matcher.accept_token(token_id):
            self.rejected = True
        return not self.rejected

    @property
    def terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted: the request ends ("stop")."""
        return bool(self._matcher.is_terminated())

    def fill_bitmask(self, bitmask: Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (bit set: allowed)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def fork(self) -> GrammarState:
        state = GrammarState(self._matcher.fork())
        state.rejected = self.rejected
        return state


class GrammarCache:
    """Compiles specs against the model's tokenizer, each once while it stays among the
    ``max_entries`` most recently used. The tokenizer is loaded on the first compile (``load_tokenizer``);
    ``vocab_size`` is the width of the model's logits, which may exceed the tokenizer's (padding ids
    are never allowed). Safe to call from several threads."""

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: list[int],
        max_entries: int = MAX_CACHED_GRAMMARS,
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_entries = max_entries
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiled: OrderedDict[StructuredOutput, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            # Our own cache keys by spec; xgrammar's would hold a second copy.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, so: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``so``; ``ValueError`` for an invalid spec."""
        with self._lock:
            compiled = self._compiled.get(so)
            if compiled is not None:
                self._compiled.move_to_end(so)
                return compiled
            grammar = build_grammar(so)
            try:
                if so.kind == "structural_tag" and structural_tag_tokens(json.loads(so.spec)):
                    compiled = self._get_compiler().compile_structural_tag(so.spec)  # its tokens by this tokenizer
                else:
                    compiled = self._get_compiler().compile_grammar(grammar)
            except RuntimeError as exc:
                raise ValueError(f"invalid {so.kind}: {clean_error(exc)}") from None
            self.num_compiled += 1
            self._compiled[so] = compiled
            if len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
            return compiled

    def new_state(self, so: StructuredOutput, output_token_ids: Sequence[int] = ()) -> GrammarState:
        """A fresh state for ``so`` that has accepted ``output_token_ids`` (a request resumed, or
        continued on this instance after tokens sampled elsewhere); ``ValueError`` if the spec is
        invalid or those tokens leave the grammar."""
        import xgrammar as xgr

        state = GrammarState(xgr.GrammarMatcher(self.compile(so)))
        for i, token_id in enumerate(output_token_ids):
            if state.terminated or not state.accept(token_id):
                raise ValueError(f"output token {i} ({token_id}) does not match the request's {so.kind}")
        return state


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: list[int]) -> None:
    """In place, set ``logits[row, t]`` to -inf wherever bit ``t`` of ``bitmask[row]`` is clear, for
    every row in ``rows``; other rows are not read. ``bitmask`` is int32 ``[>= rows, ceil(vocab / 32)]``
    on the CPU (where xgrammar fills it). One batched op however many rows."""
    if logits.device.type == "cpu":
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
    else:
        _masked_fill_torch(logits, bitmask, rows)


def _masked_fill_torch(logits: Tensor, bitmask: Tensor, rows: list[int]) -> None:
    """``apply_token_bitmask`` in plain torch ops, for any device: no kernel to build."""
    vocab = logits.shape[-1]
    index = long_tensor(rows, logits.device)
    words = to_device(bitmask[rows], logits.device)  # pinned, not blocking: no wait for the queued forward
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))
