"""A SubmitJob request's concurrency key, limit and mode, checked (docs/flow-control.md).

The limit itself is decided in Postgres, by the state machine (ADR-0040);
what is here only refuses what can never be a key: INVALID_ARGUMENT on the
field, before anything is written.
"""

from __future__ import annotations

import re
from dataclasses import replace

from jobplane.errors import InvalidArgument
from jobplane.store.job_submit import NewJob
from jobplane.types import ConcurrencyMode

#: The longest key, in characters.
MAX_KEY_CHARS = 256
#: The highest limit a key may have.
MAX_LIMIT = 10_000
# C0 controls, DEL and C1 controls.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# ConcurrencyMode's numbers in jobs.proto.
_MODES = {0: ConcurrencyMode.QUEUE, 1: ConcurrencyMode.QUEUE, 2: ConcurrencyMode.REJECT}


def check_concurrency(key: str, limit: int, mode: int) -> tuple[str | None, int, ConcurrencyMode]:
    """The key (None: none), its limit (0 means 1) and the mode, or INVALID_ARGUMENT."""
    if mode not in _MODES:
        raise InvalidArgument(f"unknown concurrency_mode {mode}", field="concurrency_mode")
    if not key:
        if limit:
            raise InvalidArgument(
                "concurrency_limit needs a concurrency_key", field="concurrency_limit"
            )
        if mode:
            raise InvalidArgument(
                "concurrency_mode needs a concurrency_key", field="concurrency_mode"
            )
        return None, 0, ConcurrencyMode.QUEUE
    if len(key) > MAX_KEY_CHARS:
        raise InvalidArgument(
            f"concurrency_key is longer than {MAX_KEY_CHARS} characters", field="concurrency_key"
        )
    if _CONTROL.search(key):
        raise InvalidArgument("concurrency_key has control characters", field="concurrency_key")
    if not key.strip():
        raise InvalidArgument("concurrency_key is blank", field="concurrency_key")
    if limit < 0 or limit > MAX_LIMIT:
        raise InvalidArgument(
            f"concurrency_limit must be 1 to {MAX_LIMIT} (0 means 1)", field="concurrency_limit"
        )
    return key, limit or 1, _MODES[mode]


def with_concurrency(new: NewJob, key: str, limit: int, mode: int) -> NewJob:
    """``new`` with the request's concurrency key, checked."""
    checked_key, checked_limit, checked_mode = check_concurrency(key, limit, mode)
    if checked_key is None:
        return new
    return replace(
        new,
        concurrency_key=checked_key,
        concurrency_limit=checked_limit,
        concurrency_mode=checked_mode,
    )
