"""The job commands: ``submit``, ``watch``, ``get``, ``list``, ``cancel``, ``retry``."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jobplane.client._cli_input import full_name, parse_labels, parse_payload, read_job_lines
from jobplane.client._cli_render import (
    job_details,
    job_line,
    job_to_json,
    print_jobs,
    print_json,
    render_watch,
)
from jobplane.client._cli_run import (
    EXIT_FAILED,
    EXIT_OK,
    Parents,
    Subparsers,
    UsageError,
    command,
    print_error,
)
from jobplane.client._cli_schedule import parse_at, parse_deadline, parse_in
from jobplane.client.aio import AsyncClient
from jobplane.errors import JobplaneError
from jobplane.types import JobPage, JobState


def register_job_commands(subparsers: Subparsers, parents: Parents) -> None:
    """Add the job commands to ``subparsers``, each with the flags of ``parents``."""
    _register_submit(subparsers, parents)

    watch = subparsers.add_parser(
        "watch",
        parents=parents,
        help="follow a job's progress until it ends",
        description="Show a job's events until it ends (exit code 0 if it succeeded, "
        "1 if it failed or was cancelled). --json prints one JSON object per event, "
        "then the final job.",
    )
    watch.add_argument("name", metavar="NAME", help="jobs/{id}, or just the id")
    watch.add_argument(
        "--after-seq", metavar="N", type=int, default=0, help="show only events after seq N"
    )
    watch.set_defaults(func=command(_watch))

    get = subparsers.add_parser("get", parents=parents, help="show a job")
    get.add_argument("name", metavar="NAME", help="jobs/{id}, or just the id")
    get.set_defaults(func=command(_get))

    list_ = subparsers.add_parser("list", parents=parents, help="list jobs, newest first")
    list_.add_argument(
        "--state", type=str.lower, choices=[s.value for s in JobState], help="only this state"
    )
    list_.add_argument("--type", metavar="TYPE", help="only this job type")
    list_.add_argument(
        "--waiting",
        metavar="CODE",
        type=str.upper,
        default="",
        help="only QUEUED jobs waiting for this reason (SCHEDULED, CONCURRENCY_LIMIT, "
        "DEPENDENCIES, UNROUTABLE, NO_LIVE_WORKER, HANDED_BACK)",
    )
    list_.add_argument(
        "--parent",
        metavar="NAME",
        default="",
        help="only the children of this job (jobs/{id}, or just the id)",
    )
    list_.add_argument(
        "--page-size", metavar="N", type=int, default=0, help="jobs per page (server default 50)"
    )
    list_.add_argument("--page-token", metavar="TOKEN", default="", help="start at this page")
    list_.add_argument("--all", action="store_true", help="fetch every page")
    list_.set_defaults(func=command(_list))

    cancel = subparsers.add_parser("cancel", parents=parents, help="cancel a job")
    cancel.add_argument("name", metavar="NAME", help="jobs/{id}, or just the id")
    cancel.add_argument("--reason", default="", help="why, kept with the job")
    cancel.set_defaults(func=command(_cancel))

    retry = subparsers.add_parser(
        "retry", parents=parents, help="start a new attempt of a failed or cancelled job"
    )
    retry.add_argument("name", metavar="NAME", help="jobs/{id}, or just the id")
    retry.add_argument(
        "--from-stage",
        default="",
        metavar="STAGE",
        help="a pipeline job: restart at this stage (it and every later one run again) "
        "instead of at the stage that failed",
    )
    retry.set_defaults(func=command(_retry))


def _register_submit(subparsers: Subparsers, parents: Parents) -> None:
    """``submit``: one job from its flags, or every job of a ``--from-jsonl`` file."""
    submit = subparsers.add_parser(
        "submit",
        parents=parents,
        help="submit a job",
        description="Submit a job and print it; with --watch, follow it until it ends "
        "(exit code 0 if it succeeded, 1 if it failed or was cancelled).",
    )
    submit.add_argument("type", metavar="TYPE", nargs="?", help="job type, e.g. reports.render")
    submit.add_argument(
        "--from-jsonl",
        metavar="FILE",
        help="submit every job of FILE ('-' for stdin), one JSON object a line with the "
        "fields of this command (type, payload, request_id, correlation_id, max_attempts, "
        "labels, timeout), all in calls of up to 1,000; prints one line a job",
    )
    payload = submit.add_mutually_exclusive_group()
    payload.add_argument("--payload", metavar="JSON", help="the payload, a JSON object")
    payload.add_argument(
        "--payload-file", metavar="PATH", help="read the JSON payload from PATH ('-' for stdin)"
    )
    submit.add_argument("--request-id", metavar="ID", help="idempotency key (default: a new UUID)")
    submit.add_argument(
        "--correlation-id",
        metavar="ID",
        default="",
        help="the chain of work it belongs to, carried on its events (logs show its fingerprint)",
    )
    submit.add_argument(
        "--max-attempts", metavar="N", type=int, default=0, help="0: the queue's default"
    )
    submit.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=float,
        default=None,
        help="how long one attempt may run (default: the queue's)",
    )
    submit.add_argument(
        "--label",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="a label of the job (repeatable)",
    )
    _concurrency_flags(submit)
    submit.add_argument("--watch", action="store_true", help="follow the job until it ends")
    # Delayed jobs (docs/scheduling.md).
    when = submit.add_mutually_exclusive_group()
    when.add_argument(
        "--at",
        metavar="TIME",
        help="start no earlier than TIME, RFC 3339 with its zone (2027-01-31T09:00:00Z)",
    )
    when.add_argument(
        "--in",
        dest="delay",
        metavar="DURATION",
        help="start DURATION from now: seconds, or e.g. 90s, 15m, 1h30m, 2d",
    )
    submit.add_argument(
        "--deadline",
        metavar="TIME|DURATION",
        help="end the job FAILED (DEADLINE_EXCEEDED) if it has not ended by TIME "
        "(RFC 3339 with its zone) or DURATION from now (90s, 15m, 1h30m, 2d)",
    )
    submit.set_defaults(func=command(_submit))


def _concurrency_flags(submit: argparse.ArgumentParser) -> None:
    """The concurrency key's flags (docs/flow-control.md)."""
    submit.add_argument(
        "--concurrency-key",
        metavar="KEY",
        default="",
        help="at most --concurrency-limit of your jobs with this key run at once",
    )
    submit.add_argument(
        "--concurrency-limit", metavar="N", type=int, default=0, help="the key's limit (0: 1)"
    )
    submit.add_argument(
        "--concurrency-mode",
        choices=("queue", "reject"),
        default=None,
        help="when the key is full: wait (queue, the default) or refuse the submit (reject)",
    )
    submit.add_argument(
        "--after",
        action="append",
        default=[],
        metavar="jobs/ID",
        help="run after this job has succeeded (repeatable: after all of them)",
    )
    submit.add_argument(
        "--after-failure",
        choices=("fail", "cancel", "run_anyway"),
        default=None,
        help="when a job it runs after does not succeed: end FAILED (fail, the default), "
        "end CANCELLED (cancel), or run once all have ended (run_anyway)",
    )


