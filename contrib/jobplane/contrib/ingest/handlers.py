"""The handlers of the ``ingest.file`` stages, and what they share in a worker process.

``jobplane worker --handlers jobplane.contrib.ingest:registry`` runs them.
The registry's lifespan reads the settings when the worker starts and
checks that the configured embedder can be loaded; the embedder and the
Qdrant client are opened at the first stage that needs them, once per
process, and closed when the worker stops. A worker that consumes only the
parse and chunk queues therefore never loads a model or opens Qdrant — which
is what lets Qdrant's local mode (one process per path) work: the index
queue has one consuming process (docs/ingestion.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from jobplane.config import Settings
from jobplane.contrib.ingest import stages
from jobplane.contrib.ingest.embedders import Embedder, check_embedder, load_embedder
from jobplane.contrib.ingest.index import Index, open_index
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.workers.handlers import JobContext, Registry

#: The stages' job types, in order (topologies/ingest.toml).
STAGE_TYPES = ("ingest.parse", "ingest.chunk", "ingest.embed", "ingest.index")


class Ingest:
    """The ingest handlers with their shared embedder and index.

    ``Ingest(settings)`` for a worker made in code (tests, an application's
    own process); the module's :data:`registry` reads the settings from the
    environment when its worker starts.
    """

    def __init__(self, settings: Settings | None = None, *, embedder: Embedder | None = None):
        self._given = settings
        self._settings = settings
        self._given_embedder = embedder
        self._embedder = embedder
        self._index: Index | None = None
        self._opening = asyncio.Lock()
        self._users = 0
        self._fault_points: FaultPoints | None = None
        self.registry = Registry()
        self.registry.lifespan(self.running)
        self.registry.add("ingest.parse", self._parse)
        self.registry.add("ingest.chunk", self._chunk)
        self.registry.add("ingest.embed", self._embed)
        self.registry.add("ingest.index", self._index_stage)

    @property
    def settings(self) -> Settings:
        """The settings in force (read from the environment at start unless given)."""
        if self._settings is None:
            self._settings = Settings.from_env()
        return self._settings

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Ingest]:
        """A worker's life: checks the embedder can load; closes what was opened, at the end."""
        if self._users == 0 and self._given is None:
            self._settings = Settings.from_env()
        if self._given_embedder is None:
            check_embedder(self.settings.embedder)
        self._users += 1
        try:
            yield self
        finally:
            self._users -= 1
            if self._users == 0:
                await self.close()

    async def close(self) -> None:
        """Close the index and drop the embedder (opened again on next use)."""
        index, self._index = self._index, None
        self._embedder = self._given_embedder
        self._fault_points = None
        if index is not None:
            await index.close()

    async def index(self) -> Index:
        """The process's index (opened at the first call)."""
        if self._index is None:
            async with self._opening:
                if self._index is None:
                    self._index = open_index(self.settings)
        return self._index

    async def embedder(self) -> Embedder:
        """The configured embedder (loaded at the first call, in a thread: a model is slow)."""
        if self._embedder is None:
            async with self._opening:
                if self._embedder is None:
                    self._embedder = await asyncio.to_thread(load_embedder, self.settings.embedder)
        return self._embedder

    @property
    def _faults(self) -> FaultPoints:
        # Named crash points inside the stages (JOBPLANE_FAULTS), for the fault
        # suite; one set per worker's life, so that `crash:NAME@N` counts hits.
        if self._fault_points is None:
            faults = self.settings.faults
            self._fault_points = FaultPoints(faults) if faults else NO_FAULTS
        return self._fault_points

    async def _parse(self, ctx: JobContext) -> dict[str, Any]:
        return await stages.parse_stage(ctx, self._faults)

    async def _chunk(self, ctx: JobContext) -> dict[str, Any] | list[dict[str, Any]]:
        return await stages.chunk_stage(ctx, self._faults, batch=self.settings.ingest_batch)

    async def _embed(self, ctx: JobContext) -> dict[str, Any]:
        return await stages.embed_stage(ctx, await self.embedder(), self._faults)

    async def _index_stage(self, ctx: JobContext) -> dict[str, Any]:
        return await stages.index_stage(ctx, await self.index(), self._faults)


#: The ingest handlers for ``jobplane worker --handlers jobplane.contrib.ingest:registry``.
ingest = Ingest()
registry = ingest.registry
