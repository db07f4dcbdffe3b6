"""Wake-ups from Postgres NOTIFY: one dedicated LISTEN connection per process.

A notification carries only a key (a job id, or nothing) and means "read
again"; the tables are the truth. When the connection comes back every
subscriber is woken, and subscribers also re-read on a slow timer of their
own, so a lost notification costs latency, never correctness.

Every :class:`Listener` of a process (an event loop) on one database shares
that one connection, whatever its channel: a server listens on three
channels, a relay on two, `jobplane dev` in one process on six, and each
would otherwise hold a Postgres backend of its own for it
(docs/operations.md, "Connections per process").
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
import weakref
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

    @property
    def woken(self) -> bool:
        """Whether a wake-up came since the flag was last cleared."""
        return self._event.is_set()

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
        self._link: _Link | None = None
        self._connected = asyncio.Event()

    @property
    def channel(self) -> str:
        """The channel this listener LISTENs on."""
        return self._channel

    async def start(self) -> None:
        """Start listening; returns once the first LISTEN is in place."""
        # A link whose last listener was leaving while this one waited to
        # attach is closed: this one takes the link made after it.
        link = _Link.of(self._url, self._reconnect_delay)
        while not await link.attach(self):
            link = _Link.of(self._url, self._reconnect_delay)
        self._link = link
        await asyncio.wait_for(self._connected.wait(), timeout=30)

    async def stop(self) -> None:
        """Stop listening and wake every subscriber."""
        link, self._link = self._link, None
        if link is not None:
            await link.detach(self)
        self.wake_all()

    def _listening(self) -> None:
        """The LISTEN is in place (again): anything committed meanwhile is read again."""
        log.info("listen.connected", channel=self._channel)
        self._connected.set()
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


class _Link:
    """The LISTEN connection its process's Listeners on one database share.

    It connects when the first listener attaches and closes when the last
    detaches. Whatever goes wrong, it reconnects (the processes that rely on
    it have no other way to hear of changes) and LISTENs on every attached
    channel again; each listener wakes its subscribers when its connection is
    lost and again when it is back.
    """

    _links: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, _Link]] = (
        weakref.WeakKeyDictionary()
    )

    def __init__(self, url: str, reconnect_delay: float) -> None:
        self._url = url
        self._reconnect_delay = reconnect_delay
        self._listeners: list[Listener] = []
        self._conn: asyncpg.Connection | None = None
        # One operation at a time on the connection: LISTEN, UNLISTEN, the ping.
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        # Set when the last listener leaves: the link is no longer this loop's.
        self._closed = False

    @classmethod
    def of(cls, url: str, reconnect_delay: float) -> _Link:
        """This event loop's link to ``url`` (made at first use)."""
        links = cls._links.setdefault(asyncio.get_running_loop(), {})
        link = links.get(url)
        if link is None:
            link = links[url] = cls(url, reconnect_delay)
        return link

    async def attach(self, listener: Listener) -> bool:
        """LISTEN on ``listener``'s channel too, now if connected, else at connect.

        False, attaching nothing, if the link closed while this waited for it.
        """
        async with self._lock:
            if self._closed:
                return False
            self._listeners.append(listener)
            conn = self._conn
            if conn is not None and not conn.is_closed():
                try:
                    await conn.add_listener(listener.channel, listener._on_notify)
                except Exception as exc:
                    # The connection is going: the reconnect LISTENs on it.
                    log.warning("listen.error", channel=listener.channel, error=repr(exc))
                else:
                    listener._listening()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="listen")
        return True

    async def detach(self, listener: Listener) -> None:
        """UNLISTEN ``listener``'s channel; the last one out closes the connection."""
        async with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)
            conn = self._conn
            if self._listeners and conn is not None and not conn.is_closed():
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(
                        conn.remove_listener(listener.channel, listener._on_notify), timeout=2
                    )
            if self._listeners:
                return
            self._closed = True
            links = self._links.get(asyncio.get_running_loop(), {})
            if links.get(self._url) is self:
                del links[self._url]
            task, self._task = self._task, None
        await cancel_and_wait(task)

    async def _run(self) -> None:
        while True:
            conn: asyncpg.Connection | None = None
            channels: list[str] = []
            try:
                conn = await connect_raw(self._url)
                lost = asyncio.Event()
                conn.add_termination_listener(lambda _c, lost=lost: lost.set())
                async with self._lock:
                    listening = list(self._listeners)
                    for listener in listening:
                        await conn.add_listener(listener.channel, listener._on_notify)
                    self._conn = conn
                channels = [listener.channel for listener in listening]
                for listener in listening:
                    listener._listening()
                while not lost.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(lost.wait(), timeout=5)
                    if not lost.is_set():
                        # A half-open socket shows itself only when used.
                        async with self._lock:
                            await asyncio.wait_for(conn.fetchval("SELECT 1"), timeout=5)
                log.warning("listen.lost", channels=channels)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if database_down(exc) or sqlstate(exc) is not None:
                    log.warning("listen.error", channels=channels, error=describe_error(exc))
                else:
                    log.error("listen.error", channels=channels, exc_info=exc)
            finally:
                # Only its own: a task cancelled late must not forget the
                # connection a newer one made.
                if self._conn is conn:
                    self._conn = None
                if conn is not None and not conn.is_closed():
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(conn.close(), timeout=2)
            for listener in list(self._listeners):
                listener.wake_all()
            await asyncio.sleep(self._reconnect_delay)
