"""Reject mode at submit, with the statements faked: which requests a full key
refuses, and the refusal's message and metadata (the SQL itself is pinned by
tests/integration/test_concurrency_keys.py)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any, cast

import grpc

from jobplane.errors import ConcurrencyLimitReached
from jobplane.store import concurrency
from jobplane.store.db import Conn
from jobplane.store.job_submit import NewJob
from jobplane.store.machine.concurrency import LOCK
from jobplane.types import ConcurrencyMode

_TENANT = uuid.UUID(int=1)
_FIRST, _SECOND, _THIRD = (uuid.UUID(int=n) for n in (11, 12, 13))


class _Conn:
    """Answers the three statements of a refusal check; ``in_flight``: by key, oldest first."""

    def __init__(self, in_flight: Mapping[str, Sequence[uuid.UUID]], taken: Sequence[str] = ()):
        self.in_flight = in_flight
        self.taken = taken
        self.locked: list[str] = []

    async def fetch(self, statement: Any, binds: Mapping[str, Any]) -> list[dict[str, Any]]:
        if statement is concurrency._TAKEN:
            return [{"request_id": r} for r in self.taken if r in binds["request_ids"]]
        if statement is LOCK:
            self.locked.append(binds["key"])
            return [{}]
        assert statement is concurrency._IN_FLIGHT
        return [{"id": job_id} for job_id in self.in_flight.get(binds["key"], ())][: binds["limit"]]


def _job(
    request_id: str,
    key: str | None = "k",
    limit: int = 1,
    mode: ConcurrencyMode = ConcurrencyMode.REJECT,
) -> NewJob:
    return NewJob(
        type="demo.echo",
        queue="default",
        payload={},
        request_id=request_id,
        max_attempts=3,
        concurrency_key=key,
        concurrency_limit=limit,
        concurrency_mode=mode,
    )


async def _refused(conn: _Conn, news: Sequence[NewJob]) -> dict[int, ConcurrencyLimitReached]:
    return await concurrency.refuse_full_keys(cast(Conn, conn), _TENANT, news)


async def test_a_full_key_is_refused_naming_its_key_its_limit_and_its_holders() -> None:
    conn = _Conn({"k": [_FIRST, _SECOND, _THIRD]})
    (index, error), *others = (await _refused(conn, [_job("r-1", limit=2)])).items()
    assert (index, others, conn.locked) == (0, [], ["k"])
    assert (error.code, error.reason) == (grpc.StatusCode.ABORTED, "CONCURRENCY_LIMIT_REACHED")
    assert error.message == (
        f"concurrency key 'k' already has 2 job(s) in flight: jobs/{_FIRST}, jobs/{_SECOND}"
    )
    assert error.metadata == {
        "concurrency_key": "k",
        "concurrency_limit": "2",
        "holders": f"jobs/{_FIRST},jobs/{_SECOND}",
    }
    assert error.holders == [f"jobs/{_FIRST}", f"jobs/{_SECOND}"]


async def test_a_key_the_batch_itself_fills_is_refused_naming_no_holder() -> None:
    conn = _Conn({})
    refused = await _refused(conn, [_job("r-1"), _job("r-2")])
    assert list(refused) == [1]
    error = refused[1]
    assert error.message == "concurrency key 'k' already has 1 job(s) in flight: in this batch"
    assert error.metadata == {"concurrency_key": "k", "concurrency_limit": "1", "holders": ""}
    assert error.holders == []


async def test_replays_queue_mode_jobs_and_other_keys_are_not_refused() -> None:
    conn = _Conn({"k": [_FIRST], "other": []}, taken=["r-replayed"])
    news = [
        _job("r-replayed"),  # a replay: the stored job is returned, not counted again
        _job("r-waits", mode=ConcurrencyMode.QUEUE),  # waits for its key instead
        _job("r-other", key="other"),
        _job("r-refused"),
    ]
    refused = await _refused(conn, news)
    assert list(refused) == [3]
    # The job waiting in queue mode holds a place, but has no name yet.
    assert refused[3].holders == [f"jobs/{_FIRST}"]
    assert conn.locked == ["k", "other"]  # each key once, in order
    # Without a key in reject mode, no statement at all.
    plain = _Conn({})
    queued = [_job("r-1", key=None), _job("r-2", mode=ConcurrencyMode.QUEUE)]
    assert await _refused(plain, queued) == {}
    assert plain.locked == []
