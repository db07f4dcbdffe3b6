"""What ``jobplane keys``, ``tenants`` and ``workers`` say on stderr, run in-process
on a real database, in text and with ``JOBPLANE_LOG_FORMAT=json``.

docs/operations.md: with ``json`` every line a command writes is one JSON object,
its answers (``key.created``, ``tenant.retention.set``, ...) and its errors
(``command.failed``) included, whatever the log level; the key itself stays on
stdout, never on stderr. In text the lines are the ones the operator always saw.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.cli import build_parser
from jobplane.server import admin
from jobplane.store.keys import KeyStore
from jobplane.store.routes import sync_submit_rules
from jobplane.topology import load_topology
from tests.support.logs import Answer, assert_answers

Command = Callable[..., Awaitable[tuple[int, str, str]]]

LIMIT = "3,153,600,000"


@pytest.fixture(params=["console", "json"])
def fmt(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The log format asked for; no JOBPLANE_LOG_LEVEL: the commands log warnings up."""
    monkeypatch.setenv("JOBPLANE_LOG_FORMAT", request.param)
    monkeypatch.delenv("JOBPLANE_LOG_LEVEL", raising=False)
    return str(request.param)


@pytest.fixture
async def command(
    engine: AsyncEngine,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> Command:
    """``jobplane ARGV`` (keys, tenants, workers) in this process: its exit status,
    stdout and stderr. The database routes the default topology's types."""
    await sync_submit_rules(engine, load_topology(), max_payload_bytes=256 * 1024)
    monkeypatch.setenv("JOBPLANE_DATABASE_URL", database_url)
    run = {"keys": admin._keys, "tenants": admin._tenants, "workers": admin._workers}
    capsys.readouterr()

    async def call(*argv: str) -> tuple[int, str, str]:
        code = await asyncio.wait_for(run[argv[0]](build_parser().parse_args(argv)), 20)
        out, err = capsys.readouterr()
        return code, out, err

    return call


def _error(message: str) -> Answer:
    return ("command.failed", f"error: {message}", {"error": message})


async def test_keys_answer_each_in_one_line(
    engine: AsyncEngine, command: Command, fmt: str
) -> None:
    keys = KeyStore(engine)
    code, out, err = await command("keys", "create", "--tenant", "acme")
    (acme,) = await keys.list_keys("acme")
    assert (code, out.startswith(acme.prefix)) == (0, True)
    assert out.strip() not in err
    created = f"created {acme.key_id} for tenant 'acme'"
    fields: dict[str, Any] = {"key_id": acme.key_id, "tenant": "acme", "scope": "tenant"}
    assert_answers(err, fmt, [("key.created", created, fields)])

    code, out, err = await command("keys", "create", "--worker")
    (worker,) = [k for k in await keys.list_keys() if not k.tenant]
    assert (code, out.strip() in err) == (0, False)
    created = f"created worker key {worker.key_id} (WorkerService only)"
    fields = {"key_id": worker.key_id, "scope": "worker"}
    assert_answers(err, fmt, [("key.created", created, fields)])

    asked = datetime.now(UTC)
    code, out, err = await command("keys", "revoke", worker.key_id, "--after", "3600")
    ends_at = (await keys.get_key(worker.key_id)).revoke_time
    assert code == 0 and ends_at is not None
    assert _seconds_after(asked, ends_at) == pytest.approx(3600, abs=5)
    ends = ends_at.isoformat(timespec="seconds")
    said = f"{worker.key_id} (tenant '') ends at {ends}"
    fields = {"key_id": worker.key_id, "tenant": "", "ends_at": ends_at.isoformat()}
    assert_answers(err, fmt, [("key.revoking", said, fields)])

    # The table on stdout, its footnote on stderr; --json, nothing on stderr.
    code, out, err = await command("keys", "list")
    assert (code, len(out.splitlines())) == (0, 3)
    note = "* still valid until then (rotated with a grace period or revoked for later)"
    assert_answers(err, fmt, [("key.list.ending_later", note, {"key_ids": [worker.key_id]})])
    assert (await command("keys", "list", "--json"))[2] == ""

    asked = datetime.now(UTC)
    code, out, err = await command("keys", "rotate", acme.key_id, "--grace", "60")
    (new,) = [k for k in await keys.list_keys("acme") if k.key_id != acme.key_id]
    old_ends = (await keys.get_key(acme.key_id)).revoke_time
    assert code == 0 and old_ends is not None and out.startswith(new.prefix)
    assert _seconds_after(asked, old_ends) == pytest.approx(60, abs=5)
    assert out.strip() not in err
    said = (
        f"created {new.key_id} for tenant 'acme'; {acme.key_id} ends at "
        f"{old_ends.isoformat(timespec='seconds')}"
    )
    fields = {
        "key_id": new.key_id,
        "tenant": "acme",
        "old_key_id": acme.key_id,
        "ends_at": old_ends.isoformat(),
    }
    assert_answers(err, fmt, [("key.rotated", said, fields)])

    code, out, err = await command("keys", "revoke", acme.key_id)
    revoked = (await keys.get_key(acme.key_id)).revoke_time
    assert code == 0 and revoked is not None
    said = f"revoked {acme.key_id} (tenant 'acme')"
    fields = {"key_id": acme.key_id, "tenant": "acme", "ends_at": revoked.isoformat()}
    assert_answers(err, fmt, [("key.revoked", said, fields)])

    refused = [
        (("revoke", "key_nothere"), 1, "no API key 'key_nothere'"),
        (("rotate", acme.key_id), 1, f"API key {acme.key_id!r} is already revoked"),
        (
            ("rotate", new.key_id, "--grace", "-5"),
            2,
            f"--grace must be a number of seconds from 0 to {LIMIT}, got '-5'",
        ),
    ]
    for argv, status, message in refused:
        code, out, err = await command("keys", *argv)
        assert (code, out) == (status, "")
        assert_answers(err, fmt, [_error(message)])


async def _tenant(engine: AsyncEngine, name: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            text("INSERT INTO tenants (id, name) VALUES (:id, :name)"),
            {"id": uuid.uuid4(), "name": name},
        )


async def test_tenants_and_workers_answer_each_in_one_line(
    engine: AsyncEngine, command: Command, fmt: str
) -> None:
    await _tenant(engine, "acme")
    schedule = {"schedule": "schedules/jobplane-retention", "tenant": "acme"}
    steps: list[tuple[tuple[str, ...], int, list[Answer]]] = [
        (("workers",), 0, [("workers.none", "no live workers", {})]),
        (
            ("tenants", "retention", "--all"),
            0,
            [("tenant.retention.none", "no tenant has a retention horizon", {})],
        ),
        (
            ("tenants", "set-weight", "acme", "7"),
            0,
            [
                (
                    "tenant.weight.set",
                    "tenant 'acme': dispatch weight 7 (from the relays' next claim)",
                    {"tenant": "acme", "dispatch_weight": 7},
                )
            ],
        ),
        (
            ("tenants", "set-retention", "acme", "30"),
            0,
            [
                (
                    "tenant.retention.set",
                    "tenant 'acme': finished jobs and events are kept 30 days",
                    {"tenant": "acme", "retention_days": 30},
                ),
                (
                    "schedule.created",
                    "schedules/jobplane-retention runs maintenance.retention daily",
                    {**schedule, "type": "maintenance.retention"},
                ),
            ],
        ),
        (
            ("tenants", "set-retention", "acme", "none"),
            0,
            [
                (
                    "tenant.retention.set",
                    "tenant 'acme': finished jobs and events are kept for ever",
                    {"tenant": "acme", "retention_days": None},
                ),
                ("schedule.deleted", "schedules/jobplane-retention deleted: no horizon", schedule),
            ],
        ),
        (("tenants", "set-weight", "nobody", "2"), 1, [_error("no tenant 'nobody'")]),
        (
            ("tenants", "erase", "acme"),
            2,
            [
                _error(
                    "erasing deletes every job, event, blob and index point of tenant 'acme'; "
                    "add --yes"
                )
            ],
        ),
    ]
    for argv, status, answers in steps:
        code, out, err = await command(*argv)
        assert (code, out) == (status, ""), argv
        assert_answers(err, fmt, answers)

    code, out, err = await command("tenants", "erase", "acme", "--yes")
    job_id = out.removeprefix("jobs/").strip()
    assert (code, out) == (0, f"jobs/{uuid.UUID(job_id)}\n")
    said = f"submitted jobs/{job_id} for tenant 'acme'"
    fields = {"job_id": job_id, "tenant": "acme"}
    assert_answers(err, fmt, [("maintenance.submitted", said, fields)])


def _seconds_after(asked: datetime, ends: datetime) -> float:
    """How long after ``asked`` (the command's start) ``ends`` is."""
    return (ends - asked).total_seconds()
