"""The bench's target list: each target judged against the figure of its run."""

from __future__ import annotations

import math

from bench.run import Figure
from bench.targets import TARGETS, Target, verdicts


def _line(lines: list[str], what: str) -> str:
    (line,) = [line for line in lines if line.strip().startswith(what + ":")]
    return line


def test_a_target_is_met_or_missed_by_its_figure() -> None:
    figures = [
        Figure("peers_jobplane_dev_over_celery", 4.2, "x jobs/s", {}),
        Figure("peers_jobplane_dev_over_procrastinate", 1.49, "x jobs/s", {}),
        Figure("submit_to_start_p50", 5.0, "ms", {}),
        Figure("submit_to_start_p99", 25.1, "ms", {}),
    ]
    lines = verdicts(figures)
    assert _line(lines, "rate against Celery, shipped defaults").endswith("target >= 4: met")
    assert _line(lines, "rate against Procrastinate, shipped defaults").endswith(
        "target >= 1.5: missed"
    )
    assert _line(lines, "submit → start p50 at half load").endswith("target <= 5: met")
    assert _line(lines, "submit → start p99 at half load").endswith("target <= 25: missed")
    assert "4.20 x jobs/s (peers_jobplane_dev_over_celery)" in _line(
        lines, "rate against Celery, shipped defaults"
    )


def test_a_target_whose_figure_the_run_left_out_says_so() -> None:
    lines = verdicts([Figure("submit_to_start_p50", 3.0, "ms", {})])
    line = _line(lines, "BatchSubmitJobs accepted")
    assert "not measured in this run (--only batch)" in line
    assert "met" not in line.replace("measured", "")


def test_every_target_is_listed_once() -> None:
    lines = verdicts([])
    assert len(lines) == 1 + len(TARGETS)
    assert len({t.what for t in TARGETS}) == len(TARGETS)


def test_a_figure_that_is_not_a_number_misses() -> None:
    target = Target("x", "f", "<=", 2.0, "peers")
    assert not target.met(math.nan)
    assert target.met(2.0)
    assert not Target("x", "f", ">=", 2.0, "peers").met(1.99)
