"""CPU time from /proc: the whole machine's (``/proc/stat``) and by process tree.

The parsing is kept apart from the reading so that it can be tested on text.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

#: The aggregate ``cpu`` line's fields that count as busy: everything but idle
#: and iowait. guest and guest_nice are already inside user and nice.
BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq", "steal")
_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")

#: Processes that are Postgres or RabbitMQ, by their command name.
POSTGRES = frozenset({"postgres"})
RABBITMQ = frozenset({"beam.smp", "erl_child_setup", "epmd"})


def busy_jiffies(stat: str) -> int:
    """The busy clock ticks of all CPUs together in a ``/proc/stat`` text."""
    for line in stat.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            values = [int(v) for v in parts[1:]]
            # Older kernels have fewer columns; a missing one counted nothing.
            named = dict(zip(_FIELDS, values + [0] * (len(_FIELDS) - len(values)), strict=False))
            return sum(named[f] for f in BUSY_FIELDS)
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def machine_busy_seconds(path: str = "/proc/stat") -> float:
    """CPU seconds all CPUs have spent busy since boot (see ``busy_jiffies``)."""
    return busy_jiffies(Path(path).read_text()) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStat:
    """What ``/proc/PID/stat`` says of one process."""

    pid: int
    comm: str
    ppid: int
    jiffies: int  # utime + stime


def parse_pid_stat(pid: int, stat: str) -> ProcStat:
    """One ``/proc/PID/stat`` line (the command name may hold spaces and parentheses)."""
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    # After the name: state, ppid, ... utime is the 14th field of the line, stime the 15th.
    rest = stat[stat.rindex(")") + 2 :].split()
    return ProcStat(pid, comm, int(rest[1]), int(rest[11]) + int(rest[12]))


def read_processes() -> list[ProcStat]:
    """Every process's stat that could be read now."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            found.append(parse_pid_stat(int(entry.name), (entry / "stat").read_text()))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return found


def by_component(
    processes: Iterable[ProcStat], ours: Mapping[int, str], trees: Iterable[int] = ()
) -> dict[str, int]:
    """Jiffies by component: the processes named in ``ours``, with the descendants
    of those in ``trees`` (e.g. a prefork pool's children) counted as theirs;
    Postgres and RabbitMQ by command name; nothing else."""
    table = {p.pid: p for p in processes}
    roots = set(trees)
    totals: dict[str, int] = {}

    def owner(pid: int) -> str | None:
        if pid in ours:
            return ours[pid]
        seen = set()
        parent = table[pid].ppid
        while parent in table and parent not in seen:
            if parent in roots:
                return ours[parent]
            seen.add(parent)
            parent = table[parent].ppid
        return None

    for proc in table.values():
        name = owner(proc.pid)
        if name is None and proc.comm in POSTGRES:
            name = "postgres"
        elif name is None and proc.comm in RABBITMQ:
            name = "rabbitmq"
        if name is not None:
            totals[name] = totals.get(name, 0) + proc.jiffies
    return totals
