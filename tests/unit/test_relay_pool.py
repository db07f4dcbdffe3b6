"""A relay has a connection for each batch it keeps in flight."""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest

from jobplane.config import Settings
from jobplane.workers.cli import _relay_pool
from jobplane.workers.relay import relay_in_flight, relay_pool_size


@pytest.mark.parametrize("in_flight", range(1, 9))
def test_a_relays_own_pool_has_its_batches_in_flight(in_flight: int) -> None:
    assert relay_in_flight(relay_pool_size(in_flight)) == in_flight


@pytest.mark.parametrize(("pool", "in_flight"), [(1, 1), (2, 1), (3, 1), (4, 2), (6, 4), (20, 4)])
async def test_the_relay_command_keeps_no_more_batches_than_its_pool_serves(
    pool: int, in_flight: int
) -> None:
    # JOBPLANE_DB_POOL_SIZE=3 is what docs/operations.md suggests for many
    # small processes: its relay keeps one batch, beside the feed and a spare.
    settings = Settings.from_env({"JOBPLANE_DB_POOL_SIZE": str(pool)})
    async with AsyncExitStack() as stack:
        db, batches = _relay_pool(stack, settings)
        assert (db.size, batches) == (min(pool, relay_pool_size()), in_flight)
