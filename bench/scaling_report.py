"""The arithmetic of ``--only scaling`` (bench/scaling.py), apart so it can be tested on numbers.

A :class:`Sample` is what the counters say at one moment; :func:`step_figures`
turns a step's samples and totals into a :class:`Step`; :func:`saturation`
finds the step where jobs/s stops rising while Postgres's CPU keeps growing;
:func:`verdict` says which resource ran out; :func:`markdown` is the table
docs/scaling.md takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: A step must finish at least this much more than the best step before it
#: to count as still rising (the machine's noise is about this size).
GAIN = 0.10
#: A CPU share at or above this is saturated.
BUSY = 0.90
#: The hot pool each process gets when connections allow (docs/operations.md).
DEFAULT_POOL = 6
#: Below this the relay cannot keep a batch in flight beside its feed.
MIN_POOL = 3
#: What a process holds besides its hot pool: the engine's pool (2) and LISTEN (1).
OTHER_CONNECTIONS = 3


@dataclass(frozen=True)
class Sample:
    """The counters at one moment: CPU in seconds since each process started."""

    wall: float  # time.monotonic()
    ended: int  # jobs of the step that have ended
    postgres: float  # every postgres process of the server
    jobplane: float  # the servers, relays and workers
    submitters: float
    machine: float  # all CPUs' busy seconds since boot
    db_backends: dict[int, float] = field(default_factory=dict)  # this database's, by pid
    kinds: dict[str, float] = field(default_factory=dict)  # jobplane's, by process kind


@dataclass(frozen=True)
class Step:
    """One step's figures: the window's rates and shares, the whole step's per-job costs."""

    n: int  # servers = relays = workers
    pool: int  # JOBPLANE_DB_POOL_SIZE of its processes
    seconds: float  # the measured window
    jobs_per_s: float  # jobs that ended in the window, per second
    postgres_cores: float  # CPU seconds per second
    db_cores: float  # this database's backends alone
    jobplane_cores: float
    submit_cores: float
    machine_share: float  # busy share of all cores
    postgres_share: float  # postgres_cores over all cores
    jobs: int  # every job of the step
    xacts_per_job: float
    wal_per_job: float  # bytes
    postgres_ms_per_job: float
    kinds: dict[str, float] = field(default_factory=dict)  # jobplane's cores, by kind


def _backends(before: dict[int, float], after: dict[int, float]) -> float:
    # A backend that started in the window counts whole; one that ended took its time with it.
    return sum(used - before.get(pid, 0.0) for pid, used in after.items())


def step_figures(
    n: int,
    pool: int,
    cores: int,
    window: tuple[Sample, Sample],
    *,
    jobs: int,
    xacts: int,
    wal_bytes: int,
    postgres_step: float,
) -> Step:
    """Step ``n``'s figures from its window's two samples and its totals (every
    job of the step, the transactions, WAL bytes and Postgres CPU seconds from
    before its first submit until its last job ended)."""
    before, after = window
    seconds = after.wall - before.wall
    if seconds <= 0:
        raise ValueError("the window's samples are not in order")
    per_job = 1 / jobs if jobs else 0.0
    postgres = (after.postgres - before.postgres) / seconds
    return Step(
        n=n,
        pool=pool,
        seconds=seconds,
        jobs_per_s=(after.ended - before.ended) / seconds,
        postgres_cores=postgres,
        db_cores=_backends(before.db_backends, after.db_backends) / seconds,
        jobplane_cores=(after.jobplane - before.jobplane) / seconds,
        submit_cores=(after.submitters - before.submitters) / seconds,
        machine_share=(after.machine - before.machine) / seconds / cores,
        postgres_share=postgres / cores,
        jobs=jobs,
        xacts_per_job=xacts * per_job,
        wal_per_job=wal_bytes * per_job,
        postgres_ms_per_job=postgres_step * 1000 * per_job,
        kinds={k: (v - before.kinds.get(k, 0.0)) / seconds for k, v in after.kinds.items()},
    )


def _flat(steps: Sequence[Step], i: int, gain: float) -> bool:
    best = max(s.jobs_per_s for s in steps[:i])
    return steps[i].jobs_per_s - best < gain * best


def plateau(steps: Sequence[Step], gain: float = GAIN) -> int | None:
    """The index of the first step whose jobs/s is not ``gain`` above the best before it."""
    return next((i for i in range(1, len(steps)) if _flat(steps, i, gain)), None)


