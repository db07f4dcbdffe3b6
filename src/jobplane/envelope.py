"""The broker message: a small, versioned envelope of ids (never payloads)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

ENVELOPE_VERSION = 1
MESSAGE_TYPE = "jobplane.job.dispatch"
MAX_ENVELOPE_BYTES = 64 * 1024


class EnvelopeError(ValueError):
    """A broker message is not a jobplane dispatch envelope."""


@dataclass(frozen=True, slots=True)
class Envelope:
    """Tells a worker which job to load from Postgres; carries nothing else."""

    event_id: uuid.UUID
    job_id: uuid.UUID
    tenant_id: uuid.UUID
    job_type: str
    correlation_id: str = ""

    def encode(self) -> bytes:
        """The JSON body of the message."""
        return json.dumps(
            {
                "v": ENVELOPE_VERSION,
                "kind": MESSAGE_TYPE,
                "event_id": str(self.event_id),
                "job_id": str(self.job_id),
                "tenant_id": str(self.tenant_id),
                "type": self.job_type,
                "correlation_id": self.correlation_id,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, body: bytes) -> Envelope:
        """Parse and check a message body; :class:`EnvelopeError` if it is not one."""
        if len(body) > MAX_ENVELOPE_BYTES:
            raise EnvelopeError("envelope too large")
        try:
            data: Any = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise EnvelopeError(f"not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise EnvelopeError("not a JSON object")
        if data.get("v") != ENVELOPE_VERSION or data.get("kind") != MESSAGE_TYPE:
            raise EnvelopeError(f"unsupported envelope v={data.get('v')!r}")
        try:
            return cls(
                event_id=uuid.UUID(str(data["event_id"])),
                job_id=uuid.UUID(str(data["job_id"])),
                tenant_id=uuid.UUID(str(data["tenant_id"])),
                job_type=str(data["type"]),
                correlation_id=str(data.get("correlation_id") or ""),
            )
        except (KeyError, ValueError) as exc:
            raise EnvelopeError(f"bad field: {exc}") from exc
