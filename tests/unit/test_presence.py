"""A worker's presence against fake stores: what it registers, how it beats,
re-registers when its row is gone, re-dispatches parked jobs page by page,
prunes, and outlives a beat that fails."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from typing import Any

from sqlalchemy.ext.asyncio import create_async_engine

from jobplane import __version__
from jobplane.workers.presence import Presence


class Workers:
    """WorkerStore, recorded; ``beats`` answers each beat in turn (then True)."""

    def __init__(self, beats: list[bool | Exception]) -> None:
        self.beats = beats
        self.calls: list[tuple[str, Any]] = []
        self.beaten = asyncio.Event()
        self.fail_stop = False

    async def register(self, worker_id: uuid.UUID, **fields: Any) -> None:
        self.calls.append(("register", {"id": worker_id, **fields}))

    async def beat(self, worker_id: uuid.UUID, *, ttl: float) -> bool:
        self.calls.append(("beat", ttl))
        answer = self.beats.pop(0) if self.beats else True
        if not self.beats:
            self.beaten.set()
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def prune(self, *, older_than: float) -> int:
        self.calls.append(("prune", older_than))
        return 0

    async def stop(self, worker_id: uuid.UUID) -> None:
        self.calls.append(("stop", worker_id))
        if self.fail_stop:
            raise ConnectionResetError("database went away")


class Attempts:
    """AttemptStore.unpark: hands out ``pages`` of counts, then 0."""

    def __init__(self, pages: list[int]) -> None:
        self.pages = pages
        self.asked: list[tuple[list[str], list[str]]] = []

    async def unpark(self, types: list[str], queues: list[str]) -> int:
        self.asked.append((list(types), list(queues)))
        return self.pages.pop(0) if self.pages else 0


def _presence(workers: Workers, attempts: Attempts, interval: float = 0.01) -> Presence:
    engine = create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none")
    fake: Any = attempts
    presence = Presence(
        engine, fake, types=["a.b"], queues=["q1", "q2"], concurrency=4, interval=interval
    )
    presence._store = workers  # type: ignore[assignment]
    return presence


async def test_start_registers_what_the_worker_runs_and_unparks_page_by_page() -> None:
    workers, attempts = Workers([]), Attempts([500, 500, 12])
    presence = _presence(workers, attempts, interval=60)
    await presence.start()
    await presence.stop()
    assert workers.calls[0] == (
        "register",
        {
            "id": presence.id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "types": ["a.b"],
            "queues": ["q1", "q2"],
            "concurrency": 4,
            "version": __version__,
            "ttl": 181.0,  # three beats may be missed
        },
    )
    # A full page of 500 may leave more: asked again until a page is short.
    assert attempts.asked == [(["a.b"], ["q1", "q2"])] * 3
    assert workers.calls[1:] == [("stop", presence.id)]


async def test_beats_re_register_a_pruned_row_and_survive_a_failure() -> None:
    workers = Workers([True, False, ConnectionResetError("gone"), True])
    presence = _presence(workers, Attempts([]))
    await presence.start()
    await asyncio.wait_for(workers.beaten.wait(), 5)
    await presence.stop()
    names = [name for name, _ in workers.calls]
    # The first beat prunes registrations dead for a week; the second finds
    # the row gone and registers again; the third fails and the loop goes on.
    assert names[:6] == ["register", "beat", "prune", "beat", "register", "beat"]
    assert ("prune", 7 * 24 * 3600.0) in workers.calls
    assert {ttl for name, ttl in workers.calls if name == "beat"} == {0.01 * 3 + 1.0}
    assert names.count("prune") == 1
    assert names[-1] == "stop"


async def test_a_stop_that_fails_is_not_raised() -> None:
    workers = Workers([])
    workers.fail_stop = True
    presence = _presence(workers, Attempts([]), interval=60)
    await presence.start()
    await presence.stop()
    assert workers.calls[-1] == ("stop", presence.id)
