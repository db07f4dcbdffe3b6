"""The dashboard in a real browser: Playwright driving Debian's headless Chromium."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from playwright.async_api import Browser, BrowserContext, Page, async_playwright

from jobplane.envelope import Envelope
from jobplane.schedule_types import SCHEDULE_LABEL
from jobplane.types import JobState
from jobplane.workers.dlq import FailedQueue
from tests.support.dashboard import UiStack, ui_stack
from tests.support.queues import dead_letter

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_INSTALLED = CHROMIUM.exists()
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
async def ui(template_db: str, run_id: str, amqp_url: str) -> AsyncIterator[UiStack]:
    """One jobplane and dashboard for the module."""
    async with ui_stack(template_db, run_id, amqp_url) as running:
        yield running


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    """One Chromium for the module (`make test` installs Debian's package)."""
    assert CHROMIUM_INSTALLED, "no /usr/bin/chromium: scripts/services.sh installs it"
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield launched
        await launched.close()


@pytest.fixture
async def page(browser: Browser, ui: UiStack) -> AsyncIterator[Page]:
    """A signed-in page of a fresh browser context (its own cookies)."""
    context: BrowserContext = await browser.new_context(base_url=ui.url)
    tab = await context.new_page()
    problems: list[str] = []
    tab.on(
        "console",
        # A 404 or 409 page (asked for) is logged as a failed load.
        lambda m: (
            problems.append(m.text)
            if m.type == "error" and "404" not in m.text and "409" not in m.text
            else None
        ),
    )
    tab.on("pageerror", lambda e: problems.append(str(e)))
    await sign_in(tab, ui.stack.key)
    yield tab
    await context.close()
    # No script error and no Content-Security-Policy refusal on any page.
    assert problems == []


async def sign_in(tab: Page, key: str) -> None:
    await tab.goto("/jobs")
    assert "/signin?next=" in tab.url
    await tab.fill("input[name=key]", key)
    await tab.click("button[type=submit]")
    await tab.wait_for_url("**/jobs")
    assert await tab.text_content("h1") == "Jobs"


async def test_the_progress_bar_advances_without_a_reload(page: Page, ui: UiStack) -> None:
    client = ui.stack.client()
    job = await client.submit("demo.progress", {"steps": 20, "interval_ms": 100})
    loads: list[str] = []
    page.on("load", lambda p: loads.append(p.url))
    response = await page.goto(f"/jobs/{job.id}")
    assert response is not None and response.status == 200
    loads.clear()
    bar = page.locator("#job-progress")
    seen: list[float] = []
    for _ in range(200):
        value = float(await bar.evaluate("el => el.value"))
        if not seen or value > seen[-1]:
            seen.append(value)
        if len(seen) >= 4 and 0 < seen[-1] < 1:
            break
        await asyncio.sleep(0.05)
    assert len(seen) >= 4, seen
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert loads == []  # every value came over the live stream
    rows = await page.locator("#events tr").count()
    assert rows >= 4
    # At the end the page reads the job once more: its result shows.
    await page.locator("#job-state", has_text="succeeded").wait_for(timeout=20_000)
    await page.locator("#result").wait_for(timeout=10_000)
    assert '"steps": 20' in (await page.text_content("#result") or "")


async def test_the_jobs_list_updates_live(page: Page, ui: UiStack) -> None:
    client = ui.stack.client()
    job = await client.submit("demo.progress", {"steps": 15, "interval_ms": 100})
    await page.goto("/jobs?state=")
    row = page.locator(f"tr[data-job='{job.id}']")
    await row.wait_for()
    await row.locator("[data-field=state]", has_text="succeeded").wait_for(timeout=20_000)
    assert await row.locator("[data-field=progress]").evaluate("el => el.value") == 1
    succeeded = page.locator("[data-count=succeeded]")
    assert int((await succeeded.text_content() or "0").rstrip("+")) >= 1


async def test_cancel_a_job_from_its_page(page: Page, ui: UiStack) -> None:
    client = ui.stack.client()
    job = await client.submit("demo.progress", {"steps": 600, "interval_ms": 100})
    await page.goto(f"/jobs/{job.id}")
    await page.locator("#job-state", has_text="running").wait_for(timeout=20_000)
    await page.click("#cancel")
    await page.locator("#job-state", has_text="cancelled").wait_for(timeout=20_000)
    assert (await client.get(job.name)).state is JobState.CANCELLED
    # Once it has ended, the page (read again) offers a retry, and no cancel.
    await page.locator("#retry").wait_for(timeout=10_000)
    assert await page.locator("#cancel").count() == 0


async def test_replay_a_failed_message(page: Page, ui: UiStack) -> None:
    stack = ui.stack
    # A type no worker handles: the job waits, queued, for one.
    job = await stack.client().submit("nobody.runs.this", {"n": 1})
    envelope = Envelope(uuid.uuid4(), uuid.UUID(job.id), stack.tenant_id, job.type)
    await dead_letter(stack.amqp_url, stack.topology, envelope)
    await page.goto("/failed")
    row = page.locator(f"tr[data-job='{job.id}']")
    for _ in range(50):
        if await row.count():
            break
        await asyncio.sleep(0.2)
        await page.reload()
    await row.locator("button.replay").click()
    await page.locator("#report", has_text=f"replayed {job.name}").wait_for()
    assert await page.locator(f"tr[data-job='{job.id}']").count() == 0
    failed = FailedQueue(stack.amqp_url, stack.topology)
    assert [m for m in await failed.list() if m.envelope and str(m.envelope.job_id) == job.id] == []
    events = await stack.scalar(
        "SELECT count(*) FROM job_events WHERE job_id = :id AND message LIKE '%failed queue%'",
        id=job.id,
    )
    assert events == 1


async def test_another_tenants_job_url_shows_not_found(page: Page, ui: UiStack) -> None:
    other = ui.stack.client(await ui.stack.new_key("umbrella"))
    theirs = await other.submit("demo.echo", {"secret": "umbrella-only"})
    response = await page.goto(f"/jobs/{theirs.id}")
    assert response is not None and response.status == 404
    assert await page.text_content("h1") == "Not found"
    assert "umbrella-only" not in await page.content()
    unknown = await page.goto(f"/jobs/{uuid.uuid4()}")
    assert unknown is not None and unknown.status == 404
    assert await page.text_content("h1") == "Not found"


async def test_pause_and_trigger_a_schedule_from_its_page(page: Page, ui: UiStack) -> None:
    client = ui.stack.client()
    schedule = await client.create_schedule(
        "demo.progress", {"steps": 600, "interval_ms": 100}, interval=3600
    )
    await page.click("nav >> text=Schedules")
    await page.wait_for_url("**/schedules")
    await page.click(f"a[href='/{schedule.name}']")
    await page.wait_for_url(f"**/{schedule.name}")
    await page.click("#pause")
    await page.locator("#schedule-state", has_text="paused").wait_for(timeout=10_000)
    assert (await client.get_schedule(schedule)).paused
    # Paused or not, a trigger runs now, and shows its job.
    await page.click("#trigger")
    await page.wait_for_url("**/jobs/*")
    await page.locator("#job-state").wait_for(timeout=10_000)
    job = await client.get(f"jobs/{page.url.rsplit('/', 1)[1]}")
    assert job.labels[SCHEDULE_LABEL] == schedule.name
    # "Do not run" while that run goes: refused, naming it; nothing started.
    await page.goto(f"/{schedule.name}")
    await page.select_option("#trigger-overlap", "skip")
    await page.click("#trigger")
    await page.locator("h1", has_text="Not possible now").wait_for(timeout=10_000)
    assert job.name in (await page.text_content("main") or "")
    assert (await client.get_schedule(schedule)).runs == 1
    await page.goto(f"/{schedule.name}")
    assert await page.locator(f"#runs a[href='/jobs/{job.id}']").count() == 1
    await page.click("#resume")
    await page.locator("#schedule-state", has_text="active").wait_for(timeout=10_000)
    assert not (await client.get_schedule(schedule)).paused
    await client.cancel(job.name)
