"""The domain event envelope: the public :class:`Event` and its JSON on the wire.

An event travels through RabbitMQ as one JSON object (docs/events.md is the
contract, written for consumers in any language)::

    {"v": 1, "event_id": "…", "event_type": "artifact.created",
     "timestamp": "2026-11-30T12:00:00.123456Z", "tenant_id": "…",
     "project_id": null, "correlation_id": "…", "causation_id": null,
     "payload": {…}}

Every key is always written, ``null`` for an unset optional one. ``v`` changes
only when a reader of the previous version would misread a message: keys are
added as optional ones within a version, and readers ignore keys they do not
know (as the job dispatch envelope does, ADR-0006).

The body is the truth; the AMQP properties (:func:`amqp_properties`) repeat a
few fields so that tools and routing see them without decoding it.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from jobplane.errors import shown
from jobplane.ids import new_id
from jobplane.topics import EVENTS_EXCHANGE, topic_matches

EVENT_VERSION = 1
CONTENT_TYPE = "application/json"
# The topic exchange events are published to by default; the routing key is
# the event type.
EXCHANGE = EVENTS_EXCHANGE
# Written into the AMQP `app_id` property of every event jobplane publishes.
APP_ID = "jobplane"
# Whole encoded events, payload included. A payload follows the server's
# payload limit (JOBPLANE_MAX_PAYLOAD_BYTES, at most 4 MiB); the other fields
# take at most a few KiB, so this bound carries any event the server accepts
# and refuses anything else before it is parsed.
MAX_EVENT_BYTES = 4 * 1024 * 1024 + 64 * 1024
MAX_EVENT_TYPE_LENGTH = 128
# correlation_id travels as the AMQP correlation-id, a short string (255
# bytes); the other ids are held to the same bound so any of them fits a header.
MAX_ID_BYTES = 255
# As for job payloads: protobuf decodes at most 100 levels, and an Event
# inside a stream response spends a few of them.
MAX_PAYLOAD_DEPTH = 32
# AMQP header names of the fields the properties do not carry.
CAUSATION_HEADER = "causation_id"
TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"

_WORD = r"[a-z0-9][a-z0-9_-]*"
_EVENT_TYPE = re.compile(rf"{_WORD}(\.{_WORD})*")
_PATTERN_WORD = re.compile(rf"{_WORD}|\*|#")
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d{1,9})?(Z|[+-]\d{2}:\d{2})")
# Postgres' jsonb refuses NUL and unpaired surrogates; UTF-8 cannot encode
# the latter at all.
_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")
_BAD_ID = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")


class EventError(ValueError):
    """Not a valid event; ``field`` names the field at fault, when one is."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.field = field
        super().__init__(message)


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """A domain event: a fact that happened, as every service reads it.

    The fields are those of the envelope (seed 000). Constructing one checks
    it (:class:`EventError`); ``timestamp`` must be timezone-aware and is kept
    in UTC. Use :meth:`new` to make one with a fresh id and the current time.
    """

    #: Unique id; publishing is idempotent on it and consumers dedupe on it.
    event_id: uuid.UUID
    #: Lowercase dotted words, e.g. ``artifact.created``; the routing key.
    event_type: str
    #: When the fact happened (UTC; microsecond precision on every path).
    timestamp: datetime
    tenant_id: uuid.UUID
    project_id: str | None = None
    #: The chain of work the event belongs to (the first event's id).
    correlation_id: str
    #: What caused the event, usually the causing event's id.
    causation_id: str | None = None
    #: What the fact says: a JSON object.
    payload: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.event_id, uuid.UUID):
            raise EventError("event_id must be a UUID", field="event_id")
        if self.event_id.int == 0:
            raise EventError("event_id must not be the nil UUID", field="event_id")
        validate_event_type(self.event_type)
        if not isinstance(self.timestamp, datetime) or self.timestamp.utcoffset() is None:
            raise EventError("timestamp must be a timezone-aware datetime", field="timestamp")
        if self.timestamp.tzinfo is not UTC:
            object.__setattr__(self, "timestamp", self.timestamp.astimezone(UTC))
        if not isinstance(self.tenant_id, uuid.UUID):
            raise EventError("tenant_id must be a UUID", field="tenant_id")
        _check_id(self.project_id, "project_id", optional=True)
        _check_id(self.correlation_id, "correlation_id", optional=False)
        _check_id(self.causation_id, "causation_id", optional=True)
        check_payload(self.payload)

    @classmethod
    def stored(
        cls,
        *,
        event_id: uuid.UUID,
        event_type: str,
        timestamp: datetime,
        tenant_id: uuid.UUID,
        project_id: str | None,
        correlation_id: str,
        causation_id: str | None,
        payload: dict[str, Any],
    ) -> Event:
        """An event read back from the events table, not checked again.

        Every path that writes the table checks what it writes (as the
        constructor does, or in SQL to the same rules); the relay and the
        subscriptions read many events, and the checks would be most of
        their cost. ``timestamp`` must be timezone-aware.
        """
        event = object.__new__(cls)
        for name, value in (
            ("event_id", event_id),
            ("event_type", event_type),
            ("timestamp", timestamp if timestamp.tzinfo is UTC else timestamp.astimezone(UTC)),
            ("tenant_id", tenant_id),
            ("project_id", project_id),
            ("correlation_id", correlation_id),
            ("causation_id", causation_id),
            ("payload", payload),
        ):
            object.__setattr__(event, name, value)
        return event

    @classmethod
    def new(
        cls,
        event_type: str,
        payload: dict[str, Any] | None = None,
        *,
        tenant_id: uuid.UUID,
        project_id: str | None = None,
        caused_by: Event | None = None,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        event_id: uuid.UUID | None = None,
        timestamp: datetime | None = None,
    ) -> Event:
        """A new event: a fresh time-ordered id and the current time unless given.

        ``caused_by``: the event this one follows from; it gives the
        correlation id and the causation id (unless they are given). Without
        it, the event starts a chain and correlates to its own id.
        """
        if event_id is None:
            event_id = new_id()
        if caused_by is not None:
            correlation_id = correlation_id or caused_by.correlation_id
            causation_id = causation_id or str(caused_by.event_id)
        return cls(
            event_id=event_id,
            event_type=event_type,
            timestamp=timestamp or datetime.now(UTC),
            tenant_id=tenant_id,
            project_id=project_id,
            correlation_id=correlation_id or str(event_id),
            causation_id=causation_id,
            payload=dict(payload or {}),
        )


