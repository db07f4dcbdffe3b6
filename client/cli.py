"""The client commands of ``jobplane``: submit, watch, get, list, cancel, retry, events.

:func:`register` adds them to the top-level parser. Each command talks to the
server named by ``--address`` / ``JOBPLANE_ADDRESS`` with the key from
``--api-key`` / ``JOBPLANE_API_KEY`` (over TLS with ``--tls`` and its
options, or their ``JOBPLANE_TLS*`` variables), and returns the process exit code: 0 on
success, 1 when the call failed or the watched job did not succeed, 2 for bad
usage (a missing API key, a payload that is not a JSON object, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import enum
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from jobplane.client.aio import AsyncClient, job_name_of
from jobplane.client.batch import JobSpec
from jobplane.client.joblines import BadLine, parse_job_lines
from jobplane.client.progress import ProgressTracker
from jobplane.client.subscription import SubscribedEvent
from jobplane.client.tls import ENV_CA, ENV_CLIENT_CERT, ENV_CLIENT_KEY, ENV_SERVER_NAME, ENV_SWITCH
from jobplane.errors import JobplaneError
from jobplane.events.envelope import Event, envelope_fields, format_timestamp
from jobplane.types import Blob, Job, JobEvent, JobState, Stage

Command = Callable[[AsyncClient, argparse.Namespace], Awaitable[int]]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """A command line the command cannot act on; exit code 2."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the client commands to ``subparsers``; each sets ``func`` (args -> exit code)."""
    connection = argparse.ArgumentParser(add_help=False)
    group = connection.add_argument_group("connection")
    group.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="server address (default: $JOBPLANE_ADDRESS, else 127.0.0.1:50051)",
    )
    key = group.add_mutually_exclusive_group()
    key.add_argument("--api-key", metavar="KEY", help="API key (default: $JOBPLANE_API_KEY)")
    key.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="read the API key from PATH, e.g. a mounted secret ('-' for stdin)",
    )
    group.add_argument(
        "--call-timeout",
        metavar="SECONDS",
        type=float,
        default=10.0,
        help="give up on a call (and its repeats while the server is unreachable) after "
        "this long (default 10)",
    )
    group.add_argument(
        "--tls",
        action="store_true",
        default=None,
        help="connect with TLS (default: $JOBPLANE_TLS; implied by the options below)",
    )
    group.add_argument(
        "--tls-ca", metavar="PEM", help="CA that signed the server's certificate ($JOBPLANE_TLS_CA)"
    )
    group.add_argument(
        "--tls-client-cert",
        metavar="PEM",
        help="certificate for mutual TLS ($JOBPLANE_TLS_CLIENT_CERT)",
    )
    group.add_argument(
        "--tls-client-key",
        metavar="PEM",
        help="key of --tls-client-cert ($JOBPLANE_TLS_CLIENT_KEY)",
    )
    group.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="name in the server's certificate, if not the host of --address",
    )
    json_flag = argparse.ArgumentParser(add_help=False)
    json_flag.add_argument("--json", action="store_true", help="print JSON instead of text")
    parents = [connection, json_flag]

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
    submit.add_argument("--correlation-id", metavar="ID", default="")
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
    submit.add_argument("--watch", action="store_true", help="follow the job until it ends")
    submit.set_defaults(func=command(_submit))

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

    events = subparsers.add_parser(
        "events",
        help="publish domain events, or follow them",
        description="Domain events: facts that happened, such as artifact.created, "
        "that other services react to (docs/events.md).",
    ).add_subparsers(dest="events", required=True, metavar="COMMAND")
    publish = events.add_parser(
        "publish",
        parents=parents,
        help="publish an event and print it as stored",
        description="Publish a domain event of your tenant and print it as the server stored "
        "it. Publishing is idempotent on the event id: run it again with the same --id and the "
        "same event to get the stored one back (nothing new is written); with a different event "
        "it fails with EVENT_ID_REUSED.",
    )
    publish.add_argument(
        "event_type", metavar="TYPE", help="lowercase dotted words, e.g. artifact.created"
    )
    event_payload = publish.add_mutually_exclusive_group()
    event_payload.add_argument(
        "--payload", metavar="JSON", help="what the fact says, a JSON object (default {})"
    )
    event_payload.add_argument(
        "--payload-file", metavar="PATH", help="read the JSON payload from PATH ('-' for stdin)"
    )
    publish.add_argument(
        "--id",
        metavar="UUID",
        dest="event_id",
        help="the event id, the idempotency key (default: a new UUID)",
    )
    publish.add_argument(
        "--correlation-id",
        metavar="ID",
        help="the chain of work it belongs to (default: the event starts one, its own id)",
    )
    publish.add_argument(
        "--causation-id", metavar="ID", help="what caused it, usually the causing event's id"
    )
    publish.add_argument(
        "--project", metavar="PROJECT", dest="project_id", help="the project it belongs to"
    )
    publish.set_defaults(func=command(_events_publish))

    tail = events.add_parser(
        "tail",
        parents=parents,
        help="follow events until Ctrl-C",
        description="Print your tenant's events whose type matches any PATTERN, in commit "
        "order, one line each (time, type, id, payload), until Ctrl-C; --json prints one JSON "
        "object per event with its cursor. Lost connections are resumed where they broke off, "
        "with no gap and no repeat. On Ctrl-C the cursor of the last event printed goes to "
        "stderr: pass it to --after to go on from there.",
    )
    tail.add_argument(
        "patterns",
        metavar="PATTERN",
        nargs="+",
        help="event types in topic syntax: a word '*' matches one word, '#' any number "
        "(e.g. 'job.*', 'artifact.#', '#' for all)",
    )
    where = tail.add_mutually_exclusive_group()
    where.add_argument(
        "--after", metavar="CURSOR", help="start right after the event with this cursor"
    )
    where.add_argument(
        "--from-start",
        dest="start",
        action="store_const",
        const="earliest",
        help="start with the oldest event kept",
    )
    where.add_argument(
        "--latest",
        dest="start",
        action="store_const",
        const="latest",
        help="show only events committed from now on (the default)",
    )
    tail.set_defaults(func=command(_events_tail), start="latest")
    _register_ingest(subparsers, parents)


