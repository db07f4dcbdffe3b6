"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.topology import Topology
from tests.support.stack import Stack, start_stack


@pytest.fixture
async def bare(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> AsyncIterator[Stack]:
    """A server alone: the test claims and writes as a worker would."""
    stack = await start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    yield stack
    await stack.close()
