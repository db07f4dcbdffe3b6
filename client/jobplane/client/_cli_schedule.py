"""``jobplane submit --at TIME`` and ``--in DURATION``: a delayed job's start from the command line.

``--at`` is an RFC 3339 time with its zone (``2027-01-31T09:00:00Z``,
``2027-01-31T10:00:00+01:00``): a time without one would silently mean the
machine's zone or UTC. ``--in`` is a number of seconds or a sum of units,
``90``, ``90s``, ``15m``, ``1h30m``, ``2d`` (docs/scheduling.md).
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta

from jobplane.client._cli_run import UsageError

_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_SECONDS = re.compile(r"\d{1,12}(?:\.\d+)?")
_PARTS = re.compile(r"(?:\d+(?:\.\d+)?[dhms])+")


def parse_at(text: str) -> datetime:
    """``--at``: an RFC 3339 time with a zone offset or ``Z``."""
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(
            f"--at must be an RFC 3339 time such as 2027-01-31T09:00:00Z, not {text!r}"
        ) from None
    if value.tzinfo is None:
        raise UsageError(f"--at needs a time zone (Z or +01:00): {text!r}")
    return value


def parse_in(text: str) -> timedelta:
    """``--in``: seconds (``90``, ``1.5``) or units summed (``1h30m``, ``2d``, ``45s``)."""
    raw = text.strip().lower()
    if raw.startswith("-"):
        raise UsageError(f"--in must not be negative: {text!r}")
    if _SECONDS.fullmatch(raw):
        return timedelta(seconds=float(raw))
    if not _PARTS.fullmatch(raw):
        raise UsageError(
            f"--in must be seconds or a duration such as 90s, 15m, 1h30m or 2d, not {text!r}"
        )
    try:
        return timedelta(seconds=sum(float(n) * _UNITS[u] for n, u in _PART.findall(raw)))
    except OverflowError:
        raise UsageError(f"--in is too long: {text!r}") from None
