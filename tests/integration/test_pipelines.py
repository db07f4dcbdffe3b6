"""Pipelines on the seed's topology: native → neural → index, each stage on its own queue.

Each stage has its own worker, consuming only its stage's queue with only
its stage's handler, as the seed deploys them: a stage that ran, ran there.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import EventType, InvalidArgument, JobState, StageState
from jobplane.envelope import Envelope
from jobplane.topology import Topology, TopologyError, load_topology, parse_topology
from jobplane.workers.handlers import JobContext, PermanentError, Registry, RetryableError
from tests.support import services
from tests.support.parts import Started
from tests.support.queues import publish_raw
from tests.support.stack import Stack, eventually, start_stack

pytestmark = pytest.mark.integration

_AIDJ = Path(__file__).parents[2] / "examples" / "topologies" / "aidj.toml"
_PIPELINE = "aidj.analyze"


class Stages:
    """The three stage handlers, each in a registry of its own, counting their runs."""

    def __init__(self) -> None:
        self.runs: Counter[tuple[str, str]] = Counter()  # (job id, stage)
        self.seen: dict[tuple[str, str], dict[str, Any]] = {}
        self.fail_neural: str | None = None  # "permanent", "once"
        self.neural_started = asyncio.Event()
        self.hold_neural = False
        self.native = Registry()
        self.neural = Registry()
        self.index = Registry()
        self.native.handler("native.analyze")(self._native)
        self.neural.handler("neural.embed")(self._neural)
        self.index.handler("index.upsert")(self._index)

    def _record(self, ctx: JobContext) -> None:
        key = (ctx.id, ctx.stage)
        self.runs[key] += 1
        self.seen[key] = {
            "type": ctx.type,
            "pipeline": ctx.pipeline,
            "stage_version": ctx.stage_version,
            "inputs": dict(ctx.inputs),
            "previous": ctx.previous,
            "payload": dict(ctx.payload),
        }

    async def _native(self, ctx: JobContext) -> dict[str, Any]:
        self._record(ctx)
        for step in (0.25, 0.5, 1.0):
            await ctx.progress(step, f"analysed {step:.0%}")
        return {"tempo": 120, "track": ctx.payload["track"]}

    async def _neural(self, ctx: JobContext) -> dict[str, Any]:
        self._record(ctx)
        self.neural_started.set()
        await ctx.progress(0.5, "embedding")
        if self.hold_neural:
            await asyncio.sleep(60)
        if self.fail_neural == "permanent":
            raise PermanentError("the model refused the track")
        if self.fail_neural == "once" and self.runs[(ctx.id, ctx.stage)] == 1:
            raise RetryableError("the model server was busy", delay=0.05)
        if self.fail_neural == "always":
            raise RetryableError("the model server is down", delay=0.05)
        return {"embedding": [0.1, 0.2], "tempo_seen": ctx.inputs["native"]["tempo"]}

    async def _index(self, ctx: JobContext) -> dict[str, Any]:
        self._record(ctx)
        await ctx.progress(1.0, "upserted")
        return {"indexed": True, "from": list(ctx.inputs)}


@pytest.fixture
async def aidj(amqp_url: str) -> AsyncIterator[Topology]:
    """The seed's topology under names of this test's own."""
    names = load_topology(_AIDJ).prefixed(f"p{uuid.uuid4().hex[:6]}.")
    yield names
    await services.delete_topology(amqp_url, names)


@pytest.fixture
async def pipeline(
    engine: AsyncEngine, database_url: str, amqp_url: str, aidj: Topology, started: Started
) -> tuple[Stack, Stages]:
    """Server and relay on the seed's topology, and one worker per stage on its queue."""
    stages = Stages()
    stack = await started(start_stack(engine, database_url, amqp_url, aidj, worker=False))
    queues = {q.name.rsplit(".", 1)[-1]: q.name for q in aidj.queues}
    for name, registry in (
        ("native", stages.native),
        ("neural", stages.neural),
        ("index", stages.index),
    ):
        await stack.start_worker(registry, queues=[queues[name]])
    return stack, stages


