"""Handlers run by ``jobplane worker`` from the worker install (test_worker_install.py)."""

from __future__ import annotations

import sys
from typing import Any

from jobplane.workers import JobContext, Registry

registry = Registry()


@registry.handler("lean.modules")
async def modules(ctx: JobContext) -> dict[str, Any]:
    """The top-level modules the worker's process has loaded, with progress on the way."""
    await ctx.progress(0.5, "looking")
    return {
        "modules": sorted({name.split(".")[0] for name in sys.modules}),
        "otel_sdk": "opentelemetry.sdk" in sys.modules,
        **ctx.payload,
    }
