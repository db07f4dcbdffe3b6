"""The operator's commands of ``jobplane`` on accounts: ``keys`` (API keys),
``tenants`` (retention horizons, retention runs, erasure, dispatch weights) and ``workers`` (who
runs jobs), each with its arguments.

They read and write Postgres directly, with a pool of one: no server runs.
jobplane.cli imports this module only when one of them runs (or for the whole
parser).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from datetime import datetime
from typing import TYPE_CHECKING, Any

from jobplane.config import Settings
from jobplane.logs import configure
from jobplane.process import _answer, _async, _error_line

if TYPE_CHECKING:
    import uuid

    from sqlalchemy.ext.asyncio import AsyncEngine

    from jobplane.store.jobs import JobStore
    from jobplane.store.keys import KeyInfo, KeyStore
    from jobplane.store.maintenance import MaintenanceStore


async def _keys(args: argparse.Namespace) -> int:
    from jobplane.store.engine import create_engine
    from jobplane.store.keys import KeyNotFound, KeyRevoked, KeyStore

    settings = Settings.from_env()
    configure(settings.log_level or "warning", settings.log_format)
    engine = create_engine(settings.database_url, pool_size=1)
    try:
        return await _keys_command(KeyStore(engine), args)
    except (KeyNotFound, KeyRevoked) as exc:
        _error_line(str(exc))
        return 1
    except ValueError as exc:  # a tenant name, --grace or --after out of range
        _error_line(str(exc))
        return 2
    finally:
        await engine.dispose()


async def _keys_command(keys: KeyStore, args: argparse.Namespace) -> int:
    if args.keys == "create":
        if args.worker:
            created = await keys.create_worker()
            print(created.key)
            _answer(
                "key.created",
                f"created worker key {created.key_id} (WorkerService only)",
                key_id=created.key_id,
                scope="worker",
            )
            return 0
        created = await keys.create(args.tenant)
        # stdout carries the secret alone, for `$(jobplane keys create ...)`.
        print(created.key)
        _answer(
            "key.created",
            f"created {created.key_id} for tenant {created.tenant!r}",
            key_id=created.key_id,
            tenant=created.tenant,
            scope="tenant",
        )
        return 0
    if args.keys == "list":
        listed = await keys.list_keys(args.tenant)
        if args.json:
            for info in listed:
                print(json.dumps(_key_json(info), sort_keys=True))
        else:
            _print_keys(listed)
        return 0
    if args.keys == "revoke":
        info = await keys.revoke(args.key_id, after=_key_seconds(args.after, "--after"))
        ends_at = info.revoke_time.isoformat() if info.revoke_time else None
        fields: dict[str, Any] = {"key_id": info.key_id, "tenant": info.tenant, "ends_at": ends_at}
        if info.active and info.revoke_time is not None:
            ends = info.revoke_time.isoformat(timespec="seconds")
            _answer(
                "key.revoking", f"{info.key_id} (tenant {info.tenant!r}) ends at {ends}", **fields
            )
        else:
            _answer("key.revoked", f"revoked {info.key_id} (tenant {info.tenant!r})", **fields)
        return 0
    created, old = await keys.rotate(args.key_id, grace=_key_seconds(args.grace, "--grace"))
    print(created.key)
    ends = old.revoke_time.isoformat(timespec="seconds") if old.revoke_time else "-"
    owner = "worker key" if not created.tenant else f"for tenant {created.tenant!r}"
    _answer(
        "key.rotated",
        f"created {created.key_id} {owner}; {old.key_id} ends at {ends}",
        key_id=created.key_id,
        tenant=created.tenant,
        old_key_id=old.key_id,
        ends_at=old.revoke_time.isoformat() if old.revoke_time else None,
    )
    return 0


async def _tenants(args: argparse.Namespace) -> int:
    from jobplane.errors import JobplaneError, TenantNotFound
    from jobplane.store.engine import create_engine

    settings = Settings.from_env()
    configure(settings.log_level or "warning", settings.log_format)
    engine = create_engine(settings.database_url, pool_size=1)
    try:
        return await _tenants_command(engine, args)
    except TenantNotFound as exc:
        _error_line(str(exc))
        return 1
    except (JobplaneError, ValueError) as exc:  # a horizon out of range, a route missing
        _error_line(str(exc))
        return 2
    finally:
        await engine.dispose()


_TENANT_HELP = "a tenant's name, as keys create --tenant gave it"


def _retention_days(value: str) -> int | None:
    """DAYS of ``tenants set-retention``: a whole number of days, or ``none``."""
    if value.lower() in ("none", "off", "forever"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"DAYS must be a whole number of days or 'none', got {value!r}"
        ) from None


def _whole_number(value: str) -> int:
    """WEIGHT of ``tenants set-weight``: a whole number (its range is the store's check)."""
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"WEIGHT must be a whole number, got {value!r}") from None