async def test_a_pipeline_runs_its_stages_in_order_each_on_its_own_queue(
    pipeline: tuple[Stack, Stages],
) -> None:
    stack, stages = pipeline
    client = stack.client()
    job = await client.submit(
        _PIPELINE, {"track": "t-1"}, request_id="analyze-t-1", labels={"team": "audio"}
    )
    assert job.type == _PIPELINE and job.stage == "native"
    assert job.labels == {"team": "audio"}
    assert [(s.name, s.state) for s in job.stages] == [
        ("native", StageState.QUEUED),
        ("neural", StageState.PENDING),
        ("index", StageState.PENDING),
    ]
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.SUCCEEDED, done.error
    # The job's result is its last stage's; every stage keeps its own.
    assert done.result == {"indexed": True, "from": ["native", "neural"]}
    assert done.labels == {"team": "audio"}
    assert [(s.name, s.type, s.version, s.state, s.attempts) for s in done.stages] == [
        ("native", "native.analyze", "mir-1.4", StageState.SUCCEEDED, 1),
        ("neural", "neural.embed", "clap-2", StageState.SUCCEEDED, 1),
        ("index", "index.upsert", "qdrant-1", StageState.SUCCEEDED, 1),
    ]
    assert done.stages[0].result == {"tempo": 120, "track": "t-1"}
    assert done.stages[1].result == {"embedding": [0.1, 0.2], "tempo_seen": 120}
    assert all(s.start_time and s.end_time and s.start_time <= s.end_time for s in done.stages)
    assert done.stages[0].end_time <= done.stages[1].start_time  # type: ignore[operator]
    # Each stage ran once, by the worker of its own queue, seeing what came before.
    assert stages.runs == Counter(
        {(job.id, "native"): 1, (job.id, "neural"): 1, (job.id, "index"): 1}
    )
    neural = stages.seen[(job.id, "neural")]
    assert neural["type"] == "neural.embed" and neural["pipeline"] == _PIPELINE
    assert neural["stage_version"] == "clap-2"
    assert neural["payload"] == {"track": "t-1"}
    assert neural["inputs"] == {"native": {"tempo": 120, "track": "t-1"}}
    assert stages.seen[(job.id, "native")]["previous"] is None
    assert stages.seen[(job.id, "index")]["previous"] == neural_result(done)

    events = [e async for e in client.watch(job.name)]
    # Every event names its stage; the job's progress never goes back.
    assert all(e.stage in ("native", "neural", "index") for e in events), events
    progress = [e.progress for e in events]
    assert progress == sorted(progress) and progress[-1] == 1.0
    assert [(e.type, e.stage) for e in events if e.type is not EventType.PROGRESS] == [
        (EventType.QUEUED, "native"),
        (EventType.STARTED, "native"),
        (EventType.STAGE_SUCCEEDED, "native"),
        (EventType.STARTED, "neural"),
        (EventType.STAGE_SUCCEEDED, "neural"),
        (EventType.STARTED, "index"),
        (EventType.SUCCEEDED, "index"),
    ]
    # Weighted: native is 2 of 6, neural 3, index 1; a stage's half is the job's share of it.
    neural_half = next(e for e in events if e.stage == "neural" and e.type is EventType.PROGRESS)
    assert neural_half.progress == pytest.approx(2 / 6 + 0.5 * 3 / 6)
    handoff = next(e for e in events if e.type is EventType.STAGE_SUCCEEDED)
    assert handoff.state is JobState.QUEUED and handoff.data["next_stage"] == "neural"

    # Listed by its pipeline's name, not by its stages' types.
    listed = await client.list(type=_PIPELINE)
    assert [j.name for j in listed.jobs] == [job.name]
    assert (await client.list(type="index.upsert")).jobs == []
    # The same request again is the same job, whatever stage it reached.
    again = await client.submit(
        _PIPELINE, {"track": "t-1"}, request_id="analyze-t-1", labels={"team": "audio"}
    )
    assert again.name == job.name


def neural_result(job: Any) -> dict[str, Any]:
    return dict(job.stages[1].result)


