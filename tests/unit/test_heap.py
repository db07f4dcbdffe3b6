"""A long-running process's collector settings (ADR-0032)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from jobplane import heap, process


@pytest.fixture
def collector() -> Iterator[None]:
    """The collector as it was, restored after the test."""
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


@pytest.mark.usefixtures("collector")
def test_settling_freezes_what_the_process_holds_and_collects_the_young_less_often() -> None:
    held = {"made": "before"}
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    _, middle, old = gc.get_threshold()
    heap.settle()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (heap.YOUNG_THRESHOLD, middle, old)
    # What was held is kept; what is made after is collected as before.
    assert held == {"made": "before"}
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1


@pytest.mark.usefixtures("collector")
def test_a_process_settles_as_it_starts_waiting_for_its_stop_signal() -> None:
    gc.unfreeze()

    async def up() -> int:
        with process._stop_signals():
            return gc.get_freeze_count()

    assert asyncio.run(up()) > 0
