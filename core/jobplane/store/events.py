"""Domain events in Postgres: appended in the writer's transaction, read back in commit order.

:func:`append` is the one way an event is written, by ``PublishEvent`` and
by anything that emits events inside its own transaction (it is what a job
transition's statement writes too): the ``events`` row, on the caller's
connection, in the caller's transaction — it commits with the caller's
writes or not at all. The table is its own outbox: the relays publish it
by a cursor in commit order (:mod:`jobplane.store.event_feed`, ADR-0016),
and subscriptions read it by theirs.

Reading (:meth:`EventStore.read_after`) follows a commit-ordered cursor
(ADR-0011). Every row records the id of the transaction that wrote it
(``txid``) and a ``seq`` drawn at insert. A ``seq`` alone is not commit
order: a transaction that drew seq 5 may commit after one that drew seq 6,
and a reader that had passed 6 would never see 5. So a reader returns only
rows whose transaction is older than every transaction still running
(``txid < pg_snapshot_xmin(pg_current_snapshot())``): those transactions
have all ended, and no transaction that starts writing later can get an id
below that bound. Ordered by (txid, seq), what a reader has passed is
settled for good, and a cursor is a plain position. The price: while some
transaction stays open, events of younger transactions wait for it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.errors import EventIdReused, InvalidArgument
from jobplane.events.envelope import (
    Event,
    encode,
    validate_pattern,
)
from jobplane.store.engine import autocommit
from jobplane.store.machine import Emitted
from jobplane.store.rows import DOMAIN_EVENTS_CHANNEL, dumps

_MAX_POSITION = 2**63 - 1
_CURSOR_VERSION = 1
_CURSOR = struct.Struct(">BQQ")  # version, txid, seq


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event to append, and what goes with it on the broker.

    ``timestamp_given``: whether ``event.timestamp`` was chosen by the
    publisher. When it was not (PublishEvent without a timestamp), a second
    publish of the same event_id matches the stored event whatever its time.
    """

    event: Event
    #: The job the event is about (a lifecycle or handler event), if any.
    job_id: uuid.UUID | None = None
    #: W3C trace context of the work that emitted it, published as AMQP headers.
    traceparent: str | None = None
    tracestate: str | None = None
    timestamp_given: bool = True

    def fingerprint(self) -> bytes:
        """What makes two appends of one event_id "the same event" (the time aside)."""
        event = self.event
        canonical = dumps(
            {
                "event_type": event.event_type,
                "project_id": event.project_id,
                "correlation_id": event.correlation_id,
                "causation_id": event.causation_id,
                "payload": event.payload,
                "job_id": None if self.job_id is None else str(self.job_id),
            }
        )
        return hashlib.sha256(canonical.encode()).digest()


@dataclass(frozen=True, slots=True, order=True)
class Position:
    """Where an event sits in commit order: (writing transaction, seq)."""

    txid: int
    seq: int

    def cursor(self) -> str:
        """The opaque cursor a subscriber resumes from."""
        raw = _CURSOR.pack(_CURSOR_VERSION, self.txid, self.seq)
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def parse(cls, cursor: str, *, field: str = "after_cursor") -> Position:
        """The position in a cursor this server made; :class:`InvalidArgument` otherwise."""
        bad = InvalidArgument(f"{field} is not a cursor this server made", field=field)
        if len(cursor) != 23:  # the base64 of 17 bytes, unpadded
            raise bad
        try:
            raw = base64.urlsafe_b64decode(cursor + "=")
        except (ValueError, binascii.Error):
            raise bad from None
        if len(raw) != _CURSOR.size or base64.urlsafe_b64encode(raw).decode()[:23] != cursor:
            raise bad
        version, txid, seq = _CURSOR.unpack(raw)
        if version != _CURSOR_VERSION or txid > _MAX_POSITION or seq > _MAX_POSITION:
            raise bad
        return cls(txid, seq)