def _register_ingest(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: list[argparse.ArgumentParser],
) -> None:
    """``jobplane ingest`` (jobplane.contrib.ingest.cli: needs only the SDK)."""
    from jobplane.contrib.ingest.cli import register as register_ingest

    register_ingest(subparsers, parents)

    blobs = subparsers.add_parser(
        "blobs",
        help="store, fetch, list and delete blobs",
        description="Blobs: files stored by their SHA-256 (blobs/<sha256>), for job payloads "
        "to reference by name. The same bytes are the same blob, stored once.",
    ).add_subparsers(dest="blobs", required=True, metavar="COMMAND")
    put = blobs.add_parser(
        "put",
        parents=parents,
        help="upload a file and print its name",
        description="Upload "
        "FILE ('-' for stdin) and print the blob's name (blobs/<sha256>); --json prints it all.",
    )
    put.add_argument("file", metavar="FILE", help="the file to upload, '-' for stdin")
    put.add_argument("--content-type", metavar="TYPE", help="e.g. application/pdf")
    put.set_defaults(func=command(_blobs_put))
    get_blob = blobs.add_parser(
        "get",
        parents=parents,
        help="download a blob",
        description="Write the blob to FILE "
        "(whole or not at all), or to stdout without -o. The bytes are checked against the name.",
    )
    get_blob.add_argument("name", metavar="NAME", help="blobs/<sha256>, or just the sha256")
    get_blob.add_argument("-o", "--output", metavar="FILE", help="write here (default stdout)")
    get_blob.set_defaults(func=command(_blobs_get))
    list_blobs = blobs.add_parser("list", parents=parents, help="list your blobs")
    list_blobs.set_defaults(func=command(_blobs_list))
    delete = blobs.add_parser(
        "delete", parents=parents, help="delete a blob (refused while a job references it)"
    )
    delete.add_argument("name", metavar="NAME", help="blobs/<sha256>, or just the sha256")
    delete.set_defaults(func=command(_blobs_delete))


