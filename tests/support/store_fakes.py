"""Stand-ins for the store's seams, for unit tests of what the store decides.

:class:`ScriptedConn` answers each statement with rows scripted for it and
records every call; :class:`FakeDb` hands it out; :class:`ScriptedMachine`
applies nothing: it records each transition asked of it and answers with the
rows scripted for that transition.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from jobplane.store.machine import Cause, Transition

# What the machine applies with when it is given no cause (as the real one does).
NO_CAUSE = Cause()


class _Result:
    """What an SQLAlchemy ``execute`` returns, as far as the store reads it."""

    def __init__(self, rows: Sequence[Any]) -> None:
        self._rows = list(rows)

    def mappings(self) -> _Result:
        return self

    def all(self) -> list[Any]:
        return self._rows

    def first(self) -> Any:
        return self._rows[0] if self._rows else None


class ScriptedConn:
    """A connection that answers each statement from a script, in order."""

    def __init__(self) -> None:
        #: Every call: (method, statement, binds).
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []
        self._answers: dict[int, list[Any]] = {}
        #: How many transactions are open on it now.
        self.depth = 0

    def answer(self, statement: Any, *answers: Any) -> None:
        """Queue ``answers`` for the next calls of ``statement``."""
        self._answers.setdefault(id(statement), []).extend(answers)

    def ran(self, statement: Any) -> list[dict[str, Any]]:
        """The binds of each call of ``statement``, in order."""
        return [binds for _, s, binds in self.calls if s is statement]

    def _next(self, method: str, statement: Any, binds: Any, default: Any) -> Any:
        self.calls.append((method, statement, dict(binds or {})))
        queue = self._answers.get(id(statement))
        return queue.pop(0) if queue else default

    async def fetch(self, statement: Any, binds: Any = None) -> list[Any]:
        return list(self._next("fetch", statement, binds, []))

    async def fetchrow(self, statement: Any, binds: Any = None) -> Any:
        return self._next("fetchrow", statement, binds, None)

    async def fetchval(self, statement: Any, binds: Any = None) -> Any:
        return self._next("fetchval", statement, binds, None)

    async def execute(self, statement: Any, binds: Any = None) -> _Result:
        return _Result(self._next("execute", statement, binds, []))

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[ScriptedConn]:
        self.depth += 1
        try:
            yield self
        finally:
            self.depth -= 1


def _check_conn(conn: Any) -> None:
    """A transition runs on a connection the caller holds (as the real machine needs)."""
    if not isinstance(conn, ScriptedConn):
        raise TypeError(f"a transition applied on {conn!r}, not a connection")


class FakeDb:
    """A database whose every connection is one :class:`ScriptedConn`."""

    def __init__(self, conn: ScriptedConn | None = None) -> None:
        self.conn = conn or ScriptedConn()
        #: How each connection was asked for: "connect" or "begin".
        self.opened: list[str] = []

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[ScriptedConn]:
        self.opened.append("connect")
        yield self.conn

    @asynccontextmanager
    async def begin(self) -> AsyncIterator[ScriptedConn]:
        self.opened.append("begin")
        yield self.conn


@dataclass(frozen=True)
class Applied:
    """One application of a transition the machine was asked for."""

    transition: Transition
    params: dict[str, Any]
    cause: Cause
    returning: tuple[str, ...] | None


class ScriptedMachine:
    """A state machine that records what it is asked and answers from a script."""

    def __init__(self, *, groupable: bool = True) -> None:
        self.applied: list[Applied] = []
        #: Each application's transition and how many transactions were open.
        self.depths: list[tuple[Transition, int]] = []
        #: Every session: (its transitions, many).
        self.sessions: list[tuple[tuple[Transition, ...], bool]] = []
        self._answers: dict[Transition, list[list[Any]]] = {}
        self._groupable = groupable

    def answer(self, transition: Transition, *rows: list[Any]) -> None:
        """Queue the changed rows of the next applications of ``transition``."""
        self._answers.setdefault(transition, []).extend(rows)

    def of(self, transition: Transition) -> list[Applied]:
        """The applications of ``transition``, in order."""
        return [a for a in self.applied if a.transition is transition]

    def session(self, db: FakeDb, *transitions: Transition, many: bool = False) -> Any:
        self.sessions.append((transitions, many))
        return db.begin() if many else db.connect()

    async def apply(
        self,
        conn: Any,
        transition: Transition,
        params: Mapping[str, Any],
        cause: Cause = NO_CAUSE,
        *,
        returning: tuple[str, ...] | None = None,
        settles: bool = True,
    ) -> list[Any]:
        _check_conn(conn)
        self.applied.append(Applied(transition, dict(params), cause, returning))
        self.depths.append((transition, conn.depth))
        queue = self._answers.get(transition)
        return queue.pop(0) if queue else []

    async def apply_many(
        self,
        conn: Any,
        transition: Transition,
        rows: Sequence[Mapping[str, Any]],
        *,
        returning: tuple[str, ...] | None = None,
    ) -> list[Any]:
        _check_conn(conn)
        answered: list[Any] = []
        for binds in rows:
            self.applied.append(Applied(transition, dict(binds), NO_CAUSE, returning))
            queue = self._answers.get(transition)
            changed = queue.pop(0) if queue else []
            answered.append(changed[0] if changed else None)
        return answered

    def prepare(
        self, transition: Transition, params: Mapping[str, Any], cause: Cause = NO_CAUSE
    ) -> dict[str, Any]:
        return {"prepared": transition, "params": dict(params), "cause": cause}

    def groupable(self, transition: Transition) -> bool:
        return self._groupable
