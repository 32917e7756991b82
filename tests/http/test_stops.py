"""Stop strings over streamed deltas, against a reference that scans the whole output one
character at a time."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpprefill.http.stops import StopStrings

pytestmark = pytest.mark.timeout(60)


def _reference(text: str, stops: list[str], no_stop_trim: bool) -> tuple[str, str | None]:
    """The output as the stop string that ends first, the longest at a tie, cuts it."""
    for end in range(1, len(text) + 1):
        for stop in sorted((s for s in stops if s), key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[: end if no_stop_trim else end - len(stop)], stop
    return text, None


def _run(stops: list[str], deltas: list[str], no_stop_trim: bool = False):
    s = StopStrings(stops, no_stop_trim)
    out = []
    matched = None
    for delta in deltas:
        text, stop = s.feed(delta)
        out.append(text)
        if stop is not None:
            assert matched is None
            matched = stop
    if matched is None:
        out.append(s.flush())
    return out, matched


def test_a_stop_split_across_three_deltas():
    out, stop = _run(["STOP"], ["go S", "T", "OP and more", "never"])
    assert out == ["go ", "", "", ""]
    assert stop == "STOP"


def test_overlapping_stops_hold_then_release():
    s = StopStrings(["ab", "abc"])
    assert s.feed("xa") == ("x", None)
    assert s.held == "a"
    assert s.feed("bd") == ("", "ab")  # "ab" ends first
    assert s.feed("more") == ("", None)
    s = StopStrings(["abc"])
    assert s.feed("xab") == ("x", None)
    assert s.feed("d") == ("abd", None)  # can no longer be "abc"
    assert s.flush() == ""


def test_the_stop_ending_first_wins_then_the_longest():
    assert _run(["abc", "b"], ["abc"]) == (["a"], "b")
    assert _run(["bc", "abc"], ["xa", "bc"]) == (["x", ""], "abc")
    assert _run(["world", "lo"], ["hello world"]) == (["hel"], "lo")


def test_no_stop_trim_keeps_the_stop():
    assert _run(["</s>", "END"], ["a</", "s>b"], no_stop_trim=True) == (["a", "</s>"], "</s>")


def test_unicode_stops():
    out, stop = _run(["世界", "😀!"], ["你好世", "界😀!"])
    assert (out, stop) == (["你好", ""], "世界")
    out, stop = _run(["😀!"], ["a😀", "😀", "!b"])
    assert ("".join(out), stop) == ("a😀", "😀!")


def test_no_match_flushes_what_is_held():
    out, stop = _run(["abc"], ["xa", "b"])
    assert out == ["x", "", "ab"]
    assert stop is None
    assert _run([], ["one", "two"]) == (["one", "two", ""], None)
    assert _run([""], ["one"]) == (["one", ""], None)


def test_held_text_stays_shorter_than_the_longest_stop():
    s = StopStrings(["aaaab", "xyz"])
    for _ in range(5000):
        text, stop = s.feed("a")
        assert stop is None
        assert len(s.held) <= 4
    assert s.held == "aaaa"


@settings(max_examples=400, deadline=None)
@given(
    st.text("abc😀", max_size=30),
    st.lists(st.text("abc😀", min_size=1, max_size=4), max_size=4),
    st.lists(st.integers(0, 6), max_size=12),
    st.booleans(),
)
def test_any_cut_into_deltas_matches_the_reference(text, stops, cuts, no_stop_trim):
    deltas = []
    at = 0
    for n in cuts:
        deltas.append(text[at : at + n])
        at += n
    deltas.append(text[at:])
    out, stop = _run(stops, deltas, no_stop_trim)
    assert ("".join(out), stop) == _reference(text, stops, no_stop_trim)
