"""A worker tells the interceptors it was handed each seam of a delivery, in order."""

from __future__ import annotations

import asyncio

import pytest

from jobplane.client import JobState
from tests.support.interceptors import Recording
from tests.support.stack import Stack

pytestmark = pytest.mark.stack(worker=False)


def _seams(seen: list[str]) -> list[str]:
    # Whether a write went out in a group depends on timing: not part of the order.
    return [s for s in seen if ".grouped:" not in s and ".applied:" not in s]


async def test_each_seam_of_a_delivery_in_order_to_each_interceptor(stack: Stack) -> None:
    seen: list[str] = []
    outer, inner = Recording("outer", seen), Recording("inner", seen, run=False)
    worker = await stack.start_worker(interceptors=[outer, inner], group_window=0)
    (known_outer, known_inner) = seen
    assert known_outer.startswith("outer.known:(0, 0):") and "demo.progress" in known_outer
    assert known_inner == known_outer.replace("outer.", "inner.", 1)
    seen.clear()
    client = stack.client()
    job = await client.submit("demo.progress", {"steps": 2, "interval_ms": 0})
    done = await asyncio.wait_for(client.wait(job.name), timeout=20)
    assert done.state is JobState.SUCCEEDED

    def both(what: str) -> list[str]:
        return [f"outer.{what}", f"inner.{what}"]

    for _ in range(100):  # the delivery's blocks close after its outcome is visible
        if seen[-1:] == ["outer.<delivered"]:
            break
        await asyncio.sleep(0.05)
    assert _seams(seen) == [
        *both("delivered>"),
        *both("claim>"),
        "inner.claimed:claimed",
        "inner.<claim",
        "outer.claimed:claimed",
        "outer.<claim",
        *both("started"),
        "outer.context",  # the handler runs in the context outer gave
        *both("progress:0.5"),
        *both("progress:1.0"),
        "outer.run.ended:NoneType",
        *both("outcome>"),
        *both("ended:completed"),
        "inner.<outcome",
        "outer.<outcome",
        "inner.<delivered",
        "outer.<delivered",
    ]
    assert len(outer.contexts) == 1
    assert worker.bounced == 0


async def test_grouped_writes_are_seen_as_groups_and_their_transitions(stack: Stack) -> None:
    seen: list[str] = []
    await stack.start_worker(interceptors=[Recording("r", seen)], group_window=0.05)
    client = stack.client()
    jobs = [await client.submit("demo.fail", {"message": "no"}) for _ in range(3)]
    for job in jobs:
        done = await asyncio.wait_for(client.wait(job.name), timeout=20)
        assert done.state is JobState.FAILED
    ended = [s for s in seen if s.startswith("r.ended:")]
    assert ended == ["r.ended:failed"] * 3
    grouped = [s for s in seen if s.startswith("r.grouped:")]
    assert {g.rsplit(":", 2)[1] for g in grouped} == {"claim", "outcome"}
    sizes = {kind: 0 for kind in ("claim", "outcome")}
    for g in grouped:
        _, kind, size = g.split(":")
        sizes[kind] += int(size)
    assert sizes == {"claim": 3, "outcome": 3}
    applied = [s for s in seen if s.startswith("r.applied:")]
    assert applied.count("r.applied:claim") == 3
    assert applied.count("r.applied:fail") == 3
