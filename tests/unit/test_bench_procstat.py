"""The benchmark's CPU accounting: /proc/stat's busy time, /proc/PID/stat, process trees."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench import procstat
from bench.peer_apps.callers import shares

STAT = """cpu  4705 356 584 3699176 2316 101 207 13 7 0
cpu0 1393 280 260 1849412 1164 50 102 6 7 0
cpu1 3312 76 324 1849764 1152 51 105 7 0 0
intr 114930548 113199788 3 0 5 263 0 4 [...]
ctxt 1990473
"""


def test_busy_is_everything_but_idle_and_iowait() -> None:
    # user + nice + system + irq + softirq + steal; guest is inside user already.
    assert procstat.busy_jiffies(STAT) == 4705 + 356 + 584 + 101 + 207 + 13


def test_a_short_cpu_line_counts_the_missing_columns_as_nothing() -> None:
    assert procstat.busy_jiffies("cpu  10 20 30 400 50\n") == 60


def test_no_aggregate_line_is_an_error() -> None:
    with pytest.raises(ValueError, match="aggregate"):
        procstat.busy_jiffies("cpu0 1 2 3 4 5 6 7 8\n")


def test_this_machine_has_been_busy() -> None:
    assert procstat.machine_busy_seconds() > 0


@given(st.text(alphabet=st.characters(blacklist_characters="\n\x00"), max_size=20))
def test_a_command_name_may_hold_spaces_and_parentheses(comm: str) -> None:
    line = f"4242 ({comm}) S 17 4242 4242 0 -1 4194560 1 0 0 0 250 31 0 0 20 0 1 0 5 0 0\n"
    stat = procstat.parse_pid_stat(4242, line)
    assert (stat.comm, stat.ppid, stat.jiffies) == (comm, 17, 281)


def test_this_process_reads_as_itself() -> None:
    mine = [p for p in procstat.read_processes() if p.pid == os.getpid()]
    assert len(mine) == 1
    assert mine[0].ppid == os.getppid()


def test_children_count_for_their_tree_and_services_by_name() -> None:
    processes = [
        procstat.ProcStat(1, "init", 0, 5),
        procstat.ProcStat(10, "python", 1, 100),  # the benchmark
        procstat.ProcStat(20, "celery", 10, 7),  # a started process with a pool
        procstat.ProcStat(21, "celery", 20, 30),
        procstat.ProcStat(22, "celery", 21, 2),  # a grandchild
        procstat.ProcStat(30, "moto_server", 10, 9),  # the benchmark's, not started by name
        procstat.ProcStat(40, "postgres", 1, 11),
        procstat.ProcStat(41, "postgres", 40, 4),
        procstat.ProcStat(50, "beam.smp", 1, 6),
        procstat.ProcStat(60, "sshd", 1, 1000),
    ]
    ours = {10: "bench client", 20: "celery worker"}
    got = procstat.by_component(processes, ours, trees=[20])
    assert got == {"bench client": 100, "celery worker": 39, "postgres": 15, "rabbitmq": 6}


def test_a_parent_loop_ends() -> None:
    processes = [procstat.ProcStat(2, "x", 3, 1), procstat.ProcStat(3, "y", 2, 1)]
    assert procstat.by_component(processes, {9: "a"}, trees=[9]) == {}


@given(st.integers(0, 10_000), st.integers(1, 200))
def test_callers_share_the_jobs_evenly(jobs: int, callers: int) -> None:
    split = shares(jobs, callers)
    assert len(split) == callers
    assert sum(split) == jobs
    assert max(split) - min(split) <= 1
