"""What JobService makes of a SubmitJob or BatchSubmitJobs request, on a fake store.

A valid request turns into the job the store is asked to write (its queue's
defaults where the request sets none, a pipeline's stages); every refusal is
INVALID_ARGUMENT (or its kin) on the field, with the message callers see, at
each bound's exact end; a batch's refusal names the request's index.
"""

from __future__ import annotations

import tomllib
import uuid
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from jobplane.blobs.reader import BlobInfo
from jobplane.blobs.store import BlobStore
from jobplane.errors import (
    BlobsDisabled,
    InvalidArgument,
    JobplaneError,
    PayloadTooLarge,
    UnroutableJobType,
)
from jobplane.observe.metrics import Metrics
from jobplane.server.service import SubmitRequest
from jobplane.store.job_submit import NewJob
from jobplane.topology import parse_topology
from jobplane.types import BlobRef, ConcurrencyMode, DependencyFailurePolicy
from tests.support.job_service import TENANT, JobStoreFake, service_on
from tests.support.jobs import NOW

_AFTER = uuid.UUID(int=7)

# Two queues, neither taking every type, and a pipeline whose own name no
# queue takes: its stages run on the docs queue, then the reports queue.
TOPOLOGY = parse_topology(
    tomllib.loads(
        """
[[queues]]
name = "jobs.reports"
bindings = ["reports.#"]
max_attempts = 7
timeout_seconds = 120

[[queues]]
name = "jobs.docs"
bindings = ["docs.#"]
max_attempts = 2
timeout_seconds = 30

[[pipelines]]
name = "flows.ingest"
version = "v2"
[[pipelines.stages]]
name = "split"
type = "docs.split"
max_attempts = 4
timeout_seconds = 50
[[pipelines.stages]]
name = "index"
type = "reports.index"
"""
    ),
    source="submit checks topology",
)


class _Metrics:
    def __init__(self) -> None:
        self.submits: list[tuple[str, str]] = []

    def submitted(self, job_type: str, queue: str, count: int = 1) -> None:
        self.submits.append((job_type, queue))

    def submit_grouped(self, size: int) -> None:
        pass


async def _accepted(request: SubmitRequest, **kwargs: Any) -> NewJob:
    """The job the store is asked to write for ``request``."""
    store = JobStoreFake()
    service = service_on(store, TOPOLOGY, **kwargs)
    metrics = _Metrics()
    service.metrics = cast(Metrics, metrics)
    try:
        job = await service.submit(TENANT, request)
    finally:
        await service.close()
    (new,) = store.news
    assert job.request_id == new.request_id
    assert metrics.submits == [(new.type, new.queue)]
    return new


async def _refused(request: SubmitRequest, **kwargs: Any) -> tuple[str | None, str]:
    """The field and message of the refusal of ``request``; nothing written."""
    store = JobStoreFake()
    service = service_on(store, TOPOLOGY, **kwargs)
    try:
        with pytest.raises(InvalidArgument) as refused:
            await service.submit(TENANT, request)
    finally:
        await service.close()
    assert store.news == []
    return refused.value.field, refused.value.message


async def test_a_plain_request_takes_its_queues_defaults() -> None:
    new = await _accepted(SubmitRequest("reports.render", {"a": [1, "é"]}))
    uuid.UUID(new.request_id)  # one of the server's making
    assert new == NewJob(
        type="reports.render",
        queue="jobs.reports",
        payload={"a": [1, "é"]},
        request_id=new.request_id,
        max_attempts=7,
        timeout_seconds=120.0,
    )
    assert new.payload_json == '{"a":[1,"é"]}'


async def test_a_requests_own_values_replace_the_queues() -> None:
    request = SubmitRequest(
        "docs.parse",
        {"n": 1},
        request_id="order-1",
        correlation_id="trace-9",
        max_attempts=5,
        labels={"team": "a"},
        timeout_seconds=12.5,
        concurrency_key="acct",
        concurrency_limit=3,
        concurrency_mode=2,
        after=(f"jobs/{_AFTER}",),
        after_failure=3,
    )
    new = await _accepted(request)
    assert new == NewJob(
        type="docs.parse",
        queue="jobs.docs",
        payload={"n": 1},
        request_id="order-1",
        max_attempts=5,
        correlation_id="trace-9",
        labels={"team": "a"},
        timeout_seconds=12.5,
        concurrency_key="acct",
        concurrency_limit=3,
        concurrency_mode=ConcurrencyMode.REJECT,
        after=(_AFTER,),
        after_failure=DependencyFailurePolicy.RUN_ANYWAY,
    )
    assert new.labels is not request.labels  # the job's own copy


