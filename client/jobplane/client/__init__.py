"""The Python SDK of jobplane: submit jobs, read them back, follow their progress;
publish domain events and subscribe to them.

:class:`Client` blocks, :class:`AsyncClient` is for asyncio; both have the
same methods. ``from_env()`` reads ``JOBPLANE_ADDRESS`` and ``JOBPLANE_API_KEY``.

Example::

    from jobplane.client import Client, JobState

    with Client("127.0.0.1:50051", api_key="...") as client:
        job = client.submit("reports.render", {"report": 42}, labels={"team": "bi"})
        for event in client.watch(job):  # resumes across server restarts
            print(f"{event.seq} {event.type.value} {event.progress:.0%} {event.message}")
        job = client.get(job)
        if job.state is JobState.SUCCEEDED:
            print(job.result)
        client.publish("report.rendered", {"report": 42})
        with client.subscribe(["report.*"], after_cursor=saved) as events:
            for event, cursor in events:  # resumes by itself too
                handle(event)
                saved = cursor

Failed calls raise subclasses of :class:`JobplaneError`, e.g. :class:`JobNotFound`.
"""

from __future__ import annotations

from jobplane.client._errors import WatchSequenceError
from jobplane.client._retry import RetryPolicy
from jobplane.client.aio import AsyncClient
from jobplane.client.batch import JobSpec
from jobplane.client.progress import ProgressTracker
from jobplane.client.subscription import EventSubscription, SubscribedEvent, SubscribeStart
from jobplane.client.sync import BlockingSubscription, Client
from jobplane.client.tls import ClientTLS
from jobplane.errors import (
    Aborted,
    BlobInUse,
    BlobNotFound,
    BlobsDisabled,
    BlobSizeMismatch,
    BlobStoreUnavailable,
    BlobTooLarge,
    ConcurrencyLimitReached,
    DigestMismatch,
    EventIdReused,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    JobAlreadyTerminal,
    JobNotFound,
    JobNotRetryable,
    JobplaneError,
    KeyScopeMismatch,
    MalformedRequest,
    ParentWaiting,
    PayloadTooLarge,
    PermissionDenied,
    RequestIdReused,
    ResourceExhausted,
    ScheduleExists,
    ScheduleNotFound,
    TenantLimitExceeded,
    Unauthenticated,
    Unavailable,
    UnroutableJobType,
)
from jobplane.events.envelope import Event
from jobplane.schedule_types import CatchUp, JobTemplate, Overlap, Schedule, SchedulePage, Spec
from jobplane.types import (
    Blob,
    BlobPage,
    BlobRef,
    ConcurrencyMode,
    DependencyFailurePolicy,
    EventType,
    FanOut,
    Job,
    JobError,
    JobEvent,
    JobPage,
    JobState,
    Stage,
    StageState,
    WaitingCode,
)

__all__ = [
    "Aborted",
    "AsyncClient",
    "Blob",
    "BlobInUse",
    "BlobNotFound",
    "BlobPage",
    "BlobRef",
    "BlobSizeMismatch",
    "BlobStoreUnavailable",
    "BlobTooLarge",
    "BlobsDisabled",
    "BlockingSubscription",
    "CatchUp",
    "Client",
    "ClientTLS",
    "ConcurrencyLimitReached",
    "ConcurrencyMode",
    "DependencyFailurePolicy",
    "DigestMismatch",
    "Event",
    "EventIdReused",
    "EventSubscription",
    "EventType",
    "FailedPrecondition",
    "FanOut",
    "InternalError",
    "InvalidArgument",
    "Job",
    "JobAlreadyTerminal",
    "JobError",
    "JobEvent",
    "JobNotFound",
    "JobNotRetryable",
    "JobPage",
    "JobSpec",
    "JobState",
    "JobTemplate",
    "JobplaneError",
    "KeyScopeMismatch",
    "MalformedRequest",
    "Overlap",
    "ParentWaiting",
    "PayloadTooLarge",
    "PermissionDenied",
    "ProgressTracker",
    "RequestIdReused",
    "ResourceExhausted",
    "RetryPolicy",
    "Schedule",
    "ScheduleExists",
    "ScheduleNotFound",
    "SchedulePage",
    "Spec",
    "Stage",
    "StageState",
    "SubscribeStart",
    "SubscribedEvent",
    "TenantLimitExceeded",
    "Unauthenticated",
    "Unavailable",
    "UnroutableJobType",
    "WaitingCode",
    "WatchSequenceError",
]
