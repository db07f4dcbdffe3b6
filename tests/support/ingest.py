"""Ingestion on a test's stack: the ingest topology under names of its own, files put as blobs."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobplane.blobs import BlobStore
from jobplane.client import AsyncClient
from jobplane.contrib.ingest import Hit, Index, Ingest
from jobplane.topology import Topology, load_topology
from jobplane.types import Job
from tests.support import services
from tests.support.stack import Stack

CORPUS = Path(__file__).parents[2] / "examples" / "ingest"


def ingest_topology() -> Topology:
    """The shipped ingest topology, its queues under names no other test uses."""
    return load_topology(Path("builtin:ingest")).prefixed(f"i{uuid.uuid4().hex[:8]}.")


async def drop_topology(amqp_url: str, topology: Topology) -> None:
    """Delete the topology's queues (quorum queues are Raft groups: do not keep them)."""
    await services.delete_topology(amqp_url, topology)


@dataclass
class Ingestion:
    """A stack running the ingest handlers, and the test's ways in."""

    stack: Stack
    ingest: Ingest
    store: BlobStore

    async def put(self, data: bytes, *, tenant: uuid.UUID | None = None, **kw: Any) -> str:
        """Store ``data`` as the tenant's blob (the stack's tenant by default); its name."""
        info = await self.store.put_bytes(tenant or self.stack.tenant_id, data, **kw)
        return info.name

    async def run(
        self,
        file: str,
        data: bytes,
        *,
        client: AsyncClient | None = None,
        tenant: uuid.UUID | None = None,
        timeout: float = 30,
        **payload: Any,
    ) -> Job:
        """Upload ``data`` as ``file``, ingest it, wait for the end; the job."""
        client = client or self.stack.client()
        blob = await self.put(data, tenant=tenant)
        job = await client.submit("ingest.file", {"blob": blob, "file": file, **payload})
        return await client.wait(job.name, timeout=timeout)

    async def index(self) -> Index:
        """The worker's own index (local mode: one client per process)."""
        return await self.ingest.index()

    async def points(self, tenant: uuid.UUID | None = None, file: str | None = None) -> list[Hit]:
        """The tenant's points (of one file), by id."""
        index = await self.index()
        return await index.points(str(tenant or self.stack.tenant_id), file)
