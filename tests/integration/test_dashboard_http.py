"""The dashboard over HTTP (no browser): sign-in, sessions, CSRF, tenant walls, headers."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from jobplane.envelope import Envelope
from jobplane.errors import Unavailable
from jobplane.server.dashboard.app import CSP, THROTTLE
from jobplane.server.dashboard.session import SESSION_COOKIE
from jobplane.types import JobState
from jobplane.workers.dlq import FailedQueue
from tests.support.dashboard import UiStack, browserless, csrf_token, form_token, sign_in, ui_stack
from tests.support.queues import dead_letter
from tests.support.stack import eventually

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
async def ui(template_db: str, run_id: str, amqp_url: str) -> AsyncIterator[UiStack]:
    """One jobplane and dashboard for the module."""
    async with ui_stack(template_db, run_id, amqp_url) as running:
        yield running


async def test_pages_need_a_session_and_send_the_security_headers(ui: UiStack) -> None:
    async with browserless(ui.url) as http:
        for path in ("/jobs", "/queues", "/failed", "/workers", "/events", "/jobs/x"):
            async with http.get(path, allow_redirects=False) as response:
                assert response.status == 303, path
                assert response.headers["Location"].startswith("/signin?next=")
        async with http.get("/jobs/live", headers={"Accept": "text/event-stream"}) as response:
            assert response.status == 401
        async with http.get("/signin") as response:
            assert response.status == 200
            assert response.headers["Content-Security-Policy"] == CSP
            assert "script-src 'self'" in CSP and "unsafe-inline" not in CSP
            assert response.headers["X-Frame-Options"] == "DENY"
            assert response.headers["X-Content-Type-Options"] == "nosniff"
            assert response.headers["Referrer-Policy"] == "same-origin"
            page = await response.text()
            assert "<script>" not in page and "onclick" not in page


async def test_sign_in_sets_an_http_only_strict_cookie_without_the_key(ui: UiStack) -> None:
    key = ui.stack.key
    async with browserless(ui.url) as http:
        async with http.get("/signin") as form:
            token = form_token(await form.text())
        async with http.post(
            "/signin", data={"key": key, "token": token, "next": "/queues"}, allow_redirects=False
        ) as response:
            assert response.status == 303
            assert response.headers["Location"] == "/queues"
            cookie = response.cookies[SESSION_COOKIE]
            assert cookie["httponly"] is True
            assert cookie["samesite"] == "Strict"
            assert key not in cookie.value and key[3:20] not in cookie.value
        async with http.get("/jobs") as page:
            assert page.status == 200
            assert "Sign out" in await page.text()


async def test_sign_in_goes_on_to_this_sites_pages_only(ui: UiStack) -> None:
    for asked, went in (
        ("/workers?x=1", "/workers?x=1"),
        ("//evil.example/", "/jobs"),
        ("/\t/evil.example/", "/jobs"),
        ("/\\evil.example", "/jobs"),
        ("https://evil.example/", "/jobs"),
    ):
        async with browserless(ui.url) as http:
            async with http.get("/signin") as form:
                token = form_token(await form.text())
            async with http.post(
                "/signin",
                data={"key": ui.stack.key, "token": token, "next": asked},
                allow_redirects=False,
            ) as response:
                assert response.headers["Location"] == went, asked


async def test_bad_keys_worker_keys_and_forged_forms_are_refused(ui: UiStack) -> None:
    worker_key = (await ui.stack.server.keys.create_worker()).key
    async with browserless(ui.url) as http:
        done = await sign_in(http, worker_key)
        assert done.status == 401
        assert "worker key cannot sign in" in await done.text()
        async with http.get("/jobs", allow_redirects=False) as response:
            assert response.status == 303
        # A form without the sign-in cookie's token (login CSRF).
        async with http.post("/signin", data={"key": ui.stack.key, "token": "x"}) as forged:
            assert forged.status == 403
        async with http.get("/jobs", allow_redirects=False) as response:
            assert response.status == 303


async def test_failed_sign_ins_are_slowed_then_refused(ui: UiStack) -> None:
    ui.dashboard.app[THROTTLE].succeeded("127.0.0.1")  # earlier tests' failures
    async with browserless(ui.url) as http:
        started = asyncio.get_running_loop().time()
        statuses = [(await sign_in(http, "jp_" + "A" * 43)).status for _ in range(6)]
        took = asyncio.get_running_loop().time() - started
        assert statuses[:5] == [401] * 5
        assert statuses[5] == 429
        assert took >= 5 * ui.dashboard.app[THROTTLE].delay > 0
        # The right key is refused too while the client waits.
        assert (await sign_in(http, ui.stack.key)).status == 429
    ui.dashboard.app[THROTTLE].succeeded("127.0.0.1")  # the next tests sign in from here too


async def test_posts_need_the_sessions_csrf_token(ui: UiStack) -> None:
    client = ui.stack.client()
    job = await client.submit("demo.progress", {"steps": 200, "interval_ms": 50})
    async with browserless(ui.url, ui.stack.key) as http:
        async with http.get(f"/jobs/{job.id}") as page:
            token = csrf_token(await page.text())
        for data in (
            {},
            {"csrf": "nope"},
            {"csrf": token[:-1] + ("A" if token[-1] != "A" else "B")},
        ):
            async with http.post(f"/jobs/{job.id}/cancel", data=data) as refused:
                assert refused.status == 403
        assert not (await client.get(job.name)).state.terminal
        # Another site's form, with a good token, is refused on its Origin.
        async with http.post(
            f"/jobs/{job.id}/cancel",
            data={"csrf": token},
            headers={"Origin": "https://evil.example"},
        ) as refused:
            assert refused.status == 403
        async with http.post(
            f"/jobs/{job.id}/cancel", data={"csrf": token}, allow_redirects=False
        ) as done:
            assert done.status == 303
    ended = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert ended.state is JobState.CANCELLED


async def test_another_tenants_job_is_not_found_like_an_unknown_one(ui: UiStack) -> None:
    other_key = await ui.stack.new_key("globex")
    theirs = await ui.stack.client(other_key).submit("demo.echo", {"secret": "globex-only"})
    unknown = uuid.uuid4()
    async with browserless(ui.url, ui.stack.key) as http:
        token = csrf_token(await (await http.get("/jobs")).text())
        bodies = []
        for job_id in (theirs.id, str(unknown), "not-a-job-id"):
            async with http.get(f"/jobs/{job_id}") as response:
                assert response.status == 404
                body = await response.text()
                assert "globex-only" not in body
                bodies.append(body.replace(job_id, ""))
            async with http.post(f"/jobs/{job_id}/cancel", data={"csrf": token}) as response:
                assert response.status == 404
            async with http.post(f"/jobs/{job_id}/retry", data={"csrf": token}) as response:
                assert response.status == 404
        assert bodies[0] == bodies[1]
        async with http.get(f"/jobs/{theirs.id}/live", timeout=aiohttp_timeout()) as live:
            assert live.status == 200
            assert b"event: notfound" in await live.content.readuntil(b"\n\n")
        async with http.get("/jobs?size=1000") as listed:
            assert theirs.id not in await listed.text()
    assert (await ui.stack.client(other_key).get(theirs.name)).type == "demo.echo"


async def test_the_jobs_page_filters_by_creation_time(ui: UiStack) -> None:
    client = ui.stack.client()
    old = await client.submit("demo.echo", {"n": 1})
    new = await client.submit("demo.echo", {"n": 2})
    async with ui.stack.engine.begin() as conn:
        await conn.execute(
            text("UPDATE jobs SET create_time = '2020-01-01T12:00:00Z' WHERE id = :id"),
            {"id": old.id},
        )
    async with browserless(ui.url, ui.stack.key) as http:
        async with http.get("/jobs?size=1000&until=2021-01-01T00:00:00Z") as listed:
            body = await listed.text()
        assert old.id in body and new.id not in body
        async with http.get("/jobs?size=1000&since=2021-01-01T00:00:00Z") as listed:
            body = await listed.text()
        assert new.id in body and old.id not in body


def aiohttp_timeout() -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=30)


async def test_sign_out_and_revocation_end_the_session(ui: UiStack) -> None:
    key, _tenant = await ui.stack.server.keys.create_key("acme")
    async with browserless(ui.url, key) as http:
        page = await (await http.get("/jobs")).text()
        stolen = {c.key: c.value for c in http.cookie_jar}[SESSION_COOKIE]
        async with http.post("/signout", data={"csrf": csrf_token(page)}) as out:
            assert out.url.path == "/signin"
    # The cookie's value no longer opens a page, though it is within its age.
    async with browserless(ui.url) as http:
        http.cookie_jar.update_cookies({SESSION_COOKIE: stolen})
        async with http.get("/jobs", allow_redirects=False) as response:
            assert response.status == 303
    async with browserless(ui.url, key) as http:
        assert (await http.get("/jobs", allow_redirects=False)).status == 200
        info = [k for k in await ui.stack.server.keys.list_keys("acme") if k.active][-1]
        await ui.stack.server.keys.revoke(info.key_id)

        async def refused() -> bool:
            async with http.get("/jobs", allow_redirects=False) as response:
                return response.status == 303

        await eventually(refused, timeout=10)


async def test_the_events_tail_streams_the_tenants_events_only(ui: UiStack) -> None:
    other = ui.stack.client(await ui.stack.new_key("hooli"))
    ours = ui.stack.client()
    async with (
        browserless(ui.url, ui.stack.key) as http,
        http.get(
            "/events/live",
            params={"type": "artifact.*"},
            headers={"Accept": "text/event-stream"},
            timeout=aiohttp_timeout(),
        ) as live,
    ):
        assert live.status == 200
        published: list[str] = []
        stop = asyncio.Event()

        async def publish() -> None:
            # Until the stream has started (it starts at the latest event); a
            # publish under way when the frame arrives is finished, so that its
            # id is known.
            while not stop.is_set():
                await other.publish("artifact.created", {"who": "hooli"})
                await ours.publish("job.noise", {"who": "acme"})
                published.append(
                    str((await ours.publish("artifact.created", {"who": "acme"})).event_id)
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2)

        publisher = asyncio.create_task(publish())
        try:
            # A keep-alive comment (": ping") comes first when the first event
            # is slow (a loaded machine): the first frame that is an event.
            frame = ": ping"
            while frame.startswith(":"):
                frame = (await live.content.readuntil(b"\n\n")).decode()
        finally:
            stop.set()
            await asyncio.wait_for(publisher, 30)
        assert frame.startswith("id: ")
        assert "event: event" in frame
        assert any(event_id in frame for event_id in published)
        assert '"who":"acme"' in frame and "hooli" not in frame and "job.noise" not in frame


async def test_bad_query_parameters_are_400_naming_the_field(ui: UiStack) -> None:
    cases = {
        "/jobs?state=done": "state",
        "/jobs?size=0": "size",
        "/jobs?size=1001": "size",
        "/jobs?since=yesterday": "since",
        "/jobs?since=2026-12-02&until=2026-12-01": "until",
        "/jobs?label=nokey": "label",
        "/jobs?type=Bad%20Type": "type",
        "/jobs?page=garbage": "page_token",
        "/jobs?color=red": "color",
        "/jobs?state=queued&state=running": "state",
        "/queues?x=1": "x",
        "/events?type=a..b": "type",
        "/jobs/00000000-0000-0000-0000-000000000000/live?after=-1": "after",
    }
    async with browserless(ui.url, ui.stack.key) as http:
        for path, field in cases.items():
            async with http.get(path) as response:
                assert response.status == 400, path
                assert f'data-field="{field}"' in await response.text(), path


async def test_failed_queue_shows_and_replays_only_the_tenants_messages(ui: UiStack) -> None:
    stack = ui.stack
    ours = await stack.client().submit("nobody.handles.this", {"n": 1})
    other_key = await stack.new_key("initech")
    theirs = await stack.client(other_key).submit("nobody.handles.this", {"n": 2})
    other_tenant = uuid.UUID(
        str(await stack.scalar("SELECT tenant_id FROM jobs WHERE id = :id", id=theirs.id))
    )
    failed = FailedQueue(stack.amqp_url, stack.topology)
    await dead_letter(
        stack.amqp_url,
        stack.topology,
        *(
            Envelope(uuid.uuid4(), uuid.UUID(job.id), tenant, job.type)
            for job, tenant in ((ours, stack.tenant_id), (theirs, other_tenant))
        ),
    )
    async with browserless(ui.url, stack.key) as http:

        async def listed() -> bool:
            async with http.get("/failed") as response:
                return ours.id in await response.text()

        await eventually(listed, timeout=10)
        page = await (await http.get("/failed")).text()
        assert theirs.id not in page
        async with http.post(
            "/failed/replay", data={"csrf": csrf_token(page), "job": theirs.name}
        ) as response:
            assert "nothing to replay" in await response.text()
        async with http.post(
            "/failed/replay", data={"csrf": csrf_token(page), "job": ours.name}
        ) as response:
            assert f'replayed <a href="/{ours.name}">' in await response.text()
    left = [m.envelope.job_id for m in await failed.list() if m.envelope]
    assert left == [uuid.UUID(theirs.id)]
    await failed.purge()


async def test_queues_and_workers_pages_show_the_deployment(ui: UiStack) -> None:
    async with browserless(ui.url, ui.stack.key) as http:
        page = await (await http.get("/queues")).text()
        assert ui.stack.topology.queues[0].name in page
        assert ui.stack.topology.failed_queue in page
        # The worker's consumer, counted by the broker.
        queue_row = page.split(f'data-queue="{ui.stack.topology.queues[0].name}"')[1]
        assert '<td data-field="consumers">1</td>' in queue_row.split("</tr>")[0]
        worker = ui.stack.worker
        assert worker is not None
        page = await (await http.get("/workers")).text()
        assert worker.id in page
        # A running job counts against its worker, and its page names that worker.
        client = ui.stack.client()
        job = await client.submit("demo.progress", {"steps": 300, "interval_ms": 100})

        async def busy() -> bool:
            async with http.get("/workers") as response:
                row = (await response.text()).split(f'data-worker="{worker.id}"')[1]
                return '<td data-field="busy">1 /' in row.split("</tr>")[0]

        await eventually(busy, timeout=10)
        assert f"<code>{worker.id}</code>" in await (await http.get(f"/jobs/{job.id}")).text()
        await client.cancel(job.name)


_PARAMS = ["state", "type", "label", "since", "until", "size", "page", "next", "after", "x"]


async def test_fuzzed_query_parameters_never_fail_the_server(ui: UiStack) -> None:
    loop = asyncio.get_running_loop()
    job = await ui.stack.client().submit("demo.echo", {"fuzz": True})
    paths = ["/jobs", "/queues", "/failed", "/workers", "/events", "/", "/signin", "/jobs/live"]
    paths += [f"/jobs/{job.id}", f"/jobs/{job.id}/live", "/events/live"]
    async with browserless(ui.url, ui.stack.key) as http:

        async def probe(path: str, params: list[tuple[str, str]]) -> None:
            async with http.get(
                path, params=params, allow_redirects=False, timeout=aiohttp_timeout()
            ) as response:
                assert response.status in (200, 303, 400), (path, params, response.status)
                if response.status == 400:
                    assert "data-field=" in await response.text()

        @settings(max_examples=150, deadline=None, derandomize=True)
        @given(
            path=st.sampled_from(paths),
            params=st.lists(st.tuples(st.sampled_from(_PARAMS), st.text(max_size=40)), max_size=4),
        )
        def check(path: str, params: list[tuple[str, str]]) -> None:
            asyncio.run_coroutine_threadsafe(probe(path, params), loop).result()

        await asyncio.to_thread(check)


@pytest.mark.parametrize("path", ["/events/live", "/jobs/live"])
async def test_sign_out_ends_the_sessions_open_streams(
    ui: UiStack, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jobplane.server.dashboard import live

    monkeypatch.setattr(live, "RECHECK_SECONDS", 0.3)
    async with browserless(ui.url, ui.stack.key) as http:
        if path == "/jobs/live":
            await ui.stack.client().submit("demo.progress", {"steps": 100, "interval_ms": 100})
        cookie = {c.key: c.value for c in http.cookie_jar}[SESSION_COOKIE]
        page = await (await http.get("/jobs")).text()
        async with browserless(ui.url) as other:
            other.cookie_jar.update_cookies({SESSION_COOKIE: cookie})
            async with other.get(
                path, headers={"Accept": "text/event-stream"}, timeout=aiohttp_timeout()
            ) as stream:
                assert stream.status == 200
                async with http.post("/signout", data={"csrf": csrf_token(page)}) as out:
                    assert out.url.path == "/signin"
                body = await asyncio.wait_for(stream.content.read(), timeout=10)
        assert b"event: signedout" in body


async def test_forms_behind_a_tls_proxy_pass_the_origin_check(ui: UiStack) -> None:
    """The browser says https://host; the socket is plain HTTP from the proxy."""
    client = ui.stack.client()
    host = ui.url.removeprefix("http://")
    async with browserless(ui.url, ui.stack.key) as http:
        job = await client.submit("demo.progress", {"steps": 200, "interval_ms": 50})
        token = csrf_token(await (await http.get(f"/jobs/{job.id}")).text())
        for headers, status in (
            ({"Origin": "https://evil.example", "Sec-Fetch-Site": "cross-site"}, 403),
            ({"Origin": f"https://{host}", "Sec-Fetch-Site": "same-site"}, 403),
            ({"Origin": "https://evil.example"}, 403),
            ({"Origin": f"https://{host}", "Sec-Fetch-Site": "same-origin"}, 303),
        ):
            async with http.post(
                f"/jobs/{job.id}/cancel",
                data={"csrf": token},
                headers=headers,
                allow_redirects=False,
            ) as response:
                assert response.status == status, headers
        assert (await asyncio.wait_for(client.wait(job.name), 20)).state is JobState.CANCELLED
        job = await client.submit("demo.progress", {"steps": 200, "interval_ms": 50})
        async with http.post(
            f"/jobs/{job.id}/cancel",
            data={"csrf": token},
            headers={"Origin": f"https://{host}"},
            allow_redirects=False,
        ) as response:
            assert response.status == 303
        await asyncio.wait_for(client.wait(job.name), 20)
    # A public origin set: only it passes.
    from jobplane.server.dashboard import Dashboard

    public = Dashboard(
        ui.dashboard.backend, listen="127.0.0.1:0", signin_delay=0.1, origin="https://jobs.example"
    )
    await public.start()
    try:
        host = public.url.removeprefix("http://").rstrip("/")
        async with browserless(public.url.rstrip("/")) as http:
            async with http.get("/signin") as form:
                signin_token = form_token(await form.text())
            data = {"key": ui.stack.key, "token": signin_token, "next": "/jobs"}
            for origin, status in ((f"http://{host}", 403), ("https://jobs.example", 303)):
                async with http.post(
                    "/signin", data=data, headers={"Origin": origin}, allow_redirects=False
                ) as response:
                    assert response.status == status, origin
    finally:
        await public.stop()


