"""RabbitMQ connections, and the one definition of "the broker is down".

``aio_pika.connect`` leaves a connection that failed to open to the garbage
collector, whose finalizer schedules ``close()`` on a loop that may no longer
run ("coroutine was never awaited"); a process retrying an unreachable broker
piles those up. Here a failed connection is closed before the error goes on.

Relay, worker and sweeper ask :func:`broker_down` whether an error means "try
again later" (the broker is unreachable, restarting, or dropped the
connection) or "this will fail again" (the account is refused, an entity is
missing): the first kind is waited out with a backoff, the second is said
once and ends the process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aio_pika
import aiormq
import pamqp.exceptions
import structlog
from aio_pika.abc import AbstractConnection
from aio_pika.connection import make_url

from jobplane.broker_addresses import Failover, describe, failover_of

log = structlog.get_logger("jobplane.broker")

# What the broker answers when the account, not the network, is at fault:
# repeating the same call cannot help. aiormq raises ProbableAuthenticationError
# when the broker closes the socket during the handshake, which is how
# RabbitMQ refuses a login.
REFUSALS: tuple[type[BaseException], ...] = (
    aiormq.exceptions.AuthenticationError,
    aiormq.exceptions.ProbableAuthenticationError,
    aiormq.exceptions.IncompatibleProtocolError,
    aiormq.exceptions.ConnectionNotAllowed,
    aiormq.exceptions.ChannelAccessRefused,
    aiormq.exceptions.ChannelNotFoundEntity,
    aiormq.exceptions.ChannelPreconditionFailed,
)

# Like aio-pika's CONNECTION_EXCEPTIONS (what its robust connection reconnects
# on), without its RuntimeError: that would make any bug of ours (an injected
# fault too) look like an outage. Only aiormq's RuntimeError of a closed
# channel is named. REFUSALS are taken out by broker_down().
DOWN: tuple[type[BaseException], ...] = (
    OSError,  # includes ConnectionError
    TimeoutError,
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    pamqp.exceptions.PAMQPException,
)


def broker_down(exc: BaseException) -> bool:
    """True when ``exc`` means the broker is unreachable now (not that it refused us)."""
    if isinstance(exc, StopAsyncIteration):
        return _hung_up(exc)
    return isinstance(exc, DOWN) and not isinstance(exc, REFUSALS)


def _hung_up(exc: StopAsyncIteration) -> bool:
    """Whether aiormq's frame reader raised ``exc``: the socket ended before a frame.

    That is how a connection ends that an address accepts and closes at once (a
    load balancer or proxy in front of a broker that is down, a broker still
    booting): aiormq's reader, finding the stream already at its end, stops
    iterating instead of raising a connection error. aio-pika's
    CONNECTION_EXCEPTIONS name StopAsyncIteration too; here only aiormq's is
    an outage, so one escaping our own code stays the bug it is.
    """
    tb = exc.__traceback__
    module = ""
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        tb = tb.tb_next
    return module.startswith("aiormq.")


def home_node_down(exc: BaseException) -> bool:
    """True when ``exc`` is a cluster's NOT_FOUND for a classic queue whose node is down.

    A classic queue lives on one node (its home); while that node is down,
    declaring or using the queue through another node is refused with
    NOT_FOUND naming it "down or inaccessible". Quorum queues have no home.
    """
    return isinstance(
        exc, aiormq.exceptions.ChannelNotFoundEntity
    ) and "is down or inaccessible" in str(exc)


def access_refused(exc: BaseException) -> bool:
    """True when the broker refused an operation for lack of permissions (ACCESS_REFUSED)."""
    return isinstance(
        exc, aiormq.exceptions.ChannelAccessRefused | aiormq.exceptions.ConnectionNotAllowed
    )


T = TypeVar("T")


async def until_up(op: Callable[[], Awaitable[T]], log: Any, *, max_delay: float = 10.0) -> T:
    """``op()``, repeated with a growing backoff while the broker is down."""
    delay = 0.5
    while True:
        try:
            return await op()
        except Exception as exc:
            if not broker_down(exc):
                raise
            log.warning("broker.unavailable", error=repr(exc), retry_in=delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay)


async def connect(url: str, *, timeout: float = 10.0, robust: bool = False) -> AbstractConnection:
    """An open connection to one of ``url``'s addresses, or the error (nothing left behind).

    ``url``: one AMQP URL or several, separated by commas
    (:mod:`jobplane.broker_addresses`); they are tried in the order of the
    setting's :class:`~jobplane.broker_addresses.Failover`, and the first that
    opens is used. An address that is down is passed over; any other error
    (a refused login, a missing vhost) is raised at once: the nodes of one
    cluster share their users and vhosts, so another address would refuse too.

    ``robust``: a :class:`FailoverConnection`, which reconnects (and restores
    its channels and consumers) once it has been opened, to any of the addresses.
    """
    failover = failover_of(url)
    if robust:
        robust_connection = FailoverConnection(failover)
        try:
            await robust_connection.connect(timeout=timeout)
        except BaseException:
            await robust_connection.close()
            raise
        return robust_connection
    order = failover.order()
    for position, address in enumerate(order, start=1):
        try:
            connection = await _connect_one(address, timeout)
        except Exception as exc:
            if broker_down(exc):
                failover.failed(address)
            if not broker_down(exc) or position == len(order):
                raise
            log.warning("broker.address.down", address=describe(address), error=repr(exc))
            continue
        failover.succeeded(address)
        connection.close_callbacks.add(_lost(failover, address))
        return connection
    raise AssertionError("unreachable: a setting names at least one address")


async def _connect_one(address: str, timeout: float) -> AbstractConnection:
    connection = aio_pika.Connection(make_url(address))
    try:
        await connection.connect(timeout=timeout)
    except BaseException as exc:
        await connection.close()
        said = _said(exc)
        if said is not exc:
            raise said from exc
        raise
    return connection


def _said(exc: BaseException) -> BaseException:
    """``exc``, or the connection error it means (said as what it is, for the logs
    and the one-line fatal message)."""
    if isinstance(exc, StopAsyncIteration) and _hung_up(exc):
        return aiormq.exceptions.AMQPConnectionError(
            "the broker's address closed the connection before the AMQP handshake"
        )
    return exc


def _lost(failover: Failover, address: str) -> Callable[..., None]:
    """A close callback: a connection closed by anything but its owner marks its address."""

    def closed(connection: Any, *_: object) -> None:
        if not getattr(connection, "close_called", True):
            failover.failed(address)

    return closed


class FailoverConnection(aio_pika.RobustConnection):
    """aio-pika's robust connection, reconnecting to any of several addresses.

    aio-pika's :class:`~aio_pika.RobustConnection` reconnects to the one URL
    it was made with. This one makes each of its connection attempts go
    through the addresses in :meth:`Failover.order`: a node lost (its address
    marked failed when the connection drops) is tried last, so the reconnect
    that follows goes straight to a live node. Channels and consumers are
    restored on it as aio-pika restores them.
    """

    def __init__(self, failover: Failover) -> None:
        super().__init__(make_url(failover.order()[0]))
        self.failover = failover
        self.address = failover.order()[0]

    async def _attempt(self) -> None:
        """One connection attempt, over the addresses in turn (replaces aio-pika's)."""
        order = self.failover.order()
        for position, address in enumerate(order, start=1):
            self.url = make_url(address)
            self.address = address
            try:
                await _ROBUST_ATTEMPT(self)
            except Exception as exc:
                if broker_down(exc):
                    self.failover.failed(address)
                if not broker_down(exc) or position == len(order):
                    said = _said(exc)
                    if said is exc:
                        raise
                    raise said from exc
                log.warning("broker.address.down", address=describe(address), error=repr(exc))
                continue
            self.failover.succeeded(address)
            if self.connection_attempt > 1:
                log.warning("broker.reconnected", address=describe(address))
            return

    async def _on_connection_close(self, closing: asyncio.Future[Any]) -> None:
        if not self._close_called and not self.is_closed and self.connected.is_set():
            self.failover.failed(self.address)
            log.warning("broker.connection.lost", address=describe(self.address))
        await super()._on_connection_close(closing)


# aio-pika's robust connection opens each attempt in this private method; the
# subclass's replaces it (tests/unit/test_broker_addresses.py checks it exists).
_ATTEMPT_NAME = "_RobustConnection__connect_transport"
_ROBUST_ATTEMPT = getattr(aio_pika.RobustConnection, _ATTEMPT_NAME)
setattr(FailoverConnection, _ATTEMPT_NAME, FailoverConnection._attempt)
