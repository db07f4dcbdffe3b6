"""``jobplane dlq list``, ``replay`` and ``purge`` run in this process against the
failed queue: what each prints, its exit status and what it leaves in the queue."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.cli import build_parser
from jobplane.envelope import Envelope
from jobplane.topology import Topology
from jobplane.workers.dlq import FailedQueue
from tests.faults.cluster import topology_toml
from tests.support.logs import assert_answers
from tests.support.parts import Started
from tests.support.queues import dead_letter
from tests.support.stack import Stack, start_stack

KEPT = "(no job to re-dispatch, or a live attempt holds it)"


async def _dlq(*argv: str) -> int:
    """``jobplane dlq ARGV`` as its entry point runs it (its own event loop)."""
    args = build_parser({"dlq"}).parse_args(["dlq", *argv])
    code: int = await asyncio.to_thread(args.func, args)
    return code


@pytest.fixture
async def stack(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    started: Started,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Stack:
    """A server with no relay and no worker, its topology in a file, and the ``jobplane``
    variables (topology file, broker and database) pointing the commands at it."""
    stack = await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )
    path = tmp_path / "topology.toml"
    path.write_text(topology_toml(stack.topology))
    monkeypatch.setenv("JOBPLANE_TOPOLOGY", str(path))
    monkeypatch.setenv("JOBPLANE_AMQP_URL", amqp_url)
    monkeypatch.setenv("JOBPLANE_DATABASE_URL", database_url)
    return stack


async def test_dlq_commands_list_replay_and_purge(
    stack: Stack, amqp_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client = stack.client()
    job = await client.submit("demo.echo", {"from": "dlq"})
    ended = await client.submit("demo.echo", {"from": "dlq, cancelled"})
    await client.cancel(ended.name)
    await stack.scalar("UPDATE outbox SET published_at = now() RETURNING 1")
    stray = Envelope(uuid.uuid4(), uuid.uuid4(), stack.tenant_id, "demo.echo")
    # A dispatch of the cancelled job from before its cancel.
    late = Envelope(uuid.uuid4(), uuid.UUID(ended.id), stack.tenant_id, "demo.echo")
    await dead_letter(amqp_url, stack.topology, await stack.envelope(job.id), late, stray)
    capsys.readouterr()

    # Listed (reason and source queue unknown: dead-lettered by hand), left queued.
    assert await _dlq("list") == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{'-':<16} {'-':<28} {name} (demo.echo)"
        for name in (job.name, ended.name, f"jobs/{stray.job_id}")
    ]
    assert await _dlq("list", "--json", "--limit", "2") == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [m["job"] for m in listed] == [job.name, ended.name]

    assert await _dlq("replay") == 0
    assert capsys.readouterr().out.splitlines() == [
        f"replayed  {job.name}",
        f"finished  {ended.name} (already ended; message dropped)",
        f"kept      jobs/{stray.job_id} {KEPT}",
    ]

    assert await _dlq("purge") == 2
    said = capsys.readouterr()
    assert (said.out, said.err) == ("", "error: purge drops every failed message; add --yes\n")
    assert len(await FailedQueue(amqp_url, stack.topology).list()) == 1
    assert await _dlq("purge", "--yes") == 0
    assert capsys.readouterr().err.splitlines()[-1] == "purged 1 messages"
    assert await FailedQueue(amqp_url, stack.topology).list() == []


async def test_dlq_replay_takes_at_most_its_limit(
    stack: Stack, amqp_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    strays = [Envelope(uuid.uuid4(), uuid.uuid4(), stack.tenant_id, "demo.echo") for _ in "ab"]
    await dead_letter(amqp_url, stack.topology, *strays)
    capsys.readouterr()
    assert await _dlq("replay", "--limit", "1") == 0
    assert capsys.readouterr().out.splitlines() == [f"kept      jobs/{strays[0].job_id} {KEPT}"]


@pytest.mark.parametrize("fmt", ["console", "json"])
async def test_purge_answers_in_one_line_each(
    stack: Stack,
    amqp_url: str,
    fmt: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """With JOBPLANE_LOG_FORMAT=json, one JSON object a line: the refusal and the count."""
    monkeypatch.setenv("JOBPLANE_LOG_FORMAT", fmt)
    monkeypatch.delenv("JOBPLANE_LOG_LEVEL", raising=False)
    stray = Envelope(uuid.uuid4(), uuid.uuid4(), stack.tenant_id, "demo.echo")
    await dead_letter(amqp_url, stack.topology, stray)
    capsys.readouterr()
    assert await _dlq("purge") == 2
    refused = "purge drops every failed message; add --yes"
    assert_answers(
        capsys.readouterr().err, fmt, [("command.failed", f"error: {refused}", {"error": refused})]
    )
    assert await _dlq("purge", "--yes") == 0
    said = capsys.readouterr()
    assert said.out == ""
    assert_answers(said.err, fmt, [("dlq.purged", "purged 1 messages", {"messages": 1})])
    assert await FailedQueue(amqp_url, stack.topology).list() == []
