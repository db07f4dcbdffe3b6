"""``jobplane submit --at TIME`` and ``--in DURATION``: a delayed job's start from the command line;
``--deadline TIME|DURATION``: the time by which it must have ended.

``--at`` is an RFC 3339 time with its zone (``2027-01-31T09:00:00Z``,
``2027-01-31T10:00:00+01:00``): a time without one would silently mean the
machine's zone or UTC. ``--in`` is a number of seconds or a sum of units,
``90``, ``90s``, ``15m``, ``1h30m``, ``2d`` (docs/scheduling.md). ``--deadline``
takes either: a duration counts from when the server accepts the job.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta

from jobplane.client._cli_run import UsageError

_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
_SECONDS = re.compile(r"\d{1,12}(?:\.\d+)?")
_PARTS = re.compile(r"(?:\d+(?:\.\d+)?[dhms])+")


def parse_at(text: str, flag: str = "--at") -> datetime:
    """``--at``: an RFC 3339 time with a zone offset or ``Z``."""
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise UsageError(
            f"{flag} must be an RFC 3339 time such as 2027-01-31T09:00:00Z, not {text!r}"
        ) from None
    if value.tzinfo is None:
        raise UsageError(f"{flag} needs a time zone (Z or +01:00): {text!r}")
    return value


def parse_in(text: str, flag: str = "--in") -> timedelta:
    """``--in``: seconds (``90``, ``1.5``) or units summed (``1h30m``, ``2d``, ``45s``)."""
    raw = text.strip().lower()
    if raw.startswith("-"):
        raise UsageError(f"{flag} must not be negative: {text!r}")
    if _SECONDS.fullmatch(raw):
        return timedelta(seconds=float(raw))
    if not _PARTS.fullmatch(raw):
        raise UsageError(
            f"{flag} must be seconds or a duration such as 90s, 15m, 1h30m or 2d, not {text!r}"
        )
    try:
        return timedelta(seconds=sum(float(n) * _UNITS[u] for n, u in _PART.findall(raw)))
    except OverflowError:
        raise UsageError(f"{flag} is too long: {text!r}") from None


def parse_deadline(text: str) -> datetime | timedelta:
    """``--deadline``: an RFC 3339 time with its zone, or a duration as ``--in`` takes it."""
    raw = text.strip().lower()
    if raw.startswith("-") or _SECONDS.fullmatch(raw) or _PARTS.fullmatch(raw):
        return parse_in(text, "--deadline")
    return parse_at(text, "--deadline")
