"""Handlers of the tracing tests, run inside real `jobplane worker` processes."""

from __future__ import annotations

from typing import Any

from jobplane.workers.handlers import JobContext, Registry, RetryableError

registry = Registry()

#: The stages of the tracing tests' pipeline, in order.
STAGES = ("one", "two")


@registry.handler("trace.work")
async def work(ctx: JobContext) -> dict[str, Any]:
    """Three progress reports, an emitted event, then success."""
    for step in (1, 2, 3):
        await ctx.progress(step / 3, f"step {step}")
    ctx.emit("trace.worked", {"job": ctx.id})
    return {"ok": True}


@registry.handler("trace.flaky")
async def flaky(ctx: JobContext) -> dict[str, Any]:
    """Fails its first attempt retryably, succeeds on the second."""
    if ctx.attempt == 1:
        raise RetryableError("not yet", delay=0.05)
    return {"attempt": ctx.attempt}


async def _stage(ctx: JobContext) -> dict[str, Any]:
    await ctx.progress(0.5)
    return {"stage": ctx.type}


for _name in STAGES:
    registry.handler(f"trace.stage.{_name}")(_stage)
