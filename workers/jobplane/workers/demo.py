"""Built-in demo handlers, used by ``jobplane dev``."""

from __future__ import annotations

import asyncio
from typing import Any

from jobplane.workers.handlers import JobContext, PermanentError, Registry

registry = Registry()


@registry.handler("demo.echo")
async def echo(ctx: JobContext) -> dict[str, Any]:
    """The result is the payload."""
    return dict(ctx.payload)


@registry.handler("demo.progress")
async def progress(ctx: JobContext) -> dict[str, Any]:
    """Payload ``{steps, interval_ms}``: report ``steps`` progress events, then succeed."""
    steps = ctx.payload.get("steps", 10)
    interval_ms = ctx.payload.get("interval_ms", 100)
    if not isinstance(steps, int) or not 0 <= steps <= 100_000:
        raise PermanentError("steps must be an integer 0..100000", code="BAD_PAYLOAD")
    if not isinstance(interval_ms, int | float) or not 0 <= interval_ms <= 60_000:
        raise PermanentError("interval_ms must be a number 0..60000", code="BAD_PAYLOAD")
    for step in range(1, steps + 1):
        await asyncio.sleep(interval_ms / 1000)
        await ctx.progress(step / steps, f"step {step}/{steps}", {"step": step})
    return {"steps": steps}


@registry.handler("demo.fail")
async def fail(ctx: JobContext) -> dict[str, Any]:
    """Fails permanently, with the payload's ``message`` if it has one."""
    raise PermanentError(str(ctx.payload.get("message", "demo.fail always fails")))
