"""The SDK's publish and subscribe, and `jobplane events`, against a real server.

A subscription never ends by itself, so "nothing more came" is shown by a
sentinel: an event published last whose arrival right after the expected
ones proves nothing else came between.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import (
    AsyncClient,
    Client,
    Event,
    EventIdReused,
    EventSubscription,
    InvalidArgument,
    SubscribedEvent,
)
from jobplane.events import decode
from jobplane.store.events import EventStore, NewEvent
from jobplane.topology import Topology
from tests.integration.test_cli_and_sync import jobplane
from tests.support.event_api import STREAM_WAIT, all_published, bound_queue
from tests.support.parts import Started
from tests.support.ports import free_port
from tests.support.proxy import CuttableProxy
from tests.support.stack import Stack, eventually, start_stack


@pytest.fixture
async def server_only(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology
) -> AsyncIterator[Stack]:
    """A server alone: subscriptions read Postgres, not the broker."""
    running = await start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    yield running
    await running.close()


class Collector:
    """Drains a subscription in the background, keeping what it delivered."""

    def __init__(self, subscription: EventSubscription) -> None:
        self.subscription = subscription
        self.items: list[SubscribedEvent] = []
        self._task = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        async for item in self.subscription:
            self.items.append(item)

    @property
    def ids(self) -> list[uuid.UUID]:
        return [item.event.event_id for item in self.items]

    async def until(self, count: int) -> None:
        """Until ``count`` items came (fails the test if the subscription failed)."""

        async def enough() -> bool:
            if self._task.done():
                self._task.result()  # its failure, if any
                raise AssertionError("the subscription ended")
            return len(self.items) >= count

        await eventually(enough, timeout=STREAM_WAIT)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.subscription.aclose()


async def publish_n(
    client: AsyncClient, n: int, event_type: str = "artifact.created"
) -> list[Event]:
    return [await client.publish(event_type, {"i": i}) for i in range(n)]


async def test_publish_then_subscribe_sees_it(server_only: Stack) -> None:
    client = server_only.client()
    first = await client.publish(
        "artifact.created",
        {"artifact": "builds/1/app.tar"},
        project_id="web",
        causation_id="upload-7",
    )
    assert first.tenant_id == server_only.tenant_id
    assert first.correlation_id == str(first.event_id)
    other = await client.publish("deployment.started", {"env": "prod"})
    second = await client.publish("artifact.replaced", {"artifact": "builds/1/app.tar"})

    subscription = client.subscribe(["artifact.*"])
    one, two = [await anext(subscription) for _ in range(2)]
    assert (one.event, two.event) == (first, second)
    assert subscription.cursor == two.cursor
    sentinel = await client.publish("artifact.sentinel", {})
    assert (await anext(subscription)).event == sentinel
    await subscription.aclose()

    # Resuming with a cursor goes on right after its event.
    async with client.subscribe(["#"], after_cursor=one.cursor) as resumed:
        assert [(await anext(resumed)).event for _ in range(3)] == [other, second, sentinel]

    # "latest" leaves out what was committed before. The server holds the
    # stream's slot once it is about to fix its start: wait for the slots of
    # the streams closed above to be freed first, so the one counted is this.
    await eventually(lambda: _streams(server_only, 0), timeout=STREAM_WAIT)
    async with client.subscribe("#", start="latest") as latest:
        waiting = asyncio.ensure_future(anext(latest))
        await eventually(lambda: _streams(server_only, 1))
        fresh = await client.publish("artifact.created", {"fresh": True})
        assert (await asyncio.wait_for(waiting, STREAM_WAIT)).event == fresh

    # A bad request is refused at once, by name.
    with pytest.raises(InvalidArgument) as info:
        await anext(client.subscribe(["Not A Pattern"]))
    assert info.value.field == "type_patterns"


async def _streams(stack: Stack, count: int) -> bool:
    return stack.server.limiter.streams(stack.tenant_id) == count


class DropFirstReply(grpc.aio.UnaryUnaryClientInterceptor):
    """Lets each call reach the server, then loses the first reply on the way back,
    as a connection that breaks after the server committed would."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def intercept_unary_unary(
        self,
        continuation: Callable[[Any, Any], Awaitable[Any]],
        client_call_details: Any,
        request: Any,
    ) -> Any:
        self.requests.append(request)
        call = await continuation(client_call_details, request)
        response = await call
        if len(self.requests) == 1:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details="Socket closed",
            )
        return response


