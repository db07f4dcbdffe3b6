"""JobService's calls on one job, on a fake store: each refuses a malformed name
or argument on its field before the store is asked, at the argument's exact
bound, and asks the store for the job the name names."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, cast

import pytest

from jobplane.errors import InvalidArgument, JobNotFound
from jobplane.server.feeds import FeedHub
from jobplane.server.service import JobService
from jobplane.store.job_reads import StreamRead
from jobplane.store.jobs import JobStore
from jobplane.store.listen import Listener
from jobplane.topology import load_topology
from jobplane.types import Job, JobState

_NOW = datetime(2026, 1, 1, tzinfo=UTC)
_TENANT = uuid.UUID(int=1)
_ID = uuid.UUID(int=42)
_NAME = f"jobs/{_ID}"
# What the fakes answer, passed through as they are.
_MILESTONES: Any = ["started"]
_TREE: Any = "tree"
_EVENTS: Any = ["e1", "e2"]


def _job(last_seq: int = 0) -> Job:
    return Job(
        name=_NAME,
        type="demo.echo",
        state=JobState.FAILED,
        payload={},
        result=None,
        error=None,
        progress=0.0,
        progress_message="",
        attempt=1,
        max_attempts=1,
        request_id="r",
        correlation_id="",
        labels={},
        create_time=_NOW,
        update_time=_NOW,
        last_seq=last_seq,
    )


class _Store:
    """Answers every call with the one job (or its events), and remembers the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.tree_of: Any = _TREE

    async def get(self, tenant: uuid.UUID, job_id: uuid.UUID) -> Job:
        self.calls.append(("get", tenant, job_id))
        return _job()

    async def cancel(self, tenant: uuid.UUID, job_id: uuid.UUID, reason: str) -> Job:
        self.calls.append(("cancel", tenant, job_id, reason))
        return _job()

    async def retry(self, tenant: uuid.UUID, job_id: uuid.UUID, *, from_stage: str) -> Job:
        self.calls.append(("retry", tenant, job_id, from_stage))
        return _job()

    async def milestones(self, tenant: uuid.UUID, job_id: uuid.UUID, limit: int) -> Any:
        self.calls.append(("milestones", tenant, job_id, limit))
        return _MILESTONES

    async def tree(self, tenant: uuid.UUID, job_id: uuid.UUID) -> Any:
        self.calls.append(("tree", tenant, job_id))
        return self.tree_of

    async def read_stream(
        self, tenant: uuid.UUID, job_id: uuid.UUID, after_seq: int, limit: int
    ) -> StreamRead:
        self.calls.append(("read_stream", tenant, job_id, after_seq, limit))
        return StreamRead(events=_EVENTS, ended=True, last_seq=0)

    async def count_states(self, tenant: uuid.UUID, *, cap: int) -> dict[JobState, int]:
        self.calls.append(("count_states", tenant, cap))
        return {JobState.QUEUED: 2}

    async def read_streams(self, *_: Any) -> list[Any]:
        return []


