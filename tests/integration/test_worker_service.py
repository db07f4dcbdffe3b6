"""WorkerService: a worker that imports nothing of jobplane runs jobs end to end.

The foreign worker (foreign_worker/worker.py) is a process of its own, with
stubs generated from proto/ into a temporary directory and a plain AMQP
client: what it needs is only what docs/workers.md says. The other tests
call WorkerService directly for what a well-behaved worker never does
(stale tokens, the wrong keys, bad requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeAlias

import grpc
import pytest
from google.protobuf import duration_pb2
from grpc_tools import protoc  # type: ignore[import-untyped]
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.attempt_end import RetryPolicy
from jobplane.client import EventType, JobState
from jobplane.convert import struct_from_dict
from jobplane.envelope import Envelope
from jobplane.store.sweeps import SweepStore
from jobplane.store.workers import WorkerStore
from jobplane.topology import Topology
from jobplane.v1 import jobs_pb2, jobs_pb2_grpc, workers_pb2, workers_pb2_grpc
from jobplane.workers.handlers import JobContext, Registry, RetryableError
from jobplane.workers.sweeper import lease_expired
from tests.support.answers import check_refusal
from tests.support.queues import publish_raw, ready_count
from tests.support.s3 import MotoServer, blob_store
from tests.support.stack import Stack, eventually, start_stack

pytestmark = pytest.mark.stack(worker=False)

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parent / "foreign_worker" / "worker.py"
Claim = workers_pb2.ClaimJobResponse
# The job types the foreign worker runs, unless a test says otherwise.
TYPES = "reports.render,reports.flaky,reports.broken,reports.long"
# A WorkerService stub and the worker key's metadata.
Workers: TypeAlias = "tuple[workers_pb2_grpc.WorkerServiceAsyncStub, Any]"


def generate_stubs(out: Path) -> Path:
    """WorkerService stubs from proto/, as the package ``workerapi`` (not jobplane.v1)."""
    protos = out / "protos" / "workerapi"
    protos.mkdir(parents=True)
    shutil.copy(ROOT / "proto" / "jobplane" / "v1" / "workers.proto", protos / "workers.proto")
    stubs = out / "stubs"
    (stubs / "workerapi").mkdir(parents=True)
    (stubs / "workerapi" / "__init__.py").write_text("")
    include = Path(protoc.__file__).parent / "_proto"
    code = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{out / 'protos'}",
            f"-I{include}",
            f"--python_out={stubs}",
            f"--grpc_python_out={stubs}",
            "workerapi/workers.proto",
        ]
    )
    assert code == 0
    return stubs


@dataclass
class ForeignWorker:
    """The running foreign worker and what it has said so far."""

    process: asyncio.subprocess.Process
    lines: list[dict[str, Any]] = field(default_factory=list)
    reader: asyncio.Task[None] | None = None

    def said(self, event: str, **match: Any) -> list[dict[str, Any]]:
        return [
            line
            for line in self.lines
            if line.get("event") == event and all(line.get(k) == v for k, v in match.items())
        ]

    async def read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            with contextlib.suppress(ValueError):
                self.lines.append(json.loads(raw))

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()
        if self.reader is not None:
            await asyncio.wait_for(self.reader, 5)


StartForeign: TypeAlias = "Callable[..., Awaitable[ForeignWorker]]"


@pytest.fixture
async def worker_key(stack: Stack) -> str:
    return (await stack.server.keys.create_worker()).key


@pytest.fixture
async def foreign_worker(
    stack: Stack, worker_key: str, tmp_path: Path
) -> AsyncIterator[StartForeign]:
    started: list[ForeignWorker] = []

    async def start(types: str = TYPES) -> ForeignWorker:
        stubs = generate_stubs(tmp_path / f"w{len(started)}")
        env = {k: v for k, v in os.environ.items() if not k.startswith("JOBPLANE_")}
        env["FOREIGN_WORKER_KEY"] = worker_key
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",  # no PYTHONPATH, no script directory: nothing of the repo on sys.path
            str(WORKER),
            "--address",
            stack.server.address,
            "--amqp-url",
            stack.amqp_url,
            "--queue",
            stack.topology.queues[0].name,
            "--stubs",
            str(stubs),
            "--types",
            types,
            env=env,
            stdout=asyncio.subprocess.PIPE,
        )
        worker = ForeignWorker(process)
        worker.reader = asyncio.create_task(worker.read())
        started.append(worker)

        async def up() -> bool:
            assert process.returncode is None, "the foreign worker exited"
            return bool(worker.said("started"))

        await eventually(up, timeout=20)
        return worker

    yield start
    for worker in started:
        await worker.stop()


async def test_a_foreign_worker_runs_a_job_end_to_end(
    stack: Stack, foreign_worker: StartForeign
) -> None:
    worker = await foreign_worker()
    assert worker.said("started")[0]["jobplane_modules"] == []
    client = stack.client()
    job = await client.submit("reports.render", {"mode": "succeed", "steps": 4})
    events = [e async for e in client.watch(job.name)]

    done = await client.get(job.name)
    assert done.state is JobState.SUCCEEDED, done.error
    assert done.result == {
        "echo": {"mode": "succeed", "steps": 4},
        "attempt": 1,
        "worker": "foreign",
    }
    assert [e.type for e in events] == [
        EventType.QUEUED,
        EventType.STARTED,
        *[EventType.PROGRESS] * 4,
        EventType.SUCCEEDED,
    ]
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    progress = [e for e in events if e.type is EventType.PROGRESS]
    assert [e.progress for e in progress] == [0.25, 0.5, 0.75, 1.0]
    assert [e.message for e in progress] == ["step 1", "step 2", "step 3", "step 4"]
    assert progress[-1].data == {"n": 4}

    async def acked() -> bool:
        return bool(worker.said("settled", settle="ack"))

    await eventually(acked)
    assert worker.said("claim", status="STATUS_CLAIMED", job=job.name, attempt=1)
    # Acked after the outcome, with nothing of jobplane ever imported.
    assert all(line["jobplane_modules"] == [] for line in worker.said("settled"))


async def test_a_retryable_failure_schedules_a_retry_that_the_foreign_worker_runs(
    stack: Stack, foreign_worker: StartForeign
) -> None:
    worker = await foreign_worker()
    client = stack.client()
    job = await client.submit("reports.flaky", {"mode": "flaky"}, max_attempts=3)
    events = [e async for e in client.watch(job.name)]

    done = await client.get(job.name)
    assert done.state is JobState.SUCCEEDED, done.error
    assert done.attempt == 2 and (done.result or {}).get("attempt") == 2
    retry = [e for e in events if e.type is EventType.RETRY_SCHEDULED]
    assert len(retry) == 1
    assert retry[0].data["error"]["code"] == "FOREIGN_FAILURE"
    assert retry[0].data["next_attempt"] == 2
    assert worker.said("failed", job=job.name, attempt=1, retry_scheduled=True)


async def test_a_permanent_failure_fails_the_job(
    stack: Stack, foreign_worker: StartForeign
) -> None:
    await foreign_worker()
    client = stack.client()
    job = await client.submit("reports.broken", {"mode": "fail"}, max_attempts=3)
    _ = [e async for e in client.watch(job.name)]
    done = await client.get(job.name)
    assert done.state is JobState.FAILED
    assert done.error is not None
    assert (done.error.code, done.error.message) == ("FOREIGN_FAILURE", "it broke")
    assert done.attempt == 1


async def test_a_cancel_request_reaches_the_foreign_worker_by_heartbeat(
    stack: Stack, foreign_worker: StartForeign
) -> None:
    worker = await foreign_worker()
    client = stack.client()
    job = await client.submit("reports.long", {"mode": "wait_cancel"})

    async def running() -> bool:
        return (await client.get(job.name)).state is JobState.RUNNING

    await eventually(running, timeout=20)
    await client.cancel(job.name, "enough")
    _ = [e async for e in client.watch(job.name)]
    done = await client.get(job.name)
    assert done.state is JobState.CANCELLED
    assert worker.said("cancel_seen", job=job.name)
    assert worker.said("cancelled", job=job.name)


async def test_registered_foreign_workers_share_a_queue_with_python_workers(
    stack: Stack, foreign_worker: StartForeign
) -> None:
    await stack.start_worker()  # the demo handlers, none for foreign.only
    client = stack.client()
    waiting = await client.submit("foreign.only", {"mode": "succeed"})

    async def parked() -> bool:
        return "no live worker" in (await client.get(waiting.name)).waiting_reason

    await eventually(parked, timeout=20)

    # Registering re-dispatches the parked job; jobs of either kind reach a
    # worker that runs them, whichever worker the broker hands them to.
    worker = await foreign_worker("foreign.only")
    names = [waiting.name]
    for n in range(6):
        names.append((await client.submit("foreign.only", {"n": n})).name)
        names.append((await client.submit("demo.echo", {"n": n})).name)
    for name in names:
        _ = [e async for e in client.watch(name)]
        done = await client.get(name)
        assert done.state is JobState.SUCCEEDED, (name, done.error)
        if done.type == "foreign.only":
            assert (done.result or {}).get("worker") == "foreign"
    assert all(line["status"] == "STATUS_HANDED_BACK" for line in worker.said("handed_back"))
    assert not worker.said("claim", status="STATUS_CLAIMED", job=names[2])  # a demo.echo

    (registered,) = [
        w for w in await WorkerStore(stack.engine).list() if w.types == ("foreign.only",)
    ]
    assert registered.live and registered.host == "foreign"
    assert registered.queues == (stack.topology.queues[0].name,)
    await worker.stop()
    (stopped,) = [w for w in await WorkerStore(stack.engine).list() if w.id == registered.id]
    assert stopped.status == "stopped"


# -- WorkerService called directly --------------------------------------------


@pytest.fixture
async def workers(stack: Stack, worker_key: str) -> AsyncIterator[Workers]:
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        stub: workers_pb2_grpc.WorkerServiceAsyncStub = workers_pb2_grpc.WorkerServiceStub(channel)
        yield (
            stub,
            (("authorization", f"Bearer {worker_key}"),),
        )


async def _claim(
    stack: Stack, workers: Workers, job_type: str
) -> tuple[str, workers_pb2.ClaimJobResponse]:
    stub, metadata = workers
    job = await stack.client().submit(job_type, {"x": 1})
    envelope = await stack.envelope(job.name.removeprefix("jobs/"))
    claim = await stub.ClaimJob(
        workers_pb2.ClaimJobRequest(
            event_id=str(envelope.event_id),
            job_id=str(envelope.job_id),
            tenant_id=str(envelope.tenant_id),
            type=envelope.job_type,
        ),
        metadata=metadata,
    )
    assert claim.status == Claim.STATUS_CLAIMED
    return job.name, claim


async def _row(stack: Stack, name: str) -> tuple[Any, ...]:
    async with stack.engine.connect() as conn:
        row = (
            await conn.execute(
                text(
                    "SELECT state, attempt, lease_token, last_seq, progress, result "
                    "FROM jobs WHERE id = :id"
                ),
                {"id": name.removeprefix("jobs/")},
            )
        ).one()
    return tuple(row)


async def test_a_stale_lease_token_is_refused_and_changes_nothing(
    stack: Stack, workers: Workers
) -> None:
    stub, metadata = workers
    name, claim = await _claim(stack, workers, "reports.stale")
    assert claim.payload == struct_from_dict({"x": 1})
    assert claim.max_attempts == 3 and claim.attempts_left == 2
    assert claim.lease_duration.seconds > 0
    before = await _row(stack, name)
    stale = workers_pb2.AttemptRef(job=name, attempt=1, lease_token=str(uuid.uuid4()))
    earlier = workers_pb2.AttemptRef(job=name, attempt=2, lease_token=claim.attempt.lease_token)
    calls: list[Awaitable[Any]] = [
        stub.Heartbeat(workers_pb2.HeartbeatRequest(attempt=stale), metadata=metadata),
        stub.ReportProgress(
            workers_pb2.ReportProgressRequest(
                attempt=stale, reports=[workers_pb2.Progress(progress=0.5)]
            ),
            metadata=metadata,
        ),
        stub.CompleteJob(workers_pb2.CompleteJobRequest(attempt=stale), metadata=metadata),
        stub.CompleteJob(workers_pb2.CompleteJobRequest(attempt=earlier), metadata=metadata),
        stub.FailJob(workers_pb2.FailJobRequest(attempt=stale), metadata=metadata),
        stub.ReportCancelled(workers_pb2.ReportCancelledRequest(attempt=stale), metadata=metadata),
    ]
    for call in calls:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        answer = check_refusal(refused.value)
        assert (answer.code, answer.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "LEASE_LOST")
    assert await _row(stack, name) == before

    # The claim's own token writes; once the job ended, it is stale too.
    await stub.CompleteJob(
        workers_pb2.CompleteJobRequest(attempt=claim.attempt, result=struct_from_dict({"ok": 1})),
        metadata=metadata,
    )
    ended = await _row(stack, name)
    assert ended[0] == "succeeded"
    with pytest.raises(grpc.aio.AioRpcError) as again:
        await stub.FailJob(workers_pb2.FailJobRequest(attempt=claim.attempt), metadata=metadata)
    assert check_refusal(again.value).reason == "LEASE_LOST"
    assert await _row(stack, name) == ended

    # A redelivery of the finished job's message is acked, not run.
    envelope = await stack.envelope(name.removeprefix("jobs/"))
    again_claim = await stub.ClaimJob(
        workers_pb2.ClaimJobRequest(message_body=envelope.encode()), metadata=metadata
    )
    assert again_claim.status == Claim.STATUS_FINISHED


async def test_a_message_of_no_job_here_is_dead_lettered_unless_another_deployment_sent_it(
    stack: Stack, workers: Workers
) -> None:
    stub, metadata = workers
    stray = Envelope(uuid.uuid4(), uuid.uuid4(), stack.tenant_id, "reports.stray")
    answers = []
    for envelope in (
        stray,
        replace(stray, deployment=stack.server.workers.deployment),
        replace(stray, deployment="0123456789abcdef"),
    ):
        claim = await stub.ClaimJob(
            workers_pb2.ClaimJobRequest(message_body=envelope.encode()), metadata=metadata
        )
        answers.append(claim.status)
    assert answers == [
        Claim.STATUS_NOT_FOUND,
        Claim.STATUS_NOT_FOUND,
        Claim.STATUS_OTHER_DEPLOYMENT,
    ]


async def test_the_foreign_worker_dead_letters_a_message_the_server_calls_malformed(
    stack: Stack, foreign_worker: StartForeign
) -> None:
    worker = await foreign_worker()
    topology = stack.topology
    await publish_raw(stack.amqp_url, topology.exchange, "reports.render", b"{not json")

    async def rejected() -> bool:
        return bool(worker.said("settled", settle="reject"))

    await eventually(rejected, timeout=20)
    [malformed] = worker.said("malformed")
    assert "message_body is not a dispatch envelope" in malformed["details"]
    # Dead-lettered once, not redelivered until the delivery limit.

    async def in_the_failed_queue() -> bool:
        return await ready_count(stack.amqp_url, topology.failed_queue) == 1

    await eventually(in_the_failed_queue, timeout=20)
    assert len(worker.said("settled")) == 1 and not worker.said("crashed")


async def test_cancelled_is_refused_until_cancel_was_requested(
    stack: Stack, workers: Workers
) -> None:
    stub, metadata = workers
    name, claim = await _claim(stack, workers, "reports.cancel")
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ReportCancelled(
            workers_pb2.ReportCancelledRequest(attempt=claim.attempt), metadata=metadata
        )
    assert check_refusal(refused.value).reason == "CANCEL_NOT_REQUESTED"
    await stack.client().cancel(name, "stop")
    beat = await stub.Heartbeat(
        workers_pb2.HeartbeatRequest(attempt=claim.attempt), metadata=metadata
    )
    assert beat.cancel_requested
    await stub.ReportCancelled(
        workers_pb2.ReportCancelledRequest(attempt=claim.attempt), metadata=metadata
    )
    assert (await stack.client().get(name)).state is JobState.CANCELLED


# A job whose every attempt fails retryably, by either kind of worker.
FLAKY_CODE = "FOREIGN_FLAKE"
flaky_registry = Registry()


@flaky_registry.handler("python.flaky")
async def _always_flaky(ctx: JobContext) -> dict[str, Any]:
    raise RetryableError(f"flaked on attempt {ctx.attempt}", code=FLAKY_CODE, delay=0)


async def _ended(stack: Stack, name: str) -> dict[str, Any]:
    """What a user and the database show of a job that ended."""
    client = stack.client()
    done = await client.get(name, resolve_blobs=False)
    events = [e async for e in client.watch(name)]
    last = events[-1]
    error = {**last.data.get("error", {}), "message": last.message}
    pending = await stack.scalar(
        "SELECT next_attempt_time IS NOT NULL FROM jobs WHERE id = :id",
        id=name.removeprefix("jobs/"),
    )
    return {
        "state": done.state,
        "error": done.error and (done.error.code, done.error.message, done.error.retryable),
        "attempts": (done.attempt, done.attempts_used, done.max_attempts),
        "events": [e.type for e in events],
        "final": {k: error.get(k) for k in ("code", "message", "retryable", "attempts_exhausted")},
        "next attempt pending": pending,
    }


def _exhausted(code: str, message: str) -> dict[str, Any]:
    """:func:`_ended` of a job of 3 attempts whose last ended with ``code`` and ``message``."""
    return {
        "state": JobState.FAILED,
        "error": (code, message, False),
        "attempts": (3, 3, 3),
        "events": [
            EventType.QUEUED,
            *[EventType.STARTED, EventType.RETRY_SCHEDULED] * 2,
            EventType.STARTED,
            EventType.FAILED,
        ],
        "final": {"code": code, "message": message, "retryable": False, "attempts_exhausted": True},
        "next attempt pending": False,
    }


async def test_a_retryable_failure_of_the_last_attempt_fails_the_job_at_once(
    stack: Stack, workers: Workers
) -> None:
    # With no attempt left, the worker's own error ends the job: no retry is
    # scheduled to end later as ATTEMPTS_EXHAUSTED. The same as the Python
    # worker's, which runs the same job after.
    stub, metadata = workers
    job = await stack.client().submit("reports.flaky", {}, max_attempts=3)
    for n in (1, 2, 3):
        envelope = await stack.envelope(job.name.removeprefix("jobs/"))
        claim = await stub.ClaimJob(
            workers_pb2.ClaimJobRequest(message_body=envelope.encode()), metadata=metadata
        )
        assert claim.status == Claim.STATUS_CLAIMED
        assert (claim.attempt.attempt, claim.attempts_left) == (n, 3 - n)
        failed = await stub.FailJob(
            workers_pb2.FailJobRequest(
                attempt=claim.attempt,
                code=FLAKY_CODE,
                message=f"flaked on attempt {n}",
                retryable=True,
                retry_delay=duration_pb2.Duration(),
            ),
            metadata=metadata,
        )
        assert failed.retry_scheduled is (n < 3)
    assert not failed.HasField("retry_delay")
    # The last message, delivered again, finds the job ended.
    again = await stub.ClaimJob(
        workers_pb2.ClaimJobRequest(message_body=envelope.encode()), metadata=metadata
    )
    assert again.status == Claim.STATUS_FINISHED
    foreign = await _ended(stack, job.name)
    assert foreign == _exhausted(FLAKY_CODE, "flaked on attempt 3")

    await stack.start_worker(flaky_registry)
    python_job = await stack.client().submit("python.flaky", {}, max_attempts=3)
    await stack.client().wait(python_job.name, timeout=30)
    assert await _ended(stack, python_job.name) == foreign


async def test_a_lease_that_runs_out_on_the_last_attempt_fails_the_job_at_once(
    stack: Stack, workers: Workers
) -> None:
    stub, metadata = workers
    job = await stack.client().submit("reports.hung", {}, max_attempts=3)
    job_id = job.name.removeprefix("jobs/")
    sweeps = SweepStore(stack.engine)
    for n in (1, 2, 3):
        envelope = await stack.envelope(job_id)
        claim = await stub.ClaimJob(
            workers_pb2.ClaimJobRequest(message_body=envelope.encode()), metadata=metadata
        )
        assert (claim.status, claim.attempt.attempt) == (Claim.STATUS_CLAIMED, n)
        # The worker stops heartbeating: its lease runs out.
        async with stack.engine.begin() as conn:
            await conn.execute(
                text("UPDATE jobs SET lease_expires_at = now() - interval '1 hour' WHERE id = :id"),
                {"id": job_id},
            )
        repaired = await sweeps.expire_leases(
            grace=0, limit=10, decide=lambda lease: lease_expired(lease, RetryPolicy(0.0, 0.0))
        )
        assert (repaired.requeued, repaired.failed) == ((1, 0) if n < 3 else (0, 1))
    message = "attempt 3 stopped heartbeating (its worker died or hung); no attempts left"
    assert await _ended(stack, job.name) == _exhausted("LEASE_EXPIRED", message)
    # The worker that held it comes back too late: nothing it says is written.
    with pytest.raises(grpc.aio.AioRpcError) as late:
        await stub.FailJob(
            workers_pb2.FailJobRequest(attempt=claim.attempt, code=FLAKY_CODE, retryable=True),
            metadata=metadata,
        )
    assert check_refusal(late.value).reason == "LEASE_LOST"


async def test_a_payload_out_of_reach_on_the_last_attempt_fails_the_job_at_once(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> None:
    # The claim that cannot hand out a payload by reference (the object store
    # is down) ends the attempt as a retryable failure: retried while
    # attempts are left, then FAILED as a FailJob would be.
    s3 = MotoServer()
    s3.start()
    blobs = blob_store(engine, s3.url)
    stack = await start_stack(
        engine, database_url, amqp_url, topology, relay=False, worker=False, blobs=blobs
    )
    try:
        metadata = (("authorization", f"Bearer {(await stack.server.keys.create_worker()).key}"),)
        job = await stack.client().submit("reports.render", {"text": "y" * 100_000}, max_attempts=3)
        job_id = job.name.removeprefix("jobs/")
        assert await stack.scalar("SELECT payload_blob FROM jobs WHERE id = :id", id=job_id)
        s3.stop()
        async with grpc.aio.insecure_channel(stack.server.address) as channel:
            stub: workers_pb2_grpc.WorkerServiceAsyncStub = workers_pb2_grpc.WorkerServiceStub(
                channel
            )
            for n in (1, 2, 3):
                envelope = await stack.envelope(job_id)
                claim = await stub.ClaimJob(
                    workers_pb2.ClaimJobRequest(message_body=envelope.encode()), metadata=metadata
                )
                assert claim.status == (Claim.STATUS_STALE if n < 3 else Claim.STATUS_FINISHED)
        ended = await _ended(stack, job.name)
        assert ended == _exhausted("BLOB_STORE_UNAVAILABLE", ended["final"]["message"])
    finally:
        await stack.close()
        await blobs.close()
        s3.stop()


async def test_worker_keys_and_tenant_keys_each_call_only_their_services(
    stack: Stack, worker_key: str
) -> None:
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        jobs = jobs_pb2_grpc.JobServiceStub(channel)
        workers: workers_pb2_grpc.WorkerServiceAsyncStub = workers_pb2_grpc.WorkerServiceStub(
            channel
        )
        as_worker = (("authorization", f"Bearer {worker_key}"),)
        as_tenant = (("authorization", f"Bearer {stack.key}"),)
        refused = []
        for call in (
            jobs.GetJob(jobs_pb2.GetJobRequest(name=f"jobs/{uuid.uuid4()}"), metadata=as_worker),
            jobs.SubmitJob(jobs_pb2.SubmitJobRequest(type="a.b"), metadata=as_worker),
            workers.ClaimJob(workers_pb2.ClaimJobRequest(), metadata=as_tenant),
            workers.Heartbeat(workers_pb2.HeartbeatRequest(), metadata=as_tenant),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call
            refused.append(check_refusal(error.value))
        assert {(r.code, r.reason) for r in refused} == {
            (grpc.StatusCode.PERMISSION_DENIED, "KEY_SCOPE_MISMATCH")
        }
        with pytest.raises(grpc.aio.AioRpcError) as anonymous:
            await workers.ClaimJob(workers_pb2.ClaimJobRequest())
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert await stack.scalar("SELECT count(*) FROM jobs") == 0


BAD_REQUESTS: list[tuple[str, str, Callable[[workers_pb2.AttemptRef, str], Any]]] = [
    (
        "ClaimJob",
        "job_id",
        lambda ref, queue: workers_pb2.ClaimJobRequest(event_id=str(uuid.uuid4())),
    ),
    (
        "ClaimJob",
        "event_id",
        lambda ref, queue: workers_pb2.ClaimJobRequest(
            event_id="x", job_id=str(uuid.uuid4()), tenant_id=str(uuid.uuid4()), type="a.b"
        ),
    ),
    (
        "ClaimJob",
        "message_body",
        lambda ref, queue: workers_pb2.ClaimJobRequest(message_body=b"{}"),
    ),
    (
        "ClaimJob",
        "type",
        lambda ref, queue: workers_pb2.ClaimJobRequest(message_body=b"{}", type="a.b"),
    ),
    ("Heartbeat", "attempt", lambda ref, queue: workers_pb2.HeartbeatRequest()),
    (
        "Heartbeat",
        "attempt.job",
        lambda ref, queue: workers_pb2.HeartbeatRequest(
            attempt=workers_pb2.AttemptRef(job="nope", attempt=1, lease_token=ref.lease_token)
        ),
    ),
    (
        "Heartbeat",
        "attempt.attempt",
        lambda ref, queue: workers_pb2.HeartbeatRequest(
            attempt=workers_pb2.AttemptRef(job=ref.job, attempt=0, lease_token=ref.lease_token)
        ),
    ),
    (
        "Heartbeat",
        "attempt.lease_token",
        lambda ref, queue: workers_pb2.HeartbeatRequest(
            attempt=workers_pb2.AttemptRef(job=ref.job, attempt=1, lease_token="t")
        ),
    ),
    (
        "ReportProgress",
        "reports",
        lambda ref, queue: workers_pb2.ReportProgressRequest(attempt=ref),
    ),
    (
        "ReportProgress",
        "reports[1].progress",
        lambda ref, queue: workers_pb2.ReportProgressRequest(
            attempt=ref,
            reports=[workers_pb2.Progress(progress=0.1), workers_pb2.Progress(progress=1e999)],
        ),
    ),
    (
        "ReportProgress",
        "reports[0].message",
        lambda ref, queue: workers_pb2.ReportProgressRequest(
            attempt=ref, reports=[workers_pb2.Progress(message="a\x00b")]
        ),
    ),
    (
        "ReportProgress",
        "reports[0].data",
        lambda ref, queue: workers_pb2.ReportProgressRequest(
            attempt=ref,
            reports=[workers_pb2.Progress(data=struct_from_dict({"big": "x" * 70_000}))],
        ),
    ),
    (
        "ReportProgress",
        "reports",
        lambda ref, queue: workers_pb2.ReportProgressRequest(
            attempt=ref, reports=[workers_pb2.Progress()] * 101
        ),
    ),
    (
        "CompleteJob",
        "result",
        lambda ref, queue: workers_pb2.CompleteJobRequest(
            attempt=ref, result=struct_from_dict({"n": float("nan")})
        ),
    ),
    ("FailJob", "code", lambda ref, queue: workers_pb2.FailJobRequest(attempt=ref, code="lower")),
    (
        "FailJob",
        "message",
        lambda ref, queue: workers_pb2.FailJobRequest(attempt=ref, message="m" * 5000),
    ),
    (
        "FailJob",
        "retry_delay",
        lambda ref, queue: workers_pb2.FailJobRequest(
            attempt=ref, retryable=True, retry_delay=duration_pb2.Duration(seconds=-1)
        ),
    ),
    (
        "FailJob",
        "retry_delay",
        lambda ref, queue: workers_pb2.FailJobRequest(
            attempt=ref, retry_delay=duration_pb2.Duration(seconds=1)
        ),
    ),
    ("RegisterWorker", "types", lambda ref, queue: workers_pb2.RegisterWorkerRequest()),
    (
        "RegisterWorker",
        "types[1]",
        lambda ref, queue: workers_pb2.RegisterWorkerRequest(types=["a.b", "A.B"]),
    ),
    (
        "RegisterWorker",
        "queues",
        lambda ref, queue: workers_pb2.RegisterWorkerRequest(types=["a.b"]),
    ),
    (
        "RegisterWorker",
        "queues[0]",
        lambda ref, queue: workers_pb2.RegisterWorkerRequest(types=["a.b"], queues=["nope"]),
    ),
    (
        "RegisterWorker",
        "concurrency",
        lambda ref, queue: workers_pb2.RegisterWorkerRequest(types=["a.b"], queues=[queue]),
    ),
    (
        "RegisterWorker",
        "host",
        lambda ref, queue: workers_pb2.RegisterWorkerRequest(
            types=["a.b"], queues=[queue], concurrency=1, host="a\nb"
        ),
    ),
    ("RenewWorker", "name", lambda ref, queue: workers_pb2.RenewWorkerRequest(name="w")),
    (
        "StopWorker",
        "name",
        lambda ref, queue: workers_pb2.StopWorkerRequest(name=f"workers/{uuid.uuid4()}x"),
    ),
    (
        "HandBackJob",
        "message_body",
        lambda ref, queue: workers_pb2.HandBackJobRequest(message_body=b"[]"),
    ),
    (
        "ReportCancelled",
        "reports[0].progress",
        lambda ref, queue: workers_pb2.ReportCancelledRequest(
            attempt=ref, reports=[workers_pb2.Progress(progress=float("inf"))]
        ),
    ),
]


async def test_bad_requests_are_refused_whole_with_the_field(
    stack: Stack, workers: Workers
) -> None:
    stub, metadata = workers
    name, claim = await _claim(stack, workers, "reports.bad")
    before = await _row(stack, name)
    for method, field_name, make in BAD_REQUESTS:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await getattr(stub, method)(
                make(claim.attempt, stack.topology.queues[0].name), metadata=metadata
            )
        answer = check_refusal(refused.value)
        assert (answer.code, answer.field) == (grpc.StatusCode.INVALID_ARGUMENT, field_name), (
            method,
            answer,
        )
    assert await _row(stack, name) == before
    assert await stack.scalar("SELECT count(*) FROM workers") == 0
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await stub.RenewWorker(
            workers_pb2.RenewWorkerRequest(name=f"workers/{uuid.uuid4()}"), metadata=metadata
        )
    assert (check_refusal(unknown.value).code, check_refusal(unknown.value).reason) == (
        grpc.StatusCode.NOT_FOUND,
        "WORKER_NOT_FOUND",
    )
