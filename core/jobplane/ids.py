"""Ids of the rows jobplane inserts all the time: jobs and dispatches.

They are UUIDv7 (RFC 9562): the first 48 bits are the creation time in
milliseconds, the rest random. Each insert then lands at the right edge of
the primary-key and job-id indexes, whose hot pages stay cached however many
finished jobs the tables hold; random (v4) ids touch a random page of an ever
larger index on every insert.
"""

from __future__ import annotations

import uuid

try:  # Python 3.14+
    _uuid7 = uuid.uuid7  # type: ignore[attr-defined,unused-ignore]
except AttributeError:  # pragma: no cover - depends on the Python version
    from uuid6 import uuid7 as _uuid7


def new_id() -> uuid.UUID:
    """A fresh time-ordered id (a plain :class:`uuid.UUID`, version 7)."""
    return uuid.UUID(int=_uuid7().int)