def command(fn: Command) -> Callable[[argparse.Namespace], int]:
    """Wrap ``fn`` as an argparse ``func``: client from flags/env, errors as exit codes."""

    def run(args: argparse.Namespace) -> int:
        try:
            api_key = _read_key_file(args.api_key_file) or args.api_key
            if args.api_key_file is not None and not (api_key or "").strip():
                _error(f"no API key in {args.api_key_file}")
                return EXIT_USAGE
            client = AsyncClient.from_env(
                address=args.address,
                api_key=api_key,
                timeout=args.call_timeout,
                env=_with_tls_flags(args),
            )
        except OSError as exc:
            _error(f"cannot read {exc.filename}: {exc.strerror or exc}")
            return EXIT_USAGE
        except (ValueError, JobplaneError) as exc:
            # A malformed key or setting: one line, not gRPC's traceback.
            _error(str(exc))
            return EXIT_USAGE
        if client.api_key is None:
            _error("no API key: set JOBPLANE_API_KEY or pass --api-key")
            return EXIT_USAGE
        try:
            return asyncio.run(_with_client(client, fn, args))
        except UsageError as exc:
            _error(str(exc))
            return EXIT_USAGE
        except JobplaneError as exc:
            _error(f"{exc.reason}: {exc.message}")
            return EXIT_FAILED
        except BrokenPipeError:
            # The reader went away (``| head``); point stdout at /dev/null so
            # the flush at exit does not fail a second time.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return EXIT_FAILED

    return run


def _read_key_file(path: str | None) -> str | None:
    """The key in ``path`` ('-': stdin), or None without a path; the client strips it."""
    if path is None:
        return None
    if path == "-":
        return sys.stdin.read()
    return Path(path).read_text(encoding="utf-8", errors="replace")


def _with_tls_flags(args: argparse.Namespace) -> dict[str, str]:
    """The environment with each TLS flag given in place of its variable."""
    flags = {
        ENV_SWITCH: "1" if args.tls else None,
        ENV_CA: args.tls_ca,
        ENV_CLIENT_CERT: args.tls_client_cert,
        ENV_CLIENT_KEY: args.tls_client_key,
        ENV_SERVER_NAME: args.tls_server_name,
    }
    return {**os.environ, **{name: value for name, value in flags.items() if value}}


async def _with_client(client: AsyncClient, fn: Command, args: argparse.Namespace) -> int:
    async with client:
        return await fn(client, args)


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


# -- commands ----------------------------------------------------------------


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
        )
        if value
    ]
    if given:
        raise UsageError(f"--from-jsonl takes each job's fields from its line, not {given[0]}")
    path = args.from_jsonl
    jobs = read_job_lines(path)
    if not jobs:
        raise UsageError(f"{path} holds no job")
    try:
        submitted = await client.submit_many(spec for _, spec in jobs)
    except JobplaneError as exc:
        index = exc.metadata.get("index")
        if index is None or not index.isdigit() or int(index) >= len(jobs):
            raise
        # The server names the request by its index; the caller knows lines.
        _error(f"line {jobs[int(index)][0]}: {exc.reason}: {exc.message}")
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
        print(job_details(job), flush=True)
    return EXIT_OK


