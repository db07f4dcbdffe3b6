"""The hot paths' statements: ``:name`` binds become ``$n`` exactly as SQLAlchemy's
``text()`` reads them (ADR-0030)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import text
from sqlalchemy.dialects.postgresql import asyncpg

from jobplane.store.db import positional

_DIALECT = asyncpg.dialect()  # type: ignore[no-untyped-call]
_NAMES = st.sampled_from(["a", "b", "id", "k_1", "tenant_id", "x2"])
_PIECES = st.one_of(
    _NAMES.map(lambda n: f":{n}"),  # a bind
    _NAMES.map(lambda n: f"::{n}"),  # a cast, not a bind
    _NAMES.map(lambda n: f"\\:{n}"),  # an escaped colon, not a bind
    _NAMES.map(lambda n: f":{n}::int"),  # a name before a cast: not a bind either
    st.sampled_from(["SELECT ", ", ", " + ", "(", ")", " ", "'", "1", "x", "\n", "$1"]),
)


@given(st.lists(_PIECES, max_size=30))
def test_binds_are_numbered_as_sqlalchemy_numbers_them(pieces: list[str]) -> None:
    source = "".join(pieces)
    compiled = text(source).compile(dialect=_DIALECT)
    converted = positional(text(source))
    assert converted.text == compiled.string
    assert list(converted.names) == list(compiled.positiontup or [])


def test_a_name_bound_twice_is_one_argument() -> None:
    sql = positional("SELECT :a, CAST(:a AS text), :b")
    assert sql.text == "SELECT $1, CAST($1 AS text), $2"
    assert sql.args({"b": 2, "a": 1, "unused": 3}) == [1, 2]


def test_the_same_text_is_converted_once() -> None:
    assert positional("SELECT :n") is positional(text("SELECT :n"))