class _Feeds:
    """Yields two events for any watch, remembering what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[uuid.UUID, uuid.UUID, int]] = []

    async def watch(
        self, tenant: uuid.UUID, job_id: uuid.UUID, after_seq: int
    ) -> AsyncIterator[str]:
        self.asked.append((tenant, job_id, after_seq))
        for event in _EVENTS:
            yield event


def _service(store: _Store) -> JobService:
    return JobService(
        cast(JobStore, store), Listener("postgresql://unused/db", "unused"), load_topology()
    )


async def _refused(call: Any) -> tuple[str | None, str]:
    with pytest.raises(InvalidArgument) as refused:
        await call
    return refused.value.field, refused.value.message


async def test_a_call_on_a_job_asks_the_store_for_the_named_job() -> None:
    store = _Store()
    service = _service(store)
    assert (await service.get(_TENANT, _NAME)).name == _NAME
    assert await service.milestones(_TENANT, _NAME) == _MILESTONES
    await service.milestones(_TENANT, _NAME, limit=5)
    assert await service.tree(_TENANT, _NAME) == _TREE
    assert await service.count_states(_TENANT) == {JobState.QUEUED: 2}
    await service.count_states(_TENANT, cap=3)
    assert store.calls == [
        ("get", _TENANT, _ID),
        ("milestones", _TENANT, _ID, 1000),
        ("milestones", _TENANT, _ID, 5),
        ("tree", _TENANT, _ID),
        ("count_states", _TENANT, 10_000),
        ("count_states", _TENANT, 3),
    ]
    assert await _refused(service.get(_TENANT, "job/1")) == (
        "name",
        "name must look like jobs/{id}, got 'job/1'",
    )
    store.tree_of = None
    with pytest.raises(JobNotFound, match=rf"^{_NAME} not found$"):
        await service.tree(_TENANT, _NAME)


async def test_recent_events_are_the_last_of_the_stream() -> None:
    store = _Store()
    service = _service(store)
    assert await service.recent_events(_TENANT, _job(last_seq=450)) == _EVENTS
    await service.recent_events(_TENANT, _job(last_seq=450), limit=10)
    await service.recent_events(_TENANT, _job(last_seq=3))
    assert store.calls == [
        ("read_stream", _TENANT, _ID, 250, 200),
        ("read_stream", _TENANT, _ID, 440, 10),
        ("read_stream", _TENANT, _ID, 0, 200),
    ]


async def test_a_cancel_reason_is_at_most_1024_characters_without_nul() -> None:
    store = _Store()
    service = _service(store)
    await service.cancel(_TENANT, _NAME, "r" * 1024)
    await service.cancel(_TENANT, _NAME, "")
    assert store.calls == [("cancel", _TENANT, _ID, "r" * 1024), ("cancel", _TENANT, _ID, "")]
    assert await _refused(service.cancel(_TENANT, _NAME, "r" * 1025)) == (
        "reason",
        "reason is longer than 1024 characters",
    )
    assert await _refused(service.cancel(_TENANT, _NAME, "a\x00")) == (
        "reason",
        "reason has a NUL character",
    )
    assert await _refused(service.cancel(_TENANT, "jobs/x", "")) == (
        "name",
        "name has a malformed job id 'x'",
    )
    assert len(store.calls) == 2


async def test_a_retry_stage_is_at_most_64_characters_without_nul() -> None:
    store = _Store()
    service = _service(store)
    await service.retry(_TENANT, _NAME)
    await service.retry(_TENANT, _NAME, from_stage="s" * 64)
    assert store.calls == [("retry", _TENANT, _ID, ""), ("retry", _TENANT, _ID, "s" * 64)]
    for stage in ("s" * 65, "a\x00"):
        assert await _refused(service.retry(_TENANT, _NAME, from_stage=stage)) == (
            "from_stage",
            "from_stage is not a stage name",
        )
    assert await _refused(service.retry(_TENANT, "jobs/", "")) == (
        "name",
        "name has a malformed job id ''",
    )
    assert len(store.calls) == 2


async def test_a_watch_starts_after_a_seq_not_negative() -> None:
    service = _service(_Store())
    feeds = _Feeds()
    service.feeds = cast(FeedHub, feeds)
    assert [e async for e in service.watch(_TENANT, _NAME, 0)] == _EVENTS
    assert [e async for e in service.watch(_TENANT, _NAME, 7)] == _EVENTS
    assert feeds.asked == [(_TENANT, _ID, 0), (_TENANT, _ID, 7)]
    with pytest.raises(InvalidArgument) as refused:
        _ = [e async for e in service.watch(_TENANT, _NAME, -1)]
    assert (refused.value.field, refused.value.message) == (
        "after_seq",
        "after_seq must not be negative",
    )
    with pytest.raises(InvalidArgument) as refused:
        _ = [e async for e in service.watch(_TENANT, "jobs", 0)]
    assert refused.value.field == "name"
    assert len(feeds.asked) == 2
