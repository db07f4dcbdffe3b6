"""Counts the statements an engine sends that match a piece of SQL, and how many at once."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine


class Statements:
    """What :func:`counting` saw: statements sent, and the most running at once."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.sent = 0
        self.running = 0
        self.most_at_once = 0

    def before(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if self.marker in statement:
            self.sent += 1
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)

    def after(self, _conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if self.marker in statement:
            self.running -= 1


@contextmanager
def counting(engine: AsyncEngine, marker: str) -> Iterator[Statements]:
    """Count the statements of ``engine`` (and engines sharing its pool) holding ``marker``."""
    seen = Statements(marker)
    target = engine.sync_engine
    event.listen(target, "before_cursor_execute", seen.before)
    event.listen(target, "after_cursor_execute", seen.after)
    try:
        yield seen
    finally:
        event.remove(target, "before_cursor_execute", seen.before)
        event.remove(target, "after_cursor_execute", seen.after)