async def _list(client: AsyncClient, args: argparse.Namespace) -> int:
    state = JobState(args.state) if args.state else None
    if args.all:
        jobs = [
            job
            async for job in client.iter_jobs(
                page_size=args.page_size, page_token=args.page_token, state=state, type=args.type
            )
        ]
        next_token = ""
    else:
        page = await client.list(
            page_size=args.page_size, page_token=args.page_token, state=state, type=args.type
        )
        jobs, next_token = page.jobs, page.next_page_token
    if args.json:
        print_json({"jobs": [job_to_json(j) for j in jobs], "next_page_token": next_token})
        return EXIT_OK
    if sys.stdout.isatty():
        table = Table("NAME", "TYPE", "STATE", "PROGRESS", "ATTEMPT", "CREATED", box=None)
        for job in jobs:
            table.add_row(
                job.name,
                escape(job.type),
                _state_text(job),
                f"{job.progress:.0%}",
                f"{job.attempts_used}/{job.max_attempts}",
                _time(job.create_time),
            )
        Console().print(table)
    else:
        for job in jobs:
            print(
                "\t".join(
                    (
                        job.name,
                        job.type,
                        job.state.value,
                        f"{job.progress:.0%}",
                        f"{job.attempts_used}/{job.max_attempts}",
                        _time(job.create_time),
                    )
                )
            )
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


async def _events_publish(client: AsyncClient, args: argparse.Namespace) -> int:
    payload = parse_payload(args.payload, args.payload_file)
    event = await client.publish(
        args.event_type,
        payload,
        event_id=args.event_id,
        project_id=args.project_id,
        correlation_id=args.correlation_id,
        causation_id=args.causation_id,
    )
    if args.json:
        print_json(domain_event_to_json(event))
    else:
        print(domain_event_details(event), flush=True)
    return EXIT_OK


async def _events_tail(client: AsyncClient, args: argparse.Namespace) -> int:
    subscription = client.subscribe(args.patterns, after_cursor=args.after, start=args.start)
    try:
        async with subscription:
            async for item in subscription:
                if args.json:
                    print_json(subscribed_to_json(item))
                else:
                    print(domain_event_line(item.event), flush=True)
    finally:
        # Ctrl-C cancels this task: say where to go on from, on stderr so
        # that stdout stays one line (or one JSON object) per event.
        if subscription.cursor:
            print(f"resume with: --after {subscription.cursor}", file=sys.stderr, flush=True)
    return EXIT_OK


# -- watching ----------------------------------------------------------------


def blob_name_of(raw: str) -> str:
    """``blobs/{sha256}`` for a name or a bare digest."""
    return raw if "/" in raw else f"blobs/{raw}"


def blob_line(blob: Blob) -> str:
    """One line: name, size and content type."""
    return f"{blob.name}  {blob.size}  {blob.content_type or '-'}"


def blob_to_json(blob: Blob) -> dict[str, Any]:
    """``blob`` as a JSON-ready dict."""
    result: dict[str, Any] = _jsonable(dataclasses.asdict(blob))
    return result


async def _blobs_put(client: AsyncClient, args: argparse.Namespace) -> int:
    source: Any = sys.stdin.buffer if args.file == "-" else Path(args.file)
    if isinstance(source, Path) and not source.is_file():
        raise UsageError(f"no file {args.file}")
    blob = await client.upload(source, content_type=args.content_type)
    if args.json:
        print_json(blob_to_json(blob))
    else:
        print(blob.name, flush=True)
    return EXIT_OK


async def _blobs_get(client: AsyncClient, args: argparse.Namespace) -> int:
    name = blob_name_of(args.name)
    if args.output:
        blob = await client.download(name, Path(args.output))
        if args.json:
            print_json(blob_to_json(blob))
    else:
        await client.download(name, sys.stdout.buffer)
        sys.stdout.buffer.flush()
    return EXIT_OK


async def _blobs_list(client: AsyncClient, args: argparse.Namespace) -> int:
    async for blob in client.iter_blobs():
        if args.json:
            print_json(blob_to_json(blob))
        else:
            print(blob_line(blob), flush=True)
    return EXIT_OK


