"""Retention and erasure of blobs: rows and S3 objects, on the run's moto server."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import aioboto3
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.blobs import BlobStore
from jobplane.client import JobState
from jobplane.store.maintenance import MaintenanceStore
from jobplane.topology import Topology
from jobplane.workers.demo import registry as demo_registry
from jobplane.workers.maintenance import ERASURE, RETENTION, Maintenance
from tests.support.aged import aged_jobs, tenant_rows
from tests.support.stack import Stack, start_stack


@pytest.fixture
async def stack(
    engine: AsyncEngine,
    database_url: str,
    amqp_url: str,
    topology: Topology,
    blobs: BlobStore,
) -> AsyncIterator[Stack]:
    """Server (with the object store) and relay; each test starts its worker."""
    running = await start_stack(engine, database_url, amqp_url, topology, worker=False, blobs=blobs)
    yield running
    await running.close()


async def _age(stack: Stack, tenant_id: uuid.UUID, digest: str, days: int) -> None:
    async with stack.engine.begin() as conn:
        await conn.execute(
            text(
                "UPDATE blobs SET created_at = now() - make_interval(days => :d), "
                "touched_at = now() - make_interval(days => :d) "
                "WHERE tenant_id = :t AND digest = :digest"
            ),
            {"d": days, "t": tenant_id, "digest": digest},
        )


async def _keys(store: BlobStore, prefix: str) -> list[str]:
    """Every object key under ``prefix`` in the store's bucket, read with a client of our own."""
    session = aioboto3.Session()
    async with session.client(
        "s3",
        endpoint_url=store.url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ) as s3:
        found = await s3.list_objects_v2(Bucket=store.bucket, Prefix=prefix)
        return sorted(item["Key"] for item in found.get("Contents", []))


async def _put_key(store: BlobStore, key: str) -> None:
    session = aioboto3.Session()
    async with session.client(
        "s3",
        endpoint_url=store.url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ) as s3:
        await s3.put_object(Bucket=store.bucket, Key=key, Body=b"a leftover of an upload")


async def test_retention_collects_old_unreferenced_blobs_and_erasure_all(
    stack: Stack, blobs: BlobStore
) -> None:
    maintenance = Maintenance(
        stack.engine, stack.db, blobs=blobs, live_wait=10.0, poll_interval=0.1
    )
    await stack.start_worker(demo_registry.merge(maintenance.registry()))
    await stack.new_key("globex")
    acme = stack.tenant_id
    globex = (await MaintenanceStore(stack.engine).tenant_named("globex")).id
    await MaintenanceStore(stack.engine).set_retention("acme", 30)
    await MaintenanceStore(stack.engine).set_retention("globex", 30)

    by_old_job = await blobs.put_bytes(acme, b"referenced by a job of 40 days ago")
    by_young_job = await blobs.put_bytes(acme, b"referenced by a job of today")
    unreferenced = await blobs.put_bytes(acme, b"nobody's")
    young = await blobs.put_bytes(acme, b"uploaded today")
    foreign = await blobs.put_bytes(globex, b"another tenant's, as old")
    for tenant, info in (
        (acme, by_old_job),
        (acme, by_young_job),
        (acme, unreferenced),
        (globex, foreign),
    ):
        await _age(stack, tenant, info.digest, 40)
    [old_job] = await aged_jobs(stack.engine, acme, 1, age_days=40)
    async with stack.engine.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO job_blobs (tenant_id, job_id, digest, role) "
                "VALUES (:t, :j, :d, 'input')"
            ),
            {"t": acme, "j": old_job, "d": by_old_job.digest},
        )
    client = stack.client()
    holder = await client.wait(
        (await client.submit("demo.echo", {"file": by_young_job.name})).name, timeout=30
    )
    assert holder.state is JobState.SUCCEEDED, holder.error

    done = await client.wait((await client.submit(RETENTION, {})).name, timeout=30)
    assert done.state is JobState.SUCCEEDED, done.error
    assert done.result is not None
    assert done.result["blobs"] == "collected"
    assert done.result["deleted"]["blobs"] == 2
    assert done.result["deleted"]["job_blobs"] == 1
    assert sorted(await blobs.list_digests(acme)) == sorted([by_young_job.digest, young.digest])
    assert await blobs.list_digests(globex) == [foreign.digest]
    # Again: nothing more to collect.
    again = await client.wait((await client.submit(RETENTION, {})).name, timeout=30)
    assert again.state is JobState.SUCCEEDED, again.error
    assert again.result is not None and "blobs" not in again.result["deleted"]

    before_globex = await tenant_rows(stack.engine, globex)
    await _put_key(blobs, f"{blobs.prefix}tenants/{acme}/staging/{uuid.uuid4()}")
    globex_keys = await _keys(blobs, f"{blobs.prefix}tenants/{globex}/")
    assert globex_keys == [blobs.key(globex, foreign.digest)]
    erased = await client.wait((await client.submit(ERASURE, {"confirm": "acme"})).name, timeout=30)
    assert erased.state is JobState.SUCCEEDED, erased.error
    assert erased.result is not None
    assert erased.result["blobs"] == "erased"
    assert erased.result["deleted"]["blobs"] == 2
    left = await tenant_rows(stack.engine, acme, keep=uuid.UUID(erased.id))
    assert left["blobs"] == left["job_blobs"] == 0
    assert left.pop("api_keys") == 1
    assert left == dict.fromkeys(left, 0)
    # Nothing under the tenant's prefix: blobs, and what an upload left in staging.
    assert await _keys(blobs, f"{blobs.prefix}tenants/{acme}/") == []
    assert await _keys(blobs, f"{blobs.prefix}tenants/{globex}/") == globex_keys
    assert await tenant_rows(stack.engine, globex) == before_globex


async def test_erasure_refuses_to_leave_blobs_where_no_object_store_is(
    stack: Stack, blobs: BlobStore
) -> None:
    maintenance = Maintenance(stack.engine, stack.db, live_wait=10.0, poll_interval=0.1)
    await stack.start_worker(demo_registry.merge(maintenance.registry()))
    await blobs.put_bytes(stack.tenant_id, b"kept until an erasure with a store")
    client = stack.client()
    refused = await client.wait(
        (await client.submit(ERASURE, {"confirm": "acme"}, max_attempts=1)).name, timeout=30
    )
    assert refused.state is JobState.FAILED
    assert refused.error is not None and refused.error.code == "BLOB_STORE_NOT_CONFIGURED"
    assert len(await blobs.list_digests(stack.tenant_id)) == 1
