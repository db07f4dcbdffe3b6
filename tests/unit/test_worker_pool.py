"""A worker's own database pool: no larger than the settings' default pool,
as the CLI builds it, whatever its concurrency (ADR-0057)."""

from __future__ import annotations

import pytest

from jobplane.config import DEFAULT_DB_POOL_SIZE, DEFAULT_WORKER_CONCURRENCY
from jobplane.store.engine import create_engine
from jobplane.topology import load_topology
from jobplane.workers.registry import Registry
from jobplane.workers.runtime import Worker, worker_pool_size


@pytest.mark.parametrize("concurrency", [1, 8, DEFAULT_WORKER_CONCURRENCY])
async def test_a_worker_built_without_a_pool_opens_one_no_larger_than_the_default(
    concurrency: int,
) -> None:
    url = "postgresql+asyncpg://127.0.0.1/none"  # nothing connects before start
    engine = create_engine(url, pool_size=1)
    worker = Worker(
        engine,
        url,
        "amqp://127.0.0.1/",
        load_topology(),
        Registry(),
        concurrency=concurrency,
    )
    expected = min(DEFAULT_DB_POOL_SIZE, worker_pool_size(concurrency))
    assert worker._db.size == expected <= DEFAULT_DB_POOL_SIZE
    await engine.dispose()