async def test_a_pipeline_request_takes_its_stages_and_its_times() -> None:
    before = datetime.now(UTC)
    request = SubmitRequest(
        "flows.ingest",
        {"doc": 1},
        request_id="doc-1",
        correlation_id="c",
        labels={"k": "v"},
        schedule_delay_seconds=60,
        deadline_after_seconds=120,
        concurrency_key="acct",
    )
    new = await _accepted(request)
    after = datetime.now(UTC)
    assert (new.type, new.queue, new.pipeline_version) == ("flows.ingest", "jobs.docs", "v2")
    assert (new.request_id, new.correlation_id, new.labels) == ("doc-1", "c", {"k": "v"})
    assert (new.max_attempts, new.timeout_seconds, new.payload) == (0, 0.0, {"doc": 1})
    assert [(s.name, s.queue, s.max_attempts, s.timeout_seconds) for s in new.stages] == [
        ("split", "jobs.docs", 4, 50.0),
        ("index", "jobs.reports", 7, 120.0),
    ]
    assert new.concurrency_key == "acct" and new.payload_json == '{"doc":1}'
    assert new.schedule_time is not None and new.deadline is not None
    assert before + timedelta(seconds=60) <= new.schedule_time <= after + timedelta(seconds=60)
    assert new.deadline - new.schedule_time == timedelta(seconds=60)


async def test_a_pipeline_requests_attempts_and_timeout_are_every_stages() -> None:
    new = await _accepted(
        SubmitRequest("flows.ingest", {}, max_attempts=9, timeout_seconds=20, request_id="")
    )
    uuid.UUID(new.request_id)
    assert (new.max_attempts, new.timeout_seconds) == (9, 20.0)
    assert [(s.max_attempts, s.timeout_seconds) for s in new.stages] == [(9, 20.0), (9, 20.0)]
    assert (new.schedule_time, new.deadline) == (None, None)


class _Blobs:
    """The tenant's blobs: any digest but ``0…0``, each of 5 bytes."""

    async def owned(self, tenant: uuid.UUID, digests: set[str]) -> set[str]:
        assert tenant == TENANT
        return {d for d in digests if d != "0" * 64}

    async def stat(self, tenant: uuid.UUID, name: str) -> BlobInfo:
        assert tenant == TENANT
        return BlobInfo(name=name, digest=name.removeprefix("blobs/"), size=5)


async def test_a_payload_by_reference_and_the_blobs_it_uses_go_with_the_job() -> None:
    a, b = "a" * 64, "b" * 64
    blobs = cast(BlobStore, _Blobs())
    for job_type in ("reports.render", "flows.ingest"):
        request = SubmitRequest(
            job_type, {}, payload_blob=f"blobs/{a}", blob_references=(f"blobs/{b}",)
        )
        new = await _accepted(request, blobs=blobs)
        assert (new.payload_blob, new.blob_references) == (BlobRef(f"blobs/{a}", a, 5), (b,))
    gone = SubmitRequest("reports.render", {"x": "blobs/" + "0" * 64})
    assert await _refused(gone, blobs=blobs) == (
        "payload",
        f"the job references blobs/{'0' * 64}, which does not exist",
    )
    with pytest.raises(BlobsDisabled):
        await service_on(JobStoreFake(), TOPOLOGY).submit(
            TENANT, replace(gone, payload={"x": f"blobs/{a}"})
        )


async def test_a_type_no_queue_takes_is_refused() -> None:
    service = service_on(JobStoreFake(), TOPOLOGY)
    with pytest.raises(UnroutableJobType) as refused:
        await service.submit(TENANT, SubmitRequest("billing.charge", {}))
    assert (refused.value.field, refused.value.message) == (
        "type",
        "no queue of the topology takes job type 'billing.charge'",
    )
    assert await _refused(SubmitRequest("Bad Type", {})) == (
        "type",
        "type 'Bad Type' must be lowercase dotted words of letters, digits, '_' and '-' "
        "(e.g. 'reports.render')",
    )


