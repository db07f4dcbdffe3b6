"""A concurrency key, limit or mode that can never be valid: INVALID_ARGUMENT on its
field, nothing written; through SubmitJob, BatchSubmitJobs and jobplane.submit_job."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobplane import txn
from jobplane.client import InvalidArgument
from jobplane.errors import ConcurrencyLimitReached
from tests.support.stack import Stack

_FIELDS = {"concurrency_key", "concurrency_limit", "concurrency_mode"}
_CONTROL = st.characters(min_codepoint=1, max_codepoint=31) | st.sampled_from(["\x7f", "\x85"])


@st.composite
def _bad(draw: st.DrawFn) -> tuple[dict[str, Any], str]:
    """One bad combination, and the field it must be refused on."""
    good_key = draw(
        st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=20)
    )
    kind = draw(
        st.sampled_from(["limit", "no_key_limit", "no_key_mode", "long", "control", "blank"])
    )
    if kind == "limit":
        limit = draw(st.integers(-(2**31), -1) | st.integers(10_001, 2**31 - 1))
        return {"concurrency_key": good_key, "concurrency_limit": limit}, "concurrency_limit"
    if kind == "no_key_limit":
        limit = draw(st.integers(1, 10_000) | st.integers(-100, -1))
        return {"concurrency_limit": limit}, "concurrency_limit"
    if kind == "no_key_mode":
        return {"concurrency_mode": draw(st.sampled_from(["queue", "reject"]))}, (
            "concurrency_mode"
        )
    if kind == "long":
        return {"concurrency_key": "k" * draw(st.integers(257, 600))}, "concurrency_key"
    if kind == "control":
        at = draw(st.integers(0, len(good_key)))
        key = good_key[:at] + draw(_CONTROL) + good_key[at:]
        return {"concurrency_key": key}, "concurrency_key"
    return {"concurrency_key": draw(st.sampled_from([" ", "  ", " \u3000 "]))}, ("concurrency_key")


async def test_bad_concurrency_input_is_refused_on_its_field(bare: Stack) -> None:
    loop = asyncio.get_running_loop()
    client = bare.client()

    async def probe(kwargs: dict[str, Any], field: str) -> None:
        before = await bare.counts()
        with pytest.raises(InvalidArgument) as refused:
            await client.submit("demo.echo", {}, **kwargs)
        assert refused.value.field == field, (kwargs, refused.value)
        with pytest.raises(InvalidArgument) as in_batch:
            await client.submit_many([{"type": "demo.echo"}, {"type": "demo.echo", **kwargs}])
        assert in_batch.value.field == f"requests[1].{field}", (kwargs, in_batch.value)
        assert await bare.counts() == before

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(_bad())
    def check(case: tuple[dict[str, Any], str]) -> None:
        asyncio.run_coroutine_threadsafe(probe(*case), loop).result()

    await asyncio.to_thread(check)


async def test_the_sql_api_checks_and_refuses_as_the_rpc_does(bare: Stack) -> None:
    async with bare.engine.begin() as conn:
        first = await txn.submit_job(
            conn, tenant="acme", type="demo.echo", concurrency_key="t", concurrency_mode="reject"
        )
    stored = await bare.client().get(f"jobs/{first}")
    assert (stored.concurrency_key, stored.concurrency_limit) == ("t", 1)
    async with bare.engine.begin() as conn:
        with pytest.raises(ConcurrencyLimitReached) as refused:
            await txn.submit_job(
                conn,
                tenant="acme",
                type="demo.echo",
                concurrency_key="t",
                concurrency_mode="reject",
            )
    assert refused.value.holders == [f"jobs/{first}"]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"concurrency_key": "t", "concurrency_limit": 10_001}, "concurrency_limit"),
        ({"concurrency_limit": 2}, "concurrency_limit"),
        ({"concurrency_mode": "reject"}, "concurrency_mode"),
        ({"concurrency_key": "k" * 257}, "concurrency_key"),
        ({"concurrency_key": "a\tb"}, "concurrency_key"),
        ({"concurrency_key": "t", "concurrency_mode": "sometimes"}, "concurrency_mode"),
    ]
    for kwargs, field in cases:
        async with bare.engine.begin() as conn:
            with pytest.raises(InvalidArgument) as bad:
                await txn.submit_job(conn, tenant="acme", type="demo.echo", **kwargs)
        assert bad.value.field == field, kwargs
