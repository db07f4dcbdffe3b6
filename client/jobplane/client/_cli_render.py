"""How the client commands show what they got: one line, a description, a table, a
progress bar, or JSON (``--json``) for jobs, their events, domain events and blobs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import sys
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
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

from jobplane.client._cli_run import EXIT_FAILED, EXIT_OK
from jobplane.client.aio import AsyncClient, job_name_of
from jobplane.client.progress import ProgressTracker
from jobplane.client.subscription import SubscribedEvent
from jobplane.events.envelope import Event, envelope_fields, format_timestamp
from jobplane.types import Blob, Job, JobEvent, JobState, Stage

# -- jobs ------------------------------------------------------------------------


def job_line(job: Job) -> str:
    """``jobs/{id} state`` and a note when cancellation is pending."""
    line = f"{job.name} {job.state.value}"
    if job.cancel_requested and not job.state.terminal:
        line += " (cancel requested)"
    return line


def job_details(job: Job, *, children: str = "") -> str:
    """A multi-line description of ``job`` for ``get``; ``children``: how many it has."""
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
    if job.deadline:
        rows.append(("deadline", _time(job.deadline)))
    if job.concurrency_key:
        rows.append(("concurrency", f"{job.concurrency_key} (limit {job.concurrency_limit})"))
    if job.after:
        rows.append(("after", f"{', '.join(job.after)} (on failure: {job.after_failure})"))
    if job.parent:
        rows.append(("parent", job.parent))
    if job.fan_out is not None:
        fan = job.fan_out
        failed = f", {fan.failed} did not succeed" if fan.failed else ""
        rows.append(
            ("fan-out", f"stage {fan.stage}: {fan.ended} of {fan.children} children ended{failed}")
        )
    if children and children != "0":
        rows.append(("children", f"{children} (jobplane list --parent {job.name})"))
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


def print_jobs(jobs: list[Job]) -> None:
    """A table of ``jobs`` on a terminal, tab-separated lines otherwise."""
    if sys.stdout.isatty():
        table = Table("NAME", "TYPE", "STATE", "PROGRESS", "ATTEMPT", "CREATED", box=None)
        for job in jobs:
            table.add_row(
                job.name,
                escape(job.type),
                state_text(job),
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


# -- watching --------------------------------------------------------------------


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


# -- domain events and blobs -----------------------------------------------------


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


def blob_line(blob: Blob) -> str:
    """One line: name, size and content type."""
    return f"{blob.name}  {blob.size}  {blob.content_type or '-'}"


def blob_to_json(blob: Blob) -> dict[str, Any]:
    """``blob`` as a JSON-ready dict."""
    result: dict[str, Any] = _jsonable(dataclasses.asdict(blob))
    return result


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


def state_text(job: Job) -> str:
    """The STATE cell of ``list`` on a terminal (rich markup): coloured, with a waiting code."""
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