async def test_max_attempts_is_0_to_100() -> None:
    for attempts, taken in ((0, 7), (1, 1), (100, 100)):
        new = await _accepted(SubmitRequest("reports.render", {}, max_attempts=attempts))
        assert new.max_attempts == taken
    for attempts in (-1, 101):
        assert await _refused(SubmitRequest("reports.render", {}, max_attempts=attempts)) == (
            "max_attempts",
            "max_attempts must be 0 (queue default) .. 100",
        )


async def test_the_timeout_is_a_millisecond_to_a_week() -> None:
    week = 7 * 24 * 3600.0
    for seconds in (0.001, week):
        new = await _accepted(SubmitRequest("reports.render", {}, timeout_seconds=seconds))
        assert new.timeout_seconds == seconds
    for seconds in (0.0009, week + 0.001, float("nan")):
        assert await _refused(SubmitRequest("reports.render", {}, timeout_seconds=seconds)) == (
            "timeout",
            "timeout must be at least 0.001 and at most 604800 seconds",
        )


async def test_the_ids_and_labels_are_taken_up_to_their_bounds() -> None:
    labels = {f"k{i}": "v" * 256 for i in range(64)}
    new = await _accepted(
        SubmitRequest(
            "reports.render",
            {},
            request_id="r" * 256,
            correlation_id="é" * 127 + "c",  # 255 bytes in UTF-8
            labels=labels,
        )
    )
    assert (new.request_id, new.labels) == ("r" * 256, labels)
    assert len(new.correlation_id.encode()) == 255


async def test_ids_and_labels_past_their_bounds_are_refused_on_their_field() -> None:
    cases: list[tuple[dict[str, Any], tuple[str, str]]] = [
        (
            {"request_id": "r" * 257},
            ("request_id", "request_id is longer than 256 characters"),
        ),
        ({"request_id": "a\x1fb"}, ("request_id", "request_id has control characters")),
        (
            {"request_id": "fan:x"},
            (
                "request_id",
                "request_id 'fan:x' starts with 'fan:', which is the system's "
                "(its prefixes: fan:, child:)",
            ),
        ),
        (
            {"correlation_id": "é" * 128},
            ("correlation_id", "correlation_id is longer than 255 bytes in UTF-8"),
        ),
        ({"correlation_id": "\x00"}, ("correlation_id", "correlation_id has control characters")),
        ({"labels": {f"k{i}": "" for i in range(65)}}, ("labels", "at most 64 labels")),
        (
            {"labels": {"Key": ""}},
            (
                "labels",
                "label key 'Key' must be 1..63 lowercase letters, digits, '.', '_', '-', '/'",
            ),
        ),
        (
            {"labels": {"k": "v" * 257}},
            ("labels[k]", "label 'k' is longer than 256 characters"),
        ),
        ({"labels": {"k": "a\x00"}}, ("labels[k]", "label 'k' has a NUL character")),
    ]
    for fields, refusal in cases:
        assert await _refused(SubmitRequest("reports.render", {}, **fields)) == refusal


async def test_the_payload_is_taken_up_to_the_servers_limit() -> None:
    payload = {"s": "x" * 90}  # {"s":"…"} is 98 bytes
    new = await _accepted(SubmitRequest("reports.render", payload), max_payload_bytes=98)
    assert new.payload_json == f'{{"s":"{"x" * 90}"}}'
    service = service_on(JobStoreFake(), TOPOLOGY, max_payload_bytes=97)
    with pytest.raises(PayloadTooLarge) as refused:
        await service.submit(TENANT, SubmitRequest("reports.render", payload))
    assert refused.value.field == "payload"
    assert refused.value.message == "payload is 98 bytes serialized; the limit is 97"
    assert await _refused(SubmitRequest("reports.render", {"a": ["b\x00"]})) == (
        "payload",
        "payload has a NUL character at 'payload.a[0]'",
    )


