"""The built-in retention schedule is the one docs/scheduling.md describes."""

from __future__ import annotations

from jobplane.schedule_types import CatchUp, Overlap
from jobplane.server.schedule_builtin import RETENTION_TYPE, retention_schedule


def test_retention_runs_daily_at_0315_utc_spread_over_half_an_hour_catching_up_once() -> None:
    schedule = retention_schedule()
    assert schedule.name == "schedules/jobplane-retention"
    assert schedule.template.type == RETENTION_TYPE == "maintenance.retention"
    assert schedule.spec.cron == "15 3 * * *"
    assert schedule.spec.time_zone == "UTC"
    assert schedule.spec.jitter_seconds == 30 * 60
    assert schedule.overlap is Overlap.SKIP
    assert schedule.catch_up is CatchUp.ONE