def saturation(steps: Sequence[Step], gain: float = GAIN) -> int | None:
    """The index of the saturation point: the first plateau step (:func:`plateau`)
    whose Postgres CPU share is above the step's before it."""
    growing = (i for i in range(1, len(steps)) if _flat(steps, i, gain))
    return next((i for i in growing if steps[i].postgres_share > steps[i - 1].postgres_share), None)


def ceiling(step: Step, cores: int) -> float:
    """Jobs/s that ``cores`` cores of Postgres alone carry at this step's CPU per job."""
    return cores * 1000 / step.postgres_ms_per_job if step.postgres_ms_per_job else 0.0


def verdict(steps: Sequence[Step], found: int | None, cores: int) -> str:
    """One line: where the sweep stopped rising and which resource ran out."""
    last = steps[-1]
    at = (
        f"{last.postgres_ms_per_job:.2f} Postgres CPU ms per job: {cores} cores of Postgres "
        f"alone would carry about {ceiling(last, cores):,.0f} jobs/s"
    )
    flat = plateau(steps)
    if flat is None:
        return (
            f"verdict: no saturation up to n={last.n}: jobs/s rose at every step "
            f"({steps[0].jobs_per_s:,.0f} -> {last.jobs_per_s:,.0f}); Postgres at "
            f"{last.postgres_share:.0%} of {cores} cores; raise --scaling-max. At {at}"
        )
    if found is None:
        step = steps[flat]
        limit = (
            "the machine's CPUs, not the primary's"
            if step.machine_share >= BUSY
            else "not a CPU: the submitters, the broker or a pool"
        )
        return (
            f"verdict: jobs/s stopped rising at n={step.n} ({step.jobs_per_s:,.0f}) with "
            f"Postgres's CPU not growing ({step.postgres_share:.0%} of {cores} cores; machine "
            f"busy {step.machine_share:.0%}): the limit is {limit}"
        )
    step = steps[found]
    best = max(s.jobs_per_s for s in steps[:found])
    where = (
        f"at n={step.n} (best {best:,.0f} jobs/s before it, {step.jobs_per_s:,.0f} now): "
        f"Postgres {step.postgres_cores:.2f} cores = {step.postgres_share:.0%} of {cores}, "
        f"jobplane {step.jobplane_cores:.2f}, submitters {step.submit_cores:.2f}, "
        f"machine busy {step.machine_share:.0%}"
    )
    if step.postgres_share >= BUSY:
        return f"verdict: Postgres's CPU saturated {where}. At {at}"
    if step.machine_share >= BUSY:
        return (
            f"verdict: the machine's CPUs saturated {where}; Postgres shares them, so "
            f"the primary's own ceiling is higher: at {at}"
        )
    return (
        f"verdict: Postgres saturated {where}, with CPU to spare: it waits on "
        f"commits (WAL flushes), locks or I/O, not on CPU"
    )


def markdown(steps: Sequence[Step], cores: int) -> str:
    """The steps as a Markdown table (docs/scaling.md)."""
    rows = [
        "| n (servers = relays = workers) | pool | jobs/s | Postgres cores (share of "
        f"{cores}) | this database's backends, cores | jobplane cores | submitters cores "
        "| machine busy | transactions / job | WAL bytes / job | Postgres CPU ms / job |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in steps:
        rows.append(
            f"| {s.n} | {s.pool} | {s.jobs_per_s:,.0f} | {s.postgres_cores:.2f} "
            f"({s.postgres_share:.0%}) | {s.db_cores:.2f} | {s.jobplane_cores:.2f} "
            f"| {s.submit_cores:.2f} | {s.machine_share:.0%} | {s.xacts_per_job:.1f} "
            f"| {s.wal_per_job:,.0f} | {s.postgres_ms_per_job:.2f} |"
        )
    return "\n".join(rows)


def pool_size(
    max_connections: int,
    used: int,
    reserved: int,
    *,
    processes: int,
    spare: int,
    default: int = DEFAULT_POOL,
) -> int | None:
    """The hot pool that lets ``processes`` fit in the connections left free (at
    most ``default``), or None when even :data:`MIN_POOL` does not fit."""
    free = max_connections - used - reserved - spare
    pool = min(default, free // processes - OTHER_CONNECTIONS)
    return pool if pool >= MIN_POOL else None
