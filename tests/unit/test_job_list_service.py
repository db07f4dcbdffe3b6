"""JobService.list on a fake store: what each filter asks of the store, the page
size's bounds, and page tokens that hold to the filters they were made for."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest

from jobplane.errors import InvalidArgument
from jobplane.store.jobs import ListCursor
from jobplane.types import JobState
from tests.support.job_service import TENANT, JobStoreFake, service_on
from tests.support.jobs import NOW, stored_job


def _store(count: int) -> JobStoreFake:
    """Answers ``list_jobs`` with ``count`` jobs (as many as asked), newest first, and
    remembers each call."""
    jobs = [
        stored_job(
            f"jobs/{uuid.UUID(int=1000 + n)}",
            max_attempts=3,
            create_time=NOW - timedelta(seconds=n),
        )
        for n in range(count)
    ]
    return JobStoreFake(jobs=jobs, rates={"default": (3, 2, 1)})


async def test_filters_reach_the_store_and_a_full_page_has_a_token() -> None:
    store = _store(5)
    service = service_on(store)
    parent = f"jobs/{uuid.UUID(int=7)}"
    after, before = NOW - timedelta(days=1), NOW
    page = await service.list(
        TENANT,
        page_size=3,
        page_token="",
        state=JobState.QUEUED,
        job_type="demo.echo",
        labels={"team": "a"},
        created_after=after,
        created_before=before,
        waiting_code="SCHEDULED",
        parent=parent,
    )
    assert store.calls == [
        {
            "limit": 4,
            "after": None,
            "state": JobState.QUEUED,
            "job_type": "demo.echo",
            "labels": {"team": "a"},
            "created_after": after,
            "created_before": before,
            "waiting_code": "SCHEDULED",
            "parent": uuid.UUID(int=7),
        }
    ]
    assert page.jobs == store.jobs[:3]
    assert page.next_page_token

    # The next page continues after the page's last job, under the same filters.
    same: dict[str, Any] = {
        "state": JobState.QUEUED,
        "job_type": "demo.echo",
        "labels": {"team": "a"},
        "created_after": after,
        "created_before": before,
        "waiting_code": "SCHEDULED",
        "parent": parent,
    }
    await service.list(TENANT, page_size=3, page_token=page.next_page_token, **same)
    last = store.jobs[2]
    assert store.calls[-1]["after"] == ListCursor(last.create_time, uuid.UUID(last.id))
    # A token holds to its filters: another parent, type, label, time bound,
    # waiting code or state refuses it.
    changes: list[dict[str, Any]] = [
        {"parent": ""},
        {"job_type": "demo.other"},
        {"labels": {"team": "b"}},
        {"created_after": after - timedelta(seconds=1)},
        {"created_after": None},
        {"created_before": before + timedelta(seconds=1)},
        {"created_before": None},
        {"waiting_code": ""},
    ]
    for changed in changes:
        with pytest.raises(InvalidArgument, match=r"^page_token was created for other filters"):
            await service.list(
                TENANT, page_size=3, page_token=page.next_page_token, **{**same, **changed}
            )
    # The state alone (no waiting code, which needs QUEUED).
    plain = {**same, "waiting_code": ""}
    token = (await service.list(TENANT, page_size=3, page_token="", **plain)).next_page_token
    with pytest.raises(InvalidArgument, match=r"^page_token was created for other filters"):
        await service.list(TENANT, page_size=3, page_token=token, **{**plain, "state": None})


async def test_no_filter_is_none_to_the_store_and_the_last_page_has_no_token() -> None:
    store = _store(2)
    page = await service_on(store).list(TENANT, page_size=0, page_token="", state=None, job_type="")
    assert store.calls == [
        {
            "limit": 51,  # the default page of 50, and one to know there is more
            "after": None,
            "state": None,
            "job_type": None,
            "labels": None,
            "created_after": None,
            "created_before": None,
            "waiting_code": "",
            "parent": None,
        }
    ]
    assert (page.jobs, page.next_page_token) == (store.jobs, "")


async def test_the_page_size_is_bounded() -> None:
    store = _store(0)
    service = service_on(store)
    await service.list(TENANT, page_size=5000, page_token="", state=None, job_type="")
    assert store.calls[-1]["limit"] == 1001
    with pytest.raises(InvalidArgument, match=r"^page_size must not be negative$") as refused:
        await service.list(TENANT, page_size=-1, page_token="", state=None, job_type="")
    assert refused.value.field == "page_size"
    bad = {"job_type": "Not A Type", "labels": {"": "x"}, "parent": "job/1"}
    for key, value in bad.items():
        arguments: dict[str, Any] = {"state": None, "job_type": "", key: value}
        with pytest.raises(InvalidArgument):
            await service.list(TENANT, page_size=1, page_token="", **arguments)
    with pytest.raises(InvalidArgument) as refused:
        await service.list(
            TENANT,
            page_size=1,
            page_token="",
            state=JobState.RUNNING,
            job_type="",
            waiting_code="SCHEDULED",
        )
    assert refused.value.field == "waiting_code"
    assert len(store.calls) == 1


async def test_a_token_after_a_job_continues_a_list_of_the_same_filters() -> None:
    store = _store(4)
    service = service_on(store)
    parent = f"jobs/{uuid.UUID(int=7)}"
    job = store.jobs[1]
    filters: dict[str, Any] = {
        "state": JobState.QUEUED,
        "job_type": "demo.echo",
        "waiting_code": "SCHEDULED",
        "parent": parent,
    }
    token = service.page_token_after(job, **filters)
    await service.list(TENANT, page_size=2, page_token=token, **filters)
    assert store.calls[-1]["after"] == ListCursor(job.create_time, uuid.UUID(job.id))
    for changed in ({"parent": ""}, {"waiting_code": ""}, {"state": None}):
        with pytest.raises(InvalidArgument, match="page_token"):
            await service.list(TENANT, page_size=2, page_token=token, **{**filters, **changed})


async def test_queue_rates_read_a_bounded_scan_of_the_window() -> None:
    store = _store(0)
    rates = await service_on(store).queue_rates(TENANT, window_seconds=60.0)
    assert rates == {"default": (3, 2, 1)}
    assert store.calls == [{"tenant": TENANT, "window_seconds": 60.0, "scan": 100_000}]


async def test_a_page_holding_the_last_jobs_exactly_has_no_token() -> None:
    store = _store(3)
    service = service_on(store)
    page = await service.list(TENANT, page_size=3, page_token="", state=None, job_type="")
    assert (page.jobs, page.next_page_token) == (store.jobs, "")
    await service.list(TENANT, page_size=1000, page_token="", state=None, job_type="")
    assert store.calls[-1]["limit"] == 1001
    page = await service.list(TENANT, page_size=2, page_token="", state=None, job_type="")
    assert page.jobs == store.jobs[:2]
    last = store.jobs[1]
    assert page.next_page_token == service.page_token_after(last, state=None, job_type="")


async def test_a_parent_that_is_no_job_name_is_refused_on_its_field() -> None:
    store = _store(0)
    with pytest.raises(InvalidArgument) as refused:
        await service_on(store).list(
            TENANT, page_size=1, page_token="", state=None, job_type="", parent="job/1"
        )
    assert (refused.value.field, refused.value.message) == (
        "parent",
        "parent must look like jobs/{id}, got 'job/1'",
    )
    assert store.calls == []
