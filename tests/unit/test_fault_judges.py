"""The fault suite's own judges: how many of a group ran at once, and the ticks'
promises, checked against the plain definitions they must agree with."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from jobplane.schedule_spec import CatchUp, Overlap
from tests.faults.chaos import most_at_once
from tests.faults.test_schedule_faults import Kind, Run, judge_ticks

BASE = datetime(2026, 1, 1, tzinfo=UTC)
SPANS = st.lists(
    st.tuples(st.sampled_from("ab"), st.integers(0, 20), st.integers(1, 6)), max_size=12
)


@given(SPANS)
def test_most_at_once_is_the_most_spans_over_any_instant(raw: list[tuple[str, int, int]]) -> None:
    spans = [(g, BASE + timedelta(seconds=s), BASE + timedelta(seconds=s + d)) for g, s, d in raw]
    expected = {
        group: max(
            sum(1 for h, a, b in spans if h == group and a <= t < b)
            for g, t, _ in spans
            if g == group
        )
        for group in {g for g, _, _ in spans}
    }
    assert most_at_once(spans) == expected


def _runs(*groups: list[int]) -> list[Run]:
    """Runs of ticks BASE + k s, a transaction per group, in the order given."""
    return [
        Run(uuid.uuid4(), BASE + timedelta(seconds=k), "queued", BASE + timedelta(hours=i), False)
        for i, group in enumerate(groups)
        for k in group
    ]


def _judged(kind: Kind, *groups: list[int], counted: int | None = None) -> list[str]:
    runs = sorted(_runs(*groups), key=lambda r: r.tick)
    schedule = {
        "runs": len(runs) if counted is None else counted,
        "recent_runs": [r.id for r in reversed(runs)][:10],
        "anchor_time": BASE,
        "next_tick": runs[-1].tick + timedelta(seconds=1),
    }
    return judge_ticks("s", kind, BASE, schedule, runs)


ALL = Kind(CatchUp.ALL, Overlap.ALLOW_ALL, limit=3)


def test_every_tick_or_the_newest_three_after_a_gap_is_kept() -> None:
    assert _judged(ALL, [0, 1], [2], [6, 7, 8], [9]) == []
    assert _judged(ALL, [0, 1], [2], [7, 8], [9]) != []  # 3 to 6 lost, two ran
    assert _judged(ALL, [0], [1], counted=3) != []  # a tick counted twice
    assert _judged(ALL, [0], [2], [1]) != []  # a tick after a newer one
    assert _judged(Kind(CatchUp.ONE, Overlap.ALLOW_ALL), [0], [4, 5]) != []  # ONE ran two
    assert _judged(Kind(CatchUp.ONE, Overlap.ALLOW_ALL), [0], [4], [5]) == []