async def _submit(client: AsyncClient, args: argparse.Namespace) -> int:
    if args.from_jsonl is not None:
        return await _submit_jsonl(client, args)
    if args.type is None:
        raise UsageError("submit needs a TYPE, or --from-jsonl FILE")
    payload = parse_payload(args.payload, args.payload_file)
    labels = parse_labels(args.label)
    job = await client.submit(
        args.type,
        payload,
        request_id=args.request_id,
        correlation_id=args.correlation_id,
        max_attempts=args.max_attempts,
        attempt_timeout=args.timeout,
        labels=labels,
        schedule_time=None if args.at is None else parse_at(args.at),
        schedule_delay=None if args.delay is None else parse_in(args.delay),
        concurrency_key=args.concurrency_key,
        concurrency_limit=args.concurrency_limit,
        concurrency_mode=args.concurrency_mode,
        deadline=None if args.deadline is None else parse_deadline(args.deadline),
        after=args.after,
        after_failure=args.after_failure,
    )
    if args.json:
        print_json(job_to_json(job))
    else:
        print(job_line(job), flush=True)
    if not args.watch:
        return EXIT_OK
    return await render_watch(client, job.name, as_json=args.json)


async def _submit_jsonl(client: AsyncClient, args: argparse.Namespace) -> int:
    given = [
        flag
        for flag, value in (
            ("TYPE", args.type),
            ("--payload", args.payload),
            ("--payload-file", args.payload_file),
            ("--request-id", args.request_id),
            ("--correlation-id", args.correlation_id),
            ("--max-attempts", args.max_attempts),
            ("--timeout", args.timeout),
            ("--label", args.label),
            ("--watch", args.watch),
            ("--deadline", args.deadline),
        )
        if value
    ]
    if given:
        raise UsageError(f"--from-jsonl takes each job's fields from its line, not {given[0]}")
    path = args.from_jsonl
    jobs = read_job_lines(path)
    if not jobs:
        raise UsageError(f"{path} holds no job")
    if args.at is not None or args.delay is not None:
        # Each line without a time of its own starts then.
        at = None if args.at is None else parse_at(args.at)
        delay = None if args.delay is None else parse_in(args.delay)
        jobs = [
            (n, spec)
            if spec.schedule_time is not None or spec.schedule_delay is not None
            else (n, dataclasses.replace(spec, schedule_time=at, schedule_delay=delay))
            for n, spec in jobs
        ]
    try:
        submitted = await client.submit_many(spec for _, spec in jobs)
    except JobplaneError as exc:
        index = exc.metadata.get("index")
        if index is None or not index.isdigit() or int(index) >= len(jobs):
            raise
        # The server names the request by its index; the caller knows lines.
        print_error(f"line {jobs[int(index)][0]}: {exc.reason}: {exc.message}")
        return EXIT_FAILED
    for job in submitted:
        if args.json:
            print_json(job_to_json(job))
        else:
            print(job_line(job), flush=True)
    return EXIT_OK


