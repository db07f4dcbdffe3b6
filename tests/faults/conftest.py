"""A cluster of real jobplane processes per fault test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from jobplane.topology import Topology
from tests.faults.cluster import Cluster, with_fan_pipeline, with_pipeline


@pytest.fixture
async def cluster(
    database_url: str, amqp_url: str, topology: Topology, tmp_path: Path
) -> AsyncIterator[Cluster]:
    """Processes on this test's database and vhost; all killed at the end."""
    running = Cluster(database_url, amqp_url, topology, tmp_path)
    await running.prepare()
    yield running
    await running.close()


@pytest.fixture
async def staged(
    database_url: str, amqp_url: str, topology: Topology, tmp_path: Path
) -> AsyncIterator[Cluster]:
    """A cluster whose topology also has the fault suite's pipeline."""
    running = Cluster(database_url, amqp_url, with_pipeline(topology), tmp_path)
    await running.prepare()
    yield running
    await running.close()


@pytest.fixture
async def fanned(
    database_url: str, amqp_url: str, topology: Topology, tmp_path: Path
) -> AsyncIterator[Cluster]:
    """A cluster whose topology also has the fault suite's fan-out pipeline."""
    running = Cluster(database_url, amqp_url, with_fan_pipeline(topology), tmp_path)
    await running.prepare()
    yield running
    await running.close()


@pytest.fixture
async def mixed(
    database_url: str, amqp_url: str, topology: Topology, tmp_path: Path
) -> AsyncIterator[Cluster]:
    """A cluster whose topology has the fault suite's pipeline and its fan-out pipelines."""
    running = Cluster(database_url, amqp_url, with_fan_pipeline(with_pipeline(topology)), tmp_path)
    await running.prepare()
    yield running
    await running.close()
