"""The event service: PublishEvent's rules, and SubscribeEvents' streams.

Servicers translate protobuf to these calls and back; nothing here knows gRPC.

A subscription reads the events table itself (no shared buffer as for job
watches: events are per tenant, not per job, and a subscriber's patterns
are its own). It reads after its position, sends what matches, and then
waits for a wake-up: a notification that its tenant appended events, the
LISTEN connection coming back, or a slow timer for notifications lost.
Events already committed but held back behind an older transaction that is
still open (see jobplane.store.events) get no notification when that
transaction ends, so while a read reports some the stream polls, backing
off from :data:`HELD_POLL_SECONDS`.
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from jobplane.errors import InvalidArgument, Unavailable, shown
from jobplane.events.envelope import Event, EventError, validate_pattern
from jobplane.server.service import check_payload
from jobplane.store.events import (
    EventStore,
    NewEvent,
    Position,
    Start,
    StoredEvent,
    pattern_regex,
)
from jobplane.store.listen import Listener
from jobplane.store.rows import check_payload_size

# Its own generator: a recheck's jitter never moves the process's global
# random state (an application's seeded random, or a test's).
_JITTER = random.Random()

# Patterns one subscription may hold; each costs a regex alternative.
MAX_PATTERNS = 64
# Events (matching or not) one read looks at.
READ_BATCH = 500
# The first wait before reading again while events are held back, doubled
# up to HELD_POLL_MAX_SECONDS.
HELD_POLL_SECONDS = 0.02
HELD_POLL_MAX_SECONDS = 1.0
_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# W3C trace context (https://www.w3.org/TR/trace-context/): a traceparent
# that is not one is ignored, as the recommendation says, not refused.
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[ -~]*)?")
_MAX_TRACESTATE = 512
_TRACESTATE = re.compile(r"[ -~]*")


@dataclass(frozen=True, slots=True)
class PublishRequest:
    """A PublishEvent call, as plain values (``timestamp`` None: unset)."""

    event_id: str
    event_type: str
    timestamp: datetime | None = None
    project_id: str | None = None
    correlation_id: str = ""
    causation_id: str | None = None
    payload: dict[str, Any] = field(default_factory=dict)
    traceparent: str | None = None
    tracestate: str | None = None


class SubscribeStart:
    """Values of SubscribeEventsRequest.Start, without the protobuf enum."""

    UNSPECIFIED = 0
    EARLIEST = 1
    LATEST = 2


class EventService:
    """Every EventService call, for one tenant at a time."""

    def __init__(
        self,
        store: EventStore,
        wakeups: Listener,
        *,
        max_payload_bytes: int = 256 * 1024,
        recheck_seconds: float = 30.0,
    ) -> None:
        self._store = store
        self._wakeups = wakeups
        self._max_payload_bytes = max_payload_bytes
        self._recheck_seconds = recheck_seconds
        self._closing = False

    def open(self) -> None:
        """Accept subscriptions (again)."""
        self._closing = False

    def close_streams(self) -> None:
        """End every subscription with UNAVAILABLE, so clients resume elsewhere."""
        self._closing = True
        self._wakeups.wake_all()

    async def publish(self, tenant: uuid.UUID, request: PublishRequest) -> StoredEvent:
        """Validate whole, then store the event and its outbox row in one transaction."""
        event = self._event(tenant, request)
        new = NewEvent(
            event,
            traceparent=_traceparent(request.traceparent),
            tracestate=_tracestate(request.tracestate) if request.traceparent else None,
            timestamp_given=request.timestamp is not None,
        )
        return await self._store.publish(tenant, new)

    def _event(self, tenant: uuid.UUID, request: PublishRequest) -> Event:
        if not request.event_id:
            raise InvalidArgument(
                "event_id is required (a UUID the publisher chooses)", field="event_id"
            )
        if not _CANONICAL_UUID.fullmatch(request.event_id):
            raise InvalidArgument(
                f"event_id {shown(request.event_id)} must be a UUID in its canonical "
                "lowercase form (8-4-4-4-12 hex digits)",
                field="event_id",
            )
        check_payload_size(request.payload, self._max_payload_bytes)
        check_payload(request.payload)
        event_id = uuid.UUID(request.event_id)
        try:
            return Event(
                event_id=event_id,
                event_type=request.event_type,
                timestamp=request.timestamp or datetime.now(UTC),
                tenant_id=tenant,
                project_id=request.project_id,
                correlation_id=request.correlation_id or str(event_id),
                causation_id=request.causation_id,
                payload=request.payload,
            )
        except EventError as exc:
            raise InvalidArgument(str(exc), field=exc.field or "event") from None

    async def subscribe(
        self, tenant: uuid.UUID, patterns: Sequence[str], after_cursor: str, start: int
    ) -> AsyncIterator[StoredEvent]:
        """The tenant's events matching ``patterns`` after the cursor (or from
        ``start``), in commit order, then live ones; it does not end by itself."""
        regex = _patterns(patterns)
        if after_cursor:
            begin = Start(Position.parse(after_cursor))
        elif start in (SubscribeStart.UNSPECIFIED, SubscribeStart.EARLIEST):
            begin = await self._store.start(latest=False)
        elif start == SubscribeStart.LATEST:
            begin = await self._store.start(latest=True)
        else:
            raise InvalidArgument(f"start {start} is not a known start", field="start")
        position, snapshot = begin.position, begin.snapshot
        # Subscribed before the first read: an append committed from then on
        # wakes this stream, even one committed while that read runs.
        with self._wakeups.subscribe(str(tenant)) as wakeup:
            poll = HELD_POLL_SECONDS
            while True:
                if self._closing:
                    raise Unavailable(
                        "the server is shutting down; resume with the cursor of the last event"
                    )
                read = await self._store.read_after(
                    tenant, regex, position, limit=READ_BATCH, snapshot=snapshot
                )
                for stored in read.events:
                    yield stored
                position = read.position
                if read.full:
                    continue
                if read.held:
                    await wakeup.wait(poll)
                    poll = min(poll * 2, HELD_POLL_MAX_SECONDS)
                else:
                    poll = HELD_POLL_SECONDS
                    await wakeup.wait(self._recheck_seconds * _JITTER.uniform(0.75, 1.25))


def _patterns(patterns: Sequence[str]) -> str | None:
    if not patterns:
        raise InvalidArgument(
            "type_patterns needs at least one pattern (e.g. 'artifact.*', or '#' for all)",
            field="type_patterns",
        )
    if len(patterns) > MAX_PATTERNS:
        raise InvalidArgument(
            f"type_patterns has more than {MAX_PATTERNS} patterns", field="type_patterns"
        )
    try:
        for pattern in patterns:
            validate_pattern(pattern)
        return pattern_regex(patterns)
    except EventError as exc:
        raise InvalidArgument(str(exc), field="type_patterns") from None


def _traceparent(value: str | None) -> str | None:
    if value and len(value) <= 512 and _TRACEPARENT.fullmatch(value):
        return value
    return None


def _tracestate(value: str | None) -> str | None:
    if value and len(value) <= _MAX_TRACESTATE and _TRACESTATE.fullmatch(value):
        return value
    return None
