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
from aio_pika.abc import AbstractConnection
from aio_pika.connection import make_url

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
    """An open connection to ``url``, or the error (nothing left behind).

    ``robust``: a :class:`aio_pika.RobustConnection`, which reconnects (and
    restores its channels and consumers) once it has been opened.
    """
    factory = aio_pika.RobustConnection if robust else aio_pika.Connection
    connection = factory(make_url(url))
    try:
        await connection.connect(timeout=timeout)
    except BaseException as exc:
        await connection.close()
        if isinstance(exc, StopAsyncIteration) and _hung_up(exc):
            # Said as what it is, for the logs and the one-line fatal message.
            raise aiormq.exceptions.AMQPConnectionError(
                "the broker's address closed the connection before the AMQP handshake"
            ) from exc
        raise
    return connection