async def test_a_failed_stage_fails_the_job_and_retry_resumes_there(
    pipeline: tuple[Stack, Stages],
) -> None:
    stack, stages = pipeline
    client = stack.client()
    stages.fail_neural = "permanent"
    job = await client.submit(_PIPELINE, {"track": "t-2"})
    failed = await client.wait(job.name, timeout=30)
    assert failed.state is JobState.FAILED
    assert failed.stage == "neural" and failed.error is not None
    assert failed.error.code == "HANDLER_FAILED" and not failed.error.retryable
    assert [(s.name, s.state) for s in failed.stages] == [
        ("native", StageState.SUCCEEDED),
        ("neural", StageState.FAILED),
        ("index", StageState.PENDING),
    ]
    assert failed.stages[1].error is not None
    assert "refused" in failed.stages[1].error.message

    # Retried: the failed stage and those after it run; the one before does not.
    stages.fail_neural = None
    retried = await client.retry(job.name)
    assert retried.state is JobState.QUEUED and retried.stage == "neural"
    assert [s.state for s in retried.stages] == [
        StageState.SUCCEEDED,
        StageState.QUEUED,
        StageState.PENDING,
    ]
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.SUCCEEDED, done.error
    assert stages.runs[(job.id, "native")] == 1
    assert stages.runs[(job.id, "neural")] == 2
    assert stages.runs[(job.id, "index")] == 1
    # The resumed stage still reads what the first one returned.
    assert stages.seen[(job.id, "neural")]["inputs"] == {"native": {"tempo": 120, "track": "t-2"}}


async def test_a_server_whose_topology_lacks_the_pipeline_still_lists_its_jobs(
    pipeline: tuple[Stack, Stages],
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    started: Started,
) -> None:
    stack, _stages = pipeline
    job = await stack.client().submit(_PIPELINE, {"track": "t-listed"})
    plain = await stack.client().submit("index.upsert", {})
    # A server on the same database with the default topology: no pipelines.
    other = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    assert topology.pipeline(_PIPELINE) is None
    client = other.client(stack.key)
    listed = await client.list(type=_PIPELINE)
    assert [j.name for j in listed.jobs] == [job.name]
    assert [j.name async for j in client.iter_jobs(type=_PIPELINE, page_size=1)] == [job.name]
    # A stage's type lists the plain jobs of that type, not the pipeline's jobs.
    assert [j.name for j in (await client.list(type="index.upsert")).jobs] == [plain.name]


async def test_retry_from_a_named_stage_reruns_it_and_the_later_ones(
    pipeline: tuple[Stack, Stages],
) -> None:
    stack, stages = pipeline
    client = stack.client()
    stages.fail_neural = "permanent"
    job = await client.submit(_PIPELINE, {"track": "t-3"})
    assert (await client.wait(job.name, timeout=30)).state is JobState.FAILED
    stages.fail_neural = None
    with pytest.raises(InvalidArgument) as refused:
        await client.retry(job.name, from_stage="mastering")
    assert "mastering" in str(refused.value)
    restarted = await client.retry(job.name, from_stage="native")
    assert restarted.stage == "native"
    assert [s.state for s in restarted.stages] == [
        StageState.QUEUED,
        StageState.PENDING,
        StageState.PENDING,
    ]
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.SUCCEEDED, done.error
    assert stages.runs[(job.id, "native")] == 2
    assert stages.runs[(job.id, "neural")] == 2
    assert stages.runs[(job.id, "index")] == 1


async def test_a_stage_retries_within_its_own_attempts(pipeline: tuple[Stack, Stages]) -> None:
    stack, stages = pipeline
    client = stack.client()
    stages.fail_neural = "once"
    job = await client.submit(_PIPELINE, {"track": "t-4"})
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.SUCCEEDED, done.error
    assert [s.attempts for s in done.stages] == [1, 2, 1]
    # The index stage's budget is its own (5 in the topology), not what neural used.
    assert (done.max_attempts, done.attempts_used) == (5, 1)
    events = [e async for e in client.watch(job.name)]
    retry = [e for e in events if e.type is EventType.RETRY_SCHEDULED]
    assert [e.stage for e in retry] == ["neural"]
    progress = [e.progress for e in events]
    # A new attempt of a stage starts where the stage started, never before it.
    assert min(p for e, p in zip(events, progress, strict=True) if e.stage == "neural") >= 2 / 6


