"""`jobplane dev` as an operator sees it: its ops listener's /metrics, /livez and
/readyz, and its JSON log lines, after real jobs ran through server, relay and worker."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jobplane.client import AsyncClient
from jobplane.config import DEFAULT_WORKER_CONCURRENCY
from jobplane.logs import fingerprint
from tests.support import services

PREFIX = "ingestion."


@dataclass
class Dev:
    process: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    address: str = ""
    key: str = ""
    ops: str = ""

    def records(self) -> list[dict[str, object]]:
        return [json.loads(line) for line in self.lines if line.startswith("{")]


def samples(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, by name and labels."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture
def vhost_url() -> Iterator[str]:
    name = f"jobplane-obs-{uuid.uuid4().hex[:8]}"
    yield services.create_vhost(name)
    services.delete_vhost(name)


@pytest.fixture
async def dev(database_url: str, vhost_url: str) -> AsyncIterator[Dev]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        "dev",
        "--no-maintenance",
        "--processes",
        "1",  # the worker's counts and lines in this one process
        env={
            **os.environ,
            "JOBPLANE_DATABASE_URL": database_url,
            "JOBPLANE_AMQP_URL": vhost_url,
            "JOBPLANE_LISTEN": "127.0.0.1:0",
            "JOBPLANE_METRICS_LISTEN": "127.0.0.1:0",
            "JOBPLANE_UI_LISTEN": "off",  # not the default port another process may hold
            "JOBPLANE_LOG_FORMAT": "json",
            "JOBPLANE_LOG_LEVEL": "info",
            "JOBPLANE_LOG_JOB_PREFIX": PREFIX,
        },
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    running = Dev(process)
    up = asyncio.Event()

    async def read() -> None:
        assert process.stdout is not None
        async for raw in process.stdout:
            line = raw.decode(errors="replace").strip()
            running.lines.append(line)
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("event") == "ops.listening":
                running.ops = str(record["address"])
            elif record.get("event") == "dev.ready":
                running.address = str(record["address"])
                running.key = str(record["api_key"])
            elif record.get("event") == "dev.serving":
                up.set()

    reader = asyncio.create_task(read())
    try:
        async with asyncio.timeout(60):
            await up.wait()
        yield running
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()
        await asyncio.wait_for(reader, 10)


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


async def test_dev_counts_its_jobs_and_logs_their_lifecycle(dev: Dev) -> None:
    assert dev.ops and dev.address and dev.key, dev.lines
    assert (await _get(f"http://{dev.ops}/livez"))[0] == 200
    status, body = await _get(f"http://{dev.ops}/readyz")
    assert status == 200, body
    assert set(json.loads(body)["checks"]) == {"database", "grpc", "relay", "worker"}

    async with AsyncClient(dev.address, dev.key) as client:
        echoed = [
            await client.submit("demo.echo", {"n": n}, correlation_id=f"order-{n}")
            for n in range(3)
        ]
        failing = await client.submit("demo.fail", {}, max_attempts=1)
        for job in [*echoed, failing]:
            await client.wait(job.name, timeout=30)

    found = samples((await _get(f"http://{dev.ops}/metrics"))[1])
    echo = {"type": "demo.echo", "queue": "jobplane.default"}
    fail = {"type": "demo.fail", "queue": "jobplane.default"}
    assert value(found, "jobplane_jobs_submitted_total", **echo) == 3
    assert value(found, "jobplane_jobs_started_total", **echo) == 3
    assert value(found, "jobplane_job_attempts_total", **echo) == 3
    assert value(found, "jobplane_jobs_finished_total", **echo, outcome="completed") == 3
    assert value(found, "jobplane_jobs_finished_total", **echo, outcome="failed") == 0
    assert value(found, "jobplane_jobs_finished_total", **fail, outcome="failed") == 1
    assert value(found, "jobplane_job_run_seconds_count", **echo, outcome="completed") == 3
    assert value(found, "jobplane_job_queue_wait_seconds_count", **echo) == 3
    assert value(found, "jobplane_job_retries_total", **echo) == 0
    dispatches = {"kind": "job.dispatch", "outcome": "confirmed"}
    assert value(found, "jobplane_relay_published_total", **dispatches) == 4
    assert value(found, "jobplane_relay_confirm_seconds_count") >= 1
    assert value(found, "jobplane_outbox_backlog_rows") == 0
    assert value(found, "jobplane_failed_queue_messages", queue="jobplane.failed") == 0
    assert value(found, "jobplane_worker_slots", state="free") == DEFAULT_WORKER_CONCURRENCY
    assert value(found, "jobplane_worker_slots", state="busy") == 0
    assert value(found, "jobplane_db_pool_connections", state="size") > 0
    # Labels stay low-cardinality: no job or tenant ids anywhere.
    names = {job.name.split("/")[-1] for job in echoed}
    assert not any(v in names for _n, labels in found for _k, v in labels)

    dev.process.send_signal(signal.SIGINT)
    await asyncio.wait_for(dev.process.wait(), 30)
    await asyncio.sleep(0.2)
    records = dev.records()
    assert records and all("logger" in r for r in records), dev.lines

    def events(name: str, job: str) -> list[dict[str, object]]:
        return [r for r in records if r.get("event") == name and r.get("job") == job]

    for n, job in enumerate(echoed):
        for name in ("job.dispatched", "job.received", "job.started", "job.completed"):
            assert len(events(PREFIX + name, job.name)) == 1, (name, dev.lines)
            assert not events(name, job.name)
        completed = events(PREFIX + "job.completed", job.name)[0]
        assert completed["logger"] == "jobplane.worker"
        assert isinstance(completed["tenant_id"], str) and uuid.UUID(completed["tenant_id"])
        assert completed["correlation_id"] == fingerprint(f"order-{n}")
        assert completed["routing_key"] == "demo.echo"
        assert completed["queue"] == "jobplane.default"
        assert completed["exchange"] == "jobplane.jobs"
        assert isinstance(completed["delivery_tag"], int)
        assert completed["redelivered"] is False
        assert str(completed["request_id"]).startswith("sha256:")
        dispatched = events(PREFIX + "job.dispatched", job.name)[0]
        assert dispatched["logger"] == "jobplane.relay"
        assert dispatched["tenant_id"] == completed["tenant_id"]
        assert f"order-{n}" not in json.dumps(records)
    assert len(events(PREFIX + "job.failed", failing.name)) == 1
    # Only job.* names take the prefix.
    assert any(r.get("event") == "worker.started" for r in records)
