"""``pdserve bench chaos``'s pure parts: workload, answer classification, fault overlap, /metrics, the gate."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest

from ops.bench import _BENCHES
from ops.bench.chaos import build_parser, check_args, gate
from ops.bench.chaos_client import ChaosResult
from ops.bench.chaos_compare import (
    Comparison,
    classify_tokens,
    compare_answer,
    latency_summary,
    overlapping_faults,
    request_rows,
    summarize_rows,
)
from ops.bench.chaos_faults import ChildInfo, Fault, parse_children, pick_target, read_children
from ops.bench.chaos_report import outcome_of, plot_timeline, report_lines
from ops.bench.chaos_stack import blocks_idle, instance_gauges, wait_blocks_idle, wait_whole
from ops.bench.chaos_workload import COMBINATIONS, ChaosRequest, chaos_workload, describe, log_uniform_int
from ops.bench.serve_workloads import PromptBuilder
from tests.bench.test_serve_workloads import WordTokenizer

REF = list(range(100, 120))  # a reference answer of 20 distinct tokens


# -- workload ------------------------------------------------------------------------------------


def workload(seed: int, num: int = 40) -> list[ChaosRequest]:
    return chaos_workload(PromptBuilder(WordTokenizer(), seed), num, 8, 256, 24, 48)


def test_workload_is_the_same_for_the_same_seed_and_differs_for_another() -> None:
    assert workload(3) == workload(3)
    assert [r.prompt for r in workload(3)] != [r.prompt for r in workload(4)]


def test_workload_mixes_endpoints_streaming_and_lengths_within_bounds() -> None:
    requests = workload(0, 40)
    assert [(r.endpoint, r.stream) for r in requests[:4]] == list(COMBINATIONS)
    assert all(8 <= r.prompt_len <= 256 and 24 <= r.max_tokens <= 48 for r in requests)
    tokenizer = WordTokenizer()
    assert all(len(tokenizer.encode(r.prompt)) == r.prompt_len for r in requests)
    lengths = [r.prompt_len for r in requests]
    assert min(lengths) <= 16 < 128 <= max(lengths)  # short prompts and multi-block ones
    info = describe(requests)
    assert info["by_kind"] == {"chat-json": 10, "chat-stream": 10, "completions-json": 10, "completions-stream": 10}
    assert info["max_tokens_total"] == sum(r.max_tokens for r in requests)


def test_log_uniform_int_reaches_both_ends_and_refuses_bad_bounds() -> None:
    rng = random.Random(0)
    draws = [log_uniform_int(rng, 8, 256) for _ in range(5000)]
    assert min(draws) == 8 and max(draws) == 256
    assert sum(1 for d in draws if d < 45) > 2000  # log-uniform: half below the geometric mean
    assert log_uniform_int(rng, 5, 5) == 5
    with pytest.raises(ValueError):
        log_uniform_int(rng, 0, 4)


# -- comparing answers ---------------------------------------------------------------------------


def test_identical_answers_are_identical() -> None:
    assert classify_tokens(REF, list(REF)) == Comparison("identical")


def test_an_answer_restarted_from_its_prompt_is_a_duplicate_of_the_tokens_already_sent() -> None:
    chaos = REF[:7] + REF[:13]  # 7 tokens streamed, then the whole answer again within the budget
    c = classify_tokens(REF, chaos)
    assert (c.verdict, c.num_duplicated, c.num_missing, c.diverge_at) == ("duplicate", 7, 0, 7)


def test_tokens_sent_twice_at_the_migration_point_are_a_duplicate() -> None:
    chaos = REF[:10] + REF[8:18]  # 2 tokens re-sent, and the budget ran out 2 tokens early
    c = classify_tokens(REF, chaos)
    assert (c.verdict, c.num_duplicated) == ("duplicate", 2)


def test_tokens_skipped_at_the_migration_point_are_missing() -> None:
    chaos = REF[:10] + REF[13:]
    c = classify_tokens(REF, chaos)
    assert (c.verdict, c.num_missing, c.num_duplicated, c.diverge_at) == ("missing", 3, 0, 10)


def test_a_cut_short_answer_is_truncated_and_a_longer_one_extra() -> None:
    assert classify_tokens(REF, REF[:15]) == Comparison("truncated", num_missing=5, diverge_at=15)
    assert classify_tokens(REF, REF + [7, 8]) == Comparison("extra", num_duplicated=2, diverge_at=20)


def test_a_different_continuation_is_other() -> None:
    c = classify_tokens(REF, REF[:5] + list(range(900, 915)))
    assert (c.verdict, c.diverge_at) == ("other", 5)


def test_compare_answer_reports_failures_and_tokenizes_only_differing_texts() -> None:
    def no_tokenize(text: str) -> list[int]:
        raise AssertionError("identical texts must not be tokenized")

    assert compare_answer(True, "a b", True, "a b", no_tokenize).verdict == "identical"
    assert compare_answer(True, "a b", False, "", no_tokenize).verdict == "failed"
    assert compare_answer(False, "", True, "a b", no_tokenize).verdict == "reference-failed"
    words = compare_answer(True, "x y z w v", True, "x y x y z w", lambda t: t.split())
    assert (words.verdict, words.num_duplicated) == ("duplicate", 2)


# -- faults and latency --------------------------------------------------------------------------


def test_a_fault_overlaps_a_request_when_it_falls_between_its_start_and_end() -> None:
    kill = Fault("kill", "decode-0", 1, 10.0, 10.0)
    stop = Fault("stop", "prefill-1", 2, 20.0, 50.0)
    assert kill.overlaps(5.0, 10.0) and kill.overlaps(10.0, 12.0) and not kill.overlaps(10.5, 30.0)
    assert stop.overlaps(45.0, 60.0) and stop.overlaps(25.0, 30.0) and not stop.overlaps(50.5, 60.0)
    assert overlapping_faults(8.0, 22.0, [kill, stop]) == [0, 1]
    assert overlapping_faults(11.0, 19.0, [kill, stop]) == []
    assert overlapping_faults(math.nan, 19.0, [kill, stop]) == []


def test_latency_summary_interpolates_percentiles() -> None:
    s = latency_summary([float(i) for i in range(1, 101)])
    assert s["num"] == 100 and s["p50"] == pytest.approx(50.5) and s["p99"] == pytest.approx(99.01)
    assert s["max"] == 100.0
    assert math.isnan(latency_summary([])["p50"])


def result(i: int, text: str, start: float, end: float, ok: bool = True, num_tokens: int | None = 3) -> ChaosResult:
    return ChaosResult(i, ok, text, num_tokens, 3, "length", start, end, "" if ok else "boom")


def rows_of_a_small_run() -> list[dict[str, Any]]:
    requests = [ChaosRequest(i, f"p{i}", 9, 3, *COMBINATIONS[i % 4]) for i in range(4)]
    reference = [result(i, "a b c", 0.0, 1.0) for i in range(4)]
    chaos = [
        result(0, "a b c", 0.0, 1.5),  # identical, no fault inside
        result(1, "a b c", 1.0, 5.0),  # identical, the kill at 2 s inside: 3 s extra
        result(2, "a b a b c", 1.0, 9.0, num_tokens=5),  # duplicated tokens, the stop inside: 7 s extra
        result(3, "", 3.0, 4.0, ok=False),  # failed, between the faults
    ]
    faults = [Fault("kill", "decode-1", 7, 2.0, 2.0), Fault("stop", "prefill-0", 8, 6.0, 8.0)]
    return request_rows(requests, reference, chaos, faults, lambda t: t.split())


def test_rows_and_summary_count_verdicts_tokens_and_the_extra_latency_of_faulted_requests() -> None:
    rows = rows_of_a_small_run()
    assert [r["verdict"] for r in rows] == ["identical", "identical", "duplicate", "failed"]
    assert [r["faults"] for r in rows] == [[], [0], [0, 1], []]
    assert "chaos_text" not in rows[0] and rows[2]["chaos_text"] == "a b a b c"
    s = summarize_rows(rows)
    assert (s["num_requests"], s["num_completed"], s["num_identical"]) == (4, 3, 2)
    assert s["num_tokens_duplicated"] == 2 and s["num_usage_mismatch"] == 1
    assert s["num_overlapping_fault"] == 2
    hit = s["extra_latency_overlapping_s"]
    assert hit["num"] == 2 and hit["p50"] == pytest.approx(5.0) and hit["max"] == pytest.approx(7.0)
    assert s["extra_latency_other_s"]["p50"] == pytest.approx(0.5)
    assert [outcome_of(r) for r in rows] == ["ok", "ok", "mismatch", "failed"]


def test_gate_fails_on_failed_or_different_answers_and_on_blocks_left_in_use() -> None:
    rows = rows_of_a_small_run()
    idle = {"exported": True, "idle": True, "instances": {"decode-0": {"pdserve:num_blocks_in_use": 0.0}}}
    failures = gate(summarize_rows(rows), idle)
    assert failures == ["1 chaos requests failed", "1 completed answers differ from the reference"]
    clean = summarize_rows(rows[:2])
    assert gate(clean, idle) == []
    assert gate(clean, {"exported": False, "idle": False, "instances": {}}) == []  # not reported: not judged
    back = {"whole": False, "waited_s": 60.0, "counts": {"prefill": 1, "decode": 2}}
    assert gate(clean, idle, back) == [
        "the stack did not get every instance back (router serves with {'prefill': 1, 'decode': 2})"]
    leaked = {"exported": True, "idle": False, "instances": {"decode-0": {"pdserve:num_blocks_in_use": 4.0},
                                                             "prefill-0": {"pdserve:num_blocks_in_use": 0.0}}}
    assert gate(clean, leaked) == ["KV blocks still in use once idle on decode-0"]


def test_report_prints_every_part_and_the_timeline_is_written(tmp_path: Path) -> None:
    rows = rows_of_a_small_run()
    faults = [Fault("kill", "decode-1", 7, 2.0, 2.0).to_json(), Fault("stop", "prefill-0", 8, 6.0, 8.0).to_json()]
    blocks = {"exported": True, "idle": True, "waited_s": 0.4, "error": "",
              "instances": {"decode-0": {"role": "decode", "pdserve:num_blocks_in_use": 0.0}}}
    summary = summarize_rows(rows)
    failures = gate(summary, blocks)
    text = "\n".join(report_lines({
        "summary": summary, "faults": faults, "num_faults_skipped": 1, "blocks_after": blocks,
        "passes": {"reference": {"duration_s": 1.0}, "chaos": {"duration_s": 9.0}},
        "instances_before": {"prefill": 2, "decode": 2},
        "instances_after": {"whole": True, "waited_s": 3.0, "counts": {"prefill": 2, "decode": 2}},
        "children_after": {"decode-1": {"pid": 9, "restarts": 1, "role": "decode"}},
        "passed": not failures, "failures": failures,
    }))
    for part in ("2 (1 kill -9, 1 SIGSTOP/SIGCONT), 1 slots skipped", "completed: 3/4",
                 "identical to the reference: 2/4", "duplicate 1", "tokens duplicated: 2",
                 "extra latency vs reference p50 5.00 s", "all 0 after 0.4s): decode-0 0", "restarts: decode-1 1",
                 "instances serving after the chaos pass: prefill 2/2, decode 2/2 (after 3.0s)",
                 "result: FAIL (1 chaos requests failed"):
        assert part in text
    png = tmp_path / "timeline.png"
    plot_timeline(png, rows, faults, "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- the stack's files and pages -----------------------------------------------------------------


def test_children_json_entries_without_a_valid_pid_are_skipped(tmp_path: Path) -> None:
    data = {"prefill-0": {"pid": 11, "restarts": 2, "role": "prefill"}, "decode-0": {"pid": None, "role": "decode"},
            "router": {"pid": 12, "role": "router"}, "bad": "x"}
    assert parse_children(data) == {"prefill-0": ChildInfo("prefill-0", 11, "prefill", 2),
                                    "router": ChildInfo("router", 12, "router", 0)}
    assert parse_children([1, 2]) == {}
    assert read_children(tmp_path / "absent.json") == {}
    (tmp_path / "children.json").write_text('{"prefill-0": {"pid": 11, "restarts": 0, "role": "prefill"}}')
    assert list(read_children(tmp_path / "children.json")) == ["prefill-0"]


def stack_children() -> dict[str, ChildInfo]:
    names = [("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"),
             ("router", "router"), ("redis", "redis")]
    return {n: ChildInfo(n, 100 + i, role) for i, (n, role) in enumerate(names)}


def picks(children: dict[str, ChildInfo], dead: set[str], serving: dict[str, int] | None = None) -> set[str]:
    """The names ``pick_target`` chooses over many draws (with ``dead`` processes gone)."""
    rng = random.Random(0)
    live_pids = {c.pid for n, c in children.items() if n not in dead}
    chosen = [pick_target(children, rng, live_pids.__contains__, serving) for _ in range(200)]
    return {c.name for c in chosen if c is not None}


def test_pick_target_takes_only_engines_whose_role_keeps_another_instance() -> None:
    children = stack_children()
    assert picks(children, set()) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
    assert picks(children, {"decode-0"}) == {"prefill-0", "prefill-1"}
    # the router serves with one prefill only (the other is still loading): only decodes may go
    assert picks(children, set(), {"prefill": 1, "decode": 2}) == {"decode-0", "decode-1"}
    assert pick_target(children, random.Random(0), lambda pid: True, {"prefill": 1, "decode": 1}) is None


ROUTER_PAGE = """\
# HELP pdserve:num_requests_running Requests running.
# TYPE pdserve:num_requests_running gauge
pdserve:num_requests_running{role="router"} 3.0
pdserve:num_requests_running{instance="decode-0",model_name="m",role="decode"} 2.0
# TYPE pdserve:num_blocks_in_use gauge
pdserve:num_blocks_in_use{instance="decode-0",model_name="m",role="decode"} 7.0
pdserve:num_blocks_in_use{instance="prefill-0",model_name="m",role="prefill"} 0.0
pdserve:kv_cache_usage_perc{instance="prefill-0",model_name="m",role="prefill"} 0.0
pdserve:num_blocks_in_use{instance="decode-1" broken line
pdserve:prompt_tokens_total 123.0
"""


def test_instance_gauges_reads_labelled_gauges_and_skips_the_rest() -> None:
    gauges = instance_gauges(ROUTER_PAGE)
    assert gauges == {
        "decode-0": {"role": "decode", "pdserve:num_requests_running": 2.0, "pdserve:num_blocks_in_use": 7.0},
        "prefill-0": {"role": "prefill", "pdserve:num_blocks_in_use": 0.0, "pdserve:kv_cache_usage_perc": 0.0},
    }
    assert not blocks_idle(gauges)
    assert blocks_idle({"prefill-0": {"pdserve:num_blocks_in_use": 0.0}})
    assert not blocks_idle({}) and not blocks_idle({"decode-0": {"role": "decode"}})


def test_wait_blocks_idle_polls_until_every_instance_holds_none() -> None:
    pages = [ROUTER_PAGE, ROUTER_PAGE, ROUTER_PAGE.replace("7.0", "0.0")]
    calls = []

    def fetch() -> str:
        calls.append(1)
        return pages[min(len(calls), len(pages)) - 1]

    out = wait_blocks_idle(fetch, timeout_s=10.0, poll_s=0.01)
    assert out["idle"] and out["exported"] and len(calls) == 3
    assert out["instances"]["decode-0"]["pdserve:num_blocks_in_use"] == 0.0


def test_wait_blocks_idle_gives_up_at_the_deadline_and_says_when_nothing_is_exported() -> None:
    out = wait_blocks_idle(lambda: ROUTER_PAGE, timeout_s=0.05, poll_s=0.01)
    assert not out["idle"] and out["exported"] and out["instances"]["decode-0"]["pdserve:num_blocks_in_use"] == 7.0
    bare = wait_blocks_idle(lambda: "pdserve:prompt_tokens_total 1.0\n", timeout_s=0.05, poll_s=0.01)
    assert not bare["idle"] and not bare["exported"]


def test_wait_whole_waits_for_restarted_instances_and_gives_up_at_the_deadline() -> None:
    answers = iter([None, {"prefill": 1, "decode": 2}, {"prefill": 2, "decode": 2}])
    out = wait_whole(lambda: next(answers), {"prefill": 2, "decode": 2}, timeout_s=10.0, poll_s=0.01)
    assert out["whole"] and out["counts"] == {"prefill": 2, "decode": 2}
    out = wait_whole(lambda: {"prefill": 1, "decode": 2}, {"prefill": 2, "decode": 2}, timeout_s=0.05, poll_s=0.01)
    # Gave up at the deadline (not before, not much after) and says what it last saw.
    assert not out["whole"] and out["counts"] == {"prefill": 1, "decode": 2}
    assert 0.05 <= out["waited_s"] < 5.0
    assert wait_whole(lambda: None, None, timeout_s=0.0)["whole"]  # nothing expected: nothing to wait for


# -- the command line ----------------------------------------------------------------------------


def test_cli_defaults_and_argument_checks() -> None:
    assert _BENCHES["chaos"] == "ops.bench.chaos"
    args = build_parser().parse_args([])
    assert (args.prefill, args.decode, args.num_requests, args.concurrency) == (2, 2, 200, 16)
    assert (args.kill_interval, args.stop_seconds, args.ignore_eos) == (20.0, 30.0, True)
    check_args(args)
    with pytest.raises(SystemExit, match="--log-dir"):
        check_args(build_parser().parse_args(["--url", "http://127.0.0.1:8000"]))
    check_args(build_parser().parse_args(["--url", "http://h:1", "--kill-interval", "0"]))
    with pytest.raises(SystemExit):
        check_args(build_parser().parse_args(["--min-output-len", "50", "--max-output-len", "40"]))