async def test_a_stage_that_uses_up_its_attempts_fails_the_job_there(
    pipeline: tuple[Stack, Stages],
) -> None:
    stack, stages = pipeline
    client = stack.client()
    stages.fail_neural = "always"
    job = await client.submit(_PIPELINE, {"track": "t-7"})
    failed = await client.wait(job.name, timeout=30)
    assert failed.state is JobState.FAILED and failed.stage == "neural"
    assert failed.error is not None and not failed.error.retryable
    neural = failed.stages[1]
    # The neural stage's own budget (the queue's 3), spent in full; nothing after it ran.
    assert (neural.state, neural.attempts, neural.max_attempts) == (StageState.FAILED, 3, 3)
    assert neural.error is not None and "down" in neural.error.message
    assert stages.runs[(job.id, "neural")] == 3
    assert stages.runs[(job.id, "index")] == 0
    assert failed.stages[2].state is StageState.PENDING


async def test_cancel_mid_pipeline_skips_the_later_stages(pipeline: tuple[Stack, Stages]) -> None:
    stack, stages = pipeline
    client = stack.client()
    stages.hold_neural = True
    job = await client.submit(_PIPELINE, {"track": "t-5"})
    await asyncio.wait_for(stages.neural_started.wait(), 30)
    await client.cancel(job.name, reason="enough")
    done = await client.wait(job.name, timeout=30)
    assert done.state is JobState.CANCELLED
    assert [(s.name, s.state) for s in done.stages] == [
        ("native", StageState.SUCCEEDED),
        ("neural", StageState.CANCELLED),
        ("index", StageState.SKIPPED),
    ]
    # Nothing is dispatched for the skipped stage: it never runs.
    await asyncio.sleep(1.0)
    assert stages.runs[(job.id, "index")] == 0
    assert (
        await stack.scalar(
            "SELECT count(*) FROM outbox WHERE job_id = :id AND published_at IS NULL", id=job.id
        )
        == 0
    )


async def test_a_stage_message_delivered_again_after_its_commit_runs_nothing(
    pipeline: tuple[Stack, Stages],
) -> None:
    stack, stages = pipeline
    client = stack.client()
    stages.hold_neural = True
    job = await client.submit(_PIPELINE, {"track": "t-6"})
    await asyncio.wait_for(stages.neural_started.wait(), 30)
    # native committed and advanced: its message, delivered again, is stale.
    native_dispatch = await stack.scalar(
        "SELECT id FROM outbox WHERE job_id = :id AND routing_key = 'native.analyze'", id=job.id
    )
    stale = Envelope(
        uuid.UUID(str(native_dispatch)), uuid.UUID(job.id), stack.tenant_id, "native.analyze"
    )
    await publish_raw(stack.amqp_url, stack.topology.exchange, "native.analyze", stale.encode())

    async def native_queue_drained() -> bool:
        from tests.support.queues import ready_count

        return await ready_count(stack.amqp_url, stack.topology.queues[0].name) == 0

    await eventually(native_queue_drained, timeout=10)
    await asyncio.sleep(0.5)
    assert stages.runs[(job.id, "native")] == 1
    rows = await stack.scalar(
        "SELECT count(*) FROM job_stages WHERE job_id = :id AND name = 'native' "
        "AND state = 'succeeded'",
        id=job.id,
    )
    assert rows == 1
    await client.cancel(job.name)


