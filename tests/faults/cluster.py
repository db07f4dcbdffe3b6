"""Real jobplane processes for fault tests: spawn, SIGKILL, restart, and check.

A :class:`Cluster` runs `jobplane serve`, `relay` and `worker` as separate OS
processes on the test's own database and vhost (and a topology under names of
its own), and judges a run by three properties:

- **L** every job reached exactly one terminal state (one terminal event);
- **D** each succeeded job has exactly one side-effect row, written last by the
  winning attempt, whose attempt is also the stored result's; and no attempt
  completed after its job had ended;
- **O** every watcher saw seqs 1..n in order without a gap or a repeat.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import tomllib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import asyncpg

from jobplane.client import AsyncClient, JobEvent
from jobplane.store.engine import asyncpg_dsn
from jobplane.topology import PipelineSpec, RateLimitSpec, StageSpec, Topology
from tests.faults.handlers import PIPELINE_STAGES, SCHEMA
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


#: The fault suite's three-stage pipeline (tests/faults/handlers.py runs its stages).
PIPELINE = "fault.pipeline"


def with_pipeline(topology: Topology) -> Topology:
    """``topology`` with the fault suite's pipeline, its stages on the first queue."""
    queue = topology.queues[0]
    stages = tuple(
        StageSpec(
            name=name,
            type=f"fault.stage.{name}",
            queue=queue.name,
            max_attempts=10,
            timeout_seconds=60.0,
            version="1",
        )
        for name in PIPELINE_STAGES
    )
    return replace(topology, pipelines=(PipelineSpec(PIPELINE, stages, version="1"),))


#: The fault suite's fan-out pipeline: split → map (one child per item) → join.
FAN_PIPELINE = "fault.fan"
#: The same, with the join run while at most :data:`FAN_TOLERATED` children failed.
FAN_TOLERANT = "fault.fan.tolerant"
FAN_TOLERATED = 2


def with_fan_pipeline(topology: Topology) -> Topology:
    """``topology`` with the fault suite's fan-out pipelines added, on the first queue."""
    queue = topology.queues[0].name

    def pipeline(name: str, max_failures: int) -> PipelineSpec:
        stages = tuple(
            StageSpec(
                stage,
                f"fault.fan.{stage}",
                queue,
                10,
                60.0,
                "1",
                fan_out=stage == "map",
                max_failures=max_failures if stage == "map" else 0,
            )
            for stage in ("split", "map", "join")
        )
        return PipelineSpec(name, stages, version="1")

    fans = (pipeline(FAN_PIPELINE, 0), pipeline(FAN_TOLERANT, FAN_TOLERATED))
    return replace(topology, pipelines=(*topology.pipelines, *fans))


def topology_toml(topology: Topology) -> str:
    """``topology`` as a TOML file the processes can load."""
    published = ", ".join(f'"{p}"' for p in topology.publish_lifecycle)
    lines = [
        f'[exchange]\nname = "{topology.exchange}"\n',
        f'[dead_letter]\nexchange = "{topology.dead_letter_exchange}"\n'
        f'queue = "{topology.failed_queue}"\n',
        f'[events]\nexchange = "{topology.events_exchange}"\npublish_lifecycle = [{published}]\n',
    ]
    if topology.quorum_group_size is not None:
        lines.append(f"[quorum]\ninitial_group_size = {topology.quorum_group_size}\n")
    for q in topology.queues:
        bindings = ", ".join(f'"{b}"' for b in q.bindings)
        lines.append(
            f'[[queues]]\nname = "{q.name}"\nbindings = [{bindings}]\n'
            f"delivery_limit = {q.delivery_limit}\nmax_attempts = {q.max_attempts}\n"
            f"timeout_seconds = {q.timeout_seconds}\nretry_base_delay = 0.05\n"
            f"retry_max_delay = 0.5\nmax_running_per_tenant = {q.max_running_per_tenant}\n"
        )
    for pipeline in topology.pipelines:
        lines.append(f'[[pipelines]]\nname = "{pipeline.name}"\nversion = "{pipeline.version}"\n')
        for st in pipeline.stages:
            lines.append(
                f'[[pipelines.stages]]\nname = "{st.name}"\ntype = "{st.type}"\n'
                f'version = "{st.version}"\nmax_attempts = {st.max_attempts}\n'
                f"timeout_seconds = {st.timeout_seconds}\nweight = {st.weight}\n"
                + (
                    f"fan_out = true\nmax_failures = {st.max_failures}\n"
                    f"fail_fast = {str(st.fail_fast).lower()}\n"
                    if st.fan_out
                    else ""
                )
            )
    lines.extend(_rate_limit_toml(limit) for limit in topology.rate_limits)
    text = "\n".join(lines)
    tomllib.loads(text)  # fail here, not in a child process
    return text


