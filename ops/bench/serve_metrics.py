"""Per-request measurements of a serving run and the summary figures computed from them.

Pure arithmetic over samples (no I/O), so the tests can check it on synthetic numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds, ``start_s`` relative to the run start."""

    ok: bool
    kind: str = "main"
    prompt_len: int = 0
    max_tokens: int = 0
    output_tokens: int = 0  # from the usage chunk when the server sends one, else content chunks
    start_s: float = 0.0
    ttft_s: float = math.nan  # request sent -> first chunk with content
    e2e_s: float = math.nan  # request sent -> last byte of the response
    itl_s: list[float] = field(default_factory=list)  # gaps between successive content chunks
    error: str = ""

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (nan for a single-token answer)."""
        if self.output_tokens < 2:
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("itl_s")
        data["tpot_s"] = self.tpot_s
        data["num_chunks"] = len(self.itl_s) + (1 if self.ok and not math.isnan(self.ttft_s) else 0)
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in data.items()}


@dataclass(frozen=True)
class SLO:
    """A request is good when its TTFT and its mean inter-token latency (TPOT) are both within."""

    ttft_ms: float | None = None
    itl_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return self.ttft_ms is not None or self.itl_ms is not None

    def met_by(self, result: RequestResult) -> bool:
        if not result.ok:
            return False
        if self.ttft_ms is not None and not result.ttft_s * 1000 <= self.ttft_ms:
            return False
        tpot = result.tpot_s
        return self.itl_ms is None or math.isnan(tpot) or tpot * 1000 <= self.itl_ms


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method); nan for no values."""
    data = sorted(v for v in values if not math.isnan(v))
    if not data:
        return math.nan
    rank = (len(data) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float]:
    """mean and p50/p90/p99 of seconds, in milliseconds."""
    finite = [v for v in values_s if not math.isnan(v)]
    out = {"mean": (sum(finite) / len(finite) * 1000) if finite else math.nan}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(finite, q) * 1000
    return out


def summarize(results: Sequence[RequestResult], duration_s: float, slo: SLO | None = None) -> dict[str, Any]:
    """Throughput, latency distributions and goodput of one run (failed requests count as not good)."""
    ok = [r for r in results if r.ok]
    num_output = sum(r.output_tokens for r in ok)
    num_good = sum(1 for r in ok if slo.met_by(r)) if slo is not None and slo.is_set else len(ok)
    duration_s = max(duration_s, 1e-9)
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": sum(r.prompt_len for r in ok),
        "total_output_tokens": num_output,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": num_output / duration_s,
        "ttft_ms": distribution_ms([r.ttft_s for r in ok]),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl_s]),
        "tpot_ms": distribution_ms([r.tpot_s for r in ok]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok]),
        "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms} if slo else None,
        "num_good": num_good,
        "goodput": num_good / duration_s,
        "good_fraction": num_good / len(results) if results else math.nan,
    }


def summarize_by_kind(
    results: Sequence[RequestResult], duration_s: float, slo: SLO | None = None
) -> dict[str, dict[str, Any]]:
    """``summarize`` per workload class, when a workload mixes classes (e.g. decodes and long prompts)."""
    kinds = sorted({r.kind for r in results})
    if len(kinds) < 2:
        return {}
    return {k: summarize([r for r in results if r.kind == k], duration_s, slo) for k in kinds}


def prefix_reuse(
    before: dict[str, float], after: dict[str, float], num_requests: int, prefix_len: int, block_size: int,
    num_prefixes: int = 1,
) -> dict[str, Any]:
    """How much of the common prefixes came from a cache, from the engines' prefix-cache counters.

    ``reused = hits / (num_requests * prefix_len)``. Every request is in the denominator, the first
    of each prefix included: it necessarily computes its prefix, so the best possible value is
    ``(num_requests - num_prefixes) / num_requests`` (less when requests arrive before the prefix is cached).
    Hits are counted in whole blocks, so a prefix that is not a multiple of the block size can
    reuse at most its full blocks. Hits beyond the prefix are not credited (the distinct questions
    share no full block, so there should be none).
    """
    queries = after.get("pdserve:prefix_cache_queries_total", 0.0) - before.get(
        "pdserve:prefix_cache_queries_total", 0.0
    )
    hits = after.get("pdserve:prefix_cache_hits_total", 0.0) - before.get("pdserve:prefix_cache_hits_total", 0.0)
    denominator = num_requests * prefix_len
    prefix_hits = min(hits, denominator)
    cacheable = prefix_len // block_size * block_size if block_size else prefix_len
    return {
        "prefix_len": prefix_len,
        "num_prefixes": num_prefixes,
        "num_requests": num_requests,
        "prompt_tokens_queried": queries,
        "prompt_tokens_hit": hits,
        "prefix_tokens_reused": prefix_hits,
        "reused_fraction": prefix_hits / denominator if denominator else math.nan,
        "best_possible_fraction": (max(0, num_requests - num_prefixes) * cacheable / denominator
                                   if denominator else math.nan),
        "hit_fraction_of_all_prompt_tokens": hits / queries if queries else math.nan,
    }
