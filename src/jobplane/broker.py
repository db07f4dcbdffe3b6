"""Opening a RabbitMQ connection that is closed again when it cannot open.

``aio_pika.connect`` leaves a connection that failed to open to the garbage
collector, whose finalizer schedules ``close()`` on a loop that may no longer
run ("coroutine was never awaited"); a process retrying an unreachable broker
piles those up. Here a failed connection is closed before the error goes on.
"""

from __future__ import annotations

import aio_pika
from aio_pika.abc import AbstractConnection
from aio_pika.connection import make_url


async def connect(url: str, *, timeout: float = 10.0, robust: bool = False) -> AbstractConnection:
    """An open connection to ``url``, or the error (nothing left behind).

    ``robust``: a :class:`aio_pika.RobustConnection`, which reconnects (and
    restores its channels and consumers) once it has been opened.
    """
    factory = aio_pika.RobustConnection if robust else aio_pika.Connection
    connection = factory(make_url(url))
    try:
        await connection.connect(timeout=timeout)
    except BaseException:
        await connection.close()
        raise
    return connection
