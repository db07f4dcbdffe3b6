"""Opening a broker connection that cannot open leaves nothing behind."""

from __future__ import annotations

from typing import Any

import aio_pika
import aiormq
import pytest

from jobplane import broker


@pytest.mark.parametrize("robust", [False, True])
async def test_a_connection_that_cannot_open_is_closed_not_left_to_the_gc(
    monkeypatch: pytest.MonkeyPatch, robust: bool
) -> None:
    # aio_pika.connect leaves such a connection to its finalizer, which
    # creates a close() coroutine that nobody awaits once the loop is gone.
    closed: list[aio_pika.Connection] = []
    original = aio_pika.Connection.close

    async def close(self: aio_pika.Connection, *args: Any, **kwargs: Any) -> None:
        closed.append(self)
        await original(self, *args, **kwargs)

    monkeypatch.setattr(aio_pika.Connection, "close", close)
    with pytest.raises((OSError, aiormq.exceptions.AMQPConnectionError, TimeoutError)):
        await broker.connect("amqp://guest:guest@127.0.0.1:1/", timeout=2, robust=robust)
    assert len(closed) == 1
    assert closed[0].is_closed