async def test_sign_ins_sent_at_once_cannot_pass_the_throttle(ui: UiStack) -> None:
    throttle = ui.dashboard.app[THROTTLE]
    throttle.succeeded("127.0.0.1")
    try:
        async with browserless(ui.url) as http:
            async with http.get("/signin") as form:
                token = form_token(await form.text())

            async def attempt() -> int:
                # Keys of their own: each one is looked up (no cached answer).
                key = "jp_" + secrets.token_urlsafe(32)
                async with http.post(
                    "/signin", data={"key": key, "token": token, "next": "/jobs"}
                ) as response:
                    return response.status

            statuses = await asyncio.gather(*(attempt() for _ in range(20)))
        assert statuses.count(401) == 5, statuses
        assert statuses.count(429) == 15, statuses
    finally:
        throttle.succeeded("127.0.0.1")


async def test_the_failed_queue_is_peeked_once_for_every_tenant(ui: UiStack) -> None:
    """Each peek returns the messages it took, which RabbitMQ 4 quorum queues count
    toward their delivery limit: pages of every tenant share one peek per period."""
    from jobplane.server.dashboard.shared import Deployment

    stack = ui.stack
    deployment = Deployment(stack.engine, stack.amqp_url, stack.topology, failed_ttl=30.0)
    peeks = 0
    peek = deployment._failed.list

    async def counted(limit: int) -> Any:
        nonlocal peeks
        peeks += 1
        return await peek(limit)

    deployment._failed.list = counted  # type: ignore[method-assign,assignment]
    other = uuid.uuid4()
    for _ in range(5):
        await asyncio.gather(deployment.failed_of(stack.tenant_id), deployment.failed_of(other))
    assert peeks == 1
    # A replay of nothing the snapshot holds does not read the queue.
    report = await deployment.replay(other, None)
    assert report.replayed == [] and report.kept == [] and peeks == 1


