"""Server-sent event streams: one job, a page of jobs, the tenant's domain events.

Every job stream is a watcher of the server's :class:`~jobplane.server.feeds.FeedHub`,
exactly as a WatchJob call is: a page watching 100 jobs costs the database
what 100 WatchJob streams cost (the feeds' batched reads), and nothing per
browser beyond that. A stream holds one of its tenant's stream slots (the
limit WatchJob and SubscribeEvents count against), re-checks its session's
key every ``recheck`` seconds (a revoked key ends it) and sends a comment
line as often, so that proxies keep it open and a closed browser is noticed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from jobplane.errors import JobNotFound, JobplaneError, Unavailable
from jobplane.events.envelope import envelope_fields
from jobplane.server.status import error_for
from jobplane.tasks import cancel_and_wait
from jobplane.types import JobEvent

T = TypeVar("T")

#: Events of many jobs sent in one frame at most.
FRAME_EVENTS = 100
#: Seconds between a stream's keep-alive comments and key checks.
RECHECK_SECONDS = 15.0


def event_json(event: JobEvent) -> dict[str, Any]:
    """What a page needs of one job event."""
    return {
        "job": event.name.partition("/")[2],
        "seq": event.seq,
        "type": event.type.value,
        "state": event.state.value,
        "progress": round(event.progress, 4),
        "message": event.message,
        "time": event.event_time.isoformat(),
        "attempt": event.attempt,
        "stage": event.stage,
    }


class EventStream:
    """An open ``text/event-stream`` response."""

    def __init__(self, response: web.StreamResponse) -> None:
        self._response = response

    @property
    def response(self) -> web.StreamResponse:
        """The prepared response (what the handler returns)."""
        return self._response

    @classmethod
    async def open(cls, request: web.Request) -> EventStream:
        """Start the response (its status and headers go out now)."""
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-store",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        return cls(response)

    async def send(self, kind: str, data: Any, *, event_id: str | None = None) -> None:
        """One event (``data`` as JSON on one line)."""
        await self._response.write(frame(kind, data, event_id=event_id))

    async def send_raw(self, chunk: bytes) -> None:
        """Frames made by :func:`frame`, at once."""
        await self._response.write(chunk)

    async def comment(self) -> None:
        """A keep-alive line the browser ignores."""
        await self._response.write(b": ping\n\n")


def frame(kind: str, data: Any, *, event_id: str | None = None) -> bytes:
    """One SSE frame."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    body = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"{head}event: {kind}\ndata: {body}\n\n".encode()


class Merged:
    """Items of many async iterators into one queue, each pumped by a task of its own."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    def add(self, tag: str, source: AsyncIterator[Any]) -> None:
        """Pump ``source``; its items arrive as (tag, item), its end as (tag, _END) or an error."""
        self._tasks.append(asyncio.create_task(self._pump(tag, source)))

    async def _pump(self, tag: str, source: AsyncIterator[Any]) -> None:
        # Whatever ends the source, a terminal item is queued: the stream
        # ends (the browser's EventSource reconnects) instead of waiting on
        # a pump that is gone. A lost database is UNAVAILABLE, as for the API.
        try:
            async for item in source:
                self.queue.put_nowait((tag, item))
        except Exception as exc:
            self.queue.put_nowait((tag, error_for(exc, "dashboard.live")))
            return
        self.queue.put_nowait((tag, END))

    async def close(self) -> None:
        """Stop every pump (their sources are closed by the cancellation)."""
        for task in self._tasks:
            await cancel_and_wait(task)
        self._tasks.clear()


END = object()


async def next_batch(
    queue: asyncio.Queue[tuple[str, Any]], timeout: float
) -> list[tuple[str, Any]]:
    """Whatever is queued (waiting up to ``timeout`` for the first item); [] on timeout."""
    try:
        async with asyncio.timeout(timeout):
            first = await queue.get()
    except TimeoutError:
        return []
    batch = [first]
    while not queue.empty():
        batch.append(queue.get_nowait())
    return batch


async def serve_job(
    stream: EventStream,
    events: AsyncIterator[JobEvent],
    still_signed_in: Callable[[], Awaitable[bool]],
) -> None:
    """One job's events (``job``, with the seq as the event id) until it ends (``end``)."""

    def render(item: Any) -> bytes:
        return frame("job", event_json(item), event_id=str(item.seq))

    await _serve_one(stream, events, still_signed_in, render, ended=frame("end", {}))


