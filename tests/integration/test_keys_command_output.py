"""What ``jobplane keys`` prints, run in-process on a real database.

docs/security.md: ``keys create`` prints the key alone on stdout (for
``KEY=$(jobplane keys create --tenant acme)``) and its id on stderr; ``list``
shows id, tenant, prefix, created, revoked, last used — never a key — and
``(worker)`` for a worker key; ``rotate`` prints the new key and when the old
one ends. tests/integration/test_keys.py runs the command itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import datetime

import pytest
import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.cli import build_parser
from jobplane.server import admin
from jobplane.server.admin import _keys_command
from jobplane.store.keys import KeyStore


async def _run(keys: KeyStore, capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    """stdout and stderr of ``jobplane keys ARGV``; its exit status must be 0."""
    args = build_parser().parse_args(["keys", *argv])
    assert await _keys_command(keys, args) == 0
    out, err = capsys.readouterr()
    return [out, err]


async def test_create_prints_the_key_alone_and_says_its_id(
    engine: AsyncEngine, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = KeyStore(engine)
    out, err = await _run(keys, capsys, "create", "--tenant", "acme")
    (info,) = await keys.list_keys("acme")
    assert out.startswith("jp_") and out == out.strip() + "\n"
    assert out.startswith(info.prefix)
    assert err == f"created {info.key_id} for tenant 'acme'\n"

    out, err = await _run(keys, capsys, "create", "--worker")
    (worker,) = [k for k in await keys.list_keys() if not k.tenant]
    assert out.startswith(worker.prefix) and out == out.strip() + "\n"
    assert err == f"created worker key {worker.key_id} (WorkerService only)\n"


async def test_list_shows_each_key_never_its_secret(
    engine: AsyncEngine, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = KeyStore(engine)
    tenant = await keys.create("acme")
    worker = await keys.create_worker()
    gone = await keys.create("globex")
    await keys.revoke(gone.key_id)
    out, err = await _run(keys, capsys, "list")
    assert len(out.splitlines()) == 4 and err == ""  # no key ends later: no footnote
    later = await keys.create("acme")
    await keys.revoke(later.key_id, after=3600)
    listed = {k.key_id: k for k in await keys.list_keys()}

    out, err = await _run(keys, capsys, "list")
    lines = out.splitlines()
    assert lines[0].split() == [
        "KEY",
        "ID",
        "TENANT",
        "PREFIX",
        "CREATED",
        "REVOKED",
        "LAST",
        "USED",
    ]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert set(rows) == {tenant.key_id, worker.key_id, later.key_id, gone.key_id}

    def seconds(key_id: str, field: str) -> str:
        value: datetime = getattr(listed[key_id], field)
        return value.isoformat(timespec="seconds")

    # Worker keys first (no tenant), then by tenant and creation.
    assert [line.split()[0] for line in lines[1:]] == [
        worker.key_id,
        tenant.key_id,
        later.key_id,
        gone.key_id,
    ]
    assert rows[worker.key_id][1:] == [
        "(worker)",
        listed[worker.key_id].prefix,
        seconds(worker.key_id, "create_time"),
        "-",
        "-",
    ]
    assert rows[later.key_id][1:] == [
        "acme",
        listed[later.key_id].prefix,
        seconds(later.key_id, "create_time"),
        seconds(later.key_id, "revoke_time") + "*",
        "-",
    ]
    assert rows[gone.key_id][1:] == [
        "globex",
        listed[gone.key_id].prefix,
        seconds(gone.key_id, "create_time"),
        seconds(gone.key_id, "revoke_time"),  # ended: no mark
        "-",
    ]
    assert err == "* still valid until then (rotated with a grace period or revoked for later)\n"
    for secret in (tenant.key, worker.key, later.key, gone.key):
        assert secret not in out and secret not in err

    out, err = await _run(keys, capsys, "list", "--tenant", "acme", "--json")
    assert err == ""
    assert all(list(json.loads(line)) == sorted(json.loads(line)) for line in out.splitlines())
    assert [json.loads(line) for line in out.splitlines()] == [
        {
            "key_id": k.key_id,
            "tenant": "acme",
            "tenant_id": str(tenant.tenant_id),
            "scope": "tenant",
            "prefix": k.prefix,
            "create_time": k.create_time.isoformat(),
            "revoke_time": None if k.revoke_time is None else k.revoke_time.isoformat(),
            "last_used_time": None,
            "active": True,
        }
        for k in (listed[tenant.key_id], listed[later.key_id])
    ]


async def test_revoke_and_rotate_say_what_ends_when(
    engine: AsyncEngine, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = KeyStore(engine)
    first = await keys.create("acme")
    worker = await keys.create_worker()

    out, err = await _run(keys, capsys, "rotate", first.key_id, "--grace", "600")
    (old, new) = await keys.list_keys("acme")
    assert old.key_id == first.key_id and old.revoke_time is not None
    assert out.startswith(new.prefix) and out == out.strip() + "\n"
    ends = old.revoke_time.isoformat(timespec="seconds")
    assert err == f"created {new.key_id} for tenant 'acme'; {first.key_id} ends at {ends}\n"

    out, err = await _run(keys, capsys, "rotate", worker.key_id)
    ended = await keys.get_key(worker.key_id)
    assert ended.revoke_time is not None and not ended.active
    (rotated,) = [k for k in await keys.list_keys() if not k.tenant and k.active]
    ends = ended.revoke_time.isoformat(timespec="seconds")
    assert err == f"created {rotated.key_id} worker key; {worker.key_id} ends at {ends}\n"

    out, err = await _run(keys, capsys, "revoke", new.key_id, "--after", "60")
    later = await keys.get_key(new.key_id)
    assert later.revoke_time is not None and later.active
    ends = later.revoke_time.isoformat(timespec="seconds")
    assert (out, err) == ("", f"{new.key_id} (tenant 'acme') ends at {ends}\n")

    out, err = await _run(keys, capsys, "revoke", new.key_id)
    assert (out, err) == ("", f"revoked {new.key_id} (tenant 'acme')\n")
    assert not (await keys.get_key(new.key_id)).active


async def test_a_refused_key_or_bad_seconds_is_one_line_and_changes_nothing(
    engine: AsyncEngine,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Exit 1 for a key that is not there or already revoked, 2 for SECONDS out of range.

    The command's pool has one connection: a refused rotation must not wait on a second."""
    monkeypatch.setenv("JOBPLANE_DATABASE_URL", database_url)
    keys = KeyStore(engine)
    key = await keys.create("acme")
    gone = await keys.create("acme")
    await keys.revoke(gone.key_id)
    capsys.readouterr()

    async def keys_command(*argv: str) -> tuple[int, str, str]:
        # A command that waited on a second connection would sit out the pool's
        # 30 s timeout: fail well before it.
        code = await asyncio.wait_for(
            admin._keys(build_parser().parse_args(["keys", *argv])), timeout=10
        )
        out, err = capsys.readouterr()
        return code, out, err

    limit = "3,153,600,000"
    assert await keys_command("revoke", key.key_id, "--after", "soon") == (
        2,
        "",
        f"error: --after must be a number of seconds from 0 to {limit}, got 'soon'\n",
    )
    assert await keys_command("rotate", key.key_id, "--grace", "-5") == (
        2,
        "",
        f"error: --grace must be a number of seconds from 0 to {limit}, got '-5'\n",
    )
    assert await keys_command("revoke", "key_nothere") == (
        1,
        "",
        "error: no API key 'key_nothere'\n",
    )
    assert await keys_command("rotate", "key_nothere") == (
        1,
        "",
        "error: no API key 'key_nothere'\n",
    )
    assert await keys_command("rotate", gone.key_id) == (
        1,
        "",
        f"error: API key {gone.key_id!r} is already revoked\n",
    )
    listed = await keys.list_keys("acme")
    assert [(k.key_id, k.active, k.revoke_time is None) for k in listed] == [
        (key.key_id, True, True),
        (gone.key_id, False, False),
    ]


async def test_the_command_logs_warnings_up_in_the_configured_format(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No JOBPLANE_LOG_LEVEL: warnings and worse only, jobplane's and the drivers' alike,
    each one JSON object a line with JOBPLANE_LOG_FORMAT=json."""
    monkeypatch.setenv("JOBPLANE_DATABASE_URL", database_url)
    monkeypatch.delenv("JOBPLANE_LOG_LEVEL", raising=False)
    monkeypatch.setenv("JOBPLANE_LOG_FORMAT", "json")
    capsys.readouterr()
    assert await admin._keys(build_parser().parse_args(["keys", "list", "--json"])) == 0
    assert capsys.readouterr() == ("", "")
    log = structlog.get_logger("jobplane.test")
    log.info("not shown")
    log.warning("shown", n=1)
    logging.getLogger("asyncpg").warning("a driver's warning")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert [(line["logger"], line["event"], line["level"]) for line in lines] == [
        ("jobplane.test", "shown", "warning"),
        ("asyncpg", "a driver's warning", "warning"),
    ]
    assert lines[0]["n"] == 1
