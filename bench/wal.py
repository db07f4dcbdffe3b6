"""`--only wal`: what a job writes to Postgres, in figures that do not depend on load.

Two workloads run end to end through the server, relay and a worker of this
run (its own database and vhost): ``--wal-jobs`` no-op jobs (a job's life
alone: submit, claim, succeed), then ``--wal-running-jobs`` jobs that run for
about three seconds each, reporting progress ten times, under a worker whose
lease is 3 s (a heartbeat a second): the updates a RUNNING job repeats for as
long as it runs. For each, per job:

- WAL bytes written for this database's relations: the records between the
  workload's first and last LSN that name a block of this database, read
  with ``pg_walinspect`` (other databases on the server write WAL in the
  same range; their records are left out), without the full-page images
  (how many a checkpoint in the range adds depends on when it falls), by
  relation: the ``jobs`` heap, its indexes, the other tables. When
  ``pg_walinspect`` cannot be installed, the server's whole WAL is given
  instead (``pg_current_wal_lsn()``'s difference), which counts the other
  databases' too.
- ``jobs`` rows updated (``n_tup_upd``) and how many of those updates were
  heap-only (``n_tup_hot_upd``), the HOT share.
- index tuples written into ``jobs``' indexes: a row inserted and a non-HOT
  update add an entry to each index whose predicate the new row version
  matches; estimated from the WAL's B-tree and GIN insert records on those
  indexes.
- transactions committed by this database (``pg_stat_database``): the
  statements a job costs, as most of the hot paths run one statement a
  transaction (``pg_stat_statements`` needs a preloaded library and a
  restart, which the bench does not assume). The bench's own reads count
  too: its poll for the jobs' ends, ten a second (about 0.05 a no-op job
  and 0.6 a running job at the defaults).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import asyncpg

from bench.run import submit_closed_loop

if TYPE_CHECKING:
    from bench.run import Bench

NOOP_TYPE = "bench.noop"
RUNNING_TYPE = "bench.progress"
# The running workload's jobs: ten progress reports 300 ms apart, a 3 s lease.
RUNNING_PAYLOAD = {"steps": 10, "interval_ms": 300}
RUNNING_LEASE_SECONDS = 3.0
_BLOCK = re.compile(r"rel (\d+)/(\d+)/(\d+)")
# Postgres reports a backend's counters within about a second of its last
# transaction; read until two reads this far apart agree.
_SETTLE_SECONDS = 1.5
# The records that add an entry to a leaf of a B-tree (plain, or into a posting
# list) or to a GIN index.
_INDEX_INSERTS = frozenset({"INSERT_LEAF", "INSERT_POST", "INSERT"})

_TABLE = """
SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'jobs'
"""
# A temporary slot is released on any error of its session: it may be gone.
_DROP_SLOT = (
    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1"
)
_XACTS = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
# The WAL records of the range by the relation of their first block (the
# database's oid, the relation's file node), with their sizes without
# full-page images.
_RECORDS = """
SELECT block_ref, resource_manager, record_type, record_length - fpi_length AS bytes,
       fpi_length
FROM pg_get_wal_records_info(CAST($1::text AS pg_lsn), CAST($2::text AS pg_lsn))
WHERE block_ref IS NOT NULL
"""
_RELATIONS = """
SELECT c.relfilenode, c.relname,
       coalesce(i.indrelid = 'jobs'::regclass, false) AS on_jobs
FROM pg_class c LEFT JOIN pg_index i ON i.indexrelid = c.oid
WHERE c.relfilenode <> 0
"""


@dataclass
class Snapshot:
    """Counters at one moment."""

    lsn: str
    inserts: int
    updates: int
    hot: int
    xacts: int


@dataclass
class WalSplit:
    """WAL of one range, by what it wrote."""

    database: int = 0  # bytes of records on this database's relations (no FPIs)
    fpi: int = 0  # bytes of their full-page images
    by_relation: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    jobs_heap: int = 0
    jobs_indexes: int = 0
    index_inserts: int = 0  # B-tree and GIN insert records into jobs' indexes
    server: int = 0  # the whole server's WAL in the range (every database)


async def snapshot(bench: Bench) -> Snapshot:
    """The counters once they have stopped moving (the backends have reported)."""
    last: Snapshot | None = None
    while True:
        row = (await bench.sql(_TABLE))[0]
        xacts = (await bench.sql(_XACTS))[0]["xact_commit"]
        # Flushed: pg_walinspect reads no further.
        lsn = (await bench.sql("SELECT pg_current_wal_flush_lsn()::text AS lsn"))[0]["lsn"]
        now = Snapshot(lsn, row["n_tup_ins"], row["n_tup_upd"], row["n_tup_hot_upd"], xacts)
        # Our own three reads commit a transaction each: compare the rest.
        if last is not None and (now.inserts, now.updates, now.hot) == (
            last.inserts,
            last.updates,
            last.hot,
        ):
            return now
        last = now
        await asyncio.sleep(_SETTLE_SECONDS)


async def walinspect(bench: Bench) -> bool:
    """Whether pg_walinspect is installed in this run's database (it is a superuser's
    to install, and a superuser's or pg_read_server_files' to call)."""
    try:
        await bench.sql("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    except asyncpg.PostgresError:  # not available: the server-wide figure instead
        return False
    return True


async def keep_wal(bench: Bench, slot: str) -> None:
    """Keep the server's WAL from now until the slot is dropped: the other databases'
    writes would otherwise recycle the segments before they are read. A
    temporary slot: it goes with the bench's connection, however the run ends."""
    await bench.sql("SELECT pg_create_physical_replication_slot($1, true, true)", slot)


