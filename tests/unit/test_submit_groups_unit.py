"""The server's submit groups when a statement is refused (ADR-0030), on a fake store."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, cast

import pytest

from jobplane.errors import BlobReferenceNotFound, JobplaneError
from jobplane.server.service import JobService, SubmitRequest
from jobplane.store.jobs import JobStore, NewJob
from jobplane.store.listen import Listener
from jobplane.topology import load_topology
from jobplane.types import Job, JobState

_NOW = datetime(2026, 1, 1, tzinfo=UTC)
_TENANT = uuid.UUID(int=1)


def _job(new: NewJob) -> Job:
    return Job(
        name=f"jobs/{uuid.uuid4()}",
        type=new.type,
        state=JobState.QUEUED,
        payload=new.payload,
        result=None,
        error=None,
        progress=0.0,
        progress_message="",
        attempt=0,
        max_attempts=new.max_attempts,
        request_id=new.request_id,
        correlation_id="",
        labels={},
        create_time=_NOW,
        update_time=_NOW,
    )


class _Store:
    """Refuses any statement holding the request whose payload says ``gone``."""

    def __init__(self) -> None:
        self.statements: list[int] = []

    async def submit_each(
        self, _tenant: uuid.UUID, news: Sequence[NewJob]
    ) -> list[tuple[Job, bool] | JobplaneError]:
        self.statements.append(len(news))
        await asyncio.sleep(0.01)
        if any(n.payload.get("gone") for n in news):
            raise BlobReferenceNotFound("a blob was deleted", field="payload")
        return [(_job(n), True) for n in news]

    async def submit(self, tenant: uuid.UUID, new: NewJob) -> tuple[Job, bool]:
        (result,) = await self.submit_each(tenant, [new])
        if isinstance(result, BaseException):
            raise result
        return result

    async def read_streams(self, *_: Any) -> list[Any]:
        return []


async def test_a_statement_refused_for_one_request_fails_only_that_request() -> None:
    store = _Store()
    service = JobService(
        cast(JobStore, store), Listener("postgresql://unused/db", "unused"), load_topology()
    )
    try:
        results = await asyncio.gather(
            *(
                service.submit(_TENANT, SubmitRequest("demo.echo", {"n": i, "gone": i == 3}))
                for i in range(8)
            ),
            return_exceptions=True,
        )
    finally:
        await service.close()
    assert isinstance(results[3], BlobReferenceNotFound)
    assert results[3].field == "payload"
    for i, job in enumerate(results):
        if i != 3:
            assert isinstance(job, Job) and job.payload == {"n": i, "gone": False}
    # A group was refused whole, then its requests went one at a time.
    assert max(store.statements) > 1
    assert store.statements.count(1) >= 2


async def test_a_transient_refusal_reaches_every_caller_of_its_group() -> None:
    class _Down(_Store):
        async def submit_each(
            self, _tenant: uuid.UUID, news: Sequence[NewJob]
        ) -> list[tuple[Job, bool] | JobplaneError]:
            self.statements.append(len(news))
            raise ConnectionResetError("the database went away")

    store = _Down()
    service = JobService(
        cast(JobStore, store), Listener("postgresql://unused/db", "unused"), load_topology()
    )
    try:
        results = await asyncio.gather(
            *(service.submit(_TENANT, SubmitRequest("demo.echo", {})) for _ in range(5)),
            return_exceptions=True,
        )
    finally:
        await service.close()
    assert all(isinstance(r, ConnectionResetError) for r in results)
    # No request was tried alone: each caller repeats its own call.
    assert sum(store.statements) == 5


@pytest.mark.parametrize("size", [1, 2])
async def test_the_same_request_id_twice_goes_in_separate_statements(size: int) -> None:
    store = _Store()
    service = JobService(
        cast(JobStore, store), Listener("postgresql://unused/db", "unused"), load_topology()
    )
    try:
        await asyncio.gather(
            service.submit(_TENANT, SubmitRequest("demo.echo", {}, request_id="same")),
            *(service.submit(_TENANT, SubmitRequest("demo.echo", {})) for _ in range(size)),
            service.submit(_TENANT, SubmitRequest("demo.echo", {}, request_id="same")),
        )
    finally:
        await service.close()
    # Those that came together share a statement, but for the repeated
    # request_id: it waits for a later one, which finds the first one's job.
    assert store.statements == [size + 1, 1]
