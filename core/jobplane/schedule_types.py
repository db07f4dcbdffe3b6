"""A recurring schedule as the SDK, the server and the store pass it (ADR-0041).

Plain values, free of gRPC and of the database, like :mod:`jobplane.types`
for jobs; :mod:`jobplane.schedule_spec` says when one runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from jobplane.schedule_spec import CatchUp, Overlap, Spec

__all__ = ["CatchUp", "JobTemplate", "Overlap", "Schedule", "SchedulePage", "Spec"]

#: The label every job a schedule starts carries: the schedule's name.
SCHEDULE_LABEL = "jobplane.dev/schedule"


@dataclass(frozen=True, slots=True)
class JobTemplate:
    """The job each run submits, as SubmitJob takes it."""

    type: str
    payload: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    #: 0: the queue's default.
    max_attempts: int = 0
    #: None: the queue's default.
    timeout_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Schedule:
    """A job template and when it runs; ``name`` is ``schedules/{id}``."""

    name: str
    template: JobTemplate
    spec: Spec
    description: str = ""
    overlap: Overlap = Overlap.SKIP
    catch_up: CatchUp = CatchUp.SKIP
    #: The most missed ticks catch-up ALL runs; 0: the default (100).
    catch_up_limit: int = 0
    paused: bool = False
    #: When the next run starts (its tick and jitter); None when no tick is left.
    next_run_time: datetime | None = None
    #: When the newest run was submitted.
    last_run_time: datetime | None = None
    #: The newest runs' jobs, newest first (``jobs/{id}``), at most ten.
    recent_runs: tuple[str, ...] = ()
    #: Runs started, and ticks that started none (overlap or catch-up).
    runs: int = 0
    skipped: int = 0
    #: Why the newest tick started no job, when it was refused (e.g. its type
    #: no longer routes); empty otherwise.
    last_error: str = ""
    create_time: datetime | None = None
    update_time: datetime | None = None

    @property
    def id(self) -> str:
        """The id part of ``name``."""
        return self.name.removeprefix("schedules/")


@dataclass(frozen=True, slots=True)
class SchedulePage:
    """One page of ListSchedules."""

    schedules: list[Schedule]
    next_page_token: str = ""