async def test_a_live_stream_does_not_freeze_when_the_database_connections_drop(
    ui: UiStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every backend of the test database is terminated under an open job stream:
    the stream goes on or ends (the browser reconnects), and never just pings."""
    from jobplane.server.dashboard import live

    monkeypatch.setattr(live, "RECHECK_SECONDS", 0.5)
    job = await ui.stack.client().submit("demo.progress", {"steps": 400, "interval_ms": 50})
    async with (
        browserless(ui.url, ui.stack.key) as http,
        http.get(
            f"/jobs/{job.id}/live",
            headers={"Accept": "text/event-stream"},
            timeout=aiohttp_timeout(),
        ) as stream,
    ):
        assert stream.status == 200
        assert b"event: job" in await asyncio.wait_for(stream.content.readuntil(b"\n\n"), 10)
        database = await ui.stack.scalar("SELECT current_database()")
        # Other connections: the feed's, the pools', the listeners'; not this one.
        # Each ended before this returns (a backend ends on its own time after
        # the signal; one still running would fail a later statement of this
        # test mid-flight, which is the outage itself, not what is tested).
        await ui.stack.scalar(
            "SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity "
            "WHERE datname = :db AND pid <> pg_backend_pid()",
            db=database,
        )
        events_after = 0
        ended = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while loop.time() < deadline and events_after < 3:
            try:
                chunk = await asyncio.wait_for(stream.content.readuntil(b"\n\n"), 20)
            except (asyncio.IncompleteReadError, aiohttp.ClientPayloadError):
                ended = True
                break
            if not chunk:
                ended = True
                break
            if b"event: job" in chunk:
                events_after += 1
            if b"event: unavailable" in chunk or b"event: failed" in chunk:
                ended = True
        assert ended or events_after >= 3
    # The server answers UNAVAILABLE ("retry") to a call that meets a
    # connection the outage ended before the pool learned of it; a client
    # asked to retry does.
    for _ in range(50):
        try:
            await ui.stack.client().cancel(job.name)
            break
        except Unavailable:
            await asyncio.sleep(0.2)
    else:
        raise AssertionError("the cancel was refused for 10 s after the outage")