async def _blobs_delete(client: AsyncClient, args: argparse.Namespace) -> int:
    await client.delete_blob(blob_name_of(args.name))
    return EXIT_OK


async def render_watch(
    client: AsyncClient, name: str | Job, *, after_seq: int = 0, as_json: bool = False
) -> int:
    """Show a job's events until it ends, then its outcome; the exit code.

    A live progress bar on a terminal, one line per event otherwise, one JSON
    object per event with ``as_json`` (then the final job as JSON). Returns 0
    when the job SUCCEEDED, 1 otherwise.
    """
    job_name = job_name_of(name)
    async with contextlib.aclosing(client.watch(job_name, after_seq)) as events:
        if as_json:
            async for event in events:
                print_json(event_to_json(event))
        elif sys.stdout.isatty():
            await _progress_bar(job_name, events)
        else:
            async for event in events:
                print(event_line(event), flush=True)
    job = await client.get(job_name)
    if as_json:
        print_json(job_to_json(job))
    else:
        print(outcome(job), flush=True)
    return EXIT_OK if job.state is JobState.SUCCEEDED else EXIT_FAILED


async def _progress_bar(job_name: str, events: AsyncIterator[JobEvent]) -> None:
    with Progress(
        SpinnerColumn(finished_text="•"),
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
    ) as progress:
        task: TaskID = progress.add_task(escape(job_name), total=1.0)
        tracker = ProgressTracker()
        async for event in events:
            progress.update(task, description=describe(event))
            completed = tracker.update(event)
            if completed is not None:
                progress.update(task, completed=completed)
        progress.stop_task(task)


def describe(event: JobEvent) -> str:
    """The progress bar label of ``event`` (rich markup)."""
    detail = event.message or event.type.value
    text = f"[bold]{event.state.value}[/bold]"
    if detail != event.state.value:
        text += f" {escape(detail)}"
    if event.attempt > 1:
        text += f" [dim](attempt {event.attempt})[/dim]"
    return text


def event_line(event: JobEvent) -> str:
    """One plain-text line for ``event``."""
    line = (
        f"{_time(event.event_time)}  #{event.seq:<4} {event.type.value:<16} "
        f"{event.state.value:<9} {event.progress:>4.0%}"
    )
    if event.stage:
        line += f"  [{event.stage}]"
    if event.message:
        line += f"  {event.message}"
    return line


def outcome(job: Job) -> str:
    """The last words on a job: its state, then its result or error."""
    lines = [job_line(job)]
    if job.result is not None:
        lines.append(f"result: {json.dumps(job.result, sort_keys=True)}")
    if job.error is not None:
        lines.append(f"error: {job.error.code}: {job.error.message}")
    return "\n".join(lines)


# -- formatting --------------------------------------------------------------


def job_line(job: Job) -> str:
    """``jobs/{id} state`` and a note when cancellation is pending."""
    line = f"{job.name} {job.state.value}"
    if job.cancel_requested and not job.state.terminal:
        line += " (cancel requested)"
    return line


