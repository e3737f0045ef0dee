"""Stop strings (`engine.generate.stops.StopText`): pushed a token's text at a time, the text shown is always a
prefix of the final text, and the final text is cut before the first stop string the text contains
once the token completing it arrived — wherever the stop string falls across tokens."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.generate.stops import StopText

ALPHABET = "abc é"


def reference(pieces: list[str], stops: list[str]) -> tuple[str, int | None]:
    text = ""
    for count, piece in enumerate(pieces, start=1):
        text += piece
        found = [text.find(stop) for stop in stops if stop in text]
        if found:
            return text[: min(found)], count
    return text, None


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.text(ALPHABET, max_size=4), max_size=12),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_the_text_shown_is_the_reference_cut(pieces: list[str], stops: list[str]) -> None:
    matcher = StopText(stops)
    expected, stopped_at = reference(pieces, stops)
    shown = ""
    for piece in pieces:
        shown += matcher.push(piece)
        assert expected.startswith(shown)
    shown += matcher.finish()
    assert (shown, matcher.stopped_at) == (expected, stopped_at)
    assert shown == matcher.shown


def test_stop_strings_match_only_from_min_tokens_on() -> None:
    """As vLLM: before `min_tokens` tokens a stop string is shown like any text; from then on, a stop
    string in the text not yet shown ends it."""
    matcher = StopText(["a"], min_tokens=3)
    assert [matcher.push(piece) for piece in ("xa", "ya", "za", "w")] == ["xa", "ya", "z", ""]
    assert (matcher.shown, matcher.stopped_at) == ("xayaz", 3)


def test_a_stop_string_across_tokens() -> None:
    matcher = StopText(["END"])
    assert [matcher.push(piece) for piece in ("abc E", "N", "D tail")] == ["abc ", "", ""]
    assert (matcher.shown, matcher.stopped_at, matcher.finish()) == ("abc ", 3, "")


def test_a_possible_start_is_held_back_and_released() -> None:
    matcher = StopText(["END"])
    assert matcher.push("abcE") == "abc"
    assert matcher.push("x") == "Ex"
    assert matcher.push("EN") == ""
    assert matcher.finish() == "EN"
    assert matcher.stopped_at is None


def test_empty_stop_strings_are_refused() -> None:
    with pytest.raises(ValueError, match=r"^a stop string must not be empty$"):
        StopText([""])