def envelope_fields(event: Event) -> dict[str, Any]:
    """The envelope's fields of ``event`` as JSON values, in the wire order (no version)."""
    return {
        "event_id": str(event.event_id),
        "event_type": event.event_type,
        "timestamp": format_timestamp(event.timestamp),
        "tenant_id": str(event.tenant_id),
        "project_id": event.project_id,
        "correlation_id": event.correlation_id,
        "causation_id": event.causation_id,
        "payload": event.payload,
    }


def encode(event: Event, *, max_bytes: int = MAX_EVENT_BYTES) -> bytes:
    """The JSON body of ``event`` (UTF-8, compact); :class:`EventError` over ``max_bytes``."""
    data = {"v": EVENT_VERSION, **envelope_fields(event)}
    body = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    if len(body) > max_bytes:
        raise EventError(
            f"event is {len(body)} bytes encoded; the limit is {max_bytes}", field="payload"
        )
    return body


def decode(body: bytes, *, max_bytes: int = MAX_EVENT_BYTES) -> Event:
    """The event in a message body; :class:`EventError` if the body is not one."""
    if len(body) > max_bytes:
        raise EventError(f"event is {len(body)} bytes; the limit is {max_bytes}")
    try:
        data: Any = json.loads(body, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EventError(f"not JSON: {exc}") from None
    except RecursionError:
        raise EventError("not JSON this reader can parse: nested too deep") from None
    if not isinstance(data, dict):
        raise EventError("not a JSON object")
    version = data.get("v")
    # bool is an int in Python; `true` is not version 1.
    if type(version) is not int or version != EVENT_VERSION:
        raise EventError(f"unsupported envelope version v={version!r}", field="v")
    payload = data.get("payload")
    if not isinstance(payload, dict):
        raise EventError("payload must be a JSON object", field="payload")
    return Event(
        event_id=parse_uuid(data.get("event_id"), "event_id"),
        event_type=_string(data.get("event_type"), "event_type"),
        timestamp=parse_timestamp(data.get("timestamp")),
        tenant_id=parse_uuid(data.get("tenant_id"), "tenant_id"),
        project_id=_optional_string(data.get("project_id"), "project_id"),
        correlation_id=_string(data.get("correlation_id"), "correlation_id"),
        causation_id=_optional_string(data.get("causation_id"), "causation_id"),
        payload=payload,
    )


def amqp_properties(
    event: Event, *, traceparent: str | None = None, tracestate: str | None = None
) -> dict[str, Any]:
    """The AMQP properties an event is published with, as ``aio_pika.Message`` keywords.

    Persistent; ``message_id`` is the event id, ``type`` the event type,
    ``correlation_id`` the correlation id; the causation id and the W3C trace
    context travel as headers, present only when set.
    """
    headers: dict[str, str] = {}
    if event.causation_id is not None:
        headers[CAUSATION_HEADER] = event.causation_id
    if traceparent:
        headers[TRACEPARENT_HEADER] = traceparent
    if tracestate:
        headers[TRACESTATE_HEADER] = tracestate
    return {
        "content_type": CONTENT_TYPE,
        "delivery_mode": 2,  # persistent
        "message_id": str(event.event_id),
        "type": event.event_type,
        "correlation_id": event.correlation_id,
        # Whole seconds, rounded down, as the broker carries them: given the
        # microseconds, aio-pika's encoding (through a float) rounds a far
        # year's ``…59.999999`` up. A timestamp is always in UTC here.
        "timestamp": event.timestamp.replace(microsecond=0),
        "app_id": APP_ID,
        "headers": headers,
    }


def validate_event_type(value: object, *, field: str = "event_type") -> str:
    """``value`` when it is an event type: lowercase dotted words, at most 128 characters."""
    if not isinstance(value, str) or not value:
        raise EventError(f"{field} is required", field=field)
    if len(value) > MAX_EVENT_TYPE_LENGTH:
        raise EventError(f"{field} is longer than {MAX_EVENT_TYPE_LENGTH} characters", field=field)
    # fullmatch: `$` would also match before a trailing newline.
    if not _EVENT_TYPE.fullmatch(value):
        raise EventError(
            f"{field} {shown(value)} must be lowercase dotted words of letters, digits, "
            "'_' and '-' (e.g. 'artifact.created')",
            field=field,
        )
    return value


def validate_pattern(value: object, *, field: str = "type_patterns") -> str:
    """``value`` when it is a pattern of event types in AMQP topic syntax.

    Dotted words as in an event type, where a word may also be ``*`` (exactly
    one word) or ``#`` (zero or more words).
    """
    if not isinstance(value, str) or not value:
        raise EventError(f"{field} has an empty pattern", field=field)
    # An AMQP routing key (and so a binding key) is a short string.
    if len(value.encode()) > MAX_ID_BYTES:
        raise EventError(f"{field} has a pattern longer than {MAX_ID_BYTES} bytes", field=field)
    if not all(_PATTERN_WORD.fullmatch(word) for word in value.split(".")):
        raise EventError(
            f"{field} has {shown(value)}, which is not a pattern of dotted words, "
            "'*' or '#' (e.g. 'job.*', 'artifact.#')",
            field=field,
        )
    return value


def matches(patterns: Iterable[str], event_type: str) -> bool:
    """True when any of ``patterns`` takes ``event_type``, as a topic binding would."""
    return any(topic_matches(pattern, event_type) for pattern in patterns)


def check_payload(payload: object, *, field: str = "payload") -> None:
    """Refuse what JSON, Postgres' jsonb or a protobuf Struct cannot carry.

    A JSON object of JSON values only, no NUL or unpaired surrogate in any
    key or string, finite numbers, at most :data:`MAX_PAYLOAD_DEPTH` objects
    or arrays deep.
    """
    if not isinstance(payload, dict):
        raise EventError(f"{field} must be a JSON object", field=field)
    # Iterative, so no payload can exhaust the interpreter's stack here.
    pending: list[tuple[object, int]] = [(payload, 1)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, dict | list | tuple):
            if depth > MAX_PAYLOAD_DEPTH:
                raise EventError(
                    f"{field} is nested more than {MAX_PAYLOAD_DEPTH} objects or arrays deep",
                    field=field,
                )
            if isinstance(value, dict):
                for key, item in value.items():
                    if not isinstance(key, str):
                        raise EventError(f"{field} has a key that is not a string", field=field)
                    if _BAD_TEXT.search(key):
                        raise EventError(
                            f"{field} has a key with NUL or an unpaired surrogate", field=field
                        )
                    pending.append((item, depth + 1))
            else:
                pending.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            if _BAD_TEXT.search(value):
                raise EventError(
                    f"{field} has a string with NUL or an unpaired surrogate", field=field
                )
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise EventError(f"{field} has {value}; JSON numbers are finite", field=field)
        elif value is not None and not isinstance(value, bool | int):
            raise EventError(
                f"{field} has a {type(value).__name__}, which is not a JSON value", field=field
            )


def format_timestamp(value: datetime) -> str:
    """RFC 3339 in UTC with microseconds, e.g. ``2026-11-30T12:00:00.123456Z``."""
    return value.astimezone(UTC).replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


def parse_timestamp(value: object, *, field: str = "timestamp") -> datetime:
    """An aware UTC datetime from an RFC 3339 string (``Z`` or an offset; digits past
    microseconds are dropped)."""
    if not isinstance(value, str) or not _TIMESTAMP.fullmatch(value):
        raise EventError(
            f"{field} must be an RFC 3339 time such as 2026-11-30T12:00:00Z, got {shown(value)}",
            field=field,
        )
    try:
        return datetime.fromisoformat(value).astimezone(UTC)
    except ValueError:
        raise EventError(f"{field} {shown(value)} is not a valid time", field=field) from None


def parse_uuid(value: object, field: str) -> uuid.UUID:
    """The UUID in ``value``, a string in the 8-4-4-4-12 hex form."""
    if not isinstance(value, str) or not _UUID.fullmatch(value):
        raise EventError(f"{field} must be a UUID string, got {shown(value)}", field=field)
    return uuid.UUID(value)


def _string(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise EventError(f"{field} must be a string", field=field)
    return value


def _optional_string(value: object, field: str) -> str | None:
    return None if value is None else _string(value, field)


def _check_id(value: object, field: str, *, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        raise EventError(
            f"{field} must be a non-empty string{' or unset' if optional else ''}", field=field
        )
    if _BAD_ID.search(value):
        raise EventError(f"{field} has a control character or an unpaired surrogate", field=field)
    if len(value.encode()) > MAX_ID_BYTES:
        raise EventError(f"{field} is longer than {MAX_ID_BYTES} bytes of UTF-8", field=field)


def _refuse_constant(name: str) -> Any:
    raise EventError(f"payload has {name}; JSON numbers are finite", field="payload")