async def test_a_retried_publish_writes_once(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    stack = await started(start_stack(engine, database_url, amqp_url, topology, worker=False))
    dropper = DropFirstReply()
    client = stack.client()

    def open_channel() -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(stack.server.address, interceptors=[dropper])

    client._open_channel = open_channel  # type: ignore[method-assign]
    async with bound_queue(amqp_url, topology.events_exchange, ["artifact.#"]) as (_, queue):
        event = await client.publish("artifact.created", {"artifact": "a.tar"})
        # The server answered twice, the SDK saw one answer.
        assert len(dropper.requests) == 2
        assert {r.event_id for r in dropper.requests} == {str(event.event_id)}
        assert await stack.scalar("SELECT count(*) FROM events") == 1

        # Publishing the id again: the stored event, nothing written.
        again = await client.publish(
            "artifact.created", {"artifact": "a.tar"}, event_id=event.event_id
        )
        assert again == event
        with pytest.raises(EventIdReused) as info:
            await client.publish("artifact.created", {"artifact": "b.tar"}, event_id=event.event_id)
        assert info.value.code is grpc.StatusCode.ALREADY_EXISTS
        assert await stack.scalar("SELECT count(*) FROM events") == 1

        # On the broker: the event once, then the sentinel.
        sentinel = await client.publish("artifact.sentinel", {})
        await all_published(stack)
        bodies = []
        for _ in range(2):
            message = await queue.get(timeout=STREAM_WAIT, fail=True)
            assert message is not None
            bodies.append(decode(message.body))
            await message.ack()
        assert bodies == [event, sentinel]


async def test_subscribe_resumes_across_a_server_restart(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> None:
    port = free_port()
    stack = await started(
        start_stack(
            engine,
            database_url,
            amqp_url,
            topology,
            relay=False,
            worker=False,
            listen=f"127.0.0.1:{port}",
        )
    )
    client = stack.client()
    collector = Collector(client.subscribe(["artifact.*"]))
    published = await publish_n(client, 5)
    await collector.until(5)

    await stack.server.stop(grace=0.5)
    # Committed while no server runs: the resumed stream has them.
    store = EventStore(engine)
    for i in range(5, 10):
        new = Event.new("artifact.created", {"i": i}, tenant_id=stack.tenant_id)
        published.append((await store.publish(stack.tenant_id, NewEvent(new))).event)
    await asyncio.sleep(0.5)
    await stack.server.start()

    published += await publish_n(client, 5)
    await collector.until(15)
    sentinel = await client.publish("artifact.sentinel", {})
    await collector.until(16)
    assert collector.ids == [e.event_id for e in [*published, sentinel]]
    assert [item.event for item in collector.items[:5]] == published[:5]
    assert collector.subscription.cursor == collector.items[-1].cursor
    await collector.close()


async def test_subscribe_resumes_after_its_connection_is_cut(server_only: Stack) -> None:
    host, port = server_only.server.address.rsplit(":", 1)
    proxy = CuttableProxy(host, int(port))
    await proxy.start()
    try:
        direct = server_only.client()
        proxied = AsyncClient(f"127.0.0.1:{proxy.port}", server_only.key)
        server_only.clients.append(proxied)
        collector = Collector(proxied.subscribe("#", start="earliest"))
        published = await publish_n(direct, 3)
        await collector.until(3)
        cursor_before = collector.subscription.cursor

        for _ in range(2):
            await proxy.cut()
            published += await publish_n(direct, 3, "deployment.completed")
            await asyncio.sleep(0.3)
            await proxy.start()
        published += await publish_n(direct, 2)
        sentinel = await direct.publish("zz.sentinel", {})
        await collector.until(len(published) + 1)
        assert collector.ids == [e.event_id for e in [*published, sentinel]]
        assert collector.items[2].cursor == cursor_before
        await collector.close()
    finally:
        await proxy.cut()


async def test_sync_client_publishes_and_subscribes(server_only: Stack) -> None:
    def use() -> None:
        with Client(server_only.server.address, server_only.key) as client:
            event = client.publish("artifact.created", {"n": 1}, project_id="web")
            with client.subscribe(["artifact.*"]) as events:
                got, cursor = next(events)
                assert got == event
                assert events.cursor == cursor
            later = client.publish("artifact.created", {"n": 2})
            with client.subscribe("artifact.#", after_cursor=cursor) as events:
                assert next(events).event == later

    await asyncio.to_thread(use)


# -- jobplane events ---------------------------------------------------------------


async def test_cli_publish_prints_the_stored_event(server_only: Stack) -> None:
    event_id = str(uuid.uuid4())
    code, out, err = await jobplane(
        server_only,
        *("events", "publish", "artifact.created", "--payload", '{"artifact": "a.tar"}'),
        *("--id", event_id, "--project", "web", "--causation-id", "up-1", "--json"),
    )
    assert code == 0, err
    stored = json.loads(out)
    assert stored == {
        "event_id": event_id,
        "event_type": "artifact.created",
        "timestamp": stored["timestamp"],
        "tenant_id": str(server_only.tenant_id),
        "project_id": "web",
        "correlation_id": event_id,
        "causation_id": "up-1",
        "payload": {"artifact": "a.tar"},
    }

    # Again with the same id and event: the stored one, in text.
    code, out, err = await jobplane(
        server_only,
        *("events", "publish", "artifact.created", "--payload", '{"artifact": "a.tar"}'),
        *("--id", event_id, "--project", "web", "--causation-id", "up-1"),
    )
    assert code == 0, err
    assert f"event id:       {event_id}" in out.splitlines()
    assert "payload:        " + '{"artifact":"a.tar"}' in out.splitlines()
    assert await server_only.scalar("SELECT count(*) FROM events") == 1

    # A different event under that id, a bad type: one clean line, exit 1.
    code, _out, err = await jobplane(
        server_only, "events", "publish", "artifact.created", "--id", event_id
    )
    assert code == 1
    assert err.startswith("error: EVENT_ID_REUSED: ") and err.count("\n") == 1
    code, _out, err = await jobplane(server_only, "events", "publish", "Not A Type")
    assert code == 1
    assert err.startswith("error: INVALID_ARGUMENT: ") and err.count("\n") == 1
    code, _out, err = await jobplane(server_only, "events", "tail", "Bad Pattern")
    assert code == 1
    assert err.startswith("error: INVALID_ARGUMENT: ") and err.count("\n") == 1
    assert await server_only.scalar("SELECT count(*) FROM events") == 1


async def test_cli_tail_follows_until_interrupted(server_only: Stack) -> None:
    client = server_only.client()
    first = await client.publish("artifact.created", {"n": 1})
    await client.publish("deployment.started", {})
    second = await client.publish("artifact.replaced", {"n": 2})

    async with tail(server_only, "artifact.*", "--from-start", "--json") as process:
        lines = [json.loads(await _line(process)) for _ in range(2)]
        assert [line["event_id"] for line in lines] == [str(first.event_id), str(second.event_id)]
        assert lines[0]["payload"] == {"n": 1}
        live = await client.publish("artifact.created", {"n": 3})
        line = json.loads(await _line(process))
        assert line["event_id"] == str(live.event_id)
        code, err = await _interrupt(process)
    assert code == 130
    assert f"resume with: --after {line['cursor']}" in err

    # From that cursor, in text: only what came after.
    after = await client.publish("artifact.created", {"n": 4, "s": "x\ty"})
    async with tail(server_only, "artifact.#", "--after", line["cursor"]) as process:
        text = await _line(process)
        assert text.split("  ") == [
            text.split("  ")[0],
            "artifact.created",
            str(after.event_id),
            '{"n":4,"s":"x\\ty"}',
        ]
        sentinel = await client.publish("artifact.sentinel", {})
        assert str(sentinel.event_id) in await _line(process)
        code, err = await _interrupt(process)
    assert code == 130
    assert "resume with: --after " in err

    # --latest (the default) shows only events committed from now on.
    await eventually(lambda: _streams(server_only, 0), timeout=STREAM_WAIT)
    async with tail(server_only, "#") as process:
        await eventually(lambda: _streams(server_only, 1), timeout=STREAM_WAIT)
        fresh = await client.publish("zz.fresh", {})
        assert str(fresh.event_id) in await _line(process)
        await _interrupt(process)


# `python -m jobplane`, with Ctrl-C raising KeyboardInterrupt as in a terminal:
# a test run started in the background by a shell (`make test &`) ignores
# SIGINT, the ignoring is inherited, and Python then leaves SIGINT ignored.
_AS_FROM_A_TERMINAL = (
    "import runpy, signal, sys; "
    "signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'jobplane'; "
    "runpy.run_module('jobplane', run_name='__main__', alter_sys=True)"
)


def tail(stack: Stack, *args: str) -> _Tail:
    return _Tail(stack, args)


class _Tail:
    """`jobplane events tail ARGS` as a child process, killed if the test leaves it."""

    def __init__(self, stack: Stack, args: tuple[str, ...]) -> None:
        self._stack = stack
        self._args = args
        self._process: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> asyncio.subprocess.Process:
        env = {
            **os.environ,
            "JOBPLANE_ADDRESS": self._stack.server.address,
            "JOBPLANE_API_KEY": self._stack.key,
        }
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _AS_FROM_A_TERMINAL,
            "events",
            "tail",
            *self._args,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return self._process

    async def __aexit__(self, *_: object) -> None:
        assert self._process is not None
        if self._process.returncode is None:
            self._process.kill()
            await self._process.wait()


async def _line(process: asyncio.subprocess.Process) -> str:
    assert process.stdout is not None
    raw = await asyncio.wait_for(process.stdout.readline(), STREAM_WAIT)
    assert raw, "the tail ended"
    return raw.decode().rstrip("\n")


async def _interrupt(process: asyncio.subprocess.Process) -> tuple[int, str]:
    """Ctrl-C: its exit code and what it said on stderr."""
    process.send_signal(signal.SIGINT)
    _out, err = await asyncio.wait_for(process.communicate(), STREAM_WAIT)
    assert process.returncode is not None
    return process.returncode, err.decode()