#: Before every event.
EARLIEST = Position(0, 0)


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """An event as stored, and where it sits."""

    event: Event
    position: Position
    job_id: uuid.UUID | None = None
    #: False when the append found the same event stored before.
    created: bool = True


@dataclass(frozen=True, slots=True)
class EventRead:
    """One read of a subscription.

    ``events``: the matching settled events after the position asked for, in
    order. ``position``: how far the read got (the last settled event it
    looked at, matching or not); read on from there. ``held``: events were
    committed after ``position`` but wait for an older transaction to end:
    read again soon, no notification will come for them. ``full``: the read
    stopped at its limit; read on at once.
    """

    events: list[StoredEvent]
    position: Position
    held: bool
    full: bool


@dataclass(frozen=True, slots=True)
class Start:
    """Where a subscription without a cursor starts: a position, and the
    snapshot whose events it leaves out (START_LATEST)."""

    position: Position
    snapshot: str | None = None


_INSERT = text(
    f"""
    INSERT INTO events (tenant_id, event_id, event_type, event_time, project_id, correlation_id,
                        causation_id, payload, traceparent, tracestate, request_hash, job_id)
    SELECT :tenant_id, :event_id, :event_type, CAST(CAST(:event_time AS text) AS timestamptz),
           :project_id, :correlation_id, :causation_id, CAST(:payload AS jsonb), :traceparent,
           :tracestate, :request_hash, :job_id
    -- Sent at commit: the relays' and the subscribers' wake-up.
    FROM pg_notify('{DOMAIN_EVENTS_CHANNEL}', CAST(CAST(:tenant_id AS uuid) AS text))
    ON CONFLICT (tenant_id, event_id) DO NOTHING
    RETURNING CAST(txid AS text) AS txid, seq
    """
)
EVENT_COLUMNS = """
    event_id, event_type, event_time, project_id, correlation_id, causation_id, payload, job_id,
    CAST(txid AS text) AS txid, seq
"""
_SELECT = text(
    f"SELECT {EVENT_COLUMNS}, request_hash FROM events "
    "WHERE tenant_id = :tenant_id AND event_id = :event_id"
)
# A second append of a stored event whose digest differs: the same event when
# its stored values are, compared as Postgres compares them (jsonb: key order
# and 1 vs 1.0 do not matter). An event published through
# jobplane.publish_event has a digest of its own (SQL cannot write Python's).
_SAME_VALUES = text(
    """
    SELECT event_type = :event_type AND payload = CAST(:payload AS jsonb)
        AND project_id IS NOT DISTINCT FROM CAST(:project_id AS text)
        AND correlation_id = :correlation_id
        AND causation_id IS NOT DISTINCT FROM CAST(:causation_id AS text)
        AND job_id IS NOT DISTINCT FROM CAST(:job_id AS uuid)
    FROM events WHERE tenant_id = :tenant_id AND event_id = :event_id
    """
)
# A subscription's read. Rows of transactions at or past the horizon (the
# oldest one still running) are not settled: they end the read, and only
# say that something waits. Rows that do not match the patterns are read
# (without their payload) so that the position moves past them.
_READ = """
    SELECT {columns}, txid < h.horizon AS settled, {matched} AS matched
    FROM events
    CROSS JOIN (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS horizon) h
    WHERE tenant_id = :tenant_id
        AND (txid, seq) > (CAST(CAST(:txid AS text) AS xid8), :seq)
        {snapshot}
    -- Qualified: a bare txid would be the text column above, in text order.
    ORDER BY events.txid, events.seq
    LIMIT :limit
"""
_READ_COLUMNS = """
    event_id, event_type, event_time, project_id, correlation_id, causation_id,
    CASE WHEN {matched} THEN payload END AS payload, job_id,
    CAST(txid AS text) AS txid, seq
"""
_LATEST = text(
    "SELECT CAST(pg_current_snapshot() AS text) AS snapshot, "
    "CAST(pg_snapshot_xmin(pg_current_snapshot()) AS text) AS horizon"
)


