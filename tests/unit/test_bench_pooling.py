"""The arithmetic of ``--only pooling``: each round's pgbouncer/direct ratio and the table."""

from __future__ import annotations

from bench.pooling import Arm, markdown, ratios
from bench.scaling_report import Step


def _arm(name: str, round_: int, jobs_per_s: float, postgres_ms: float) -> Arm:
    step = Step(
        n=1,
        pool=6,
        seconds=10.0,
        jobs_per_s=jobs_per_s,
        postgres_cores=0.5,
        db_cores=0.5,
        jobplane_cores=1.0,
        submit_cores=0.1,
        machine_share=0.9,
        postgres_share=0.25,
        jobs=5000,
        xacts_per_job=1.5,
        wal_per_job=8000.0,
        postgres_ms_per_job=postgres_ms,
    )
    return Arm(name, round_, step, bouncer_ms_per_job=0.2)


def test_each_round_is_its_own_pair_whatever_order_its_arms_ran_in() -> None:
    arms = [
        _arm("direct", 0, 400.0, 1.0),
        _arm("pgbouncer", 0, 300.0, 1.5),
        _arm("pgbouncer", 1, 360.0, 1.2),
        _arm("direct", 1, 450.0, 1.0),
        _arm("direct", 2, 500.0, 2.0),  # its pgbouncer arm never ran: no ratio
    ]
    assert ratios(arms, "jobs_per_s") == [0.75, 0.8]
    assert ratios(arms, "postgres_ms_per_job") == [1.5, 1.2]


def test_the_table_has_a_row_an_arm_and_the_median_ratios_with_the_load() -> None:
    arms = [
        _arm("direct", 0, 400.0, 1.0),
        _arm("pgbouncer", 0, 300.0, 1.5),
        _arm("pgbouncer", 1, 360.0, 1.2),
        _arm("direct", 1, 450.0, 1.0),
        _arm("direct", 2, 500.0, 1.0),
        _arm("pgbouncer", 2, 350.0, 1.1),
    ]
    text = markdown(arms, (3.5, 6.25))
    assert "| 2 | pgbouncer | 360 | 1.20 | 0.20 | 1.5 | 90% |" in text
    assert sum(line.startswith("| ") for line in text.splitlines()) == 1 + 6  # head, arms
    assert text.splitlines()[-1] == (
        "pooling: pgbouncer/direct, median of 3 rounds: jobs/s 0.75x, "
        "Postgres CPU ms/job 1.20x; load average 3.50 before, 6.25 after"
    )