async def _serve_one(
    stream: EventStream,
    events: AsyncIterator[Any],
    still_signed_in: Callable[[], Awaitable[bool]],
    render: Callable[[Any], bytes],
    *,
    ended: bytes,
) -> None:
    """One source's items, each as ``render`` frames it, batched, until it ends
    (``ended`` sent then) or fails; rechecks the sign-in while it is quiet."""
    merged = Merged()
    merged.add("one", events)
    try:
        while True:
            batch = await next_batch(merged.queue, RECHECK_SECONDS)
            if not batch:
                if not await still_signed_in():
                    await stream.send("signedout", {})
                    return
                await stream.comment()
                continue
            chunk = bytearray()
            for _tag, item in batch:
                if item is END or isinstance(item, JobplaneError):
                    chunk += frame(*_failure(item)) if isinstance(item, JobplaneError) else ended
                    await stream.send_raw(bytes(chunk))
                    return
                chunk += render(item)
            await stream.send_raw(bytes(chunk))
    finally:
        await merged.close()


def _failure(error: JobplaneError) -> tuple[str, dict[str, str]]:
    if isinstance(error, JobNotFound):
        return "notfound", {}
    if isinstance(error, Unavailable):
        # The browser reconnects (with Last-Event-ID) after its retry delay.
        return "unavailable", {"message": error.message}
    return "failed", {"message": error.message}


async def serve_jobs(
    stream: EventStream,
    watches: dict[str, AsyncIterator[JobEvent]],
    counts: Callable[[], Awaitable[dict[str, int]]],
    still_signed_in: Callable[[], Awaitable[bool]],
    *,
    counts_every: float = 2.0,
) -> None:
    """Many jobs' events, batched (``jobs``: a list of events), and the state counts
    (``counts``) every ``counts_every`` seconds, until every job has ended and
    for as long as the page stays (the counts go on)."""
    merged = Merged()
    for tag, source in watches.items():
        merged.add(tag, source)
    loop = asyncio.get_running_loop()
    next_counts = loop.time()
    next_check = loop.time() + RECHECK_SECONDS
    try:
        while True:
            now = loop.time()
            if now >= next_counts:
                await stream.send("counts", await counts())
                next_counts = now + counts_every
            if now >= next_check:
                if not await still_signed_in():
                    await stream.send("signedout", {})
                    return
                next_check = now + RECHECK_SECONDS
            batch = await next_batch(merged.queue, max(0.01, next_counts - loop.time()))
            updates = [event_json(item) for _tag, item in batch if isinstance(item, JobEvent)]
            broken = next(
                (
                    item
                    for _tag, item in batch
                    if isinstance(item, JobplaneError) and not isinstance(item, JobNotFound)
                ),
                None,
            )
            if broken is not None:
                # A feed that failed: end the stream; the page reconnects and lists afresh.
                chunk = b"".join(
                    frame("jobs", updates[i : i + FRAME_EVENTS])
                    for i in range(0, len(updates), FRAME_EVENTS)
                )
                await stream.send_raw(chunk + frame(*_failure(broken)))
                return
            if updates:
                # One write, in frames a browser (or a proxy) parses in small bites.
                await stream.send_raw(
                    b"".join(
                        frame("jobs", updates[i : i + FRAME_EVENTS])
                        for i in range(0, len(updates), FRAME_EVENTS)
                    )
                )
    finally:
        await merged.close()


async def serve_domain_events(
    stream: EventStream,
    events: AsyncIterator[Any],
    still_signed_in: Callable[[], Awaitable[bool]],
) -> None:
    """The tenant's domain events as they commit (``event``, the cursor as the event id)."""

    def render(item: Any) -> bytes:
        return frame(
            "event",
            {
                "envelope": envelope_fields(item.event),
                "job": f"{item.job_id}" if item.job_id else "",
            },
            event_id=item.position.cursor(),
        )

    await _serve_one(stream, events, still_signed_in, render, ended=b"")