async def append(
    conn: AsyncConnection, tenant_id: uuid.UUID, events: Sequence[NewEvent]
) -> list[StoredEvent]:
    """Write ``events`` of ``tenant_id``, in ``conn``'s transaction.

    ``conn`` is in an open transaction and stays so; nothing commits here.
    The events reach the broker (through the relay) and subscribers only
    once that transaction commits, and never if it rolls back.

    Idempotent per (tenant, event_id): an event stored before with the same
    content (and the same timestamp, when ``timestamp_given``) is returned
    as stored, with ``created=False``, and nothing is written for it; with
    other content :class:`~jobplane.errors.EventIdReused` is raised (the
    transaction is left usable: the caller decides). Each event must belong
    to ``tenant_id`` (``ValueError`` otherwise); its encoded body must fit
    :data:`~jobplane.events.MAX_EVENT_BYTES` (``EventError``).
    """
    stored: list[StoredEvent] = []
    for new in events:
        event = new.event
        if event.tenant_id != tenant_id:
            raise ValueError(f"event {event.event_id} belongs to another tenant")
        encode(event)  # EventError when its body would be over the limit: nothing written
        fingerprint = new.fingerprint()
        params: dict[str, Any] = {
            "tenant_id": tenant_id,
            "event_id": event.event_id,
            "event_type": event.event_type,
            # As text: asyncpg sends the last microsecond of year 9999
            # (datetime.max) as 'infinity'.
            "event_time": event.timestamp.isoformat(),
            "project_id": event.project_id,
            "correlation_id": event.correlation_id,
            "causation_id": event.causation_id,
            "payload": dumps(event.payload),
            "request_hash": fingerprint,
            "job_id": new.job_id,
            "traceparent": new.traceparent or None,
            "tracestate": new.tracestate or None,
        }
        inserted = (await conn.execute(_INSERT, params)).first()
        if inserted is not None:
            position = Position(int(inserted.txid), int(inserted.seq))
            stored.append(StoredEvent(event, position, new.job_id, created=True))
            continue
        # Stored before: by a committed transaction (ON CONFLICT waited for
        # it), or earlier in this one.
        row = (
            (await conn.execute(_SELECT, {"tenant_id": tenant_id, "event_id": event.event_id}))
            .mappings()
            .one()
        )
        same_time = not new.timestamp_given or row["event_time"] == event.timestamp
        same = bytes(row["request_hash"]) == fingerprint or bool(
            (await conn.execute(_SAME_VALUES, params)).scalar_one()
        )
        if not same or not same_time:
            raise EventIdReused(
                f"event_id {str(event.event_id)!r} was published with a different event",
                field="event_id",
            )
        previous = stored_event(tenant_id, row)
        stored.append(
            StoredEvent(previous.event, previous.position, previous.job_id, created=False)
        )
    return stored


def emitted(event: Event, job_id: uuid.UUID) -> Emitted:
    """``event``, emitted by a handler of job ``job_id``, ready for the outcome's statement.

    Its body is encoded now (:class:`EventError` when it is over the limit)
    and its fingerprint is the one :func:`append` compares, so that the
    stored event is the same whichever way it was written.
    """
    return Emitted(event, encode(event), NewEvent(event, job_id=job_id).fingerprint())


def pattern_regex(patterns: Sequence[str]) -> str | None:
    """A Postgres (and Python) regex that ``'.' || event_type`` matches when any of
    ``patterns`` takes the event type; None when every type matches.

    Each word becomes ``\\.word``, ``*`` one more ``\\.word`` of any word, and
    ``#`` any number of them: with the leading dot, ``#`` needs no special
    case for the dots around it. Words are validated first, so they hold no
    character a regex treats specially.
    """
    alternatives: list[str] = []
    for pattern in patterns:
        validate_pattern(pattern)
        if all(word == "#" for word in pattern.split(".")):
            return None
        parts = []
        for word in pattern.split("."):
            if word == "#":
                parts.append(r"(\.[^.]+)*")
            elif word == "*":
                parts.append(r"\.[^.]+")
            else:
                parts.append(r"\." + word)
        alternatives.append("".join(parts))
    return "^(" + "|".join(dict.fromkeys(alternatives)) + ")$"


