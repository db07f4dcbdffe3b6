"""``jobplane ingest FILE...``: upload each file, submit ``ingest.file``, follow its stages.

Kept apart from the other client commands (jobplane.client.cli registers it):
it needs only the SDK, never the handlers or Qdrant.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TaskProgressColumn, TextColumn

from jobplane.client.aio import AsyncClient
from jobplane.client.cli import (
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    command,
    event_line,
    event_to_json,
    job_to_json,
    print_json,
)
from jobplane.client.progress import ProgressTracker
from jobplane.types import EventType, Job, JobEvent, JobState

PIPELINE = "ingest.file"
#: What each stage counts, in the data of its progress events.
_COUNTS = {"parse": "pages", "chunk": "chunks", "embed": "vectors", "index": "points"}


def register(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
    parents: Sequence[argparse.ArgumentParser],
) -> None:
    """Add ``ingest`` to the client commands."""
    ingest = subparsers.add_parser(
        "ingest",
        parents=list(parents),
        help="upload files and ingest them into the vector index",
        description="Upload each FILE as a blob, submit the ingest.file pipeline for it "
        "(parse, chunk, embed, index into Qdrant), and show each stage's progress until "
        "they end. A file is known by its path as given (normalised): ingesting a path "
        "again replaces its points. Exit code 0 when every file was ingested.",
    )
    ingest.add_argument("files", nargs="+", metavar="FILE", help="text, Markdown, HTML or PDF")
    ingest.add_argument(
        "--collection", metavar="C", help="Qdrant collection (default: the pipeline's)"
    )
    ingest.add_argument("--chunk-size", metavar="CHARS", type=int, help="default 1000")
    ingest.add_argument("--chunk-overlap", metavar="CHARS", type=int, help="default 200")
    ingest.add_argument(
        "--no-wait", action="store_true", help="print the jobs and exit; follow them with watch"
    )
    ingest.set_defaults(func=command(_ingest))


@dataclass
class _Submitted:
    file: str
    job: Job


def file_name(path: str) -> str:
    """The name a path is ingested under: the path as given, normalised (``./a`` is ``a``)."""
    return os.path.normpath(path)


async def _ingest(client: AsyncClient, args: argparse.Namespace) -> int:
    paths = [Path(f) for f in args.files]
    for path in paths:
        if not path.is_file():
            raise UsageError(f"{path}: no such file")
    options: dict[str, Any] = {}
    if args.collection:
        options["collection"] = args.collection
    if args.chunk_size is not None:
        options["chunk_size"] = args.chunk_size
    if args.chunk_overlap is not None:
        options["chunk_overlap"] = args.chunk_overlap
    mode = "json" if args.json else "live" if sys.stdout.isatty() else "lines"
    ok = await ingest_files(client, paths, options, mode=mode, wait=not args.no_wait)
    return EXIT_OK if ok else EXIT_FAILED


async def ingest_files(
    client: AsyncClient,
    paths: Sequence[Path],
    options: dict[str, Any] | None = None,
    *,
    mode: str = "live",
    wait: bool = True,
) -> bool:
    """Upload and submit each file, then follow them until they end; True when all succeeded.

    ``mode`` is how they are shown: ``live`` (a bar per file and a line per stage),
    ``lines`` (a line per event) or ``json`` (an object per line).
    """
    submitted = []
    for path in paths:
        blob = await client.upload(path)
        name = file_name(str(path))
        job = await client.submit(PIPELINE, {"blob": blob.name, "file": name, **(options or {})})
        submitted.append(_Submitted(name, job))
        if mode == "json":
            print_json({"file": name, "blob": blob.name, "job": job.name})
        elif not wait or mode == "lines":
            print(f"{name}: {blob.name} ({blob.size} bytes) -> {job.name}", flush=True)
    if not wait:
        return True
    if mode == "json":
        await asyncio.gather(*(_json_events(client, s) for s in submitted))
    elif mode == "live":
        await _live(client, submitted)
    else:
        await asyncio.gather(*(_lines(client, s) for s in submitted))
    ok = True
    for item in submitted:
        job = await client.get(item.job.name)
        ok = ok and job.state is JobState.SUCCEEDED
        if mode == "json":
            print_json({"file": item.file, **job_to_json(job)})
        else:
            print(summary(item.file, job), flush=True)
    return ok


def summary(file: str, job: Job) -> str:
    """One line on how a file's ingestion ended."""
    result = job.result or {}
    if job.state is JobState.SUCCEEDED:
        return (
            f"{file}: {result.get('pages', 0)} page(s), {result.get('chunks', 0)} chunks, "
            f"{result.get('vectors', 0)} vectors, {result.get('points', 0)} points "
            f"in {result.get('collection', '?')} ({job.name})"
        )
    error = f" {job.error.code}: {job.error.message}" if job.error else ""
    return f"{file}: {job.state.value}{error} ({job.name})"


async def _json_events(client: AsyncClient, item: _Submitted) -> None:
    async with contextlib.aclosing(client.watch(item.job.name)) as events:
        async for event in events:
            print_json({"file": item.file, **event_to_json(event)})


async def _lines(client: AsyncClient, item: _Submitted) -> None:
    async with contextlib.aclosing(client.watch(item.job.name)) as events:
        async for event in events:
            print(f"{item.file}  {event_line(event)}", flush=True)


async def _live(client: AsyncClient, submitted: list[_Submitted]) -> None:
    """A bar per file (the job's weighted progress) and a line per stage with its counts."""
    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn())
    with Progress(*columns) as progress:
        await asyncio.gather(*(_follow(client, progress, item) for item in submitted))


async def _follow(client: AsyncClient, progress: Progress, item: _Submitted) -> None:
    job_task = progress.add_task(f"[bold]{escape(item.file)}[/bold]", total=1.0)
    # The stage rows under the file's, at once: the files' rows stay in groups.
    stages: dict[str, tuple[TaskID, str]] = {
        stage.name: (
            progress.add_task(f"  {escape(stage.name)}  [dim]waiting[/dim]", total=None),
            "",
        )
        for stage in item.job.stages
    }
    tracker = ProgressTracker()
    async with contextlib.aclosing(client.watch(item.job.name)) as events:
        async for event in events:
            position = tracker.update(event)
            if position is not None:
                progress.update(job_task, completed=position)
            _stage_row(progress, stages, event)
    job = await client.get(item.job.name)
    progress.update(job_task, description=f"[bold]{escape(item.file)}[/bold] {job.state.value}")


def _stage_row(progress: Progress, stages: dict[str, tuple[TaskID, str]], event: JobEvent) -> None:
    stage = event.stage or str(event.data.get("stage", ""))
    if not stage:
        return
    task, counts = stages.get(stage) or (progress.add_task(f"  {escape(stage)}", total=None), "")
    counted = _COUNTS.get(stage)
    if counted is not None and counted in event.data:
        counts = f"  {event.data[counted]} {counted}"
    elif "children" in event.data:  # a fan-out stage: each child's end (the embed batches)
        counts = f"  {event.data.get('ended', 0)}/{event.data['children']} batches"
    stages[stage] = (task, counts)
    label = f"  {escape(stage)}{counts}"
    if event.type in (EventType.STAGE_SUCCEEDED, EventType.SUCCEEDED):
        progress.update(task, description=f"{label}  done", total=1.0, completed=1.0)
    elif event.type is EventType.FAILED:
        progress.update(task, description=f"{label}  [red]failed[/red]")
    elif event.message:
        progress.update(task, description=f"{label}  [dim]{escape(event.message)}[/dim]")
