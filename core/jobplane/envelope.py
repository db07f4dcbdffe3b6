"""The broker message: a small, versioned envelope of ids (never payloads).

The version changes only when a reader of the previous one would misread a
message. Fields are added as optional keys within a version: readers ignore
keys they do not know, and a message without the new key is still read (a
v1 message without ``deployment`` is one of this deployment's).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

ENVELOPE_VERSION = 1
# The "kind" key of the body; with the version, the AMQP `type` property.
MESSAGE_TYPE = "jobplane.job.dispatch"
AMQP_TYPE = f"{MESSAGE_TYPE}.v{ENVELOPE_VERSION}"
MAX_ENVELOPE_BYTES = 64 * 1024
# The AMQP header carrying the publishing deployment's id, besides the body,
# so operators (and `jobplane dlq list`) see it without decoding.
DEPLOYMENT_HEADER = "deployment"


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
    # The deployment that published it (see jobplane.store.deployment); None
    # in messages of releases before it was carried.
    deployment: str | None = None

    def encode(self) -> bytes:
        """The JSON body of the message."""
        data: dict[str, Any] = {
            "v": ENVELOPE_VERSION,
            "kind": MESSAGE_TYPE,
            "event_id": str(self.event_id),
            "job_id": str(self.job_id),
            "tenant_id": str(self.tenant_id),
            "type": self.job_type,
            "correlation_id": self.correlation_id,
        }
        if self.deployment is not None:
            data["deployment"] = self.deployment
        return json.dumps(data, separators=(",", ":")).encode()

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
        deployment = data.get("deployment")
        if deployment is not None and not (
            isinstance(deployment, str) and 0 < len(deployment) <= 64
        ):
            raise EnvelopeError("bad field: deployment")
        try:
            return cls(
                event_id=uuid.UUID(str(data["event_id"])),
                job_id=uuid.UUID(str(data["job_id"])),
                tenant_id=uuid.UUID(str(data["tenant_id"])),
                job_type=str(data["type"]),
                correlation_id=str(data.get("correlation_id") or ""),
                deployment=deployment,
            )
        except (KeyError, ValueError) as exc:
            raise EnvelopeError(f"bad field: {exc}") from exc
