"""The arithmetic of the scaling sweep: per-step figures, the saturation point, the verdict."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench import scaling_report as r
from bench.scaling_report import Sample, Step

CORES = 4


def _sample(wall: float, ended: int, postgres: float, **more: object) -> Sample:
    fields: dict[str, object] = {
        "jobplane": 0.0,
        "submitters": 0.0,
        "machine": 0.0,
        "db_backends": {},
        **more,
    }
    return Sample(wall=wall, ended=ended, postgres=postgres, **fields)  # type: ignore[arg-type]


def _step(n: int, jobs_per_s: float, postgres_share: float, machine: float = 0.5) -> Step:
    return Step(
        n=n,
        pool=6,
        seconds=10.0,
        jobs_per_s=jobs_per_s,
        postgres_cores=postgres_share * CORES,
        db_cores=0.0,
        jobplane_cores=0.0,
        submit_cores=0.0,
        machine_share=machine,
        postgres_share=postgres_share,
        jobs=1000,
        xacts_per_job=4.0,
        wal_per_job=2000.0,
        postgres_ms_per_job=2.0,
    )


def test_a_step_s_rates_come_from_its_window_and_its_costs_from_every_job() -> None:
    before = _sample(
        100.0,
        50,
        20.0,
        jobplane=5.0,
        submitters=1.0,
        machine=1000.0,
        db_backends={1: 3.0},
        kinds={"server": 2.0, "relay": 1.0, "worker": 2.0},
    )
    after = _sample(
        110.0,
        2050,
        36.0,
        jobplane=25.0,
        submitters=4.0,
        machine=1032.0,
        # pid 1 used 4 s in the window, pid 2 started in it and used 2 s.
        db_backends={1: 7.0, 2: 2.0},
        kinds={"server": 10.0, "relay": 3.0, "worker": 12.0},
    )
    step = r.step_figures(
        3,
        5,
        CORES,
        (before, after),
        jobs=2500,
        xacts=10_000,
        wal_bytes=5_000_000,
        postgres_step=5.0,
    )
    assert step.seconds == 10.0
    assert step.jobs_per_s == 200.0
    assert step.postgres_cores == pytest.approx(1.6)
    assert step.postgres_share == pytest.approx(0.4)
    assert step.db_cores == pytest.approx(0.6)
    assert step.jobplane_cores == pytest.approx(2.0)
    assert step.submit_cores == pytest.approx(0.3)
    assert step.machine_share == pytest.approx(0.8)
    assert step.xacts_per_job == 4.0
    assert step.wal_per_job == 2000.0
    assert step.postgres_ms_per_job == 2.0
    assert step.kinds == pytest.approx({"server": 0.8, "relay": 0.2, "worker": 1.0})
    assert (step.n, step.pool, step.jobs) == (3, 5, 2500)


def test_a_window_out_of_order_is_refused() -> None:
    sample = _sample(5.0, 0, 0.0)
    with pytest.raises(ValueError, match="order"):
        r.step_figures(1, 6, CORES, (sample, sample), jobs=1, xacts=0, wal_bytes=0, postgres_step=0)


def test_a_step_without_jobs_costs_nothing_per_job() -> None:
    step = r.step_figures(
        1, 6, CORES, (_sample(0, 0, 0), _sample(1, 0, 1)), jobs=0, xacts=5, wal_bytes=9,
        postgres_step=1.0,
    )  # fmt: skip
    assert (step.xacts_per_job, step.wal_per_job, step.postgres_ms_per_job) == (0, 0, 0)


def test_saturation_is_the_first_flat_step_while_postgres_cpu_grows() -> None:
    steps = [_step(1, 500, 0.2), _step(2, 900, 0.35), _step(3, 950, 0.5), _step(4, 940, 0.6)]
    assert r.plateau(steps) == 2
    assert r.saturation(steps) == 2


def test_a_step_just_at_the_gain_still_rises() -> None:
    steps = [_step(1, 500, 0.2), _step(2, 550, 0.3), _step(3, 604, 0.4)]
    assert r.plateau(steps) == 2  # 604 < 605: flat against the best (550) before it
    assert r.saturation(steps) == 2
    assert r.plateau(steps[:2]) is None  # 550 is exactly 10 % above 500


def test_a_plateau_without_postgres_growing_is_no_saturation_of_postgres() -> None:
    steps = [_step(1, 500, 0.3), _step(2, 900, 0.5), _step(3, 880, 0.5), _step(4, 870, 0.6)]
    assert r.plateau(steps) == 2
    # Step 4 is flat too and Postgres grew there: the saturation point.
    assert r.saturation(steps) == 3
    assert r.saturation(steps[:3]) is None


def test_a_dip_compares_with_the_best_step_not_the_last() -> None:
    steps = [_step(1, 500, 0.2), _step(2, 1000, 0.3), _step(3, 700, 0.4), _step(4, 1050, 0.5)]
    assert r.saturation(steps) == 2
    assert r.saturation([steps[0], steps[1], steps[3]]) == 2


def test_the_verdict_names_postgres_cpu_when_it_holds_the_cores() -> None:
    steps = [_step(1, 500, 0.5, 0.6), _step(2, 520, 0.95, 0.97)]
    line = r.verdict(steps, r.saturation(steps), CORES)
    assert line.startswith("verdict: Postgres's CPU saturated at n=2")
    assert "about 2,000 jobs/s" in line  # 4 cores x 1000 ms / 2 ms a job


def test_the_verdict_names_the_machine_when_postgres_shares_it() -> None:
    steps = [_step(1, 500, 0.3, 0.7), _step(2, 520, 0.4, 0.95)]
    line = r.verdict(steps, r.saturation(steps), CORES)
    assert line.startswith("verdict: the machine's CPUs saturated at n=2")
    assert "Postgres 1.60 cores = 40% of 4" in line


def test_the_verdict_names_waits_when_cpu_is_left() -> None:
    steps = [_step(1, 500, 0.3, 0.5), _step(2, 520, 0.4, 0.6)]
    assert "not on CPU" in r.verdict(steps, r.saturation(steps), CORES)


def test_the_verdict_without_a_plateau_asks_for_more_steps() -> None:
    steps = [_step(1, 500, 0.2), _step(2, 900, 0.4)]
    line = r.verdict(steps, r.saturation(steps), CORES)
    assert line.startswith("verdict: no saturation up to n=2")
    assert "raise --scaling-max" in line


def test_the_verdict_of_a_plateau_without_postgres_growing() -> None:
    steps = [_step(1, 500, 0.4), _step(2, 510, 0.4)]
    line = r.verdict(steps, r.saturation(steps), CORES)
    assert line.startswith("verdict: jobs/s stopped rising at n=2 (510)")
    assert line.endswith("the limit is not a CPU: the submitters, the broker or a pool")
    busy = [_step(1, 500, 0.4, 1.0), _step(2, 400, 0.3, 1.0)]
    assert r.verdict(busy, r.saturation(busy), CORES).endswith(
        "the limit is the machine's CPUs, not the primary's"
    )


def test_the_ceiling_of_a_step_without_cpu_per_job_is_zero() -> None:
    assert r.ceiling(replace(_step(1, 1, 0.1), postgres_ms_per_job=0.0), CORES) == 0.0
    assert r.ceiling(_step(1, 1, 0.1), 8) == 4000.0


def test_the_markdown_table_has_a_row_per_step() -> None:
    table = r.markdown([_step(1, 500, 0.25), _step(2, 1234.4, 0.5)], CORES).splitlines()
    assert len(table) == 4
    assert table[0].startswith("| n (servers = relays = workers) | pool | jobs/s |")
    assert "share of 4" in table[0]
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert table[3].startswith("| 2 | 6 | 1,234 | 2.00 (50%) |")
    assert table[3].endswith("| 4.0 | 2,000 | 2.00 |")


@pytest.mark.parametrize(
    ("used", "processes", "expected"),
    [
        (10, 3, 6),  # plenty: the default pool
        (10, 12, 3),  # 100 - 10 - 3 - 10 = 77 free, 6 a process, 3 of them for the pool
        (40, 12, None),  # 47 free, 3 a process: no room for a pool
        (10, 9, 5),  # 77 // 9 = 8: pool 5
    ],
)
def test_the_pool_fits_the_free_connections(
    used: int, processes: int, expected: int | None
) -> None:
    assert r.pool_size(100, used, 3, processes=processes, spare=10) == expected