async def _retention_schedule(engine: AsyncEngine, tenant: str, tenant_id: uuid.UUID) -> None:
    """Give the tenant its built-in retention schedule, or take it (ADR-0041)."""
    from jobplane.server.schedule_builtin import sync_retention_schedules
    from jobplane.topology import load_topology

    topology = load_topology(Settings.from_env().topology_path)
    done = await sync_retention_schedules(engine, topology, tenant_id)
    schedule = {"schedule": "schedules/jobplane-retention", "tenant": tenant}
    if done.created:
        _answer(
            "schedule.created",
            "schedules/jobplane-retention runs maintenance.retention daily",
            **schedule,
            type="maintenance.retention",
        )
    if done.removed:
        _answer("schedule.deleted", "schedules/jobplane-retention deleted: no horizon", **schedule)


async def _tenants_command(engine: AsyncEngine, args: argparse.Namespace) -> int:
    import uuid
    from datetime import UTC

    from jobplane.store.maintenance import MaintenanceStore
    from jobplane.workers.maintenance import ERASURE, RETENTION

    store = MaintenanceStore(engine)
    if args.tenants == "list":
        await _tenants_list(store, as_json=args.json)
        return 0
    if args.tenants in ("set-weight", "set-retention"):
        await _tenant_set(engine, store, args)
        return 0
    if args.tenants == "retention":
        if args.all:
            names = [t.name for t in await store.tenants() if t.retention_days is not None]
        else:
            names = [(await store.tenant_named(name)).name for name in args.tenant]
        if not names:
            _answer("tenant.retention.none", "no tenant has a retention horizon")
            return 0
        # One run per tenant and day: a cron that fires twice submits once.
        day = datetime.now(UTC).strftime("%Y-%m-%d")
        jobs = [
            await _submit_maintenance(engine, name, RETENTION, {}, f"{RETENTION}/{day}")
            for name in names
        ]
    else:  # erase
        if not args.yes:
            _error_line(
                "erasing deletes every job, event, blob and index point of tenant "
                f"{args.tenant!r}; add --yes"
            )
            return 2
        tenant = await store.tenant_named(args.tenant)
        payload = {"confirm": tenant.name}
        jobs = [
            await _submit_maintenance(
                engine, tenant.name, ERASURE, payload, f"{ERASURE}/{uuid.uuid4()}"
            )
        ]
    for name, job_id in jobs:
        print(f"jobs/{job_id}")
        _answer(
            "maintenance.submitted",
            f"submitted jobs/{job_id} for tenant {name!r}",
            job_id=str(job_id),
            tenant=name,
        )
    if not args.wait:
        return 0
    failed = 0
    for name, job_id in jobs:
        failed += not await _wait_maintenance(engine, name, job_id)
    return 1 if failed else 0


async def _tenants_list(store: MaintenanceStore, *, as_json: bool) -> None:
    """``tenants list``: a line each (a JSON object with ``--json``)."""
    for tenant in await store.tenants():
        if as_json:
            print(
                json.dumps(
                    {
                        "id": str(tenant.id),
                        "name": tenant.name,
                        "retention_days": tenant.retention_days,
                        "dispatch_weight": tenant.dispatch_weight,
                    },
                    sort_keys=True,
                )
            )
        else:
            days = "-" if tenant.retention_days is None else f"{tenant.retention_days}d"
            weight = f"w{tenant.dispatch_weight}"
            print(f"{tenant.name:<40}  {days:>7}  {weight:>5}  {tenant.id}")


async def _tenant_set(
    engine: AsyncEngine, store: MaintenanceStore, args: argparse.Namespace
) -> None:
    """``tenants set-weight`` and ``tenants set-retention``."""
    if args.tenants == "set-weight":
        tenant = await store.set_weight(args.tenant, args.weight)
        _answer(
            "tenant.weight.set",
            f"tenant {tenant.name!r}: dispatch weight {tenant.dispatch_weight} "
            "(from the relays' next claim)",
            tenant=tenant.name,
            dispatch_weight=tenant.dispatch_weight,
        )
        return
    tenant = await store.set_retention(args.tenant, args.days)
    kept = "for ever" if tenant.retention_days is None else f"{tenant.retention_days} days"
    _answer(
        "tenant.retention.set",
        f"tenant {tenant.name!r}: finished jobs and events are kept {kept}",
        tenant=tenant.name,
        retention_days=tenant.retention_days,
    )
    await _retention_schedule(engine, tenant.name, tenant.id)


