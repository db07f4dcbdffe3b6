"""When a recurring schedule runs: its spec, its checks, and its ticks (ADR-0041).

Pure: no database and no clock of its own, so the server (which checks a spec
before it writes one) and the ticker (which computes the ticks) decide alike,
and the tests can walk through a DST change in a few microseconds.

A *tick* is a nominal run time: a cron match in the spec's time zone, or
``anchor + k * interval``. A run of a tick starts at the tick plus its
jitter (a fraction of ``jitter`` drawn from the schedule and the tick, so a
tick's delay is the same whichever process computes it).

Daylight saving time, in the spec's zone, as Debian's cron and the cronsim
library do it: a wall time that a spring-forward skips runs at the first
valid time after it (02:30 on a day without 02:30 runs at 03:00); a wall time
that a fall-back repeats runs on each pass when the minute or the hour field
is ``*`` or ``*/n`` (``*/30 * * * *`` runs every real half hour, and
``*/15 2 * * *`` eight times on the fall-back day), and otherwise once, at its
first occurrence (``30 2 * * *``, ``0,30 2 * * *``).
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from jobplane.errors import InvalidArgument, shown

__all__ = [
    "CatchUp",
    "Overlap",
    "Spec",
    "check_spec",
    "due_ticks",
    "jitter_of",
    "next_tick",
]

#: The shortest interval: the ticker looks for due schedules about once a second.
MIN_INTERVAL_SECONDS = 1.0
MAX_INTERVAL_SECONDS = 366 * 24 * 3600.0
MAX_JITTER_SECONDS = 24 * 3600.0
#: A start or end time must fall in [EARLIEST, LATEST): an unset protobuf
#: Timestamp reads as 1970, and 9999 is where datetime arithmetic ends.
EARLIEST = datetime(2000, 1, 1, tzinfo=UTC)
LATEST = datetime(9999, 1, 1, tzinfo=UTC)
#: How many missed ticks catch-up ALL runs at most, when the schedule says 0.
DEFAULT_CATCH_UP_LIMIT = 100
MAX_CATCH_UP_LIMIT = 1000
#: A tick the ticker reaches later than this is *missed* (its catch-up policy
#: decides); one reached sooner runs as usual.
MISSED_AFTER = timedelta(seconds=60)
# How far forward a cron expression is walked looking for due ticks.
_MAX_WALK = 100_000
_ALIASES = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


class Overlap(enum.StrEnum):
    """What a tick does while an earlier run of the schedule is still QUEUED or RUNNING."""

    SKIP = "skip"
    BUFFER_ONE = "buffer_one"
    ALLOW_ALL = "allow_all"
    CANCEL_OTHER = "cancel_other"


class CatchUp(enum.StrEnum):
    """What the ticks missed while nothing ticked (every ticker down, or paused) become."""

    SKIP = "skip"
    ONE = "one"
    ALL = "all"


@dataclass(frozen=True, slots=True)
class Spec:
    """When a schedule runs: a cron expression in ``time_zone`` or a fixed interval."""

    cron: str = ""
    time_zone: str = ""
    interval_seconds: float = 0.0
    start_time: datetime | None = None
    end_time: datetime | None = None
    jitter_seconds: float = 0.0


def _expression(cron: str) -> str:
    return _ALIASES.get(cron.strip().lower(), cron.strip())


def _zone(spec: Spec) -> ZoneInfo:
    return ZoneInfo(spec.time_zone or "UTC")


def check_spec(spec: Spec, prefix: str = "schedule.spec") -> None:
    """Refuse a spec that cannot tick, naming the field (``schedule.spec.cron``)."""
    if bool(spec.cron) == bool(spec.interval_seconds):
        raise InvalidArgument(
            "set exactly one of cron and interval",
            field=f"{prefix}.{'cron' if spec.cron else 'interval'}",
        )
    if spec.cron:
        _check_cron(spec, prefix)
    elif not math.isfinite(spec.interval_seconds) or not (
        MIN_INTERVAL_SECONDS <= spec.interval_seconds <= MAX_INTERVAL_SECONDS
    ):
        raise InvalidArgument(
            f"interval must be {MIN_INTERVAL_SECONDS:g} s to {MAX_INTERVAL_SECONDS:g} s",
            field=f"{prefix}.interval",
        )
    elif spec.time_zone:
        raise InvalidArgument("time_zone goes with cron only", field=f"{prefix}.time_zone")
    for name, when in (("start_time", spec.start_time), ("end_time", spec.end_time)):
        if when is not None and not EARLIEST <= when < LATEST:
            raise InvalidArgument(
                f"{name} must be in the years 2000 to 9998", field=f"{prefix}.{name}"
            )
    if spec.start_time and spec.end_time and spec.end_time <= spec.start_time:
        raise InvalidArgument("end_time must be after start_time", field=f"{prefix}.end_time")
    if not math.isfinite(spec.jitter_seconds) or not (
        0 <= spec.jitter_seconds <= MAX_JITTER_SECONDS
    ):
        raise InvalidArgument(
            f"jitter must be 0 to {MAX_JITTER_SECONDS:g} s", field=f"{prefix}.jitter"
        )


def _check_cron(spec: Spec, prefix: str) -> None:
    from cronsim import CronSim, CronSimError  # the server's install has it

    try:
        zone = _zone(spec)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidArgument(
            f"time_zone {shown(spec.time_zone)} is not an IANA time zone",
            field=f"{prefix}.time_zone",
        ) from None
    expression = _expression(spec.cron)
    if len(expression.split()) != 5 or len(spec.cron) > 256:
        raise InvalidArgument(
            f"cron {shown(spec.cron)} must have five fields (minute hour day month weekday) "
            "or be one of " + ", ".join(sorted(_ALIASES)),
            field=f"{prefix}.cron",
        )
    try:
        next(CronSim(expression, datetime(2001, 1, 1, tzinfo=zone)))
    except (CronSimError, StopIteration, ValueError, OverflowError) as exc:
        raise InvalidArgument(
            f"cron {shown(spec.cron)} is not a valid expression: {exc}", field=f"{prefix}.cron"
        ) from None


def next_tick(spec: Spec, anchor: datetime, after: datetime) -> datetime | None:
    """The first tick strictly after ``after`` inside the window; None when none is left.

    ``anchor`` is where an interval counts from (its start_time, else when the
    schedule was created or its spec last changed); cron ignores it.
    """
    if spec.start_time is not None and after < spec.start_time:
        after = spec.start_time - timedelta(microseconds=1)
    tick = _cron_after(spec, after) if spec.cron else _interval_after(spec, anchor, after)
    if tick is None or (spec.end_time is not None and tick > spec.end_time):
        return None
    return tick


def _cron_after(spec: Spec, after: datetime) -> datetime | None:
    from cronsim import CronSim

    try:
        return next(CronSim(_expression(spec.cron), after.astimezone(_zone(spec)))).astimezone(UTC)
    except (StopIteration, OverflowError, ValueError):
        return None


def _interval_after(spec: Spec, anchor: datetime, after: datetime) -> datetime | None:
    step = timedelta(seconds=spec.interval_seconds)
    if after < anchor:
        return anchor
    count = math.floor((after - anchor) / step) + 1
    try:
        return anchor + step * count
    except OverflowError:
        return None


def _interval_before(spec: Spec, anchor: datetime, moment: datetime) -> datetime | None:
    """The newest interval tick at or before ``moment`` (None before the anchor)."""
    if moment < anchor:
        return None
    step = timedelta(seconds=spec.interval_seconds)
    return anchor + step * math.floor((moment - anchor) / step)


def due_ticks(
    spec: Spec,
    anchor: datetime,
    first: datetime,
    now: datetime,
    policy: CatchUp,
    limit: int = 0,
    *,
    uid: str = "",
) -> list[datetime]:
    """Which due ticks run, oldest first, for a schedule whose next tick was ``first``.

    Every tick from ``first`` to ``now`` is due. The newest of them runs when
    it is not yet missed (reached within :data:`MISSED_AFTER` of its run's
    own start: the tick plus its jitter, drawn from ``uid``, the schedule's
    uid); the older ones, and a newest one reached late, were missed: SKIP
    runs none of them, ONE runs one run (for the newest due tick), ALL runs
    each, up to the ``limit`` newest (:data:`DEFAULT_CATCH_UP_LIMIT` when 0).
    """
    if first > now:
        return []
    newest = _newest_due(spec, anchor, first, now)
    # A run is awaited until its tick plus its jitter: late only after that.
    on_time = now - (newest + jitter_of(uid, newest, spec.jitter_seconds)) <= MISSED_AFTER
    if policy is CatchUp.SKIP:
        return [newest] if on_time else []
    if policy is CatchUp.ONE:
        return [newest]
    keep = limit or DEFAULT_CATCH_UP_LIMIT
    if not spec.cron:
        step = timedelta(seconds=spec.interval_seconds)
        count = min(keep, math.floor((newest - first) / step) + 1)
        return [newest - step * k for k in reversed(range(count))]
    ticks: deque[datetime] = deque(maxlen=keep)
    tick: datetime | None = first
    for _ in range(_MAX_WALK):
        if tick is None or tick > newest:
            break
        ticks.append(tick)
        tick = _cron_after(spec, tick)
    return list(ticks)


def _newest_due(spec: Spec, anchor: datetime, first: datetime, now: datetime) -> datetime:
    """The newest tick at or before ``now`` (``first`` at the least), inside the window."""
    until = now if spec.end_time is None else min(now, spec.end_time)
    cron = spec.cron
    found = _cron_newest(spec, first, until) if cron else _interval_before(spec, anchor, until)
    return first if found is None or found < first else found


def _cron_newest(spec: Spec, first: datetime, until: datetime) -> datetime | None:
    """The newest cron tick at or before ``until``, walked forward from ``first``.

    A backward search finds a tick near ``until`` at once, but in the hour a
    fall-back repeats it finds a wall time's first occurrence (02:00 CEST
    where 02:00 CET is due too): the walk forward from there, a few ticks at
    most, finds the real newest.
    """
    from cronsim import CronSim

    probe = until.astimezone(_zone(spec)) + timedelta(microseconds=1)
    try:
        behind = next(CronSim(_expression(spec.cron), probe, reverse=True)).astimezone(UTC)
    except (StopIteration, OverflowError, ValueError):
        return None
    newest = max(behind, first)
    for _ in range(_MAX_WALK):
        after = _cron_after(spec, newest)
        if after is None or after > until:
            break
        newest = after
    return newest if newest <= until else None


def jitter_of(schedule_uid: str, tick: datetime, jitter_seconds: float) -> timedelta:
    """The tick's delay: a fraction of ``jitter_seconds`` drawn from the schedule and
    the tick, the same in every process (whole milliseconds)."""
    if jitter_seconds <= 0:
        return timedelta(0)
    digest = hashlib.sha256(f"{schedule_uid}/{tick.isoformat()}".encode()).digest()
    fraction = int.from_bytes(digest[:8], "big") / 2**64
    return timedelta(milliseconds=math.floor(fraction * jitter_seconds * 1000))
