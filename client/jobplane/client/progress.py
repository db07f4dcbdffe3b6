"""Where a progress bar stands after each event of a job's stream."""

from __future__ import annotations

import math

from jobplane.types import EventType, JobEvent


class ProgressTracker:
    """Turns a job's events into a bar position that never runs backwards within an attempt.

    A new attempt starts again from its STARTED event (at 0: each attempt
    reports its own progress); within one attempt the bar only moves forward,
    and SUCCEEDED fills it. Other events leave it where it is::

        tracker = ProgressTracker()
        async for event in client.watch(job):
            position = tracker.update(event)
            if position is not None:
                bar.update(completed=position)
    """

    def __init__(self) -> None:
        self.attempt = 0
        self.position = 0.0

    def update(self, event: JobEvent) -> float | None:
        """The bar's position after ``event``; None when it stays where it is."""
        if event.type is EventType.SUCCEEDED:
            self.position = 1.0
            return self.position
        if event.type not in (EventType.PROGRESS, EventType.STARTED):
            return None
        if not math.isfinite(event.progress) or event.attempt < self.attempt:
            return None
        fraction = min(max(event.progress, 0.0), 1.0)
        if event.attempt > self.attempt:
            self.attempt = event.attempt
            self.position = fraction
            return self.position
        if fraction < self.position:
            return None
        self.position = fraction
        return self.position