def job_details(job: Job) -> str:
    """A multi-line description of ``job`` for ``get``."""
    rows: list[tuple[str, str]] = [
        ("name", job.name),
        ("type", job.type),
        ("state", job.state.value + (" (cancel requested)" if job.cancel_requested else "")),
        ("progress", f"{job.progress:.0%} {job.progress_message}".rstrip()),
        ("attempts", attempts_text(job)),
        ("created", _time(job.create_time)),
        ("updated", _time(job.update_time)),
    ]
    if job.start_time:
        rows.append(("started", _time(job.start_time)))
    if job.end_time:
        rows.append(("ended", _time(job.end_time)))
    if job.next_attempt_time:
        rows.append(("next attempt", _time(job.next_attempt_time)))
    if job.waiting_reason or job.waiting_code:
        rows.append(("waiting", ": ".join(filter(None, (job.waiting_code, job.waiting_reason)))))
    rows.append(("request id", job.request_id))
    if job.correlation_id:
        rows.append(("correlation id", job.correlation_id))
    if job.labels:
        rows.append(("labels", ", ".join(f"{k}={v}" for k, v in sorted(job.labels.items()))))
    rows.append(("payload", json.dumps(job.payload, sort_keys=True)))
    if job.result is not None:
        rows.append(("result", json.dumps(job.result, sort_keys=True)))
    if job.error is not None:
        # A finished job is not retried, whatever its last error was.
        retrying = " (will be retried)" if job.error.retryable and not job.state.terminal else ""
        rows.append(("error", f"{job.error.code}: {job.error.message}{retrying}"))
    rows.append(("timeout", f"{job.timeout.total_seconds():g}s per attempt"))
    rows.append(("last seq", str(job.last_seq)))
    if job.stages:
        version = f" {job.pipeline_version}" if job.pipeline_version else ""
        rows.append(("pipeline", f"{job.type}{version}, at stage {job.stage}"))
        for n, stage in enumerate(job.stages, start=1):
            rows.append((f"stage {n}", stage_text(stage, job)))
    width = max(len(k) for k, _ in rows) + 1
    return "\n".join(f"{k + ':':<{width}} {v}" for k, v in rows)


def stage_text(stage: Stage, job: Job | None = None) -> str:
    """One stage of a pipeline job on one line: name, state, attempts, time, error."""
    version = f"@{stage.version}" if stage.version else ""
    text = f"{stage.name}{version} ({stage.type}) {stage.state.value}"
    if stage.attempts:
        text += f", {stage_attempts_text(stage, job)}"
    if stage.start_time and stage.end_time:
        text += f", {(stage.end_time - stage.start_time).total_seconds():.3f}s"
    if stage.error is not None:
        text += f": {stage.error.code}: {stage.error.message}"
    return text


def attempts_text(job: Job) -> str:
    """``used of max``, and every attempt ever started when RetryJob (or a refund) made
    them differ: never "attempt 4 of 3".

    A pipeline job's ``attempts_used`` and ``max_attempts`` are its current
    stage's, while ``attempt`` counts the attempts of all its stages: shown
    side by side they would be two different counts of one thing. Its row
    says only the job's own count; each stage's row has the stage's.
    """
    if job.stages:
        return f"{job.attempt} started in all (each stage's own count below)"
    text = f"{job.attempts_used} of {job.max_attempts} used"
    if job.attempt != job.attempts_used:
        text += f" ({job.attempt} started in all)"
    return text


def stage_attempts_text(stage: Stage, job: Job | None = None) -> str:
    """A stage's attempts: ``n of max``, never "5 of 3" once RetryJob ran it again.

    The budget (``max_attempts``) starts over at each retry, and the stage's
    ``attempts`` never does; the job's ``attempts_used`` is what the current
    stage used of the budget since the last retry.
    """
    current = job is not None and job.stage == stage.name
    if current and job is not None and job.attempts_used != stage.attempts:
        return (
            f"{stage.attempts} attempts in all, "
            f"{job.attempts_used} of {stage.max_attempts} since the last retry"
        )
    if stage.attempts > stage.max_attempts:
        return f"{stage.attempts} attempts in all, at most {stage.max_attempts} between retries"
    return f"{stage.attempts} of {stage.max_attempts} attempts"


def job_to_json(job: Job) -> dict[str, Any]:
    """``job`` as a JSON-ready dict (enums by value, times in ISO 8601)."""
    result: dict[str, Any] = _jsonable(dataclasses.asdict(job))
    return result


