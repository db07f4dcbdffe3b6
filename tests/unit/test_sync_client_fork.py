"""What fork() does to the blocking Client's calls in flight in other threads.

The hook the client registers with ``os.register_at_fork`` is run here
without forking: what it does in the parent is what these tests look at.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from jobplane.client import AsyncClient, Client, Unavailable, sync


@pytest.fixture
def client() -> Iterator[Client]:
    # Never dialled: the calls below are coroutines of the test's own.
    made = Client("127.0.0.1:1", "key")
    yield made
    made.close()
    # The tests run the hook before a fork without forking: the one after
    # it, in the parent, ends what the first began.
    sync._after_fork_in_parent()


def _in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[object]]:
    """``call`` run in a thread of its own; the list gets its result or error."""
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # what the caller would see, whatever it is
            outcome.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    return thread, outcome


def test_a_call_in_flight_at_a_fork_ends_before_the_channel_closes(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A grace no busy machine outlasts: the fork waits for the call's end, not it.
    monkeypatch.setattr(sync, "_FORK_GRACE", 60.0)
    loop = client._loop
    started = threading.Event()

    async def call() -> str:
        started.set()
        await asyncio.sleep(0.5)
        return "answered"

    thread, outcome = _in_thread(lambda: loop.run(call()))
    assert started.wait(30)
    sync._close_before_fork()
    thread.join(30)
    assert outcome == ["answered"]
    # The client goes on with a new loop, the old one stopped.
    assert client._loop is not loop and not loop.running


def test_a_call_still_running_after_the_grace_is_a_retryable_unavailable(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sync, "_FORK_GRACE", 0.2)
    loop = client._loop
    started = threading.Event()

    async def call() -> str:
        started.set()
        await asyncio.sleep(60)
        return "answered"

    thread, outcome = _in_thread(lambda: loop.run(call()))
    assert started.wait(30)
    begun = time.monotonic()
    sync._close_before_fork()
    # The fork waits for the grace, not for the call.
    assert time.monotonic() - begun < 30
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], Unavailable), outcome
    assert "fork()" in str(outcome[0])


def test_a_stream_waiting_for_its_next_item_does_not_hold_up_a_fork(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sync, "_FORK_GRACE", 60.0)
    loop = client._loop
    started = threading.Event()

    async def stream() -> Any:
        started.set()
        await asyncio.sleep(60)
        yield "item"

    thread, outcome = _in_thread(lambda: list(sync._pulled(loop, stream())))
    assert started.wait(30)
    begun = time.monotonic()
    sync._close_before_fork()
    assert time.monotonic() - begun < 30
    thread.join(30)
    # Refused as a watch begun before the fork is, not as a call cut short.
    assert len(outcome) == 1 and type(outcome[0]) is RuntimeError, outcome
    assert "before fork()" in str(outcome[0])


def test_a_wait_does_not_hold_up_a_fork_and_goes_on_after_it(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sync, "_FORK_GRACE", 20.0)
    waits: list[tuple[AsyncClient, float | None]] = []
    started = threading.Event()

    async def wait(
        self: AsyncClient, name: str, timeout: float | None = None, *, resolve_blobs: bool = True
    ) -> str:
        waits.append((self, timeout))
        if len(waits) == 1:
            # A long poll: the job does not end while the fork goes on.
            started.set()
            await asyncio.sleep(60)
        return f"{name} ended"

    monkeypatch.setattr(AsyncClient, "wait", wait)
    thread, outcome = _in_thread(lambda: client.wait("jobs/j", timeout=50))
    assert started.wait(30)
    begun = time.monotonic()
    sync._close_before_fork()
    # Not held up for the grace: a wait is no call the fork waits for.
    assert time.monotonic() - begun < 10
    # The wait goes on only once the fork is done: a channel it opened
    # before would be open at the fork.
    time.sleep(0.3)
    assert len(waits) == 1 and outcome == []
    sync._after_fork_in_parent()
    thread.join(30)
    # The parent's own call goes on over the client's new channel, within
    # what is left of its timeout.
    assert outcome == ["jobs/j ended"]
    (first, _), (second, left) = waits
    assert second is client._async and second is not first
    assert left is not None and 0 < left <= 50
