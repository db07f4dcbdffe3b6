"""The schedule commands: ``jobplane schedules create|get|list|update|pause|resume|
trigger|delete`` (docs/scheduling.md)."""

from __future__ import annotations

import argparse
import dataclasses
from datetime import datetime
from typing import Any

from jobplane.client._cli_input import parse_labels, parse_payload
from jobplane.client._cli_render import _jsonable, job_line, job_to_json, print_json
from jobplane.client._cli_run import EXIT_OK, Parents, Subparsers, UsageError, command
from jobplane.client.aio import AsyncClient
from jobplane.schedule_types import CatchUp, Overlap, Schedule

_NAME_HELP = "schedules/{id}, or just the id"


def register_schedule_commands(subparsers: Subparsers, parents: Parents) -> None:
    """Add ``schedules`` and its commands to ``subparsers``, each with ``parents``' flags."""
    schedules = subparsers.add_parser(
        "schedules",
        help="recurring schedules: a job submitted on a cron expression or an interval",
        description="Schedules submit a job on every tick of a cron expression (in a time "
        "zone) or of a fixed interval; each tick exactly one job.",
    ).add_subparsers(dest="schedules", required=True, metavar="COMMAND")
    create = schedules.add_parser("create", parents=parents, help="create a schedule and print it")
    create.add_argument("type", metavar="TYPE", help="the job type each run submits")
    create.add_argument("--id", default="", help="the schedule's id (default: generated)")
    _spec_options(create)
    create.set_defaults(func=command(_create))
    update = schedules.add_parser(
        "update", parents=parents, help="change the fields given, keep the others"
    )
    update.add_argument("name", metavar="NAME", help=_NAME_HELP)
    update.add_argument("--type", default=None, help="the job type each run submits")
    _spec_options(update)
    update.set_defaults(func=command(_update))
    for verb, helptext, run in (
        ("get", "show a schedule", _get),
        ("pause", "stop its ticks until resumed", _pause),
        ("resume", "tick again, from the first tick after now", _resume),
        ("delete", "delete a schedule (its jobs stay)", _delete),
    ):
        sub = schedules.add_parser(verb, parents=parents, help=helptext)
        sub.add_argument("name", metavar="NAME", help=_NAME_HELP)
        sub.set_defaults(func=command(run))
    trigger = schedules.add_parser(
        "trigger", parents=parents, help="submit one run now and print its job"
    )
    trigger.add_argument("name", metavar="NAME", help=_NAME_HELP)
    trigger.add_argument("--request-id", default="", help="the same one again: the same job")
    trigger.add_argument(
        "--overlap",
        choices=[Overlap.SKIP.value, Overlap.ALLOW_ALL.value, Overlap.CANCEL_OTHER.value],
        default=None,
        help="while a run is going: skip (refuse), allow_all (run anyway: the default), "
        "cancel_other (cancel it, then run)",
    )
    trigger.set_defaults(func=command(_trigger))
    list_ = schedules.add_parser("list", parents=parents, help="list schedules, newest first")
    list_.set_defaults(func=command(_list))