class EventStore:
    """Publishes events in transactions of their own and reads subscriptions."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._auto = autocommit(engine)

    async def publish(self, tenant_id: uuid.UUID, new: NewEvent) -> StoredEvent:
        """Append one event in a transaction of its own (PublishEvent)."""
        async with self._engine.begin() as conn:
            (stored,) = await append(conn, tenant_id, [new])
        return stored

    async def start(self, *, latest: bool) -> Start:
        """Where a subscription starts: before every event, or after those committed now."""
        if not latest:
            return Start(EARLIEST)
        async with self._auto.connect() as conn:
            row = (await conn.execute(_LATEST)).one()
        # Every transaction below the horizon has ended, so its events are
        # not "after now"; of the others, those visible now are left out.
        return Start(Position(int(row.horizon), 0), row.snapshot)

    async def read_after(
        self,
        tenant_id: uuid.UUID,
        regex: str | None,
        position: Position,
        *,
        limit: int,
        snapshot: str | None = None,
    ) -> EventRead:
        """The tenant's settled events after ``position`` whose type matches ``regex``.

        ``regex`` comes from :func:`pattern_regex` (None: every type). At
        most ``limit`` rows are looked at. ``snapshot``: leave out events
        of transactions visible in it (a START_LATEST subscription).
        """
        matched = "true" if regex is None else "('.' || event_type) ~ :regex"
        statement = _READ.format(
            columns=_READ_COLUMNS.format(matched=matched),
            matched=matched,
            snapshot=(
                "AND NOT pg_visible_in_snapshot(txid, CAST(CAST(:snapshot AS text) AS pg_snapshot))"
                if snapshot is not None
                else ""
            ),
        )
        params: dict[str, Any] = {
            "tenant_id": tenant_id,
            "txid": str(position.txid),
            "seq": position.seq,
            "limit": limit,
        }
        if regex is not None:
            params["regex"] = regex
        if snapshot is not None:
            params["snapshot"] = snapshot
        async with self._auto.connect() as conn:
            rows = (await conn.execute(text(statement), params)).mappings().all()
        events: list[StoredEvent] = []
        held = False
        for row in rows:
            if not row["settled"]:
                held = True
                break
            position = Position(int(row["txid"]), int(row["seq"]))
            if row["matched"]:
                events.append(stored_event(tenant_id, row))
        return EventRead(events, position, held=held, full=len(rows) >= limit and not held)


def stored_event(tenant_id: uuid.UUID, row: Any) -> StoredEvent:
    """The event of a row read with the columns the reads select (``EVENT_COLUMNS``)."""
    payload = row["payload"]
    if isinstance(payload, str):  # asyncpg hands jsonb back as text without a codec
        payload = json.loads(payload)
    event_time: datetime = row["event_time"]
    event = Event.stored(
        event_id=uuid.UUID(str(row["event_id"])),
        event_type=row["event_type"],
        timestamp=event_time,
        tenant_id=tenant_id,
        project_id=row["project_id"],
        correlation_id=row["correlation_id"],
        causation_id=row["causation_id"],
        payload=payload if payload is not None else {},
    )
    job_id = row["job_id"]
    return StoredEvent(
        event,
        Position(int(row["txid"]), int(row["seq"])),
        None if job_id is None else uuid.UUID(str(job_id)),
    )


__all__ = [
    "EARLIEST",
    "EVENT_COLUMNS",
    "EventRead",
    "EventStore",
    "NewEvent",
    "Position",
    "Start",
    "StoredEvent",
    "append",
    "pattern_regex",
    "stored_event",
]