async def _watch(client: AsyncClient, args: argparse.Namespace) -> int:
    if args.after_seq < 0:
        raise UsageError("--after-seq must not be negative")
    return await render_watch(
        client, full_name(args.name), after_seq=args.after_seq, as_json=args.json
    )


async def _get(client: AsyncClient, args: argparse.Namespace) -> int:
    job = await client.get(full_name(args.name))
    if args.json:
        print_json(job_to_json(job))
    else:
        children = await client.list(parent=job.name, page_size=CHILDREN_SHOWN)
        print(job_details(job, children=_counted(children)), flush=True)
    return EXIT_OK


# ``get`` counts a job's children up to this many (one page of ListJobs).
CHILDREN_SHOWN = 1000


def _counted(page: JobPage) -> str:
    """How many children a page of them says the job has: ``12``, or ``1000+``."""
    count = len(page.jobs)
    return f"{count}+" if page.next_page_token else str(count)


async def _list(client: AsyncClient, args: argparse.Namespace) -> int:
    state = JobState(args.state) if args.state else None
    if args.all:
        jobs = [
            job
            async for job in client.iter_jobs(
                page_size=args.page_size,
                page_token=args.page_token,
                state=state,
                type=args.type,
                waiting_code=args.waiting,
                parent=full_name(args.parent) if args.parent else "",
            )
        ]
        next_token = ""
    else:
        page = await client.list(
            page_size=args.page_size,
            page_token=args.page_token,
            state=state,
            type=args.type,
            waiting_code=args.waiting,
            parent=full_name(args.parent) if args.parent else "",
        )
        jobs, next_token = page.jobs, page.next_page_token
    if args.json:
        print_json({"jobs": [job_to_json(j) for j in jobs], "next_page_token": next_token})
        return EXIT_OK
    print_jobs(jobs)
    if next_token:
        print(f"more jobs: --page-token {next_token}", file=sys.stderr)
    return EXIT_OK


async def _cancel(client: AsyncClient, args: argparse.Namespace) -> int:
    job = await client.cancel(full_name(args.name), args.reason)
    if args.json:
        print_json(job_to_json(job))
    else:
        print(job_line(job), flush=True)
    return EXIT_OK


async def _retry(client: AsyncClient, args: argparse.Namespace) -> int:
    job = await client.retry(full_name(args.name), from_stage=args.from_stage)
    if args.json:
        print_json(job_to_json(job))
    else:
        print(job_line(job), flush=True)
    return EXIT_OK