async def wal_split(bench: Bench, start: str, end: str, inspect: bool) -> WalSplit:
    """The WAL between ``start`` and ``end`` by relation of this database."""
    split = WalSplit()
    diff = await bench.sql(
        "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn) AS d", end, start
    )
    split.server = int(diff[0]["d"])
    if not inspect:
        return split
    oid = (await bench.sql("SELECT oid FROM pg_database WHERE datname = current_database()"))[0]
    names = {int(r["relfilenode"]): r for r in await bench.sql(_RELATIONS)}
    for record in await bench.sql(_RECORDS, start, end):
        found = _BLOCK.search(record["block_ref"])
        if found is None or int(found[2]) != oid["oid"]:
            continue
        relation = names.get(int(found[3]))
        name = relation["relname"] if relation is not None else f"filenode {found[3]}"
        bytes_ = int(record["bytes"])
        split.database += bytes_
        split.fpi += int(record["fpi_length"])
        split.by_relation[name] += bytes_
        if name == "jobs":
            split.jobs_heap += bytes_
        elif relation is not None and relation["on_jobs"]:
            split.jobs_indexes += bytes_
            if str(record["record_type"]) in _INDEX_INSERTS:
                split.index_inserts += 1
    return split


async def run_workload(bench: Bench, job_type: str, count: int, payload: dict[str, Any]) -> float:
    """Submit ``count`` jobs of ``job_type`` and wait until all have ended; seconds."""
    started = time.perf_counter()
    clients = min(bench.args.clients, count)
    await submit_closed_loop(bench.address, bench.key, job_type, count, clients, payload)
    await bench.wait_done(count, job_type)
    return time.perf_counter() - started


async def measure(
    bench: Bench, name: str, job_type: str, count: int, payload: dict[str, Any]
) -> None:
    """One workload's figures, per job."""
    from bench.run import Figure

    inspect = await walinspect(bench)
    slot = f"{bench.database}_{name}"
    if inspect:
        await keep_wal(bench, slot)
    try:
        before = await snapshot(bench)
        seconds = await run_workload(bench, job_type, count, payload)
        after = await snapshot(bench)
        split = await wal_split(bench, before.lsn, after.lsn, inspect)
    finally:
        if inspect:
            await bench.sql(_DROP_SLOT, slot)
    updates = after.updates - before.updates
    hot = after.hot - before.hot
    config = {
        "jobs": count,
        "type": job_type,
        "payload": payload,
        "seconds": round(seconds, 1),
        "wal_source": "pg_walinspect, this database's relations, no FPIs"
        if inspect
        else "pg_current_wal_lsn, whole server",
        "indexes_on_jobs": await _index_count(bench),
        "fillfactor": await _fillfactor(bench),
    }
    per = float(count)
    if inspect:
        bench.add(Figure(f"wal_{name}_bytes_per_job", split.database / per, "B", config))
        bench.add(Figure(f"wal_{name}_jobs_heap_bytes_per_job", split.jobs_heap / per, "B"))
        bench.add(Figure(f"wal_{name}_jobs_index_bytes_per_job", split.jobs_indexes / per, "B"))
        bench.add(Figure(f"wal_{name}_jobs_index_inserts_per_job", split.index_inserts / per, ""))
        bench.add(Figure(f"wal_{name}_fpi_bytes_per_job", split.fpi / per, "B"))
        top = sorted(split.by_relation.items(), key=lambda kv: -kv[1])[:12]
        bench.notes.append(
            f"wal {name}, bytes per job by relation: "
            + ", ".join(f"{rel} {b / per:,.0f}" for rel, b in top)
        )
    bench.add(Figure(f"wal_{name}_server_bytes_per_job", split.server / per, "B", config))
    bench.add(Figure(f"wal_{name}_jobs_updates_per_job", updates / per, "rows"))
    bench.add(Figure(f"wal_{name}_jobs_hot_share", hot / updates if updates else 0.0, "hot/upd"))
    bench.add(Figure(f"wal_{name}_transactions_per_job", (after.xacts - before.xacts) / per, ""))


async def _index_count(bench: Bench) -> int:
    rows = await bench.sql("SELECT count(*) AS n FROM pg_index WHERE indrelid = 'jobs'::regclass")
    return int(rows[0]["n"])


async def _fillfactor(bench: Bench) -> str:
    rows = await bench.sql(
        "SELECT coalesce(array_to_string(reloptions, ','), '') AS o FROM pg_class "
        "WHERE oid = 'jobs'::regclass"
    )
    return str(rows[0]["o"]) or "default (100)"


async def fig_wal(bench: Bench) -> None:
    """WAL bytes, HOT share, index writes and transactions per job, two workloads."""
    await bench.warm_up()
    await measure(bench, "noop", NOOP_TYPE, bench.args.wal_jobs, {})
    # The running workload under a worker of its own, heartbeating once a second.
    for name in [n for n in bench.procs if n.startswith("worker")]:
        await bench.stop(name)
    await bench.start(
        "wal_worker",
        "worker",
        "--handlers",
        "bench.handlers:registry",
        "--concurrency",
        str(bench.args.concurrency),
        "--lease-seconds",
        str(RUNNING_LEASE_SECONDS),
    )
    await bench.ready()
    await measure(bench, "running", RUNNING_TYPE, bench.args.wal_running_jobs, RUNNING_PAYLOAD)