async def _submit_maintenance(
    engine: AsyncEngine, tenant: str, job_type: str, payload: dict[str, Any], request_id: str
) -> tuple[str, Any]:
    """Submit a maintenance job for ``tenant`` through the database (jobplane.submit_job)."""
    from jobplane import txn

    async with engine.begin() as conn:
        job_id = await txn.submit_job(
            conn, tenant=tenant, type=job_type, payload=payload, request_id=request_id
        )
    return tenant, job_id


async def _wait_maintenance(engine: AsyncEngine, tenant: str, job_id: Any) -> bool:
    """Print the job's progress until it ends; True when it succeeded."""
    from jobplane.store.db import Database
    from jobplane.store.jobs import JobStore
    from jobplane.store.maintenance import MaintenanceStore

    tenant_id = (await MaintenanceStore(engine).tenant_named(tenant)).id
    # The configured URL, not the engine's: that shows a URL of several hosts bare.
    async with Database(Settings.from_env().database_url, size=1) as db:
        return await _follow_maintenance(JobStore(engine, db), tenant_id, job_id)


async def _follow_maintenance(jobs: JobStore, tenant_id: Any, job_id: Any) -> bool:
    from jobplane.types import JobState

    said = ""
    while True:
        job = await jobs.get(tenant_id, job_id)
        line = f"jobs/{job_id} {job.state.name} {job.progress:.0%} {job.progress_message}"
        if line != said:
            _answer(
                "maintenance.progress",
                line,
                job_id=str(job_id),
                state=job.state.name,
                progress=job.progress,
                progress_message=job.progress_message,
            )
            said = line
        if job.state.terminal:
            if job.result is not None:
                print(json.dumps(job.result, sort_keys=True))
            if job.error is not None:
                _error_line(f"{job.error.code}: {job.error.message}")
            return job.state is JobState.SUCCEEDED
        await asyncio.sleep(0.5)


# Far past any key's life, and keeps now() + SECONDS within Postgres' timestamps.
_KEY_SECONDS_MAX = 100 * 365 * 86_400


def _key_seconds(value: str, flag: str) -> float:
    """SECONDS of ``keys revoke --after`` and ``rotate --grace``, checked here rather than
    by argparse so that a bad one is a single line (ValueError) like the command's others."""
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 <= seconds <= _KEY_SECONDS_MAX:  # also refuses nan and inf
        raise ValueError(
            f"{flag} must be a number of seconds from 0 to {_KEY_SECONDS_MAX:,}, got {value!r}"
        )
    return seconds


def _key_json(info: KeyInfo) -> dict[str, Any]:
    def when(value: datetime | None) -> str | None:
        return value.isoformat() if value else None

    return {
        "key_id": info.key_id,
        "tenant": info.tenant,
        "tenant_id": None if info.tenant_id is None else str(info.tenant_id),
        "scope": info.scope.value,
        "prefix": info.prefix,
        "create_time": when(info.create_time),
        "revoke_time": when(info.revoke_time),
        "last_used_time": when(info.last_used_time),
        "active": info.active,
    }


