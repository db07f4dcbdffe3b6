"""Queue priorities: the topology's values, and how a worker's slots are granted."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import pytest

from jobplane.topology import PRIORITIES, TopologyError, load_topology, parse_topology
from jobplane.workers.priority import WEIGHTS, Slots, SlotsClosed, default_reserve

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "topologies"


def test_a_queue_priority_is_high_normal_or_low() -> None:
    for priority in PRIORITIES:
        topology = parse_topology({"queues": [{"name": "q", "priority": priority}]})
        assert topology.queues[0].priority == priority
    assert parse_topology({"queues": [{"name": "q"}]}).queues[0].priority == "normal"
    for bad in ("urgent", "High", "", 1):
        with pytest.raises(TopologyError) as refused:
            parse_topology({"queues": [{"name": "ok"}, {"name": "asf.x", "priority": bad}]})
        assert "'asf.x'" in str(refused.value)
        assert "allowed: high, normal, low" in str(refused.value)


def test_the_asf_example_has_its_three_priorities() -> None:
    topology = load_topology(EXAMPLES / "asf.toml")
    assert topology.queue("asf.ai.interactive").priority == "high"
    assert topology.queue("asf.indexing").priority == "low"
    assert Counter(q.priority for q in topology.queues) == {"high": 1, "normal": 5, "low": 1}


def test_reserve_and_prefetch() -> None:
    assert [default_reserve(c) for c in (1, 2, 4, 8, 16)] == [0, 1, 1, 2, 4]
    mixed = Slots(8, ["low", "high", "normal"])
    assert mixed.classes == ("high", "normal", "low") and mixed.reserve == 2
    # What each class may run, and its weighted share of the 8 slots waiting
    # (4/7, 2/7, 1/7 of them, rounded up): the turns have something to choose.
    assert [mixed.prefetch(p) for p in ("high", "normal", "low")] == [8 + 5, 6 + 3, 6 + 2]
    pair = Slots(8, ["high", "low"])
    assert [pair.prefetch(p) for p in ("high", "low")] == [8 + 7, 6 + 2]
    assert [Slots(1, ["high", "low"]).prefetch(p) for p in ("high", "low")] == [2, 2]
    # One priority: plain slots, every delivery may fill them all.
    plain = Slots(8, ["low", "low"])
    assert plain.reserve == 0 and plain.prefetch("low") == 8
    # A priority the worker does not consume counts as its lowest class.
    assert mixed.class_of("nonsense") == "low"
    reserve = r"^reserve must be at least 0 and less than concurrency$"
    for wrong in (4, -1):
        with pytest.raises(ValueError, match=reserve):
            Slots(4, ["high", "low"], reserve=wrong)
    for too_few in (0, -1):
        with pytest.raises(ValueError, match=r"^concurrency must be at least 1$"):
            Slots(too_few, ["normal"])


async def _hold(slots: Slots, priority: str, release: asyncio.Event, log: list[str]) -> None:
    async with slots.turn(priority):
        log.append(priority)
        await release.wait()


async def test_lower_classes_leave_the_reserve_free() -> None:
    slots = Slots(4, ["high", "low"], reserve=1)
    release = asyncio.Event()
    started: list[str] = []
    lows = [asyncio.create_task(_hold(slots, "low", release, started)) for _ in range(5)]
    await asyncio.sleep(0)
    assert started == ["low"] * 3 and slots.running == 3
    high = asyncio.create_task(_hold(slots, "high", release, started))
    await asyncio.sleep(0)
    assert started[-1] == "high" and slots.running == 4
    release.set()
    await asyncio.gather(*lows, high)
    assert started.count("low") == 5 and slots.running == 0


async def _take_turns(slots: Slots, waiting: dict[str, int]) -> list[str]:
    """Grant order of the ``waiting`` deliveries once the one held slot is freed."""
    order: list[str] = []

    async def one(priority: str) -> None:
        async with slots.turn(priority):
            order.append(priority)

    async with slots.turn("high"):  # hold the only slot while everybody queues
        tasks = [asyncio.create_task(one(p)) for p, n in waiting.items() for _ in range(n)]
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


async def test_waiting_classes_share_the_slots_by_weight() -> None:
    order = await _take_turns(
        Slots(1, ["high", "normal", "low"]), {"high": 70, "normal": 35, "low": 20}
    )
    first = Counter(order[:70])
    # While all three wait, grants follow the weights 4 : 2 : 1.
    assert first["high"] == pytest.approx(40, abs=2)
    assert first["normal"] == pytest.approx(20, abs=2)
    assert first["low"] == pytest.approx(10, abs=2)
    assert WEIGHTS == {"high": 4, "normal": 2, "low": 1}


async def test_an_idle_class_does_not_bank_turns() -> None:
    slots = Slots(1, ["high", "low"], reserve=0)
    for _ in range(50):  # low alone for a while
        async with slots.turn("low"):
            pass
    order = await _take_turns(slots, {"low": 10, "high": 10})
    # High, idle until now, gets its share, not 50 grants in a row first.
    assert Counter(order[:5]) == {"high": 4, "low": 1}


async def test_closing_refuses_the_waiting_and_keeps_the_held() -> None:
    slots = Slots(1, ["normal"])
    release = asyncio.Event()
    started: list[str] = []
    holder = asyncio.create_task(_hold(slots, "normal", release, started))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(_hold(slots, "normal", release, started))
    await asyncio.sleep(0)
    slots.close()
    with pytest.raises(SlotsClosed):
        await waiter
    with pytest.raises(SlotsClosed):
        async with slots.turn("normal"):
            pass
    release.set()
    await holder
    assert started == ["normal"] and slots.running == 0


async def test_a_cancelled_waiter_gives_its_turn_on() -> None:
    slots = Slots(1, ["high", "low"], reserve=0)
    release = asyncio.Event()
    started: list[str] = []
    holder = asyncio.create_task(_hold(slots, "low", release, started))
    await asyncio.sleep(0)
    cancelled = asyncio.create_task(_hold(slots, "high", release, started))
    after = asyncio.create_task(_hold(slots, "low", release, started))
    await asyncio.sleep(0)
    cancelled.cancel()
    release.set()
    await asyncio.gather(holder, after)
    assert cancelled.cancelled() and started == ["low", "low"] and slots.running == 0


async def test_the_bound_holds_under_random_arrivals_and_cancellations() -> None:
    rng = random.Random(19)
    slots = Slots(5, ["high", "normal", "low"], reserve=2)
    peak = {"all": 0, "below": 0}

    async def one(priority: str) -> None:
        async with slots.turn(priority):
            below = slots.running - slots._running["high"]
            peak["all"] = max(peak["all"], slots.running)
            peak["below"] = max(peak["below"], below)
            await asyncio.sleep(rng.random() / 100)

    tasks = []
    for _ in range(400):
        tasks.append(asyncio.create_task(one(rng.choice(PRIORITIES))))
        if rng.random() < 0.2:
            rng.choice(tasks).cancel()
        await asyncio.sleep(rng.random() / 2000)
    await asyncio.gather(*tasks, return_exceptions=True)
    assert peak == {"all": 5, "below": 3}
    assert slots.running == 0 and slots._queued == 0
