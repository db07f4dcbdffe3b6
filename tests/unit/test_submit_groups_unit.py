"""The server's submit groups when a statement is refused (ADR-0030), on a fake store."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import pytest

from jobplane.errors import BlobReferenceNotFound, JobplaneError
from jobplane.server.service import SubmitRequest
from jobplane.store.jobs import NewJob
from jobplane.types import Job
from tests.support.job_service import TENANT, JobStoreFake, service_on


async def test_a_statement_refused_for_one_request_fails_only_that_request() -> None:
    store = JobStoreFake(delay=0.01, refuse_gone=True)
    service = service_on(store)
    try:
        results = await asyncio.gather(
            *(
                service.submit(TENANT, SubmitRequest("demo.echo", {"n": i, "gone": i == 3}))
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
    class _Down(JobStoreFake):
        async def submit_each(
            self, _tenant: uuid.UUID, news: Sequence[NewJob]
        ) -> list[tuple[Job, bool] | JobplaneError]:
            self.statements.append(len(news))
            raise ConnectionResetError("the database went away")

    store = _Down()
    service = service_on(store)
    try:
        results = await asyncio.gather(
            *(service.submit(TENANT, SubmitRequest("demo.echo", {})) for _ in range(5)),
            return_exceptions=True,
        )
    finally:
        await service.close()
    assert all(isinstance(r, ConnectionResetError) for r in results)
    # No request was tried alone: each caller repeats its own call.
    assert sum(store.statements) == 5


@pytest.mark.parametrize("size", [1, 2])
async def test_the_same_request_id_twice_goes_in_separate_statements(size: int) -> None:
    store = JobStoreFake(delay=0.01, refuse_gone=True)
    service = service_on(store)
    try:
        await asyncio.gather(
            service.submit(TENANT, SubmitRequest("demo.echo", {}, request_id="same")),
            *(service.submit(TENANT, SubmitRequest("demo.echo", {})) for _ in range(size)),
            service.submit(TENANT, SubmitRequest("demo.echo", {}, request_id="same")),
        )
    finally:
        await service.close()
    # Those that came together share a statement, but for the repeated
    # request_id: it waits for a later one, which finds the first one's job.
    assert store.statements == [size + 1, 1]
