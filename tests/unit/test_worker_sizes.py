"""The sizes a worker is built with: refused before anything is set up when no
worker can run with them, and the attempts' pool they give."""

from __future__ import annotations

from typing import Any

import pytest

from jobplane.store.engine import create_engine
from jobplane.topology import load_topology
from jobplane.workers.registry import Registry
from jobplane.workers.runtime import Worker, worker_pool_size

URL = "postgresql+asyncpg://127.0.0.1/none"  # nothing connects before start


def _worker(**kwargs: Any) -> Worker:
    engine = create_engine(URL, pool_size=1)
    return Worker(engine, URL, "amqp://127.0.0.1/", load_topology(), Registry(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"concurrency": 0}, "concurrency must be at least 1"),
        ({"group_max": 0}, "group_max must be at least 1"),
        ({"sync_threads": 0}, "sync_threads must be at least 1"),
    ],
    ids=["concurrency", "group-max", "sync-threads"],
)
def test_a_size_below_one_is_refused_naming_it(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        _worker(**kwargs)
    assert str(refused.value) == message


def test_a_worker_of_the_smallest_sizes_is_built_and_not_ready_before_it_starts() -> None:
    worker = _worker(concurrency=1, group_max=1, sync_threads=1)
    assert worker.not_ready() == "no broker connection"
    assert (worker.busy, worker.running_jobs) == (False, [])


@pytest.mark.parametrize(
    ("concurrency", "size"),
    [(1, 4), (4, 4), (5, 5), (20, 20), (21, 20), (500, 20)],
)
def test_the_attempts_pool_is_between_4_and_20_connections(concurrency: int, size: int) -> None:
    assert worker_pool_size(concurrency) == size