def _spec_options(parser: argparse.ArgumentParser) -> None:
    """The options create and update share; update sends only those given."""
    payload = parser.add_mutually_exclusive_group()
    payload.add_argument("--payload", metavar="JSON", help="the payload, a JSON object")
    payload.add_argument("--payload-file", metavar="PATH", help="read the payload from PATH")
    parser.add_argument("--cron", help="five cron fields, or @daily, @hourly, ...")
    parser.add_argument("--time-zone", help="IANA zone of --cron (default UTC)")
    parser.add_argument("--interval", type=float, metavar="SECONDS", help="a fixed interval")
    parser.add_argument("--start", type=datetime.fromisoformat, metavar="TIME", help="ISO time")
    parser.add_argument("--end", type=datetime.fromisoformat, metavar="TIME", help="ISO time")
    parser.add_argument("--jitter", type=float, metavar="SECONDS", help="random delay, at most")
    parser.add_argument(
        "--overlap",
        choices=[o.value for o in Overlap],
        help="a tick while a run is going: skip (create's default), buffer_one (run it "
        "after), allow_all (run anyway), cancel_other (cancel the running one, then run)",
    )
    parser.add_argument(
        "--catch-up",
        choices=[c.value for c in CatchUp],
        help="ticks missed while nothing ticked: skip (create's default), one (one run for "
        "all), all (each, oldest first)",
    )
    parser.add_argument(
        "--catch-up-limit",
        type=int,
        metavar="N",
        help="with all: the newest N (create's default 100)",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        metavar="N",
        help="each run's attempts (create's default: the queue's)",
    )
    parser.add_argument(
        "--attempt-timeout", type=float, metavar="SECONDS", help="each attempt's time limit"
    )
    parser.add_argument("--description", help="free text, shown with the schedule")
    parser.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE", help="(repeatable)"
    )


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The options the command line set, as the SDK's keyword arguments."""
    values: dict[str, Any] = {
        "cron": args.cron,
        "time_zone": args.time_zone,
        "interval": args.interval,
        "start_time": args.start,
        "end_time": args.end,
        "jitter": args.jitter,
        "overlap": Overlap(args.overlap) if args.overlap else None,
        "catch_up": CatchUp(args.catch_up) if args.catch_up else None,
        "catch_up_limit": args.catch_up_limit,
        "max_attempts": args.max_attempts,
        "attempt_timeout": args.attempt_timeout,
        "description": args.description,
    }
    given = {key: value for key, value in values.items() if value is not None}
    if args.payload is not None or args.payload_file is not None:
        given["payload"] = parse_payload(args.payload, args.payload_file)
    if args.label:
        given["labels"] = parse_labels(args.label)
    return given


def _schedule_json(schedule: Schedule) -> dict[str, Any]:
    """The schedule as one JSON object (times in ISO 8601, policies by name)."""
    plain: dict[str, Any] = _jsonable(dataclasses.asdict(schedule))
    return plain


def _schedule_line(schedule: Schedule) -> str:
    spec = schedule.spec
    when = (
        f"cron {spec.cron!r} {spec.time_zone or 'UTC'}"
        if spec.cron
        else f"every {spec.interval_seconds:g}s"
    )
    upcoming = "paused" if schedule.paused else "done"
    if not schedule.paused and schedule.next_run_time is not None:
        upcoming = f"next {schedule.next_run_time.isoformat(timespec='seconds')}"
    return f"{schedule.name}  {schedule.template.type}  {when}  {upcoming}  runs={schedule.runs}"


def _show(schedule: Schedule, args: argparse.Namespace) -> int:
    if args.json:
        print_json(_schedule_json(schedule))
    else:
        print(_schedule_line(schedule), flush=True)
    return EXIT_OK


async def _create(client: AsyncClient, args: argparse.Namespace) -> int:
    given = _given(args)
    payload = given.pop("payload", {})
    schedule = await client.create_schedule(args.type, payload, schedule_id=args.id, **given)
    return _show(schedule, args)


async def _update(client: AsyncClient, args: argparse.Namespace) -> int:
    given = _given(args)
    if args.type is not None:
        given["type"] = args.type
    if not given:
        raise UsageError("nothing to change: give the options to change")
    return _show(await client.update_schedule(args.name, **given), args)


async def _get(client: AsyncClient, args: argparse.Namespace) -> int:
    schedule = await client.get_schedule(args.name)
    if args.json:
        print_json(_schedule_json(schedule))
        return EXIT_OK
    print(_schedule_line(schedule))
    for job in schedule.recent_runs:
        print(f"  {job}")
    if schedule.last_error:
        print(f"  last error: {schedule.last_error}")
    return EXIT_OK


async def _list(client: AsyncClient, args: argparse.Namespace) -> int:
    async for schedule in client.iter_schedules():
        _show(schedule, args)
    return EXIT_OK


async def _pause(client: AsyncClient, args: argparse.Namespace) -> int:
    return _show(await client.pause_schedule(args.name), args)


async def _resume(client: AsyncClient, args: argparse.Namespace) -> int:
    return _show(await client.resume_schedule(args.name), args)


async def _trigger(client: AsyncClient, args: argparse.Namespace) -> int:
    overlap = Overlap(args.overlap) if args.overlap else None
    job = await client.trigger_schedule(args.name, request_id=args.request_id, overlap=overlap)
    if args.json:
        print_json(job_to_json(job))
    else:
        print(job_line(job), flush=True)
    return EXIT_OK


async def _delete(client: AsyncClient, args: argparse.Namespace) -> int:
    await client.delete_schedule(args.name)
    return EXIT_OK
