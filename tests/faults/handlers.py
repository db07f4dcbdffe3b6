"""Handlers of the fault suite, run inside real `jobplane worker` processes.

Each writes an idempotent side effect (one row per job, the attempt that wrote
it last) and a completion record per attempt that returned, so the tests can
see exactly which attempts ran to the end and when.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import asyncpg

from jobplane.workers.handlers import JobContext, PermanentError, Registry

registry = Registry()
_pools: dict[str, asyncpg.Pool] = {}

SCHEMA = """
CREATE TABLE IF NOT EXISTS fault_effects (
    job_id  uuid PRIMARY KEY,
    attempt integer NOT NULL,
    writes  integer NOT NULL DEFAULT 1
);
CREATE TABLE IF NOT EXISTS fault_completions (
    job_id  uuid NOT NULL,
    attempt integer NOT NULL,
    pid     integer NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- A pipeline's stages: their effects and completions, by stage.
CREATE TABLE IF NOT EXISTS fault_stage_effects (
    job_id  uuid NOT NULL,
    stage   text NOT NULL,
    attempt integer NOT NULL,
    writes  integer NOT NULL DEFAULT 1,
    PRIMARY KEY (job_id, stage)
);
CREATE TABLE IF NOT EXISTS fault_stage_completions (
    job_id  uuid NOT NULL,
    stage   text NOT NULL,
    attempt integer NOT NULL,
    pid     integer NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- A handler that kills its worker once per (job, what): the kills done.
CREATE TABLE IF NOT EXISTS fault_kills (
    job_id uuid NOT NULL,
    what   text NOT NULL,
    PRIMARY KEY (job_id, what)
);
"""
#: The stages of the fault suite's pipeline (``fault.pipeline``), in order.
PIPELINE_STAGES = ("one", "two", "three")


async def _db() -> asyncpg.Pool:
    # Postgres itself: past a PgBouncer in transaction pooling (tests/fleet).
    url = os.environ.get("JOBPLANE_DATABASE_DIRECT_URL") or os.environ["JOBPLANE_DATABASE_URL"]
    url = url.replace("postgresql+asyncpg", "postgresql")
    if url not in _pools:
        _pools[url] = await asyncpg.create_pool(url, min_size=1, max_size=4)
    return _pools[url]


async def _execute(sql: str, *args: Any) -> None:
    for _ in range(50):
        try:
            pool = await _db()
            await pool.execute(sql, *args)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            await asyncio.sleep(0.2)  # the database is being disrupted; try again
        else:
            return
    raise RuntimeError("the database stayed unreachable")


async def _effect(ctx: JobContext) -> None:
    await _execute(
        """
        INSERT INTO fault_effects (job_id, attempt) VALUES ($1, $2)
        ON CONFLICT (job_id) DO UPDATE
        SET attempt = EXCLUDED.attempt, writes = fault_effects.writes + 1
        """,
        ctx.id,
        ctx.attempt,
    )


async def _completed(ctx: JobContext) -> None:
    await _execute(
        "INSERT INTO fault_completions (job_id, attempt, pid) VALUES ($1, $2, $3)",
        ctx.id,
        ctx.attempt,
        os.getpid(),
    )


@registry.handler("fault.work")
async def work(ctx: JobContext) -> dict[str, Any]:
    """Sleeps ``ms``, reports progress twice, writes its side effect."""
    ms = float(ctx.payload.get("ms", 100))
    await ctx.progress(0.3, "started")
    await asyncio.sleep(ms / 2000)
    await ctx.progress(0.6, "half way")
    await asyncio.sleep(ms / 2000)
    await _effect(ctx)
    await _completed(ctx)
    return {"attempt": ctx.attempt}


@registry.handler("fault.poison")
async def poison(ctx: JobContext) -> dict[str, Any]:
    """Kills its own worker process, every time."""
    await ctx.progress(0.1, "about to die")
    await asyncio.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
    return {}


@registry.handler("fault.stall")
async def stall(ctx: JobContext) -> dict[str, Any]:
    """The first attempt blocks its event loop (no heartbeats) for ``seconds``."""
    if ctx.attempt == 1:
        time.sleep(float(ctx.payload.get("seconds", 5)))  # noqa: ASYNC251 - the point of it
    await _effect(ctx)
    await _completed(ctx)
    return {"attempt": ctx.attempt}


@registry.handler("fault.fanout")
async def fanout(ctx: JobContext) -> dict[str, Any]:
    """Submits ``n`` children (``fault.work``, one per key), then, on its first
    attempt, kills its own worker before it could record anything else."""
    children = [
        await ctx.submit("fault.work", {"ms": 20}, key=f"part-{i}")
        for i in range(int(ctx.payload.get("n", 3)))
    ]
    if ctx.attempt == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    await _effect(ctx)
    await _completed(ctx)
    return {"attempt": ctx.attempt, "children": children}


async def _stage(ctx: JobContext) -> dict[str, Any]:
    """A pipeline stage: sleeps ``ms``, reports progress, writes its stage's effect.

    Checks what the earlier stages handed on: each returned its own name and
    the attempt that ran it.
    """
    expected = list(PIPELINE_STAGES[: PIPELINE_STAGES.index(ctx.stage)])
    if list(ctx.inputs) != expected:
        raise RuntimeError(f"stage {ctx.stage} got inputs {list(ctx.inputs)}")
    ms = float(ctx.payload.get("ms", 100))
    await ctx.progress(0.5, f"{ctx.stage} half way")
    await asyncio.sleep(ms / 1000)
    await _execute(
        """
        INSERT INTO fault_stage_effects (job_id, stage, attempt) VALUES ($1, $2, $3)
        ON CONFLICT (job_id, stage) DO UPDATE
        SET attempt = EXCLUDED.attempt, writes = fault_stage_effects.writes + 1
        """,
        ctx.id,
        ctx.stage,
        ctx.attempt,
    )
    await _execute(
        "INSERT INTO fault_stage_completions (job_id, stage, attempt, pid) VALUES ($1, $2, $3, $4)",
        ctx.id,
        ctx.stage,
        ctx.attempt,
        os.getpid(),
    )
    return {"stage": ctx.stage, "attempt": ctx.attempt}


for _name in PIPELINE_STAGES:
    registry.add(f"fault.stage.{_name}", _stage)


async def _kill_once(ctx: JobContext, what: str) -> None:
    """SIGKILL this worker the first time ``ctx``'s job gets here for ``what``."""
    pool = await _db()
    killed = await pool.fetchval(
        "INSERT INTO fault_kills (job_id, what) VALUES ($1, $2) ON CONFLICT DO NOTHING "
        "RETURNING true",
        ctx.id,
        what,
    )
    if killed:
        os.kill(os.getpid(), signal.SIGKILL)


@registry.handler("fault.fan.split")
async def fan_split(ctx: JobContext) -> list[dict[str, Any]]:
    """Spawns ``n`` items: the first by ctx.spawn, the rest as the list it returns;
    the items listed in ``fail`` fail. Job ``i`` first sleeps ``i * stagger`` seconds."""
    await asyncio.sleep(float(ctx.payload.get("stagger", 0)) * int(ctx.payload.get("i", 0)))
    n = int(ctx.payload.get("n", 4))
    ms = ctx.payload.get("ms", 50)
    fail = set(ctx.payload.get("fail", []))
    ctx.spawn({"i": 0, "ms": ms, "kill": ctx.payload.get("kill_child", False), "fail": 0 in fail})
    return [{"i": i, "ms": ms, "fail": i in fail} for i in range(1, n)]


@registry.handler("fault.fan.map")
async def fan_map(ctx: JobContext) -> dict[str, Any]:
    """A child: sleeps ``ms``, reports progress, killed mid-run once when asked;
    fails for good when asked, else writes its effect and completion as
    ``fault.work`` does."""
    await ctx.progress(0.5, "half way")
    await asyncio.sleep(float(ctx.payload.get("ms", 50)) / 1000)
    if ctx.payload.get("kill"):
        await _kill_once(ctx, "child")
    if ctx.payload.get("fail"):
        raise PermanentError(f"item {ctx.payload['i']} fails", code="FAULT_ITEM")
    await _effect(ctx)
    await _completed(ctx)
    return {"attempt": ctx.attempt, "i": ctx.payload["i"]}


@registry.handler("fault.fan.join")
async def fan_join(ctx: JobContext) -> dict[str, Any]:
    """The join: killed mid-run once when asked; checks the results came in
    item order, each from its child's winning attempt, and that exactly the
    items listed in ``fail`` failed; writes its stage's effect."""
    fail = set(ctx.payload.get("fail", []))
    order = [r.result["i"] if r.result else None for r in ctx.results]
    indexes = [r.index for r in ctx.results]
    failed = {r.index for r in ctx.results if not r.ok}
    expected = [None if i in fail else i for i in range(len(order))]
    if order != expected or failed != fail or indexes != list(range(len(order))):
        raise RuntimeError(f"the join got {order}, failed {sorted(failed)}")
    if ctx.payload.get("kill_join"):
        await _kill_once(ctx, "join")
    await _execute(
        """
        INSERT INTO fault_stage_effects (job_id, stage, attempt) VALUES ($1, $2, $3)
        ON CONFLICT (job_id, stage) DO UPDATE
        SET attempt = EXCLUDED.attempt, writes = fault_stage_effects.writes + 1
        """,
        ctx.id,
        ctx.stage,
        ctx.attempt,
    )
    await _execute(
        "INSERT INTO fault_stage_completions (job_id, stage, attempt, pid) VALUES ($1, $2, $3, $4)",
        ctx.id,
        ctx.stage,
        ctx.attempt,
        os.getpid(),
    )
    return {"attempt": ctx.attempt, "items": len(order), "failed": len(failed)}
