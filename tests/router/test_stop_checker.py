"""Stop strings: found across token boundaries, never emitted, nothing after them emitted."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from router.stop_checker import StopChecker


def run(pieces: list[str], stop: list[str]) -> tuple[str, bool]:
    checker = StopChecker(stop)
    text = "".join(checker.push(p) for p in pieces)
    return text + checker.flush(), checker.stopped


def test_stop_string_spanning_three_pieces_is_cut() -> None:
    assert run(["Hel", "lo W", "or", "ld and more"], ["o World"]) == ("Hell", True)


def test_earliest_of_several_stop_strings_wins() -> None:
    assert run(["abc", "def", "ghi"], ["ghi", "cd"]) == ("ab", True)


def test_partial_match_is_held_back_then_released() -> None:
    checker = StopChecker(["STOP"])
    assert checker.push("go ST") == "go "
    assert checker.push("ART") == "START"
    assert checker.flush() == "" and not checker.stopped


def test_text_ending_in_a_stop_prefix_is_flushed_at_the_end() -> None:
    assert run(["the end S", "TO"], ["STOP"]) == ("the end STO", False)


def test_the_stop_string_completing_first_wins_whatever_the_split() -> None:
    assert run(["ac", "a"], ["c", "aca"]) == ("a", True)
    assert run(["aca"], ["c", "aca"]) == ("a", True)


def test_include_keeps_the_stop_string_that_hit_and_nothing_after_it() -> None:
    checker = StopChecker(["o World", "rld"], include=True)
    text = "".join(checker.push(p) for p in ["Hel", "lo W", "or", "ld and more"])
    assert (text + checker.flush(), checker.stopped) == ("Hello World", True)


def test_nothing_is_emitted_after_a_stop() -> None:
    checker = StopChecker(["x"])
    assert checker.push("abxcd") == "ab"
    assert checker.push("more") == "" and checker.flush() == ""


@given(
    text=st.text(alphabet="abcd ", max_size=40),
    stop=st.lists(st.text(alphabet="abcd", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=10),
)
def test_any_split_gives_the_text_up_to_the_first_stop(text: str, stop: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    # The stop string that completes first wins (ties: the earlier start), as generation sees it.
    hits = [(text.find(s) + len(s), text.find(s)) for s in stop if s in text]
    expected = text[: min(hits)[1]] if hits else text
    assert run(pieces, stop) == (expected, bool(hits))
