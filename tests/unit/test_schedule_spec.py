"""When a schedule ticks: cron in a time zone across DST, intervals, windows,
jitter and catch-up (jobplane.schedule_spec; docs/scheduling.md)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobplane.errors import InvalidArgument
from jobplane.schedule_spec import (
    MISSED_AFTER,
    CatchUp,
    Spec,
    check_spec,
    due_ticks,
    jitter_of,
    next_tick,
)

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")
ANCHOR = datetime(2026, 1, 1, tzinfo=UTC)


def _ticks(spec: Spec, after: datetime, count: int) -> list[datetime]:
    ticks = []
    for _ in range(count):
        tick = next_tick(spec, ANCHOR, after)
        assert tick is not None
        ticks.append(tick)
        after = tick
    return ticks


def test_cron_ticks_in_its_zone() -> None:
    spec = Spec(cron="0 9 * * 1-5", time_zone="America/New_York")
    ticks = _ticks(spec, datetime(2026, 6, 5, 12, tzinfo=UTC), 3)  # a Friday, 08:00 in NY
    assert [t.astimezone(NEW_YORK).strftime("%a %H:%M") for t in ticks] == [
        "Fri 09:00",
        "Mon 09:00",
        "Tue 09:00",
    ]
    assert ticks[0] == datetime(2026, 6, 5, 13, tzinfo=UTC)


def test_a_wall_time_skipped_by_spring_forward_runs_at_the_first_valid_time_after() -> None:
    # Europe/Berlin: 2026-03-29 02:00 CET -> 03:00 CEST; 02:30 does not exist.
    spec = Spec(cron="30 2 * * *", time_zone="Europe/Berlin")
    ticks = _ticks(spec, datetime(2026, 3, 28, 12, tzinfo=UTC), 3)
    local = [t.astimezone(BERLIN) for t in ticks]
    assert [t.strftime("%d %H:%M") for t in local] == ["29 03:00", "30 02:30", "31 02:30"]
    # New York: 2026-03-08 02:00 EST -> 03:00 EDT.
    spec = Spec(cron="30 2 * * *", time_zone="America/New_York")
    first = next_tick(spec, ANCHOR, datetime(2026, 3, 7, 12, tzinfo=UTC))
    assert first is not None
    assert first.astimezone(NEW_YORK).strftime("%d %H:%M") == "08 03:00"


def test_a_wall_time_repeated_by_fall_back_runs_once_at_its_first_occurrence() -> None:
    # Europe/Berlin: 2026-10-25 03:00 CEST -> 02:00 CET; 02:30 happens twice.
    spec = Spec(cron="30 2 * * *", time_zone="Europe/Berlin")
    ticks = _ticks(spec, datetime(2026, 10, 24, 12, tzinfo=UTC), 2)
    assert ticks[0] == datetime(2026, 10, 25, 0, 30, tzinfo=UTC)  # 02:30 CEST, the first
    assert ticks[1] == datetime(2026, 10, 26, 1, 30, tzinfo=UTC)  # next day, CET
    spec = Spec(cron="30 1 * * *", time_zone="America/New_York")  # 2026-11-01 01:30 twice
    ticks = _ticks(spec, datetime(2026, 10, 31, 12, tzinfo=UTC), 2)
    assert ticks == [
        datetime(2026, 11, 1, 5, 30, tzinfo=UTC),
        datetime(2026, 11, 2, 6, 30, tzinfo=UTC),
    ]


def test_an_expression_with_every_hour_runs_on_both_passes_of_a_repeated_hour() -> None:
    spec = Spec(cron="0 * * * *", time_zone="Europe/Berlin")
    ticks = _ticks(spec, datetime(2026, 10, 24, 23, 30, tzinfo=UTC), 4)
    # Every real hour: 01:00 CEST, 02:00 CEST, 02:00 CET, 03:00 CET.
    assert [t - ticks[0] for t in ticks] == [timedelta(hours=h) for h in range(4)]


def test_an_expression_with_every_minute_step_repeats_a_named_hour_on_fall_back() -> None:
    # What cronsim does: the minute field `*/15` matches on both passes of 02:xx.
    spec = Spec(cron="*/15 2 * * *", time_zone="Europe/Berlin")
    ticks = _ticks(spec, datetime(2026, 10, 24, 12, tzinfo=UTC), 9)
    assert ticks[:8] == [
        datetime(2026, 10, 25, 0, 0, tzinfo=UTC) + timedelta(minutes=15 * k) for k in range(8)
    ]
    assert ticks[8] == datetime(2026, 10, 26, 1, 0, tzinfo=UTC)  # next day, CET


def test_catch_up_in_a_repeated_hour_reaches_its_second_pass() -> None:
    # Down from 00:00 CEST to 02:06 CET on the fall-back day: every real 20 minutes is due.
    spec = Spec(cron="*/20 * * * *", time_zone="Europe/Berlin")
    first = datetime(2026, 10, 24, 22, 0, tzinfo=UTC)  # 00:00 CEST
    now = datetime(2026, 10, 25, 1, 6, tzinfo=UTC)  # 02:06 CET
    everything = due_ticks(spec, first, first, now, CatchUp.ALL)
    assert everything == [first + timedelta(minutes=20 * k) for k in range(10)]
    newest = datetime(2026, 10, 25, 1, 0, tzinfo=UTC)  # 02:00 CET, not 02:00 CEST
    assert due_ticks(spec, first, first, now, CatchUp.ONE) == [newest]
    on_time = newest + timedelta(seconds=30)
    assert due_ticks(spec, first, first, on_time, CatchUp.SKIP) == [newest]


def test_aliases_and_default_zone() -> None:
    tick = next_tick(Spec(cron="@daily"), ANCHOR, datetime(2026, 5, 1, 10, tzinfo=UTC))
    assert tick == datetime(2026, 5, 2, tzinfo=UTC)


def test_intervals_count_from_the_anchor() -> None:
    spec = Spec(interval_seconds=90)
    assert next_tick(spec, ANCHOR, ANCHOR - timedelta(days=1)) == ANCHOR
    assert next_tick(spec, ANCHOR, ANCHOR) == ANCHOR + timedelta(seconds=90)
    assert next_tick(spec, ANCHOR, ANCHOR + timedelta(seconds=100)) == ANCHOR + timedelta(
        seconds=180
    )


def test_the_window_bounds_the_ticks() -> None:
    start = datetime(2026, 2, 1, tzinfo=UTC)
    end = datetime(2026, 2, 3, tzinfo=UTC)
    spec = Spec(cron="0 12 * * *", start_time=start, end_time=end)
    assert next_tick(spec, ANCHOR, ANCHOR) == datetime(2026, 2, 1, 12, tzinfo=UTC)
    assert next_tick(spec, ANCHOR, datetime(2026, 2, 2, 12, tzinfo=UTC)) is None
    spec = Spec(interval_seconds=3600, start_time=start, end_time=end)
    assert next_tick(spec, start, ANCHOR) == start
    assert next_tick(spec, start, end) is None


def test_jitter_is_bounded_and_the_same_for_a_tick() -> None:
    tick = datetime(2026, 3, 1, tzinfo=UTC)
    delays = {jitter_of("uid-1", tick + timedelta(minutes=i), 30) for i in range(200)}
    assert all(timedelta(0) <= d < timedelta(seconds=30) for d in delays)
    assert len(delays) > 100
    assert jitter_of("uid-1", tick, 30) == jitter_of("uid-1", tick, 30)
    assert jitter_of("uid-1", tick, 0) == timedelta(0)


def test_catch_up_after_downtime() -> None:
    spec = Spec(interval_seconds=60)
    first = ANCHOR + timedelta(minutes=1)
    now = ANCHOR + timedelta(minutes=10, seconds=5)  # ten ticks due, the newest on time
    assert due_ticks(spec, ANCHOR, first, now, CatchUp.SKIP) == [ANCHOR + timedelta(minutes=10)]
    assert due_ticks(spec, ANCHOR, first, now, CatchUp.ONE) == [ANCHOR + timedelta(minutes=10)]
    everything = due_ticks(spec, ANCHOR, first, now, CatchUp.ALL)
    assert everything == [ANCHOR + timedelta(minutes=m) for m in range(1, 11)]
    assert due_ticks(spec, ANCHOR, first, now, CatchUp.ALL, 3) == everything[-3:]
    spec = Spec(interval_seconds=300)
    newest = ANCHOR + timedelta(minutes=20)
    late = newest + MISSED_AFTER + timedelta(seconds=1)  # even the newest is missed
    assert due_ticks(spec, ANCHOR, first, late, CatchUp.SKIP) == []
    assert due_ticks(spec, ANCHOR, first, late, CatchUp.ONE) == [newest]
    assert due_ticks(spec, ANCHOR, first, ANCHOR, CatchUp.ALL) == []


def test_a_run_delayed_by_jitter_over_a_minute_is_not_missed() -> None:
    """Lateness counts from the run's own start (tick + jitter), not the bare tick."""
    spec = Spec(interval_seconds=3600, jitter_seconds=600)
    delays = []
    for hour in range(1, 101):
        tick = ANCHOR + timedelta(hours=hour)
        delay = jitter_of("uid-1", tick, spec.jitter_seconds)
        delays.append(delay)
        now = tick + delay + timedelta(seconds=1)  # picked up as soon as its run is due
        assert due_ticks(spec, ANCHOR, tick, now, CatchUp.SKIP, uid="uid-1") == [tick]
        late = tick + delay + MISSED_AFTER + timedelta(seconds=1)
        assert due_ticks(spec, ANCHOR, tick, late, CatchUp.SKIP, uid="uid-1") == []
    assert sum(d > MISSED_AFTER for d in delays) > 80


