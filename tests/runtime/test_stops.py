"""runtime/stops.py: stop strings on decoded text, across chunk boundaries, never emitted.

Proves: a stop string inside one chunk or split over several ``feed`` calls (down to one character
per call) stops the text just before it, drops it and everything after; with several stop strings the
first one completed ends the text, and among those completed by the same chunk the earliest start wins
(same start: the first listed); only a suffix that could begin a stop string is held back, and
``flush`` returns it when the request ends otherwise; for 1000 random texts, stop lists and chunk splits
the emitted text equals a plain ``str.find`` reference; bad ``stop`` values raise ValueError naming
what was wrong.
"""

from __future__ import annotations

import random

import pytest

from kvforge.runtime import StopStrings


def run(stop, chunks: list[str]) -> tuple[str, str | None]:
    s = StopStrings(stop)
    out = []
    for c in chunks:
        text, matched = s.feed(c)
        out.append(text)
        if matched is not None:
            return "".join(out), matched
    return "".join(out) + s.flush(), None


def test_no_stop_strings_pass_text_through():
    s = StopStrings(None)
    assert s.empty and s.feed("abc") == ("abc", None) and s.flush() == ""
    assert StopStrings([]).empty and not StopStrings("x").empty


def test_match_within_one_chunk_drops_stop_and_rest():
    assert run(["\n\n"], ["Hello.\n\nNext paragraph"]) == ("Hello.", "\n\n")


def test_match_split_across_chunks():
    assert run("STOP", ["abc S", "T", "O", "P trailing"]) == ("abc ", "STOP")
    assert run("</answer>", list("The answer is 42</answer> and more")) == ("The answer is 42", "</answer>")


def test_hold_back_exact_split():
    s = StopStrings(["END", "xyz"])
    assert s.feed("hello E") == ("hello ", None)
    assert s.feed("N") == ("", None)
    assert s.feed("Dx") == ("", "END")  # the match ends the request; "Dx" after END is dropped
    s = StopStrings(["END", "xyz"])
    s.feed("hello EN")
    assert s.feed("x") == ("EN", None)  # "ENx": "EN" cannot start a stop any more, "x" can
    assert s.feed("y") == ("", None)
    assert s.feed("!") == ("xy!", None)
    assert s.flush() == ""


def test_flush_returns_held_text():
    s = StopStrings("<|end|>")
    assert s.feed("answer <|e") == ("answer ", None)
    assert s.flush() == "<|e"


def test_earliest_match_wins_then_list_order():
    assert run(["world", "lo"], ["hello world"]) == ("hel", "lo")
    assert run(["lo w", "lo"], ["hello world"]) == ("hel", "lo w")  # same start: first listed
    assert run(["bc", "abcd"], ["xxab", "c", "d"]) == ("xxa", "bc")  # "bc" is complete first: it ends the text
    assert run(["bc", "abcd"], ["xxab", "cdef"]) == ("xx", "abcd")  # both complete in one feed: earliest start


def test_after_match_feed_returns_nothing():
    s = StopStrings(".")
    assert s.feed("a.b") == ("a", ".")
    assert s.feed("more") == ("", ".") and s.flush() == "" and s.matched == "."


def reference(stops: list[str], chunks: list[str]) -> tuple[str, str | None]:
    """The text up to the first stop string completed: after the first chunk whose end completes any
    stop string, the earliest-starting one present (same start: first listed)."""
    text = ""
    for c in chunks:
        text += c
        hits = [(text.find(s), k) for k, s in enumerate(stops) if s in text]
        if hits:
            start, k = min(hits)
            return text[:start], stops[k]
    return text, None


def test_random_texts_and_splits_equal_reference():
    rng = random.Random(0)
    alphabet = "ab \nç日😀"
    for _ in range(1000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 4))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(0, 8))))
        chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        assert run(stops, chunks) == reference(stops, chunks), (text, stops, chunks)
        assert run(stops, [text]) == reference(stops, [text]), (text, stops)


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        ("", "stop strings must be non-empty"),
        (["a", ""], "stop strings must be non-empty"),
        ([""], "stop strings must be non-empty"),
        (["a", 3], "got an entry 3 (int)"),
        (5, "stop must be a string, a list of strings or None, got int"),
    ],
)
def test_bad_stop_values(stop, message):
    with pytest.raises(ValueError, match="stop") as e:
        StopStrings(stop)
    assert message in str(e.value)
