"""Wake-ups from Postgres NOTIFY: one dedicated LISTEN connection per process.

A notification carries only a key (a job id, or nothing) and means "read
again"; the tables are the truth. When the connection comes back every
subscriber is woken, and subscribers also re-read on a slow timer of their
own, so a lost notification costs latency, never correctness.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator

import asyncpg
import structlog

from jobplane.logs import describe_error
from jobplane.store.down import database_down, sqlstate
from jobplane.store.engine import connect_raw
from jobplane.tasks import cancel_and_wait

log = structlog.get_logger("jobplane.listen")


class Subscription:
    """A subscriber's wake-up flag."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def wake(self) -> None:
        """Ask the subscriber to read again."""
        self._event.set()

    def clear(self) -> None:
        """Forget a wake-up: only one that comes after this ends the next wait."""
        self._event.clear()

    async def wait(self, timeout: float) -> None:
        """Until woken or ``timeout`` seconds pass; then clear the flag."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
        self._event.clear()


class Listener:
    """LISTENs on one channel and wakes the subscribers of each payload key.

    Subscribers of the key ``None`` are woken by every notification.
    """

    def __init__(self, database_url: str, channel: str, *, reconnect_delay: float = 0.5) -> None:
        self._url = database_url
        self._channel = channel
        self._reconnect_delay = reconnect_delay
        self._subs: defaultdict[str | None, set[Subscription]] = defaultdict(set)
        self._callbacks: list[Callable[[str], None]] = []
        self._reset_callbacks: list[Callable[[], None]] = []
        self._task: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()

    async def start(self) -> None:
        """Start listening; returns once the first LISTEN is in place."""
        self._task = asyncio.create_task(self._run(), name=f"listen-{self._channel}")
        await asyncio.wait_for(self._connected.wait(), timeout=30)

    async def stop(self) -> None:
        """Stop listening and wake every subscriber."""
        await cancel_and_wait(self._task)
        self._task = None
        self.wake_all()

    @contextlib.contextmanager
    def subscribe(self, key: uuid.UUID | str | None = None) -> Iterator[Subscription]:
        """Register a subscriber of ``key`` (None: of all) for the life of the block."""
        key = None if key is None else str(key)
        sub = Subscription()
        self._subs[key].add(sub)
        try:
            yield sub
        finally:
            subs = self._subs.get(key)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[key]

    def on_notify(self, callback: Callable[[str], None]) -> None:
        """Also call ``callback(payload)`` for every notification."""
        self._callbacks.append(callback)

    def on_reset(self, callback: Callable[[], None]) -> None:
        """Also call ``callback()`` whenever every subscriber is woken (e.g. on reconnect)."""
        self._reset_callbacks.append(callback)

    @property
    def subscriber_count(self) -> int:
        """Subscribers registered now."""
        return sum(len(s) for s in self._subs.values())

    def _on_notify(self, _conn: object, _pid: int, _channel: str, payload: object) -> None:
        payload = str(payload)
        for sub in self._subs.get(payload, ()):
            sub.wake()
        for sub in self._subs.get(None, ()):
            sub.wake()
        for callback in self._callbacks:
            callback(payload)

    def wake_all(self) -> None:
        """Wake every subscriber (they re-read, and see whatever changed)."""
        for subs in self._subs.values():
            for sub in subs:
                sub.wake()
        for callback in self._reset_callbacks:
            callback()

    async def _run(self) -> None:
        while True:
            conn: asyncpg.Connection | None = None
            try:
                conn = await connect_raw(self._url)
                lost = asyncio.Event()
                conn.add_termination_listener(lambda _c, lost=lost: lost.set())
                await conn.add_listener(self._channel, self._on_notify)
                log.info("listen.connected", channel=self._channel)
                self._connected.set()
                # Anything committed while we were not listening: read again.
                self.wake_all()
                while not lost.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(lost.wait(), timeout=5)
                    if not lost.is_set():
                        # A half-open socket shows itself only when used.
                        await asyncio.wait_for(conn.fetchval("SELECT 1"), timeout=5)
                log.warning("listen.lost", channel=self._channel)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Whatever went wrong, the listener reconnects: the processes
                # that rely on it have no other way to hear of changes.
                if database_down(exc) or sqlstate(exc) is not None:
                    log.warning("listen.error", channel=self._channel, error=describe_error(exc))
                else:
                    log.error("listen.error", channel=self._channel, exc_info=exc)
            finally:
                if conn is not None and not conn.is_closed():
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(conn.close(), timeout=2)
            self.wake_all()
            await asyncio.sleep(self._reconnect_delay)
