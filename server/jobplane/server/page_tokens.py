"""ListJobs page tokens: a keyset cursor, tied to the filters it was made for.

A token is opaque to the caller: base64 of the last job's create time and id
and a digest of the filters, so a token made for other filters is refused
rather than read as a position in a different list.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import uuid
from datetime import UTC, datetime

from jobplane.errors import InvalidArgument
from jobplane.store.jobs import ListCursor
from jobplane.types import JobState

# Tokens this server issues are about 150 characters.
MAX_PAGE_TOKEN_LENGTH = 512


def extra_filters(
    labels: dict[str, str] | None,
    after: datetime | None,
    before: datetime | None,
    waiting_code: str = "",
    parent: str = "",
) -> str:
    """The filters past state and type, as text for the token's filter key ("" for none)."""
    if not labels and after is None and before is None and not waiting_code and not parent:
        return ""
    key: list[object] = [
        sorted((labels or {}).items()),
        after.isoformat() if after else "",
        before.isoformat() if before else "",
    ]
    # Only when set: the tokens of lists without them stay what they were.
    if waiting_code or parent:
        key.append(waiting_code)
    if parent:
        key.append(parent)
    return json.dumps(key)


def filter_key(state: JobState | None, job_type: str, extra: str = "") -> str:
    """A short digest of the filters a token holds to."""
    raw = f"{state.value if state else ''}|{job_type}"
    if extra:
        raw += f"|{extra}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def encode_token(cursor: ListCursor, filters: str) -> str:
    """The page token of ``cursor`` under ``filters``."""
    raw = json.dumps(
        {"t": cursor.create_time.isoformat(), "i": str(cursor.job_id), "f": filters},
        separators=(",", ":"),
    )
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_token(token: str, filters: str) -> ListCursor:
    """The cursor of ``token``; InvalidArgument when it is no token of ours or of other filters."""
    bad = InvalidArgument("page_token is not a token this server created", field="page_token")
    if len(token) > MAX_PAGE_TOKEN_LENGTH:
        raise bad
    try:
        data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    except (ValueError, binascii.Error, RecursionError):
        raise bad from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in ("t", "i", "f")):
        raise bad
    try:
        create_time = datetime.fromisoformat(data["t"])
        job_id = uuid.UUID(data["i"])
        if create_time.tzinfo is None:
            raise bad
        # Postgres compares in UTC; a time with no UTC equivalent is no cursor.
        utc_time = create_time.astimezone(UTC)
    except (ValueError, OverflowError):
        raise bad from None
    if data["f"] != filters:
        raise InvalidArgument(
            "page_token was created for other filters; keep state and type the same",
            field="page_token",
        )
    return ListCursor(utc_time, job_id)
