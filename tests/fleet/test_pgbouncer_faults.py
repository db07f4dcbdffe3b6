"""The fault suite's scenarios with every pool through PgBouncer in transaction pooling.

Each test runs one scenario of tests/faults as it is, judged as there (L, D
and O for the jobs; P, A and O for the events), on ``bouncer_cluster``: the
server's, relays', workers' and the inbox consumer's pools reach the Patroni
leader through PgBouncer (``pgbouncer=true``), their LISTEN connections and
the tests' own reads directly. Each then checks that PgBouncer does hold
server connections to the test's database: the pools went through it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from jobplane.topology import Topology
from tests.faults import test_event_faults as event_faults
from tests.faults import test_faults as faults
from tests.faults.cluster import Cluster
from tests.faults.event_path import EventPath, event_path
from tests.fleet.load import through_bouncer

pytestmark = pytest.mark.fleet


@pytest.fixture
def topology(topology: Topology) -> Topology:
    """Every lifecycle event published: the event judge counts the tap's copies of each."""
    return replace(topology, publish_lifecycle=("job.#",))


@pytest.fixture
async def events(bouncer_cluster: Cluster) -> AsyncIterator[EventPath]:
    """The event path of ``bouncer_cluster`` (tests/faults/event_path.py)."""
    path = await event_path(bouncer_cluster)
    yield path
    await path.close()


async def test_relay_killed_mid_dispatch_through_pgbouncer(bouncer_cluster: Cluster) -> None:
    # Killed between the broker's confirms and marking the rows published.
    await faults.test_sigkill_relay_between_confirm_and_mark(bouncer_cluster)
    assert await through_bouncer(bouncer_cluster) > 0


async def test_killed_workers_job_rerun_after_its_lease_through_pgbouncer(
    bouncer_cluster: Cluster,
) -> None:
    # The relay's sweeper, on its pool through PgBouncer, expires the dead
    # attempt's lease; the job's second attempt runs on a new worker.
    await faults.test_a_killed_workers_job_runs_again_once_the_sweeper_expires_its_lease(
        bouncer_cluster
    )
    assert await through_bouncer(bouncer_cluster) > 0


async def test_stalled_attempt_fenced_after_its_lease_through_pgbouncer(
    bouncer_cluster: Cluster,
) -> None:
    await faults.test_lease_expires_while_a_stalled_attempt_still_runs(bouncer_cluster)
    assert await through_bouncer(bouncer_cluster) > 0


async def test_server_killed_mid_submit_through_pgbouncer(bouncer_cluster: Cluster) -> None:
    # Killed after a submit's commit, before its reply: the repeated calls find
    # the committed jobs by request_id through PgBouncer's pooled sessions.
    await faults.test_sigkill_server_between_submit_commit_and_reply(bouncer_cluster)
    assert await through_bouncer(bouncer_cluster) > 0


async def test_event_relay_killed_mid_batch_through_pgbouncer(
    bouncer_cluster: Cluster, events: EventPath
) -> None:
    await event_faults.test_relay_killed_mid_batch_while_publishing_events(bouncer_cluster, events)
    assert await through_bouncer(bouncer_cluster) > 0
