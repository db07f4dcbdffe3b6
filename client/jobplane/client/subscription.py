"""A subscription to a tenant's domain events that resumes by itself.

:class:`EventSubscription` is what :meth:`AsyncClient.subscribe` returns: an
async iterator of :class:`SubscribedEvent` items over ``SubscribeEvents``.
The server streams events in commit order and never ends a stream by
itself; the cursor of each event is its position, and a stream opened
``after_cursor`` = the cursor of the last event received continues with the
next event, with no gap and no repeat (events.proto). So a subscription
that loses its stream — a server restart, a cut connection, a database
outage the server reports as UNAVAILABLE — opens a new one after the last
cursor it delivered, the way :meth:`AsyncClient.watch` resumes after the
last seq: the caller sees one unbroken sequence.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Literal, NamedTuple, Protocol, Self

import grpc

from jobplane.client._retry import Backoff, RetryPolicy, stream_failure, stream_retry_delay
from jobplane.errors import InternalError, TenantLimitExceeded, Unavailable
from jobplane.events.convert import event_from_pb
from jobplane.events.envelope import Event, EventError
from jobplane.v1 import events_pb2

#: Where a subscription without a cursor begins: with the oldest event the
#: server keeps, or with the first event committed after it is accepted.
SubscribeStart = Literal["earliest", "latest"]

_STARTS: dict[str, events_pb2.SubscribeEventsRequest.Start.ValueType] = {
    "earliest": events_pb2.SubscribeEventsRequest.START_EARLIEST,
    "latest": events_pb2.SubscribeEventsRequest.START_LATEST,
}


class SubscribedEvent(NamedTuple):
    """One event of a subscription and its cursor: ``for event, cursor in …``."""

    event: Event
    #: Opaque; ``after_cursor`` to resume right after this event.
    cursor: str


class _Stream(Protocol):
    """What the subscription needs of a grpc UnaryStreamCall."""

    def __aiter__(self) -> AsyncIterator[events_pb2.SubscribeEventsResponse]: ...

    def cancel(self) -> bool: ...


#: Opens one SubscribeEvents call.
OpenStream = Callable[[events_pb2.SubscribeEventsRequest], _Stream]


def domain_event_of(message: events_pb2.Event) -> Event:
    """The :class:`Event` in a reply; :class:`InternalError` for one the envelope refuses."""
    try:
        return event_from_pb(message)
    except EventError as exc:
        raise InternalError(
            f"the server sent an event that is not valid: {exc}", field=exc.field
        ) from exc


class EventSubscription:
    """The events of one tenant matching some patterns, in commit order, resuming by itself.

    Iterate it (``async for event, cursor in subscription``); it does not end
    by itself. :attr:`cursor` is the cursor of the last event it delivered:
    store it with what the event did, and pass it as ``after_cursor`` later
    to go on right after that event. Close it (``aclose()``, or use it as an
    async context manager) to end the stream; breaking out of ``async for``
    alone leaves that to the garbage collector.

    When its stream is lost it opens a new one after :attr:`cursor` (or from
    where it started, when it has delivered nothing yet) as the client's
    :class:`RetryPolicy` says, and raises :class:`~jobplane.errors.Unavailable`
    once that has failed for the policy's ``max_elapsed``. A server that
    refuses the stream because the tenant holds its limit of streams there is
    asked again after the delay it names, within the same budget; past it
    the subscription raises :class:`~jobplane.errors.TenantLimitExceeded`.
    Any other refusal (a bad pattern or cursor, a revoked key) is raised at
    once.
    """

    def __init__(
        self,
        open_stream: OpenStream,
        patterns: Sequence[str],
        *,
        after_cursor: str | None = None,
        start: SubscribeStart = "earliest",
        retry: RetryPolicy | None = None,
        closed: Callable[[], bool] = lambda: False,
    ) -> None:
        if start not in _STARTS:
            raise ValueError(f"start must be 'earliest' or 'latest', not {start!r}")
        self._open = open_stream
        self._patterns = tuple(patterns)
        self._after_cursor = after_cursor or None
        self._start = start
        self._retry = retry or RetryPolicy()
        self._closed = closed
        self._cursor: str | None = self._after_cursor
        self._events = self._run()

    @property
    def patterns(self) -> tuple[str, ...]:
        """The event-type patterns subscribed to."""
        return self._patterns

    @property
    def cursor(self) -> str | None:
        """The cursor of the last event delivered; before any, the ``after_cursor``
        it was opened with (None when it had none)."""
        return self._cursor

    def __repr__(self) -> str:
        return f"{type(self).__name__}(patterns={list(self._patterns)!r}, cursor={self._cursor!r})"

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> SubscribedEvent:
        return await anext(self._events)

    async def aclose(self) -> None:
        """End the stream. Safe to call twice."""
        await self._events.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _request(self) -> events_pb2.SubscribeEventsRequest:
        request = events_pb2.SubscribeEventsRequest(type_patterns=self._patterns)
        if self._cursor is not None:
            request.after_cursor = self._cursor
        else:
            request.start = _STARTS[self._start]
        return request

    async def _run(self) -> AsyncGenerator[SubscribedEvent, None]:
        backoff = Backoff(self._retry)
        loop = asyncio.get_running_loop()
        while True:
            failure: BaseException | None = None
            limited: TenantLimitExceeded | None = None
            opened = loop.time()
            call = self._open(self._request())
            try:
                async for message in call:
                    item = SubscribedEvent(domain_event_of(message.event), message.cursor)
                    # Before the yield: a caller that stops at this event
                    # reads its cursor, and a resume starts after it.
                    self._cursor = item.cursor
                    backoff.reset()
                    yield item
                # The server never ends a stream by itself: whatever ended
                # it (a proxy, a balancer) cut it, and it is resumed.
            except grpc.aio.AioRpcError as exc:
                limited = stream_failure(exc, closed=self._closed())
                failure = exc
            finally:
                call.cancel()
            delay = stream_retry_delay(
                backoff, open_for=loop.time() - opened, limited=limited, failure=failure
            )
            if delay is None:
                where = f"after cursor {self._cursor}" if self._cursor else "before its first event"
                raise Unavailable(
                    f"lost the subscription to {', '.join(self._patterns)} {where} and could "
                    f"not resume it within {self._retry.max_elapsed:g}s"
                ) from failure
            await asyncio.sleep(delay)


__all__ = ["EventSubscription", "OpenStream", "SubscribeStart", "SubscribedEvent"]
