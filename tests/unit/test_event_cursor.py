"""The subscription's pattern regex agrees with AMQP topic matching; cursors round-trip."""

from __future__ import annotations

import itertools
import re

import pytest

from jobplane.errors import InvalidArgument
from jobplane.events import EventError, matches
from jobplane.store.events import Position, pattern_regex

WORDS = ["a", "b", "job", "started"]
PATTERNS = [
    "#",
    "*",
    "a",
    "a.*",
    "a.#",
    "#.a",
    "*.a",
    "a.#.b",
    "a.*.b",
    "#.a.#",
    "*.*",
    "a.#.#",
    "#.*",
    "job.started",
    "job.*.started",
]


def _types() -> list[str]:
    keys = []
    for n in range(1, 4):
        keys += [".".join(words) for words in itertools.product(WORDS, repeat=n)]
    return keys


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_regex_matches_exactly_what_a_binding_would(pattern: str) -> None:
    regex = pattern_regex([pattern])
    for event_type in _types():
        expected = matches([pattern], event_type)
        got = True if regex is None else re.fullmatch(regex, "." + event_type) is not None
        assert got is expected, (pattern, event_type)


def test_several_patterns_match_when_any_does() -> None:
    regex = pattern_regex(["a.*", "job.#"])
    assert regex is not None
    for event_type in _types():
        expected = matches(["a.*", "job.#"], event_type)
        assert (re.fullmatch(regex, "." + event_type) is not None) is expected


def test_patterns_of_hashes_alone_match_every_type_with_no_regex() -> None:
    """``#``, ``#.#``, ... take every type: the read filters on nothing (None), whatever
    other patterns come with them."""
    for patterns in (["#"], ["#.#"], ["#.#.#"], ["a.*", "#.#"], ["#.#", "job.started"]):
        assert pattern_regex(patterns) is None, patterns
    assert pattern_regex(["#.a"]) == r"^((\.[^.]+)*\.a)$"


def test_a_bad_pattern_is_refused() -> None:
    for pattern in ["", "A", "a..b", "a*", "a.b#", "a b"]:
        with pytest.raises(EventError):
            pattern_regex([pattern])


def test_cursors_round_trip_and_order() -> None:
    positions = [Position(0, 0), Position(1, 5), Position(1, 6), Position(2**63 - 1, 2**63 - 1)]
    for position in positions:
        cursor = position.cursor()
        assert len(cursor) == 23
        assert Position.parse(cursor) == position
    assert positions == sorted(positions)


@pytest.mark.parametrize(
    "cursor",
    [
        "",
        "x",
        "A" * 23,
        "AQAAAAAAAAABAAAAAAAAAAE=",
        "AQAAAAAAAAABAAAAAAAAAA!",
        "Af__________AAAAAAAAAAE",
    ],
)
def test_a_cursor_this_server_did_not_make_is_refused(cursor: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        Position.parse(cursor)
    assert info.value.field == "after_cursor"
