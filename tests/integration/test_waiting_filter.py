"""ListJobs by waiting code: the filter agrees with what GetJob shows, pages, refuses
what is no code, and reads only the queued jobs it returns (EXPLAIN)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from jobplane.client import InvalidArgument, JobState, WaitingCode
from jobplane.store.jobs import list_query
from tests.integration.test_cli_and_sync import jobplane
from tests.support.stack import Stack

pytestmark = pytest.mark.stack(worker=False, relay=False)


async def _set(stack: Stack, name: str, sql: str, **params: Any) -> None:
    async with stack.engine.begin() as conn:
        await conn.execute(
            text(f"UPDATE jobs SET {sql} WHERE id = :id"), {"id": name[5:], **params}
        )


async def _listed(stack: Stack, code: str, **filters: Any) -> list[str]:
    client = stack.client()
    return [j.name async for j in client.iter_jobs(waiting_code=code, page_size=2, **filters)]


async def test_the_filter_agrees_with_get(stack: Stack) -> None:
    client = stack.client()
    later = await client.submit("demo.echo", {"n": 1}, schedule_delay=3600)
    now = await client.submit("demo.echo", {"n": 2})
    past = await client.submit(
        "demo.echo", {"n": 3}, schedule_time=datetime.now(UTC) - timedelta(minutes=1)
    )
    came = await client.submit("demo.echo", {"n": 4}, schedule_delay=3600)
    # Its time has come (as if an hour passed): no longer SCHEDULED, though
    # nothing claimed it yet.
    await _set(stack, came.name, "schedule_time = now() - interval '1 second'")
    keyed = await client.submit("demo.echo", {"n": 5}, schedule_delay=3600)
    # A stored code wins over SCHEDULED, as GetJob reads it.
    await _set(
        stack,
        keyed.name,
        "waiting_code = 'CONCURRENCY_LIMIT', waiting_reason = 'waits for its key'",
    )
    unroutable = await client.submit("demo.echo", {"n": 6})
    await _set(stack, unroutable.name, "waiting_code = 'UNROUTABLE', waiting_reason = 'returned'")
    ended = await client.submit("demo.echo", {"n": 7}, schedule_delay=3600)
    await client.cancel(ended.name)

    every = [later, now, past, came, keyed, unroutable, ended]
    for code in ("SCHEDULED", "CONCURRENCY_LIMIT", "UNROUTABLE", "NO_LIVE_WORKER"):
        shown = {job.name for job in every if (await client.get(job.name)).waiting_code == code}
        assert set(await _listed(stack, code)) == shown, code
    assert await _listed(stack, WaitingCode.SCHEDULED) == [later.name]
    assert await _listed(stack, "SCHEDULED", state=JobState.QUEUED) == [later.name]
    assert await _listed(stack, "SCHEDULED", type="demo.echo") == [later.name]


async def test_pages_hold_to_the_code(stack: Stack) -> None:
    client = stack.client()
    delayed = [await client.submit("demo.echo", {"n": n}, schedule_delay=600) for n in range(5)]
    await client.submit("demo.echo", {"n": 99})
    page = await client.list(page_size=2, waiting_code="SCHEDULED")
    assert [j.name for j in page.jobs] == [j.name for j in reversed(delayed)][:2]
    with pytest.raises(InvalidArgument) as refused:  # a token of other filters
        await client.list(page_size=2, page_token=page.next_page_token)
    assert refused.value.field == "page_token"
    names = [j.name async for j in client.iter_jobs(page_size=2, waiting_code="SCHEDULED")]
    assert names == [j.name for j in reversed(delayed)]


async def test_what_is_no_code_is_refused_on_its_field(stack: Stack) -> None:
    loop = asyncio.get_running_loop()
    client = stack.client()
    await client.submit("demo.echo", {}, schedule_delay=600)

    async def probe(code: str) -> None:
        ok = (
            0 < len(code) <= 64
            and code[0].isascii()
            and code[0].isupper()
            and all(c.isascii() and (c.isupper() or c.isdigit() or c == "_") for c in code)
        )
        if ok or not code:
            await client.list(waiting_code=code)
            return
        with pytest.raises(InvalidArgument) as refused:
            await client.list(waiting_code=code)
        assert refused.value.field == "waiting_code", code

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(st.text(max_size=70) | st.from_regex(r"[A-Z][A-Z0-9_]{0,70}", fullmatch=True))
    def check(code: str) -> None:
        asyncio.run_coroutine_threadsafe(probe(code), loop).result()

    await asyncio.to_thread(check)


async def test_a_code_with_another_state_is_refused(stack: Stack) -> None:
    with pytest.raises(InvalidArgument) as refused:
        await stack.client().list(waiting_code="SCHEDULED", state=JobState.RUNNING)
    assert refused.value.field == "waiting_code"


async def test_the_list_command_takes_waiting(stack: Stack) -> None:
    client = stack.client()
    delayed = await client.submit("demo.echo", {}, schedule_delay=600)
    await client.submit("demo.echo", {})
    code, out, err = await jobplane(stack, "list", "--waiting", "scheduled", "--json")
    assert code == 0, err
    assert [j["name"] for j in json.loads(out)["jobs"]] == [delayed.name]


@pytest.mark.timeout(300)
async def test_many_delayed_jobs_are_not_scanned(stack: Stack) -> None:
    client = stack.client()
    seed = await client.submit("demo.echo", {}, schedule_delay=3600)
    async with stack.engine.begin() as conn:
        # 10,000 more delayed jobs, copies of the first (no triggers: only the
        # rows and their indexes matter here). A page reads some hundreds of
        # them at most; a scan would read them all.
        await conn.execute(text("SET LOCAL session_replication_role = replica"))
        for source, count in ((seed, 10_000),):
            await conn.execute(
                text(
                    "INSERT INTO jobs SELECT (jsonb_populate_record(NULL::jobs, to_jsonb(j) "
                    "|| jsonb_build_object('id', gen_random_uuid(), 'dispatch_id', "
                    "gen_random_uuid(), 'request_id', 'copy-' || j.id || '-' || g))).* "
                    "FROM jobs j, generate_series(1, :n) g WHERE j.id = :id"
                ),
                {"id": source.name[5:], "n": count},
            )
        await conn.execute(text("ANALYZE jobs"))
    for code in ("SCHEDULED", "UNROUTABLE", "CONCURRENCY_LIMIT"):
        sql, params = list_query(
            stack.tenant_id,
            limit=51,
            after=None,
            state=None,
            job_type=None,
            labels=None,
            created_after=None,
            created_before=None,
            waiting_code=code,
            now=datetime.now(UTC),
        )
        async with stack.engine.connect() as conn:
            explained: Any = (
                await conn.execute(text(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql.text}"), params)
            ).scalar()
        read = _rows_read(explained[0]["Plan"])
        assert read <= 1000, (code, read, _outline(explained[0]["Plan"]))


def _rows_read(plan: dict[str, Any]) -> int:
    """Rows the plan's scans of jobs returned or filtered out."""
    total = 0
    if "Scan" in plan["Node Type"]:
        total += int(plan.get("Actual Rows", 0)) + int(plan.get("Rows Removed by Filter", 0))
    for child in plan.get("Plans", []):
        total += _rows_read(child)
    return total


def _outline(plan: dict[str, Any], depth: int = 0) -> str:
    """The plan's nodes, one a line: type, index, rows."""
    line = (
        f"{'  ' * depth}{plan['Node Type']} {plan.get('Index Name', '')} "
        f"rows={plan.get('Actual Rows')} removed={plan.get('Rows Removed by Filter', 0)}"
    )
    return "\n".join([line, *(_outline(p, depth + 1) for p in plan.get("Plans", []))])
