"""The worker's groups (ADR-0028): the batcher's window and cap, and the ack plan."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobplane.batcher import Batcher
from jobplane.workers.group import plan_acks


@st.composite
def _channels(draw: st.DrawFn) -> tuple[set[int], set[int]]:
    """Outstanding delivery tags of a channel, and the subset a group acks."""
    unsettled = draw(st.sets(st.integers(min_value=1, max_value=200), max_size=40))
    to_ack = draw(st.sets(st.sampled_from(sorted(unsettled)))) if unsettled else set()
    return unsettled, to_ack


def _broker(unsettled: set[int], upto: int | None, singles: list[int]) -> set[int]:
    """What the broker holds outstanding after the plan; fails where the broker
    would close the channel (an ack of a tag that is not outstanding)."""
    outstanding = set(unsettled)
    if upto is not None:
        assert upto in outstanding
        outstanding = {t for t in outstanding if t > upto}
    for tag in singles:
        assert tag in outstanding, f"tag {tag} acked twice or never delivered"
        outstanding.remove(tag)
    return outstanding


@given(_channels())
def test_the_plan_acks_exactly_the_group_and_nothing_still_running(
    channel: tuple[set[int], set[int]],
) -> None:
    unsettled, to_ack = channel
    upto, singles = plan_acks(unsettled, to_ack)
    assert _broker(unsettled, upto, singles) == unsettled - to_ack


@given(_channels())
def test_a_multiple_ack_is_used_whenever_it_saves_a_frame(
    channel: tuple[set[int], set[int]],
) -> None:
    unsettled, to_ack = channel
    upto, singles = plan_acks(unsettled, to_ack)
    others = unsettled - to_ack
    lowest = [t for t in to_ack if not others or t < min(others)]
    if len(lowest) >= 2:
        assert upto == max(lowest)
        assert len(singles) == len(to_ack) - len(lowest)
    else:
        assert upto is None and sorted(singles) == sorted(to_ack)


def test_the_plan_of_examples() -> None:
    assert plan_acks({1, 2, 3}, {1, 2, 3}) == (3, [])
    assert plan_acks({1, 2, 3, 4}, {1, 2, 4}) == (2, [4])  # 3 still runs
    assert plan_acks({2, 5, 9}, {5, 9}) == (None, [5, 9])  # 2 is below them
    assert plan_acks({4}, {4}) == (None, [4])


async def test_a_group_goes_at_its_window_or_at_its_cap() -> None:
    groups: list[list[int]] = []

    async def run(items: list[int]) -> list[int]:
        groups.append(items)
        return [i * 10 for i in items]

    batcher: Batcher[int, int] = Batcher(run, window=0.05, max_size=3)
    results = await asyncio.gather(*(batcher.submit(i) for i in range(5)))
    assert results == [0, 10, 20, 30, 40]
    assert groups == [[0, 1, 2], [3, 4]]  # the cap, then the window
    assert batcher.sizes == {3: 1, 2: 1}
    await batcher.stop()


async def test_a_lone_item_waits_no_longer_than_the_window() -> None:
    async def run(items: list[int]) -> list[int]:
        return items

    loop = asyncio.get_running_loop()
    batcher: Batcher[int, int] = Batcher(run, window=0.05, max_size=64)
    started = loop.time()
    assert await batcher.submit(7) == 7
    # No upper bound on a shared machine; only that the window was not skipped.
    assert loop.time() - started >= 0.045
    await batcher.stop()


async def test_an_item_the_group_refuses_fails_alone() -> None:
    class Refused(Exception):
        pass

    async def run(items: list[int]) -> list[int]:
        if 13 in items:
            raise Refused("13")
        return items

    batcher: Batcher[int, int] = Batcher(
        run, window=0.01, max_size=8, split=lambda exc: isinstance(exc, Refused)
    )
    results = await asyncio.gather(*(batcher.submit(i) for i in (1, 13, 2)), return_exceptions=True)
    assert results[0] == 1 and results[2] == 2
    assert isinstance(results[1], Refused)
    await batcher.stop()


async def test_an_error_of_the_whole_group_reaches_every_caller() -> None:
    async def run(items: list[int]) -> list[int]:
        raise ConnectionError("down")

    batcher: Batcher[int, int] = Batcher(run, window=0.01, max_size=8)
    results = await asyncio.gather(*(batcher.submit(i) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)
    with pytest.raises(ValueError, match="at least one"):
        Batcher(run, window=0.01, max_size=0)


async def test_a_failure_counting_the_group_still_answers_every_waiter() -> None:
    def counted(size: int) -> None:
        raise RuntimeError("metrics down")

    async def run(items: list[int]) -> list[int]:
        return items

    batcher: Batcher[int, int] = Batcher(run, window=0.01, max_size=8, on_group=counted)
    async with asyncio.timeout(5):
        results = await asyncio.gather(
            *(batcher.submit(i) for i in range(3)), return_exceptions=True
        )
    assert all(isinstance(r, RuntimeError) for r in results)
    await batcher.stop()


async def test_a_stop_waits_for_a_stuck_group_no_longer_than_its_timeout() -> None:
    stuck = asyncio.Event()

    async def run(items: list[int]) -> list[int]:
        await stuck.wait()  # a statement that never returns
        return items

    batcher: Batcher[int, int] = Batcher(run, window=0.001, max_size=8)
    waiter = asyncio.ensure_future(batcher.submit(1))
    await asyncio.sleep(0.05)
    async with asyncio.timeout(5):
        await batcher.stop(timeout=0.2)
    with pytest.raises(asyncio.CancelledError):
        await waiter
    # Without a timeout, a stop waits for the group to end.
    batcher = Batcher(run, window=0.001, max_size=8)
    waiter = asyncio.ensure_future(batcher.submit(2))
    await asyncio.sleep(0.05)
    stopping = asyncio.ensure_future(batcher.stop())
    await asyncio.sleep(0.2)
    assert not stopping.done()
    stuck.set()
    await stopping
    assert await waiter == 2


async def test_with_max_running_the_calls_that_wait_go_out_together() -> None:
    running = 0
    most = 0
    gate = asyncio.Event()
    groups: list[list[int]] = []

    async def run(items: list[int]) -> list[int]:
        nonlocal running, most
        running += 1
        most = max(most, running)
        groups.append(items)
        if len(groups) == 1:
            await gate.wait()  # the first group holds its statement
        running -= 1
        return items

    batcher: Batcher[int, int] = Batcher(run, window=0.0, max_size=100, max_running=1)
    first = asyncio.ensure_future(batcher.submit(0))
    await asyncio.sleep(0.01)
    assert groups == [[0]]  # a lone call goes at the loop's next turn
    rest = [asyncio.ensure_future(batcher.submit(i)) for i in range(1, 6)]
    await asyncio.sleep(0.01)
    assert groups == [[0]]  # they wait for the running group
    gate.set()
    assert await asyncio.gather(first, *rest) == [0, 1, 2, 3, 4, 5]
    assert groups == [[0], [1, 2, 3, 4, 5]]
    assert most == 1
    await batcher.stop()


async def test_max_running_keeps_the_cap_of_a_group() -> None:
    gate = asyncio.Event()
    groups: list[list[int]] = []

    async def run(items: list[int]) -> list[int]:
        groups.append(items)
        await gate.wait()
        return items

    batcher: Batcher[int, int] = Batcher(run, window=0.0, max_size=2, max_running=2)
    calls = [asyncio.ensure_future(batcher.submit(i)) for i in range(7)]
    await asyncio.sleep(0.01)
    assert groups == [[0, 1], [2, 3]]  # two running, three waiting
    gate.set()
    assert await asyncio.gather(*calls) == list(range(7))
    assert groups == [[0, 1], [2, 3], [4, 5], [6]]
    await batcher.stop()


def test_max_running_is_at_least_one() -> None:
    async def run(items: list[int]) -> list[int]:
        return items

    with pytest.raises(ValueError, match="max_running"):
        Batcher(run, window=0.0, max_size=1, max_running=0)


async def test_eager_a_lone_item_goes_at_once_and_a_busy_one_waits_for_the_group() -> None:
    gate = asyncio.Event()
    groups: list[list[int]] = []

    async def run(items: list[int]) -> list[int]:
        groups.append(items)
        if len(groups) == 1:
            await gate.wait()  # the first group holds its statement
        return items

    # A window far longer than the test: only the eager rule can send a group.
    batcher: Batcher[int, int] = Batcher(run, window=5.0, max_size=100, eager=True)
    first = asyncio.ensure_future(batcher.submit(0))
    await asyncio.sleep(0.01)
    assert groups == [[0]]  # nothing ran: it went without its window
    rest = [asyncio.ensure_future(batcher.submit(i)) for i in range(1, 4)]
    await asyncio.sleep(0.01)
    assert groups == [[0]]  # a group runs: they collect
    gate.set()
    assert await asyncio.gather(first, *rest) == [0, 1, 2, 3]
    assert groups == [[0], [1, 2, 3]]  # together, once the running group ended
    await batcher.stop()


async def test_eager_items_of_one_turn_go_as_one_group() -> None:
    groups: list[list[int]] = []

    async def run(items: list[int]) -> list[int]:
        groups.append(items)
        return items

    batcher: Batcher[int, int] = Batcher(run, window=5.0, max_size=100, eager=True)
    assert await asyncio.gather(*(batcher.submit(i) for i in range(5))) == list(range(5))
    assert groups == [[0, 1, 2, 3, 4]]
    await batcher.stop()