def event_to_json(event: JobEvent) -> dict[str, Any]:
    """``event`` as a JSON-ready dict."""
    return {
        "name": event.name,
        "seq": event.seq,
        "type": event.type.value,
        "state": event.state.value,
        "progress": event.progress,
        "message": event.message,
        "data": event.data,
        "event_time": event.event_time.isoformat(),
        "attempt": event.attempt,
        "stage": event.stage,
    }


def domain_event_to_json(event: Event) -> dict[str, Any]:
    """A domain event as a JSON-ready dict: the envelope's keys (docs/events.md)."""
    return envelope_fields(event)


def subscribed_to_json(item: SubscribedEvent) -> dict[str, Any]:
    """A subscribed event as a JSON-ready dict: the envelope's keys and ``cursor``."""
    return {**domain_event_to_json(item.event), "cursor": item.cursor}


def domain_event_line(event: Event) -> str:
    """One line for a domain event: time, type, id, compact payload."""
    return (
        f"{format_timestamp(event.timestamp)}  {event.event_type}  {event.event_id}  "
        f"{_compact(event.payload)}"
    )


def domain_event_details(event: Event) -> str:
    """A multi-line description of a domain event for ``events publish``."""
    rows: list[tuple[str, str]] = [
        ("event id", str(event.event_id)),
        ("type", event.event_type),
        ("time", format_timestamp(event.timestamp)),
    ]
    if event.project_id is not None:
        rows.append(("project", event.project_id))
    rows.append(("correlation id", event.correlation_id))
    if event.causation_id is not None:
        rows.append(("causation id", event.causation_id))
    rows.append(("payload", _compact(event.payload)))
    width = max(len(k) for k, _ in rows) + 1
    return "\n".join(f"{k + ':':<{width}} {v}" for k, v in rows)


def _compact(value: dict[str, Any]) -> str:
    # ensure_ascii: no payload string may steer the terminal (C1 controls,
    # bidi overrides) or break the line; \u escapes keep each event one line.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def print_json(value: dict[str, Any]) -> None:
    """``value`` as one line of JSON on stdout."""
    print(json.dumps(value, sort_keys=True), flush=True)


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _state_text(job: Job) -> str:
    style = {
        JobState.SUCCEEDED: "green",
        JobState.FAILED: "red",
        JobState.CANCELLED: "yellow",
        JobState.RUNNING: "cyan",
    }.get(job.state)
    text = f"[{style}]{job.state.value}[/{style}]" if style else job.state.value
    # Why a QUEUED job does not start, by its code: `get` shows the message and the fix.
    return f"{text} [dim]({escape(job.waiting_code)})[/dim]" if job.waiting_code else text


def _time(value: datetime) -> str:
    return value.isoformat(timespec="seconds")


# -- parsing -----------------------------------------------------------------


def full_name(raw: str) -> str:
    """``jobs/{id}`` for a name or a bare id."""
    return raw if "/" in raw else f"jobs/{raw}"


def parse_payload(text: str | None, path: str | None) -> dict[str, Any]:
    """The payload of ``--payload`` or ``--payload-file``; must be a JSON object."""
    source = "--payload"
    if path is not None:
        source = "--payload-file"
        try:
            text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{source} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise UsageError(f"{source} must be a JSON object, got {_JSON_KINDS[type(value)]}")
    return value


_JSON_KINDS: dict[type, str] = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def read_job_lines(path: str) -> list[tuple[int, JobSpec]]:
    """The jobs of ``--from-jsonl PATH`` ('-': stdin), each with its line number."""
    try:
        if path == "-":
            return parse_job_lines(sys.stdin)
        with Path(path).open(encoding="utf-8") as lines:
            return parse_job_lines(lines)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is not UTF-8 text: {exc.reason}") from exc
    except BadLine as exc:
        raise UsageError(str(exc)) from exc


def parse_labels(items: list[str]) -> dict[str, str]:
    """``--label KEY=VALUE`` options as a dict."""
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--label must look like KEY=VALUE, got {item!r}")
        labels[key] = value
    return labels
