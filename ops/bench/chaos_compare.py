"""Chaos answers against reference answers: verdicts, lost or repeated tokens, extra latency.

Pure functions over sequences and numbers (no I/O), so the tests can check them on made-up data.

How a chaos answer is classified against the reference answer to the same request (both greedy):

* ``identical``: the same text.
* ``failed``: the chaos request did not complete (``reference-failed``: the reference did not).
* otherwise both texts are tokenized again with the model's tokenizer and compared token by token
  from the first token where they differ (position ``p``):
  * ``truncated``: the chaos answer is a strict prefix of the reference (``num_missing`` tokens lost
    at the end);
  * ``extra``: the reference is a strict prefix of the chaos answer (``num_duplicated`` tokens more);
  * ``duplicate``: after ``p`` the chaos answer picks the reference up again at an earlier position
    ``p - d`` (so ``d`` tokens already sent were sent again, e.g. a request restarted from its
    prompt alone); ``num_duplicated = d``;
  * ``missing``: after ``p`` it picks the reference up at a later position ``p + d`` (``d`` tokens
    skipped); ``num_missing = d``;
  * ``other``: no such realignment of at least ``MIN_REALIGN`` tokens (a different continuation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ops.bench.serve_metrics import percentile

MIN_REALIGN = 3  # tokens that must match again after a jump for it to count as one
VERDICTS = ("identical", "duplicate", "missing", "truncated", "extra", "other", "failed", "reference-failed")


@dataclass(frozen=True)
class Comparison:
    verdict: str
    num_duplicated: int = 0
    num_missing: int = 0
    diverge_at: int | None = None  # first differing token position, when both completed

    @property
    def identical(self) -> bool:
        return self.verdict == "identical"


def common_prefix_len(a: Sequence[Any], b: Sequence[Any]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def classify_tokens(reference: Sequence[Any], chaos: Sequence[Any]) -> Comparison:
    """Classify ``chaos`` against ``reference`` (token sequences); see the module docstring."""
    if list(reference) == list(chaos):
        return Comparison("identical")
    p = common_prefix_len(reference, chaos)
    if p == len(chaos):
        return Comparison("truncated", num_missing=len(reference) - p, diverge_at=p)
    if p == len(reference):
        return Comparison("extra", num_duplicated=len(chaos) - p, diverge_at=p)
    rest = chaos[p:]
    need = min(MIN_REALIGN, len(rest))
    best: tuple[int, int] | None = None  # (matched length, shift)
    for shift in range(-p, len(reference) - p):
        if shift == 0:
            continue
        matched = common_prefix_len(rest, reference[p + shift:])
        if matched >= need and (best is None or (matched, -abs(shift)) > (best[0], -abs(best[1]))):
            best = (matched, shift)
    if best is None:
        return Comparison("other", diverge_at=p)
    shift = best[1]
    if shift < 0:
        return Comparison("duplicate", num_duplicated=-shift, diverge_at=p)
    return Comparison("missing", num_missing=shift, diverge_at=p)


def compare_answer(
    reference_ok: bool, reference_text: str, chaos_ok: bool, chaos_text: str,
    tokenize: Any,
) -> Comparison:
    """Verdict for one request; ``tokenize(text) -> list[int]`` is only called when the texts differ."""
    if not reference_ok:
        return Comparison("reference-failed")
    if not chaos_ok:
        return Comparison("failed")
    if reference_text == chaos_text:
        return Comparison("identical")
    return classify_tokens(tokenize(reference_text), tokenize(chaos_text))


def count_verdicts(comparisons: Sequence[Comparison]) -> dict[str, int]:
    """How many requests got each verdict (every verdict listed, zeros included)."""
    return {v: sum(1 for c in comparisons if c.verdict == v) for v in VERDICTS}


def overlapping_faults(start_s: float, end_s: float, faults: Sequence[Any]) -> list[int]:
    """Indices of the faults (objects with ``overlaps(start, end)``) that fell inside a request."""
    if math.isnan(start_s) or math.isnan(end_s):
        return []
    return [i for i, f in enumerate(faults) if f.overlaps(start_s, end_s)]


def latency_summary(values_s: Sequence[float]) -> dict[str, Any]:
    """``num``, ``p50``, ``p99`` and ``max`` of seconds (nan where there are none)."""
    finite = [v for v in values_s if not math.isnan(v)]
    return {
        "num": len(finite), "p50": percentile(finite, 50), "p99": percentile(finite, 99),
        "max": max(finite) if finite else math.nan,
    }


def request_rows(
    requests: Sequence[Any], reference: Sequence[Any], chaos: Sequence[Any], faults: Sequence[Any], tokenize: Any,
) -> list[dict[str, Any]]:
    """One row per request: both passes' outcomes, the verdict, the faults it overlapped, extra latency.

    ``requests``: ``ChaosRequest``s; ``reference``/``chaos``: ``ChaosResult``s in the same order;
    ``faults``: ``Fault``s of the chaos pass. The texts are kept only where the answers differ.
    """
    rows = []
    for req, ref, got in zip(requests, reference, chaos, strict=True):
        comparison = compare_answer(ref.ok, ref.text, got.ok, got.text, tokenize)
        both_ok = ref.ok and got.ok
        row: dict[str, Any] = {
            "request_index": req.request_index, "kind": req.kind, "prompt_len": req.prompt_len,
            "max_tokens": req.max_tokens,
            "reference": _outcome(ref), "chaos": _outcome(got),
            "verdict": comparison.verdict, "num_duplicated": comparison.num_duplicated,
            "num_missing": comparison.num_missing, "diverge_at": comparison.diverge_at,
            "num_tokens_delta": (got.num_tokens - ref.num_tokens
                                 if both_ok and got.num_tokens is not None and ref.num_tokens is not None else None),
            "faults": overlapping_faults(got.start_s, got.end_s, faults),
            "extra_latency_s": got.latency_s - ref.latency_s if both_ok else math.nan,
        }
        if not comparison.identical:
            row["reference_text"], row["chaos_text"] = ref.text, got.text
        rows.append(row)
    return rows


def _outcome(result: Any) -> dict[str, Any]:
    return {
        "ok": result.ok, "start_s": result.start_s, "end_s": result.end_s, "latency_s": result.latency_s,
        "num_tokens": result.num_tokens, "num_chunks": result.num_chunks, "finish_reason": result.finish_reason,
        "error": result.error,
    }


def summarize_rows(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts, token losses and repeats, and latency figures over ``request_rows``' rows."""
    hit = [r for r in rows if r["faults"]]
    missed = [r for r in rows if not r["faults"]]
    verdicts = count_verdicts([Comparison(r["verdict"]) for r in rows])
    deltas = [r["num_tokens_delta"] for r in rows if r["num_tokens_delta"] is not None]
    return {
        "num_requests": len(rows),
        "num_reference_ok": sum(1 for r in rows if r["reference"]["ok"]),
        "num_completed": sum(1 for r in rows if r["chaos"]["ok"]),
        "num_identical": verdicts["identical"],
        "verdicts": verdicts,
        "num_tokens_duplicated": sum(r["num_duplicated"] for r in rows),
        "num_tokens_missing": sum(r["num_missing"] for r in rows),
        "num_usage_mismatch": sum(1 for d in deltas if d != 0),
        "num_overlapping_fault": len(hit),
        "reference_latency_s": latency_summary([r["reference"]["latency_s"] for r in rows if r["reference"]["ok"]]),
        "chaos_latency_s": latency_summary([r["chaos"]["latency_s"] for r in rows if r["chaos"]["ok"]]),
        "extra_latency_overlapping_s": latency_summary([r["extra_latency_s"] for r in hit]),
        "extra_latency_other_s": latency_summary([r["extra_latency_s"] for r in missed]),
    }