def _rate_limit_toml(limit: RateLimitSpec) -> str:
    """A ``[[rate_limits]]`` entry of ``limit``."""
    types = ", ".join(f'"{t}"' for t in limit.types)
    text = f'[[rate_limits]]\nname = "{limit.name}"\ntypes = [{types}]\n'
    if limit.per_second is not None:
        text += f"per_second = {limit.per_second}\nburst = {limit.burst}\n"
    if limit.max_running is not None:
        text += f"max_running = {limit.max_running}\n"
    return text + f"per_tenant = {'true' if limit.per_tenant else 'false'}\n"


class Proc:
    """One `jobplane …` child process and its log."""

    def __init__(
        self, cluster: Cluster, args: Sequence[str], faults: str = "", module: str = "jobplane"
    ) -> None:
        self.cluster = cluster
        self.args = list(args)
        self.module = module
        self.faults = faults
        self.process: asyncio.subprocess.Process | None = None
        name = args[0] if module == "jobplane" else module.rpartition(".")[2]
        self.log = cluster.workdir / f"{name}-{uuid.uuid4().hex[:6]}.log"
        self.starts = 0

    @property
    def alive(self) -> bool:
        """Running now."""
        return self.process is not None and self.process.returncode is None

    async def start(self, *, ready: str | None = None) -> Proc:
        """Start (again) and wait until its log shows ``ready``."""
        env = {**self.cluster.env, "JOBPLANE_FAULTS": self.faults}
        self.starts += 1
        offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                self.module,
                *self.args,
                env=env,
                cwd=ROOT,
                stdout=log,
                stderr=log,
            )
        if ready:
            await self.wait_for_log(ready, offset=offset)
        return self

    async def wait_for_log(self, text: str, *, offset: int = 0, timeout: float = 30) -> None:
        """Until ``text`` appears in the log after ``offset``."""
        await self.wait_for_any((text,), offset=offset, timeout=timeout)

    async def wait_for_any(
        self, texts: Sequence[str], *, offset: int = 0, timeout: float = 30
    ) -> str:
        """Until one of ``texts`` appears in the log after ``offset``; returns it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.log.read_text(errors="replace")[offset:] if self.log.exists() else ""
            for text in texts:
                if text in log:
                    return text
            if not self.alive:
                break
            await asyncio.sleep(0.05)
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        raise AssertionError(f"{self.args[0]}: none of {texts} in its log; tail:\n{tail}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (SIGKILL: no cleanup, no acks)."""
        if self.alive and self.process is not None:
            self.process.send_signal(sig)

    async def wait(self, timeout: float = 30) -> int:
        """Its exit code."""
        assert self.process is not None
        return await asyncio.wait_for(self.process.wait(), timeout)