async def test_a_schedule_and_a_deadline_keep_to_the_servers_horizon() -> None:
    at = NOW + timedelta(days=3650)
    new = await _accepted(
        SubmitRequest("reports.render", {}, schedule_time=at), max_schedule_seconds=4000 * 86400
    )
    assert (new.schedule_time, new.deadline) == (at, None)
    before = datetime.now(UTC)
    new = await _accepted(
        SubmitRequest("reports.render", {}, schedule_delay_seconds=60, deadline_after_seconds=60.5),
        max_schedule_seconds=60.5,
    )
    assert new.schedule_time is not None and new.deadline is not None
    assert new.schedule_time >= before + timedelta(seconds=60)
    assert new.deadline - new.schedule_time == timedelta(seconds=0.5)
    assert await _refused(
        SubmitRequest("reports.render", {}, schedule_delay_seconds=61), max_schedule_seconds=60
    ) == (
        "schedule_delay",
        "schedule_delay must be 0 to 60 seconds (the server's JOBPLANE_MAX_SCHEDULE_SECONDS), "
        "not 61",
    )
    assert await _refused(
        SubmitRequest("reports.render", {}, deadline_after_seconds=61), max_schedule_seconds=60
    ) == (
        "deadline_after",
        "deadline_after must be more than 0, up to 60 seconds "
        "(the server's JOBPLANE_MAX_SCHEDULE_SECONDS), not 61",
    )
    field, message = await _refused(
        SubmitRequest("reports.render", {}, schedule_delay_seconds=60, deadline_after_seconds=30)
    )
    assert field == "deadline_after"
    assert message.startswith("deadline_after must be after the job's schedule_time (")


async def test_concurrency_and_after_are_checked_with_the_rest() -> None:
    assert await _refused(SubmitRequest("reports.render", {}, concurrency_limit=2)) == (
        "concurrency_limit",
        "concurrency_limit needs a concurrency_key",
    )
    assert await _refused(SubmitRequest("reports.render", {}, after_failure=1)) == (
        "after_failure",
        "after_failure needs after",
    )


async def test_a_batch_is_each_request_checked_and_written_at_once() -> None:
    store = JobStoreFake(known=["old"])
    service = service_on(store, TOPOLOGY)
    metrics = _Metrics()
    service.metrics = cast(Metrics, metrics)
    requests = [
        SubmitRequest("reports.render", {}, request_id="old"),
        SubmitRequest("docs.parse", {"n": 1}),
        SubmitRequest("reports.render", {}),
    ]
    jobs = await service.submit_many(TENANT, requests)
    assert [j.type for j in jobs] == ["reports.render", "docs.parse", "reports.render"]
    assert [n.queue for n in store.news] == ["jobs.reports", "jobs.docs", "jobs.reports"]
    assert jobs[0].request_id == "old"
    assert len({j.request_id for j in jobs}) == 3  # unset ones are not shared
    # The one the tenant had submitted before is not counted again.
    assert metrics.submits == [("docs.parse", "jobs.docs"), ("reports.render", "jobs.reports")]
    jobs = await service.submit_many(TENANT, [SubmitRequest("docs.parse", {})] * 1000)
    assert len(jobs) == 1000


async def _batch_refused(requests: Sequence[SubmitRequest]) -> JobplaneError:
    store = JobStoreFake()
    with pytest.raises(InvalidArgument) as refused:
        await service_on(store, TOPOLOGY).submit_many(TENANT, requests)
    assert store.news == []
    return refused.value


async def test_a_batch_is_refused_whole_at_the_first_request_wrong() -> None:
    empty = await _batch_refused([])
    assert (empty.field, empty.message) == ("requests", "requests is empty: send 1 to 1000")
    many = await _batch_refused([SubmitRequest("docs.parse", {})] * 1001)
    assert (many.field, many.message, many.metadata) == (
        "requests",
        "at most 1000 requests in one call, not 1001",
        {"limit": "1000"},
    )
    wrong = await _batch_refused(
        [
            SubmitRequest("docs.parse", {}),
            SubmitRequest("docs.parse", {}, max_attempts=101),
            SubmitRequest("billing.charge", {}),
        ]
    )
    assert (wrong.field, wrong.message, wrong.metadata) == (
        "requests[1].max_attempts",
        "requests[1]: max_attempts must be 0 (queue default) .. 100",
        {"index": "1"},
    )
    twice = await _batch_refused(
        [
            SubmitRequest("docs.parse", {}, request_id="a"),
            SubmitRequest("docs.parse", {}, request_id="b"),
            SubmitRequest("docs.parse", {}, request_id="a"),
        ]
    )
    assert (twice.field, twice.message, twice.metadata) == (
        "requests[2].request_id",
        "requests[2]: request_id 'a' is also that of requests[0]: "
        "each request of a batch needs its own",
        {"index": "2"},
    )