def test_catch_up_all_walks_cron_ticks() -> None:
    spec = Spec(cron="*/15 * * * *")
    first = datetime(2026, 4, 1, 10, 0, tzinfo=UTC)
    now = datetime(2026, 4, 1, 11, 0, 30, tzinfo=UTC)
    ticks = due_ticks(spec, ANCHOR, first, now, CatchUp.ALL)
    assert ticks == [first + timedelta(minutes=15 * k) for k in range(5)]
    assert due_ticks(spec, ANCHOR, first, now, CatchUp.ONE) == [ticks[-1]]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (Spec(cron="61 * * * *"), "schedule.spec.cron"),
        (Spec(cron="* * *"), "schedule.spec.cron"),
        (Spec(cron="0 0 30 2 *"), "schedule.spec.cron"),
        (Spec(cron="0 * * * *", time_zone="Mars/Olympus"), "schedule.spec.time_zone"),
        (Spec(interval_seconds=0.5), "schedule.spec.interval"),
        (Spec(interval_seconds=-5), "schedule.spec.interval"),
        (Spec(), "schedule.spec.interval"),
        (Spec(cron="* * * * *", interval_seconds=60), "schedule.spec.cron"),
        (Spec(interval_seconds=60, time_zone="UTC"), "schedule.spec.time_zone"),
        (
            Spec(interval_seconds=60, start_time=datetime(1970, 1, 1, tzinfo=UTC)),
            "schedule.spec.start_time",
        ),
        (
            Spec(interval_seconds=60, end_time=datetime(9999, 6, 1, tzinfo=UTC)),
            "schedule.spec.end_time",
        ),
        (
            Spec(
                interval_seconds=60,
                start_time=datetime(2030, 1, 1, tzinfo=UTC),
                end_time=datetime(2029, 1, 1, tzinfo=UTC),
            ),
            "schedule.spec.end_time",
        ),
        (Spec(interval_seconds=60, jitter_seconds=-1), "schedule.spec.jitter"),
    ],
)
def test_bad_specs_are_refused_on_their_field(spec: Spec, field: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        check_spec(spec)
    assert refused.value.field == field


@given(seconds=st.floats(allow_nan=True, allow_infinity=True))
def test_any_interval_is_accepted_only_in_range(seconds: float) -> None:
    spec = Spec(interval_seconds=seconds)
    if 1.0 <= seconds <= 366 * 24 * 3600:
        check_spec(spec)
        return
    with pytest.raises(InvalidArgument) as refused:
        check_spec(spec)
    assert refused.value.field == "schedule.spec.interval"


@given(expression=st.text(max_size=40))
def test_any_cron_text_is_accepted_or_refused_on_cron(expression: str) -> None:
    refused: InvalidArgument | None = None
    try:
        check_spec(Spec(cron=expression))
    except InvalidArgument as exc:
        refused = exc
    if refused is None:
        assert next_tick(Spec(cron=expression), ANCHOR, ANCHOR) is not None
    else:
        assert refused.field in {"schedule.spec.cron", "schedule.spec.interval"}
