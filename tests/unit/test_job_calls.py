"""JobService's calls on one job, on a fake store: each refuses a malformed name
or argument on its field before the store is asked, at the argument's exact
bound, and asks the store for the job the name names."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from jobplane.errors import InvalidArgument, JobNotFound
from jobplane.server.feeds import FeedHub
from jobplane.types import Job, JobState
from tests.support.job_service import TENANT, JobStoreFake, service_on
from tests.support.jobs import stored_job

_ID = uuid.UUID(int=42)
_NAME = f"jobs/{_ID}"
# What the fakes answer, passed through as they are.
_MILESTONES: Any = ["started"]
_TREE: Any = "tree"
_EVENTS: Any = ["e1", "e2"]


def _job(last_seq: int = 0) -> Job:
    return stored_job(
        _NAME,
        state=JobState.FAILED,
        attempt=1,
        max_attempts=1,
        request_id="r",
        last_seq=last_seq,
    )


def _store() -> JobStoreFake:
    """Answers every call with the one job (or its events), and remembers the calls."""
    return JobStoreFake(
        one=_job(),
        milestones_of=_MILESTONES,
        tree_of=_TREE,
        events=_EVENTS,
        states={JobState.QUEUED: 2},
    )


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


async def _refused(call: Any) -> tuple[str | None, str]:
    with pytest.raises(InvalidArgument) as refused:
        await call
    return refused.value.field, refused.value.message


async def test_a_call_on_a_job_asks_the_store_for_the_named_job() -> None:
    store = _store()
    service = service_on(store)
    assert (await service.get(TENANT, _NAME)).name == _NAME
    milestones: Any = await service.milestones(TENANT, _NAME)
    assert milestones == ["started"]
    await service.milestones(TENANT, _NAME, limit=5)
    tree: Any = await service.tree(TENANT, _NAME)
    assert tree == "tree"
    assert await service.count_states(TENANT) == {JobState.QUEUED: 2}
    await service.count_states(TENANT, cap=3)
    assert store.calls == [
        ("get", TENANT, _ID),
        ("milestones", TENANT, _ID, 1000),
        ("milestones", TENANT, _ID, 5),
        ("tree", TENANT, _ID),
        ("count_states", TENANT, 10_000),
        ("count_states", TENANT, 3),
    ]
    assert await _refused(service.get(TENANT, "job/1")) == (
        "name",
        "name must look like jobs/{id}, got 'job/1'",
    )
    store.tree_of = None
    with pytest.raises(JobNotFound, match=rf"^{_NAME} not found$"):
        await service.tree(TENANT, _NAME)


async def test_recent_events_are_the_last_of_the_stream() -> None:
    store = _store()
    service = service_on(store)
    recent: Any = await service.recent_events(TENANT, _job(last_seq=450))
    assert recent == ["e1", "e2"]
    await service.recent_events(TENANT, _job(last_seq=450), limit=10)
    await service.recent_events(TENANT, _job(last_seq=3))
    assert store.calls == [
        ("read_stream", TENANT, _ID, 250, 200),
        ("read_stream", TENANT, _ID, 440, 10),
        ("read_stream", TENANT, _ID, 0, 200),
    ]


async def test_a_cancel_reason_is_at_most_1024_characters_without_nul() -> None:
    store = _store()
    service = service_on(store)
    await service.cancel(TENANT, _NAME, "r" * 1024)
    await service.cancel(TENANT, _NAME, "")
    assert store.calls == [("cancel", TENANT, _ID, "r" * 1024), ("cancel", TENANT, _ID, "")]
    assert await _refused(service.cancel(TENANT, _NAME, "r" * 1025)) == (
        "reason",
        "reason is longer than 1024 characters",
    )
    assert await _refused(service.cancel(TENANT, _NAME, "a\x00")) == (
        "reason",
        "reason has a NUL character",
    )
    assert await _refused(service.cancel(TENANT, "jobs/x", "")) == (
        "name",
        "name has a malformed job id 'x'",
    )
    assert len(store.calls) == 2


async def test_a_retry_stage_is_at_most_64_characters_without_nul() -> None:
    store = _store()
    service = service_on(store)
    await service.retry(TENANT, _NAME)
    await service.retry(TENANT, _NAME, from_stage="s" * 64)
    assert store.calls == [("retry", TENANT, _ID, ""), ("retry", TENANT, _ID, "s" * 64)]
    for stage in ("s" * 65, "a\x00"):
        assert await _refused(service.retry(TENANT, _NAME, from_stage=stage)) == (
            "from_stage",
            "from_stage is not a stage name",
        )
    assert await _refused(service.retry(TENANT, "jobs/", "")) == (
        "name",
        "name has a malformed job id ''",
    )
    assert len(store.calls) == 2


async def test_a_watch_starts_after_a_seq_not_negative() -> None:
    service = service_on(_store())
    feeds = _Feeds()
    service.feeds = cast(FeedHub, feeds)
    watched: list[Any] = [e async for e in service.watch(TENANT, _NAME, 0)]
    assert watched == ["e1", "e2"]
    watched = [e async for e in service.watch(TENANT, _NAME, 7)]
    assert watched == ["e1", "e2"]
    assert feeds.asked == [(TENANT, _ID, 0), (TENANT, _ID, 7)]
    with pytest.raises(InvalidArgument) as refused:
        _ = [e async for e in service.watch(TENANT, _NAME, -1)]
    assert (refused.value.field, refused.value.message) == (
        "after_seq",
        "after_seq must not be negative",
    )
    with pytest.raises(InvalidArgument) as refused:
        _ = [e async for e in service.watch(TENANT, "jobs", 0)]
    assert refused.value.field == "name"
    assert len(feeds.asked) == 2