def _print_keys(listed: list[KeyInfo]) -> None:
    def when(value: datetime | None) -> str:
        return value.isoformat(timespec="seconds") if value else "-"

    rows = [("KEY ID", "TENANT", "PREFIX", "CREATED", "REVOKED", "LAST USED")]
    for info in listed:
        revoked = when(info.revoke_time) + ("" if not info.active or not info.revoke_time else "*")
        rows.append(
            (
                info.key_id,
                info.tenant or "(worker)",
                info.prefix,
                when(info.create_time),
                revoked,
                when(info.last_used_time),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    if any(info.active and info.revoke_time for info in listed):
        _answer(
            "key.list.ending_later",
            "* still valid until then (rotated with a grace period or revoked for later)",
            key_ids=[i.key_id for i in listed if i.active and i.revoke_time],
        )


async def _workers(args: argparse.Namespace) -> int:

    from jobplane.store.engine import create_engine
    from jobplane.store.workers import WorkerStore

    settings = Settings.from_env()
    configure(settings.log_level or "warning", settings.log_format)
    engine = create_engine(settings.database_url, pool_size=1)
    try:
        workers = await WorkerStore(engine).list(dead_for=args.dead_for)
    finally:
        await engine.dispose()
    if args.json:
        for w in workers:
            print(
                json.dumps(
                    {
                        "id": str(w.id),
                        "status": w.status,
                        "host": w.host,
                        "pid": w.pid,
                        "types": list(w.types),
                        "queues": list(w.queues),
                        "concurrency": w.concurrency,
                        "version": w.version,
                        "start_time": w.start_time.isoformat(),
                        "heartbeat_time": w.heartbeat_time.isoformat(),
                        "stop_time": w.stop_time.isoformat() if w.stop_time else None,
                    },
                    sort_keys=True,
                )
            )
        return 0
    if not workers:
        _answer("workers.none", "no live workers")
        return 0
    print(f"{'ID':<36}  {'STATUS':<7}  {'HOST:PID':<24}  {'CONC':>4}  {'LAST BEAT':<20}  TYPES")
    for w in workers:
        where = f"{w.host}:{w.pid}"
        beat = w.heartbeat_time.isoformat(timespec="seconds").replace("+00:00", "Z")
        print(
            f"{w.id!s:<36}  {w.status:<7}  {where:<24}  {w.concurrency:>4}  {beat:<20}  "
            f"{', '.join(w.types) or '-'}  (queues: {', '.join(w.queues)})"
        )
    return 0


# -- Arguments -------------------------------------------------------------


def register_keys(parser: argparse.ArgumentParser) -> None:
    """``jobplane keys``' subcommands and their arguments."""
    keys = parser.add_subparsers(dest="keys", required=True)
    create = keys.add_parser("create", help="create a key (and the tenant); prints the key")
    owner = create.add_mutually_exclusive_group(required=True)
    owner.add_argument("--tenant", help="a tenant key: JobService and EventService")
    owner.add_argument(
        "--worker",
        action="store_true",
        help="a worker key: WorkerService only, for every tenant's jobs (docs/workers.md)",
    )
    keys_list = keys.add_parser("list", help="list keys by id (never the keys themselves)")
    keys_list.add_argument("--tenant", help="only this tenant's keys")
    keys_list.add_argument("--json", action="store_true", help="one JSON object per key")
    revoke = keys.add_parser("revoke", help="revoke a key now or later, on every server")
    revoke.add_argument("key_id", metavar="KEY_ID", help="the key's id (key_...)")
    revoke.add_argument(
        "--after",
        metavar="SECONDS",
        default="0",
        help="the key keeps working this long (default: revoked at once)",
    )
    rotate = keys.add_parser(
        "rotate", help="create a new key for the key's tenant and revoke the old one"
    )
    rotate.add_argument("key_id", metavar="KEY_ID", help="the key's id (key_...)")
    rotate.add_argument(
        "--grace",
        metavar="SECONDS",
        default="0",
        help="the old key keeps working this long (default: revoked at once)",
    )
    for parser_ in (create, keys_list, revoke, rotate):
        parser_.set_defaults(func=_async(_keys))


def register_tenants(parser: argparse.ArgumentParser) -> None:
    """``jobplane tenants``' subcommands and their arguments."""
    tenants = parser.add_subparsers(dest="tenants", required=True)
    tenants_list = tenants.add_parser(
        "list", help="tenants, their retention horizons and dispatch weights"
    )
    tenants_list.add_argument("--json", action="store_true", help="one JSON object per tenant")
    set_retention = tenants.add_parser(
        "set-retention",
        help="keep the tenant's finished jobs and events DAYS days ('none': for ever)",
    )
    set_retention.add_argument("tenant", metavar="TENANT", help=_TENANT_HELP)
    set_retention.add_argument(
        "days", metavar="DAYS", type=_retention_days, help="whole days, or none: for ever"
    )
    set_weight = tenants.add_parser(
        "set-weight",
        help="the tenant's share of each queue's dispatches against the other tenants "
        "waiting there (1..1000, default 1; docs/flow-control.md)",
    )
    set_weight.add_argument("tenant", metavar="TENANT", help=_TENANT_HELP)
    set_weight.add_argument("weight", metavar="WEIGHT", type=_whole_number, help="1..1000")
    retention = tenants.add_parser(
        "retention", help="submit maintenance.retention for tenants (at most one a day each)"
    )
    which = retention.add_mutually_exclusive_group(required=True)
    which.add_argument("tenant", metavar="TENANT", nargs="*", default=[], help=_TENANT_HELP)
    which.add_argument("--all", action="store_true", help="every tenant that has a horizon")
    erase = tenants.add_parser(
        "erase", help="submit maintenance.erasure: delete all of the tenant's data"
    )
    erase.add_argument("tenant", metavar="TENANT", help=_TENANT_HELP)
    erase.add_argument("--yes", action="store_true", help="really erase it")
    for parser_ in (retention, erase):
        parser_.add_argument("--wait", action="store_true", help="show progress until it ends")
    for parser_ in (tenants_list, set_retention, set_weight, retention, erase):
        parser_.set_defaults(func=_async(_tenants))


def register_workers(parser: argparse.ArgumentParser) -> None:
    """``jobplane workers``' description and arguments."""
    parser.description = (
        "Workers register in Postgres: what they run, where, and when they last "
        "beat. 'stopped' ones said so; 'lost' ones stopped beating (killed, hung, cut off)."
    )
    parser.add_argument(
        "--dead-for",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="also list workers stopped or lost this recently (default 3600)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per worker")
    parser.set_defaults(func=_async(_workers))
