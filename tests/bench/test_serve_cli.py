"""``pdserve bench serve`` argument handling: targets, load levels, workload choice."""

from __future__ import annotations

import pytest

from ops.bench.serve import build_parser, parse_levels, parse_targets


def targets(*argv: str) -> list[tuple[str, str | None]]:
    return parse_targets(build_parser().parse_args(list(argv)))


def test_targets_keep_the_given_order_without_duplicates() -> None:
    assert targets("--url", "http://h:1", "--launch", "pd", "--targets", "pd,pd-nocache,single,hf") == [
        ("url", "http://h:1"), ("pd", None), ("pd-nocache", None), ("single", None), ("hf", None)
    ]
    assert [n for n, _ in targets("--url", "http://a", "--url", "http://b")] == ["url1", "url2"]


def test_unknown_or_missing_targets_are_refused() -> None:
    with pytest.raises(SystemExit, match="unknown target"):
        targets("--targets", "pd,gpu")
    with pytest.raises(SystemExit, match="nothing to benchmark"):
        targets()


def test_concurrency_takes_one_value_or_a_list() -> None:
    assert parse_levels(None) == [None]
    assert parse_levels("4") == [4]
    assert parse_levels("1,4,16") == [1, 4, 16]
    with pytest.raises(SystemExit):
        parse_levels("0,4")


def test_defaults_match_the_issue() -> None:
    args = build_parser().parse_args(["--targets", "pd"])
    assert args.prefix_len == 2000 and args.workload == "random" and args.ignore_eos
    assert args.request_rate == float("inf") and args.concurrency is None
