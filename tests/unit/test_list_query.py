"""The statement and binds a job listing runs, for each filter: every condition
is the tenant's, newest first, and a type reads both plain jobs and pipelines."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from jobplane.store.jobs import ListCursor, list_query, waiting_filter
from jobplane.store.rows import JOB_COLUMNS
from jobplane.types import JobState, WaitingCode

NOW = datetime(2026, 5, 6, 7, 8, 9, tzinfo=UTC)
AFTER = datetime(2026, 1, 1, tzinfo=UTC)
BEFORE = datetime(2026, 2, 1, tzinfo=UTC)
ORDER = "ORDER BY create_time DESC, id DESC LIMIT :limit"


def _query(tenant: uuid.UUID, **filters: Any) -> tuple[str, dict[str, Any]]:
    given: dict[str, Any] = {
        "limit": 50,
        "after": None,
        "state": None,
        "job_type": None,
        "labels": None,
        "created_after": None,
        "created_before": None,
        "waiting_code": "",
        "now": NOW,
    }
    sql, binds = list_query(tenant, **{**given, **filters})
    return str(sql), binds


def test_an_unfiltered_listing_is_the_tenants_newest_first() -> None:
    tenant = uuid.uuid4()
    sql, binds = _query(tenant)
    assert sql == f"SELECT {JOB_COLUMNS} FROM jobs WHERE tenant_id = :tenant_id {ORDER}"
    assert binds == {"tenant_id": tenant, "limit": 50}


def test_every_filter_is_a_condition_with_its_bind() -> None:
    tenant, parent, last = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    sql, binds = _query(
        tenant,
        parent=parent,
        waiting_code=WaitingCode.NO_LIVE_WORKER.value,
        labels={"team": "é"},
        created_after=AFTER,
        created_before=BEFORE,
        state=JobState.QUEUED,
        after=ListCursor(NOW, last),
        limit=7,
    )
    where = " AND ".join(
        [
            "tenant_id = :tenant_id",
            "parent_id = :parent",
            "state = :waiting_state",
            "waiting_code = :waiting_code",
            "labels @> CAST(:labels AS jsonb)",
            "create_time >= :created_after",
            "create_time < :created_before",
            "state = :state",
            "(create_time, id) < (:after_time, :after_id)",
        ]
    )
    assert sql == f"SELECT {JOB_COLUMNS} FROM jobs WHERE {where} {ORDER}"
    assert binds == {
        "tenant_id": tenant,
        "limit": 7,
        "parent": parent,
        "waiting_state": "queued",
        "waiting_code": "NO_LIVE_WORKER",
        "labels": '{"team":"é"}',
        "created_after": AFTER,
        "created_before": BEFORE,
        "state": "queued",
        "after_time": NOW,
        "after_id": last,
    }


def test_a_type_reads_its_pipelines_jobs_and_its_plain_jobs_each_newest_first() -> None:
    tenant = uuid.uuid4()
    sql, binds = _query(tenant, job_type="ingest", state=JobState.FAILED)
    where = "tenant_id = :tenant_id AND state = :state"
    pipelines = f"(SELECT {JOB_COLUMNS} FROM jobs WHERE {where} AND pipeline = :type {ORDER})"
    plain = (
        f"(SELECT {JOB_COLUMNS} FROM jobs WHERE {where} AND type = :type "
        f"AND pipeline IS NULL {ORDER})"
    )
    assert sql == f"{pipelines} UNION ALL {plain} {ORDER}"
    assert binds == {"tenant_id": tenant, "limit": 50, "state": "failed", "type": "ingest"}


def test_scheduled_reads_queued_jobs_without_a_code_whose_time_is_ahead() -> None:
    where, binds = waiting_filter(WaitingCode.SCHEDULED.value, NOW)
    assert where == [
        "state = :waiting_state",
        "(waiting_code IS NULL OR waiting_code = '')",
        "schedule_time > :waiting_now",
    ]
    assert binds == {"waiting_state": "queued", "waiting_now": NOW}
    sql, params = _query(uuid.uuid4(), waiting_code="SCHEDULED")
    assert "schedule_time > :waiting_now" in sql and params["waiting_now"] == NOW
    assert "waiting_code" not in params


def test_any_other_code_reads_queued_jobs_that_carry_it() -> None:
    where, binds = waiting_filter("HANDED_BACK", NOW)
    assert where == ["state = :waiting_state", "waiting_code = :waiting_code"]
    assert binds == {"waiting_state": "queued", "waiting_code": "HANDED_BACK"}
