"""A pass of the sweeper's re-publish of lost dispatches, with its statements faked:
what each found row becomes, the windows it reads and where the next pass goes on
(the SQL itself is pinned by tests/integration/test_dispatch_repair.py)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.store import sweeps
from jobplane.store.sweeps import Republished, RepublishPass, SweepStore

_START = uuid.UUID(int=0)
_JOB_A, _JOB_B = uuid.UUID(int=0xA), uuid.UUID(int=0xB)
_SENT_A, _SENT_B, _LAST = uuid.UUID(int=0xA1), uuid.UUID(int=0xB1), uuid.UUID(int=0xF1)
_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _row(scanned: int, last: uuid.UUID | None, **found: Any) -> SimpleNamespace:
    """One row of the statement: the window's count and last job, and a re-published
    dispatch (or none: ``id`` None)."""
    fields = {"id": None, "job_id": None, "republish_count": None, "traceparent": None}
    return SimpleNamespace(scanned=scanned, last=last, **{**fields, **found})


class _Result:
    def __init__(self, rows: Sequence[SimpleNamespace] = (), locked: bool = True) -> None:
        self.rows, self.locked = list(rows), locked

    def scalar_one(self) -> bool:
        return self.locked

    def all(self) -> list[SimpleNamespace]:
        return self.rows


class _Engine:
    """Takes the pass's lock when ``locked``; answers each window with the next of ``windows``."""

    def __init__(self, windows: list[list[SimpleNamespace]], *, locked: bool = True) -> None:
        self.windows, self.locked = windows, locked
        self.asked: list[dict[str, Any]] = []

    def execution_options(self, **options: Any) -> _Engine:
        return self

    def begin(self) -> _Engine:
        return self

    async def __aenter__(self) -> _Engine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def execute(self, statement: Any, params: dict[str, Any]) -> _Result:
        if statement is sweeps._TRY_LOCK:
            assert params == {"key": sweeps.REPUBLISH_LOCK_KEY}
            return _Result(locked=self.locked)
        assert statement is sweeps._REPUBLISH
        self.asked.append(params)
        return _Result(self.windows.pop(0))


async def test_each_republished_dispatch_keeps_its_job_its_id_its_count_and_its_trace() -> None:
    engine = _Engine(
        [
            [
                _row(3, _LAST, id=_SENT_A, job_id=_JOB_A, republish_count=1, traceparent=_PARENT),
                _row(3, _LAST, id=str(_SENT_B), job_id=str(_JOB_B), republish_count=4),
            ]
        ]
    )
    store = SweepStore(cast(AsyncEngine, engine))
    done = await store.republish_unclaimed(after=60.0, scan=10)
    assert done == RepublishPass(
        [Republished(_JOB_A, _SENT_A, 1, _PARENT), Republished(_JOB_B, _SENT_B, 4, None)],
        scanned=3,
        lap_done=True,
    )
    assert engine.asked == [{"after": 60.0, "limit": 10, "cursor": _START}]


async def test_a_pass_reads_windows_up_to_its_scan_and_the_next_goes_on_from_there() -> None:
    first_last, second_last = uuid.UUID(int=0x51), uuid.UUID(int=0x52)
    engine = _Engine(
        [
            [_row(2, first_last)],  # a full window, nothing due in it
            [_row(1, second_last, id=_SENT_A, job_id=_JOB_A, republish_count=0)],
            [_row(0, None)],  # past the last QUEUED job
            [_row(0, None)],
        ]
    )
    store = SweepStore(cast(AsyncEngine, engine))
    done = await store.republish_unclaimed(after=5.0, scan=3, window=2)
    assert done == RepublishPass([Republished(_JOB_A, _SENT_A, 0)], scanned=3, lap_done=False)
    assert await store.republish_unclaimed(after=5.0, scan=3, window=2) == RepublishPass(
        [], scanned=0, lap_done=True
    )
    await store.republish_unclaimed(after=5.0, scan=3, window=2)  # a lap done: from the first
    assert engine.asked == [
        {"after": 5.0, "limit": 2, "cursor": _START},
        {"after": 5.0, "limit": 1, "cursor": first_last},
        {"after": 5.0, "limit": 2, "cursor": second_last},
        {"after": 5.0, "limit": 2, "cursor": _START},
    ]


async def test_a_pass_reads_nothing_while_another_sweepers_pass_holds_the_lock() -> None:
    engine = _Engine([], locked=False)
    store = SweepStore(cast(AsyncEngine, engine))
    assert await store.republish_unclaimed(after=1.0, scan=5) is None
    assert engine.asked == []
