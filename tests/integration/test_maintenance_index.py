"""Erasure deletes the tenant's points from the search index (Qdrant local mode, a temp path)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from jobplane.client import JobState
from jobplane.config import Settings
from jobplane.contrib.ingest.embedders import HashingEmbedder
from jobplane.contrib.ingest.index import Point, open_index, point_id
from jobplane.store.maintenance import MaintenanceStore
from jobplane.workers.demo import registry as demo_registry
from jobplane.workers.maintenance import ERASURE, Maintenance
from tests.support.aged import tenant_rows
from tests.support.stack import Stack

pytestmark = pytest.mark.stack(worker=False)

EMBED = HashingEmbedder(16)


def _points(tenant: str, file: str, count: int) -> list[Point]:
    return [
        Point(
            point_id(tenant, file, i, "p1"),
            EMBED.embed_one(f"{file} chunk {i}"),
            {"tenant_id": tenant, "file": file, "chunk_index": i, "version": "v1"},
        )
        for i in range(count)
    ]


async def test_erasure_deletes_the_tenants_index_points_only(stack: Stack, tmp_path: Path) -> None:
    async with open_index(Settings(qdrant_path=tmp_path / "qdrant")) as index:
        await stack.start_worker(
            demo_registry.merge(Maintenance(stack.engine, stack.db, index=index).registry())
        )
        await stack.new_key("globex")
        acme = str(stack.tenant_id)
        globex = str((await MaintenanceStore(stack.engine).tenant_named("globex")).id)
        await index.ensure_collection(EMBED.dim)
        await index.upsert(_points(acme, "a.txt", 5) + _points(acme, "b.md", 3))
        await index.upsert(_points(globex, "a.txt", 4))

        client = stack.client()
        done = await client.wait(
            (await client.submit(ERASURE, {"confirm": "acme"})).name, timeout=30
        )
        assert done.state is JobState.SUCCEEDED, done.error
        assert done.result is not None
        assert done.result["index"] == "erased"
        assert done.result["deleted"]["index_points"] == 8
        assert await index.count(acme) == 0
        assert await index.count(globex) == 4
        left = await tenant_rows(stack.engine, stack.tenant_id, keep=uuid.UUID(done.id))
        assert left.pop("api_keys") == 1
        assert left == dict.fromkeys(left, 0)

        # Again: no point left to delete.
        again = await client.wait(
            (await client.submit(ERASURE, {"confirm": "acme"})).name, timeout=30
        )
        assert again.state is JobState.SUCCEEDED, again.error
        assert again.result is not None and "index_points" not in again.result["deleted"]
        assert await index.count(globex) == 4
