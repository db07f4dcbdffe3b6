"""Servers (no relay, no worker) on one test database, and clients of them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import AsyncClient, Unauthenticated
from jobplane.server import JobplaneServer
from jobplane.topology import Topology


class Servers:
    """Starts :class:`JobplaneServer` instances and SDK clients; :meth:`close` (or the
    end of ``async with``) stops them all."""

    def __init__(self, engine: AsyncEngine, database_url: str, topology: Topology) -> None:
        self.engine = engine
        self.database_url = database_url
        self.topology = topology
        self._servers: list[JobplaneServer] = []
        self._clients: list[AsyncClient] = []

    async def start(self, **kwargs: Any) -> JobplaneServer:
        """A started server on a free loopback port; ``kwargs`` go to JobplaneServer."""
        kwargs.setdefault("listen", "127.0.0.1:0")
        kwargs.setdefault("recheck_seconds", 2.0)
        server = JobplaneServer(self.engine, self.database_url, self.topology, **kwargs)
        await server.start()
        self._servers.append(server)
        return server

    def client(self, server: JobplaneServer, key: str | None, **kwargs: Any) -> AsyncClient:
        """An SDK client of ``server`` (closed with the rest)."""
        client = AsyncClient(server.address, key, **kwargs)
        self._clients.append(client)
        return client

    async def __aenter__(self) -> Servers:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every client, then stop every server."""
        for client in self._clients:
            await client.close()
        for server in self._servers:
            await server.stop(grace=0.5)


async def refused_within(client: AsyncClient, seconds: float) -> bool:
    """True once a call of ``client`` is UNAUTHENTICATED, polling for ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            await client.list()
        except Unauthenticated:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.02)
