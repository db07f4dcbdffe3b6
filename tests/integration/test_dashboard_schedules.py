"""The dashboard's schedules pages over HTTP: the tenant's schedules only, one
schedule's runs, and pause, resume and trigger behind the session's CSRF token;
the jobs list's waiting filter."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from jobplane.client import Overlap
from jobplane.schedule_types import SCHEDULE_LABEL
from tests.support.dashboard import UiStack, browserless, csrf_token, ui_stack

pytestmark = pytest.mark.timeout(120)

_LONG = {"steps": 600, "interval_ms": 100}


@pytest.fixture(scope="module")
async def ui(template_db: str, run_id: str, amqp_url: str) -> AsyncIterator[UiStack]:
    async with ui_stack(template_db, run_id, amqp_url) as running:
        yield running


async def test_the_list_shows_the_tenants_schedules_only(ui: UiStack) -> None:
    client = ui.stack.client()
    ours = await client.create_schedule(
        "demo.echo", cron="30 2 * * *", time_zone="Europe/Berlin", overlap=Overlap.BUFFER_ONE
    )
    await client.pause_schedule(ours)
    stranger = ui.stack.client(await ui.stack.new_key("globex-ui"))
    theirs = await stranger.create_schedule("demo.echo", interval=3600)
    async with browserless(ui.url, ui.stack.key) as http:
        async with http.get("/schedules") as response:
            assert response.status == 200
            page = await response.text()
        assert f'href="/{ours.name}"' in page
        assert "30 2 * * *" in page and "Europe/Berlin" in page
        assert "buffer_one" in page and "paused" in page
        assert theirs.id not in page
        assert 'href="/schedules"' in page  # in the nav
        async with http.get(f"/{theirs.name}") as response:
            assert response.status == 404
        async with http.get("/schedules/Not_An_Id") as response:
            assert response.status == 404
        async with http.get("/schedules?bogus=1") as response:
            assert response.status == 400


async def test_pause_resume_and_trigger_need_the_csrf_token(ui: UiStack) -> None:
    client = ui.stack.client()
    schedule = await client.create_schedule("demo.progress", _LONG, interval=3600)
    async with browserless(ui.url, ui.stack.key) as http:
        async with http.get(f"/{schedule.name}") as response:
            assert response.status == 200
            token = csrf_token(await response.text())
        async with http.post(f"/{schedule.name}/pause", data={"csrf": "forged"}) as refused:
            assert refused.status == 403
        assert not (await client.get_schedule(schedule)).paused
        async with http.post(f"/{schedule.name}/trigger", data={}) as refused:
            assert refused.status == 403
        assert (await client.get_schedule(schedule)).runs == 0

        async with http.post(
            f"/{schedule.name}/pause", data={"csrf": token}, allow_redirects=False
        ) as done:
            assert done.status == 303 and done.headers["Location"] == f"/{schedule.name}"
        assert (await client.get_schedule(schedule)).paused
        async with http.post(f"/{schedule.name}/resume", data={"csrf": token}) as done:
            assert done.status == 200
        assert not (await client.get_schedule(schedule)).paused

        async with http.post(
            f"/{schedule.name}/trigger", data={"csrf": token}, allow_redirects=False
        ) as done:
            assert done.status == 303
            job_path = done.headers["Location"]
        job = await client.get(f"jobs/{job_path.rsplit('/', 1)[1]}")
        assert job.labels[SCHEDULE_LABEL] == schedule.name
        # One run is going: "skip" starts none and says which job runs.
        async with http.post(
            f"/{schedule.name}/trigger", data={"csrf": token, "overlap": "skip"}
        ) as refused:
            assert refused.status == 409
            assert job.name in await refused.text()
        assert (await client.get_schedule(schedule)).runs == 1
        async with http.post(
            f"/{schedule.name}/trigger", data={"csrf": token, "overlap": "buffer_one"}
        ) as refused:
            assert refused.status == 400 and "overlap" in await refused.text()
        async with http.get(f"/{schedule.name}") as response:
            page = await response.text()
        assert f'href="/jobs/{job.id}"' in page  # among its recent runs
        await client.cancel(job.name)


async def test_the_jobs_list_filters_by_waiting_code(ui: UiStack) -> None:
    client = ui.stack.client()
    delayed = await client.submit("demo.echo", {"w": 1}, schedule_delay=3600)
    now = await client.submit("demo.echo", {"w": 2})
    async with browserless(ui.url, ui.stack.key) as http:
        async with http.get("/jobs?waiting=SCHEDULED") as response:
            assert response.status == 200
            page = await response.text()
        assert delayed.id in page and now.id not in page
        async with http.get("/jobs?waiting=no+code") as response:
            assert response.status == 400 and "waiting" in await response.text()
        async with http.get("/jobs?waiting=SCHEDULED&state=running") as response:
            assert response.status == 400
    await client.cancel(delayed.name)