@dataclass
class Cluster:
    """The processes of one fault test and the means to judge the run."""

    database_url: str
    amqp_url: str
    topology: Topology
    workdir: Path
    key: str = ""
    #: The server's gRPC port: below the kernel's ephemeral range, so that no
    #: process's ops listener (on port 0) takes it before serve binds it.
    port: int = field(default_factory=free_port)
    procs: list[Proc] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        path = self.workdir / "topology.toml"
        path.write_text(topology_toml(self.topology))
        self.env = {
            **os.environ,
            "JOBPLANE_DATABASE_URL": self.database_url,
            "JOBPLANE_AMQP_URL": self.amqp_url,
            "JOBPLANE_TOPOLOGY": str(path),
            "JOBPLANE_LISTEN": f"127.0.0.1:{self.port}",
            "JOBPLANE_LOG_LEVEL": "info",
            # This tree's source first: the installed jobplane may be another checkout's.
            "PYTHONPATH": os.pathsep.join((str(ROOT / "core"), str(ROOT))),
        }

    @property
    def pool_url(self) -> str:
        """The database URL the processes' pools take (PgBouncer's, when they go through it;
        :attr:`database_url` is Postgres itself, for the tests' own reads)."""
        return self.env["JOBPLANE_DATABASE_URL"]

    @property
    def address(self) -> str:
        """The server's address."""
        return f"127.0.0.1:{self.port}"

    async def prepare(self) -> None:
        """Side-effect tables and an API key."""
        conn = await asyncpg.connect(asyncpg_dsn(self.database_url))
        try:
            await conn.execute(SCHEMA)
        finally:
            await conn.close()
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "jobplane",
            "keys",
            "create",
            "--tenant",
            "faults",
            env=self.env,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await process.communicate()
        self.key = out.decode().strip()
        assert self.key.startswith("jp_"), out

    def client(self) -> AsyncClient:
        """An SDK client of the cluster's server."""
        return AsyncClient(self.address, self.key)

    async def server(self, *, faults: str = "") -> Proc:
        """Start `jobplane serve`."""
        return await self._spawn(["serve"], "server.started", faults)

    async def relay(self, *args: str, faults: str = "") -> Proc:
        """Start `jobplane relay` (with a fast sweeper)."""
        base = ["relay", "--sweep-interval", "0.5", "--lease-grace", "0.5", *args]
        return await self._spawn(base, "relay.connected", faults)

    async def worker(self, *args: str, faults: str = "", lease: float = 2.0) -> Proc:
        """Start `jobplane worker` with the fault handlers."""
        base = [
            "worker",
            "--handlers",
            "tests.faults.handlers:registry",
            "--lease-seconds",
            str(lease),
            "--grace",
            "1",
            *args,
        ]
        return await self._spawn(base, "worker.started", faults)

    async def _spawn(self, args: list[str], ready: str, faults: str = "") -> Proc:
        proc = Proc(self, args, faults)
        self.procs.append(proc)
        await proc.start(ready=ready)
        return proc

    async def close(self) -> None:
        """SIGKILL whatever still runs."""
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            if proc.process is not None:
                await proc.wait()

    async def query(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        """Rows from the test database."""
        conn = await asyncpg.connect(asyncpg_dsn(self.database_url))
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    async def submit_many(
        self,
        client: AsyncClient,
        count: int,
        job_type: str = "fault.work",
        *,
        max_attempts: int = 0,
        **payload: Any,
    ) -> list[str]:
        """Submit ``count`` jobs, repeating a call that failed (same request_id)."""
        names = []
        for i in range(count):
            request_id = f"{job_type}-{i}-{uuid.uuid4().hex[:8]}"
            for attempt in range(50):
                try:
                    job = await client.submit(
                        job_type,
                        {**payload, "i": i},
                        request_id=request_id,
                        max_attempts=max_attempts,
                    )
                    names.append(job.name)
                    break
                except Exception:
                    if attempt == 49:
                        raise
                    await asyncio.sleep(0.1)
        return names

    async def wait_all_terminal(self, names: Sequence[str], timeout: float = 60) -> None:
        """Until every job has ended (**L** is then judged by :meth:`check`)."""
        ids = [uuid.UUID(n.partition("/")[2]) for n in names]
        deadline = time.monotonic() + timeout
        while True:
            rows = await self.query(
                "SELECT count(*) AS open FROM jobs WHERE id = ANY($1::uuid[]) "
                "AND state NOT IN ('succeeded', 'failed', 'cancelled')",
                ids,
            )
            if rows[0]["open"] == 0:
                return
            if time.monotonic() > deadline:
                stuck = await self.query(
                    "SELECT id, state, attempt, lease_expires_at, dispatch_id FROM jobs "
                    "WHERE id = ANY($1::uuid[]) AND state NOT IN "
                    "('succeeded', 'failed', 'cancelled') LIMIT 5",
                    ids,
                )
                raise AssertionError(f"{rows[0]['open']} jobs never ended, e.g. {stuck}")
            await asyncio.sleep(0.2)

    async def check(
        self, names: Sequence[str], *, expect: str = "succeeded", strict: bool = True
    ) -> dict[str, int]:
        """Judge L and D over ``names`` and fail on any violation; returns counts."""
        counts, problems = await self.judge(names, expect=expect, strict=strict)
        assert not problems, "\n".join(problems[:20])
        return counts

    async def judge(
        self, names: Sequence[str], *, expect: str = "succeeded", strict: bool = True
    ) -> tuple[dict[str, int], list[str]]:
        """Judge L and D over ``names``: the counts checked, and every violation.

        ``strict``: also require that the side effect was written last by the
        winning attempt and that no attempt completed after its job ended —
        true unless the test stalls a handler past its lease on purpose.
        """
        ids = [uuid.UUID(n.partition("/")[2]) for n in names]
        jobs = await self.query(
            """
            SELECT j.id, j.state, j.attempt, (j.result->>'attempt')::int AS result_attempt,
                   j.end_time,
                   (SELECT count(*) FROM job_events e WHERE e.job_id = j.id
                      AND e.type IN ('succeeded', 'failed', 'cancelled')) AS terminal_events,
                   (SELECT count(*) FROM job_events e WHERE e.job_id = j.id) AS events,
                   j.last_seq
            FROM jobs j WHERE j.id = ANY($1::uuid[])
            """,
            ids,
        )
        assert len(jobs) == len(ids)
        effects = {
            r["job_id"]: r
            for r in await self.query(
                "SELECT job_id, attempt FROM fault_effects WHERE job_id = ANY($1::uuid[])", ids
            )
        }
        late = await self.query(
            """
            SELECT c.job_id, c.attempt FROM fault_completions c JOIN jobs j ON j.id = c.job_id
            WHERE c.job_id = ANY($1::uuid[])
              AND (($2 AND c.at > j.end_time) OR c.attempt > j.attempt)
            """,
            ids,
            strict,
        )
        problems = []
        for job in jobs:
            if job["terminal_events"] != 1:  # L
                problems.append(f"L: {job['id']} has {job['terminal_events']} terminal events")
            if job["events"] != job["last_seq"]:  # gap-free storage
                problems.append(f"O: {job['id']} stores {job['events']} of {job['last_seq']}")
            if expect and job["state"] != expect:
                problems.append(f"L: {job['id']} ended {job['state']}, expected {expect}")
            if job["state"] == "succeeded":  # D
                effect = effects.get(job["id"])
                if effect is None:
                    problems.append(f"D: {job['id']} succeeded without its side effect")
                elif job["result_attempt"] != job["attempt"] or (
                    strict and effect["attempt"] != job["attempt"]
                ):
                    problems.append(
                        f"D: {job['id']} effect by attempt {effect['attempt']}, result of "
                        f"{job['result_attempt']}, winner {job['attempt']}"
                    )
        problems += [f"D: attempt {r['attempt']} of {r['job_id']} completed late" for r in late]
        return {"jobs": len(jobs), "effects": len(effects)}, problems

    async def check_pipelines(self, names: Sequence[str]) -> dict[str, int]:
        """:meth:`judge_pipelines`, failing on any violation; returns the counts."""
        counts, problems = await self.judge_pipelines(names)
        assert not problems, "\n".join(problems[:20])
        return counts

    async def judge_pipelines(self, names: Sequence[str]) -> tuple[dict[str, int], list[str]]:
        """Judge L, D and stored O over pipeline jobs: the counts, and every violation.

        L: every job SUCCEEDED with one terminal event, every stage SUCCEEDED.
        D: each stage's effect exists, was written last by the attempt whose
        result the stage kept, and no attempt of a stage completed after the
        stage's commit. O: the job's events are stored 1..last_seq.
        """
        ids = [uuid.UUID(n.partition("/")[2]) for n in names]
        jobs = await self.query(
            """
            SELECT j.id, j.state, j.last_seq,
                   (SELECT count(*) FROM job_events e WHERE e.job_id = j.id
                      AND e.type IN ('succeeded', 'failed', 'cancelled')) AS terminal_events,
                   (SELECT count(*) FROM job_events e WHERE e.job_id = j.id) AS events
            FROM jobs j WHERE j.id = ANY($1::uuid[])
            """,
            ids,
        )
        assert len(jobs) == len(ids)
        stages = await self.query(
            """
            SELECT s.job_id, s.name, s.state, (s.result->>'attempt')::int AS result_attempt,
                   s.end_time, f.attempt AS effect_attempt,
                   (SELECT count(*) FROM fault_stage_completions c
                      WHERE c.job_id = s.job_id AND c.stage = s.name
                        AND (c.at > s.end_time OR c.attempt > (s.result->>'attempt')::int))
                       AS late
            FROM job_stages s
            LEFT JOIN fault_stage_effects f ON f.job_id = s.job_id AND f.stage = s.name
            WHERE s.job_id = ANY($1::uuid[])
            """,
            ids,
        )
        problems = []
        for job in jobs:
            if job["state"] != "succeeded" or job["terminal_events"] != 1:  # L
                problems.append(
                    f"L: {job['id']} {job['state']}, {job['terminal_events']} terminal events"
                )
            if job["events"] != job["last_seq"]:  # O, as stored
                problems.append(f"O: {job['id']} stores {job['events']} of {job['last_seq']}")
        for stage in stages:
            where = f"{stage['job_id']} stage {stage['name']}"
            if stage["state"] != "succeeded":
                problems.append(f"L: {where} ended {stage['state']}")
            elif stage["effect_attempt"] is None:
                problems.append(f"D: {where} succeeded without its effect")
            elif stage["effect_attempt"] != stage["result_attempt"]:
                problems.append(
                    f"D: {where} effect by attempt {stage['effect_attempt']}, "
                    f"result of {stage['result_attempt']}"
                )
            if stage["late"]:
                problems.append(f"D: {where} had {stage['late']} attempts complete late")
        if len(stages) != 3 * len(ids):
            problems.append(f"L: {len(stages)} stage rows for {len(ids)} pipelines")
        return {"jobs": len(jobs), "stages": len(stages)}, problems


def check_stream(events: Sequence[JobEvent], last_seq: int) -> None:
    """**O**: seqs 1..last_seq, in order, ending with the one terminal event."""
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, last_seq + 1)), seqs
    assert events[-1].terminal
    assert sum(e.terminal for e in events) == 1