def test_the_topology_refuses_pipelines_it_cannot_run() -> None:
    base: dict[str, Any] = {"queues": [{"name": "q", "bindings": ["work.#"]}]}

    def parse(pipelines: list[dict[str, Any]]) -> Topology:
        return parse_topology({**base, "pipelines": pipelines})

    good = parse([{"name": "p.one", "stages": [{"name": "a", "type": "work.a"}]}])
    assert good.pipeline("p.one") is not None
    cases: dict[str, list[dict[str, Any]]] = {
        "no queue takes": [{"name": "p", "stages": [{"name": "a", "type": "other.a"}]}],
        "at least one": [{"name": "p", "stages": []}],
        "two stages of one name": [
            {
                "name": "p",
                "stages": [{"name": "a", "type": "work.a"}, {"name": "a", "type": "work.b"}],
            }
        ],
        "also the type of a stage": [
            {"name": "work.a", "stages": [{"name": "a", "type": "work.a"}]}
        ],
        "unknown keys": [{"name": "p", "stages": [{"name": "a", "type": "work.a", "retries": 3}]}],
        "max_attempts": [
            {"name": "p", "stages": [{"name": "a", "type": "work.a", "max_attempts": 0}]}
        ],
        "weight": [{"name": "p", "stages": [{"name": "a", "type": "work.a", "weight": -1}]}],
        "not a valid job type": [{"name": "P Q", "stages": [{"name": "a", "type": "work.a"}]}],
        "must be unique": [
            {"name": "p", "stages": [{"name": "a", "type": "work.a"}]},
            {"name": "p", "stages": [{"name": "a", "type": "work.a"}]},
        ],
    }
    for words, pipelines in cases.items():
        with pytest.raises(TopologyError, match=words):
            parse(pipelines)


async def test_the_sql_submit_refuses_a_pipeline_name(pipeline: tuple[Stack, Stages]) -> None:
    """jobplane.submit_job writes no stages: a pipeline goes through SubmitJob only."""
    stack, _ = pipeline
    with pytest.raises(DBAPIError) as refused:
        async with stack.engine.begin() as conn:
            await conn.execute(
                text(
                    "SELECT jobplane.submit_job(tenant => 'acme', type => :type, payload => '{}')"
                ),
                {"type": _PIPELINE},
            )
    assert getattr(refused.value.orig, "sqlstate", None) == "JP001"
    assert "is a pipeline" in str(refused.value)
    assert await stack.scalar("SELECT count(*) FROM jobs") == 0
    # A stage's type is a plain job's type there, as anywhere.
    async with stack.engine.begin() as conn:
        await conn.execute(
            text("SELECT jobplane.submit_job(tenant => 'acme', type => 'index.upsert')")
        )
    assert await stack.scalar("SELECT count(*) FROM jobs WHERE pipeline IS NULL") == 1


async def test_a_late_stages_lost_lease_backs_off_by_the_stages_attempts(
    pipeline: tuple[Stack, Stages], engine: AsyncEngine
) -> None:
    from jobplane.attempt_end import Decision, RetryPolicy
    from jobplane.store.sweeps import ExpiredLease, SweepStore
    from jobplane.workers.sweeper import lease_expired

    stack, stages = pipeline
    client = stack.client()
    stages.hold_neural = True
    job = await client.submit(_PIPELINE, {"track": "t-lease"})
    await asyncio.wait_for(stages.neural_started.wait(), 30)
    # The job's second attempt (native used the first) is the neural stage's first.
    assert await stack.scalar("SELECT attempt FROM jobs WHERE id = :id", id=job.id) == 2
    # The stage's progress report is written first: its statement locks the
    # row, and the sweep skips a locked row.
    for _ in range(300):
        if await stack.scalar(
            "SELECT count(*) FROM job_events WHERE job_id = :id AND message = 'embedding'",
            id=job.id,
        ):
            break
        await asyncio.sleep(0.01)
    asked: list[int] = []

    def decide(lease: ExpiredLease) -> Decision:
        asked.append(lease.budget_attempt)
        return lease_expired(lease, RetryPolicy(0.0, 0.0))

    # The worker's heartbeat may renew the lease between the rewind and the
    # sweep (or lock the row while the sweep looks): rewind it again.
    for _ in range(20):
        async with engine.begin() as conn:
            await conn.execute(
                text("UPDATE jobs SET lease_expires_at = now() - interval '1 hour' WHERE id = :id"),
                {"id": job.id},
            )
        repaired = await SweepStore(engine).expire_leases(grace=0, limit=10, decide=decide)
        if repaired.requeued:
            break
    assert repaired.requeued == 1
    # Backed off as the stage's first attempt, not as the job's second.
    assert asked == [1]
    await client.cancel(job.name)
