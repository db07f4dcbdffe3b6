"""The handler of the README's "Handlers" section, which `make dev` runs
(``jobplane dev --handlers examples.reports:registry``) so that the README's
first snippets, which submit ``reports.render``, run as written against it."""

from __future__ import annotations

from typing import Any

from jobplane.workers import JobContext, Registry

registry = Registry()


@registry.handler("reports.render")
async def render(ctx: JobContext) -> dict[str, Any]:
    for page in range(10):
        await ctx.progress((page + 1) / 10, f"page {page + 1}")
    return {"url": f"https://example.invalid/{ctx.id}.pdf"}
