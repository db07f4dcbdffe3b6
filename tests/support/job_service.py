"""A stand-in for JobService's store, for unit tests of what the service asks of
its store and makes of the answers.

:class:`JobStoreFake` takes every job it is asked to write and answers every
read with what it was given, remembering each call; :func:`service_on` is the
JobService on it (its listener never connects).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from jobplane.errors import BlobReferenceNotFound, JobplaneError
from jobplane.server.service import JobService
from jobplane.store.job_reads import StreamRead
from jobplane.store.job_submit import NewJob
from jobplane.store.jobs import JobStore
from jobplane.store.listen import Listener
from jobplane.topology import Topology, load_topology
from jobplane.types import Job, JobState
from tests.support.jobs import stored_job

TENANT = uuid.UUID(int=1)


def written(new: NewJob) -> Job:
    """The queued job the store writes for ``new``."""
    return stored_job(
        type=new.type,
        payload=new.payload,
        max_attempts=new.max_attempts,
        request_id=new.request_id,
        correlation_id=new.correlation_id,
        labels=new.labels,
    )


@dataclass
class JobStoreFake:
    """JobService's store: writes nothing, answers with what it was given.

    A submit takes every job of :data:`TENANT` (a request_id in ``known`` reads
    as a job stored before), each statement taking ``delay`` seconds; with
    ``refuse_gone``, a statement holding a payload whose ``gone`` is set is
    refused whole, as when a blob it uses was deleted. ``get``, ``cancel`` and
    ``retry`` answer ``one``; ``list_jobs`` as many of ``jobs`` as asked.
    """

    known: Sequence[str] = ()
    delay: float = 0.0
    refuse_gone: bool = False
    one: Job = field(default_factory=stored_job)
    jobs: list[Job] = field(default_factory=list)
    milestones_of: Any = None
    tree_of: Any = None
    events: Any = None
    states: dict[JobState, int] = field(default_factory=dict)
    rates: dict[str, Any] = field(default_factory=dict)
    # What it was asked: each submit statement's size, the jobs to write, the reads.
    statements: list[int] = field(default_factory=list)
    news: list[NewJob] = field(default_factory=list)
    calls: list[Any] = field(default_factory=list)

    async def submit_each(
        self, tenant: uuid.UUID, news: Sequence[NewJob]
    ) -> list[tuple[Job, bool] | JobplaneError]:
        assert tenant == TENANT
        self.statements.append(len(news))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.refuse_gone and any(n.payload.get("gone") for n in news):
            raise BlobReferenceNotFound("a blob was deleted", field="payload")
        self.news.extend(news)
        return [(written(n), n.request_id not in self.known) for n in news]

    async def submit_many(self, tenant: uuid.UUID, news: Sequence[NewJob]) -> list[Any]:
        return await self.submit_each(tenant, news)

    async def submit(self, tenant: uuid.UUID, new: NewJob) -> tuple[Job, bool]:
        (result,) = await self.submit_each(tenant, [new])
        if isinstance(result, JobplaneError):  # as the store's submit: its one refusal
            raise result
        return result

    async def get(self, tenant: uuid.UUID, job_id: uuid.UUID) -> Job:
        self.calls.append(("get", tenant, job_id))
        return self.one

    async def cancel(self, tenant: uuid.UUID, job_id: uuid.UUID, reason: str) -> Job:
        self.calls.append(("cancel", tenant, job_id, reason))
        return self.one

    async def retry(self, tenant: uuid.UUID, job_id: uuid.UUID, *, from_stage: str) -> Job:
        self.calls.append(("retry", tenant, job_id, from_stage))
        return self.one

    async def milestones(self, tenant: uuid.UUID, job_id: uuid.UUID, limit: int) -> Any:
        self.calls.append(("milestones", tenant, job_id, limit))
        return self.milestones_of

    async def tree(self, tenant: uuid.UUID, job_id: uuid.UUID) -> Any:
        self.calls.append(("tree", tenant, job_id))
        return self.tree_of

    async def read_stream(
        self, tenant: uuid.UUID, job_id: uuid.UUID, after_seq: int, limit: int
    ) -> StreamRead:
        self.calls.append(("read_stream", tenant, job_id, after_seq, limit))
        return StreamRead(events=self.events, ended=True, last_seq=0)

    async def count_states(self, tenant: uuid.UUID, *, cap: int) -> dict[JobState, int]:
        self.calls.append(("count_states", tenant, cap))
        return self.states

    async def list_jobs(self, tenant: uuid.UUID, **kwargs: Any) -> list[Job]:
        assert tenant == TENANT
        self.calls.append(kwargs)
        return self.jobs[: kwargs["limit"]]

    async def queue_rates(self, tenant: uuid.UUID, **kwargs: Any) -> dict[str, Any]:
        self.calls.append({"tenant": tenant, **kwargs})
        return self.rates

    async def read_streams(self, *_: Any) -> list[Any]:
        return []


def service_on(store: JobStoreFake, topology: Topology | None = None, **kwargs: Any) -> JobService:
    """The JobService on ``store`` (``topology``, else the default one)."""
    return JobService(
        cast(JobStore, store),
        Listener("postgresql://unused/db", "unused"),
        topology or load_topology(),
        **kwargs,
    )
