"""The call gate without a server: key shapes, refusal logs held back, handlers made once."""

from __future__ import annotations

import asyncio
import contextvars
import uuid
from typing import Any

import grpc
import pytest
import structlog

from jobplane.errors import Unauthenticated
from jobplane.logs import fingerprint
from jobplane.server import auth
from jobplane.server.auth import CallGate, LogSampler, current_identity, current_worker
from jobplane.server.limits import TenantLimiter, TenantLimits
from jobplane.store.keys import (
    KEY_PREFIX,
    KeyIdentity,
    KeyScope,
    WorkerIdentity,
    _new_key,
    key_shaped,
)
from tests.support.servicer_context import Aborted, ServicerContext

SERVICE = "jobplane.v1.JobService"
GOOD = _new_key()


def test_every_key_made_has_the_shape_the_gate_accepts() -> None:
    keys = [_new_key() for _ in range(2000)]
    assert all(key_shaped(key) for key in keys)
    # Every last character a key can end with turns up.
    assert len({key[-1] for key in keys}) == 16


@pytest.mark.parametrize(
    "key",
    [
        "",
        KEY_PREFIX,
        GOOD[:-1],  # one short
        GOOD + "A",  # one long
        "jq_" + GOOD[3:],  # another prefix
        "JP_" + GOOD[3:],
        GOOD[:-1] + "B",  # a last character no 32 bytes encode to
        GOOD[:10] + "+" + GOOD[11:],  # standard base64, not URL-safe
        GOOD[:10] + "=" + GOOD[11:],
        GOOD[:10] + "é" + GOOD[11:],
        GOOD + "\n",
        " " + GOOD,
        KEY_PREFIX + "A" * 200,
    ],
    # Named, not shown: GOOD is new in each process, and ids that change from
    # one collection to the next cannot be run again by id (mutmut does).
    ids=[
        "empty",
        "prefix-only",
        "one-short",
        "one-long",
        "other-prefix",
        "upper-prefix",
        "bad-last-character",
        "plus",
        "equals",
        "non-ascii",
        "newline",
        "leading-space",
        "far-too-long",
    ],
)
def test_anything_else_is_not_a_key(key: str) -> None:
    assert not key_shaped(key)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_sampler_lets_one_line_a_second_through_per_key() -> None:
    clock = Clock()
    sampler = LogSampler(1.0, clock=clock)
    assert sampler.take("a") == 0
    assert [sampler.take("a") for _ in range(5)] == [None] * 5
    assert sampler.take("b") == 0  # keys are counted apart
    clock.now += 0.999
    assert sampler.take("a") is None
    clock.now += 0.001
    assert sampler.take("a") == 6  # the lines held back since the last one
    assert sampler.take("a") is None
    clock.now += 5
    assert sampler.take("a") == 1
    assert sampler.take("b") == 0


class Keys:
    """Stands in for KeyStore: one known key."""

    def __init__(self) -> None:
        self.identity = KeyIdentity(uuid.uuid4(), "key_0123456789abcdef")

    async def resolve(self, key: str) -> KeyIdentity | None:
        return self.identity if key == GOOD else None


class Details(grpc.HandlerCallDetails):
    def __init__(self, rpc: str, key: str | None) -> None:
        self.method = f"/{SERVICE}/{rpc}"
        self.invocation_metadata = (("authorization", f"Bearer {key}"),) if key else ()


class Log:
    """Records the gate's log lines."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.lines.append((event, kw))

    def debug(self, event: str, **kw: Any) -> None:
        pass

    def is_enabled_for(self, level: int) -> bool:
        return False


async def _servicer(request: Any, context: Any) -> Any:
    return ("served", current_identity())


async def _streamer(request: Any, context: Any) -> Any:
    yield current_identity()


HANDLERS: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
    "GetJob": grpc.unary_unary_rpc_method_handler(_servicer),
    "WatchJob": grpc.unary_stream_rpc_method_handler(_streamer),
}


async def _continuation(details: grpc.HandlerCallDetails) -> Any:
    return HANDLERS[details.method.rsplit("/", 1)[1]]


def _gate(keys: Keys, clock: Clock | None = None) -> CallGate:
    store: Any = keys
    return CallGate(SERVICE, store, TenantLimiter(TenantLimits()), clock=clock or Clock())


async def test_admitted_calls_share_one_handler_per_method() -> None:
    keys = Keys()
    gate = _gate(keys)
    first = await gate.intercept_service(_continuation, Details("GetJob", GOOD))
    again = await gate.intercept_service(_continuation, Details("GetJob", GOOD))
    watch = await gate.intercept_service(_continuation, Details("WatchJob", GOOD))
    assert first is not None and watch is not None
    assert first is again
    assert watch is await gate.intercept_service(_continuation, Details("WatchJob", GOOD))
    assert watch is not first
    # The caller travels in the context the servicer runs in, not in the handler.
    assert current_identity() == keys.identity
    served: Any = first.unary_unary
    assert await served(object(), None) == ("served", keys.identity)


async def test_refusals_are_logged_once_a_second_per_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = Log()
    monkeypatch.setattr(auth, "log", log)
    clock = Clock()
    keys = Keys()
    gate = _gate(keys, clock)
    refusals = [
        await gate.intercept_service(_continuation, Details("GetJob", _new_key()))
        for _ in range(100)
    ]
    assert len({id(handler) for handler in refusals}) == 1  # one handler answers them all
    assert await gate.intercept_service(_continuation, Details("GetJob", None)) is not None
    assert [(e, kw["rpc"], kw["reason"], kw["suppressed"]) for e, kw in log.lines] == [
        ("auth.refused", "GetJob", "the API key is not valid", 0),
        ("auth.refused", "GetJob", "missing 'authorization: Bearer <key>' metadata", 0),
    ]
    clock.now += 1.0
    await gate.intercept_service(_continuation, Details("GetJob", "jp_short"))
    assert log.lines[-1][1]["suppressed"] == 99
    assert len(log.lines) == 3
    # A refusal answers in its own call's shape: a watch's is a stream.
    watch = await gate.intercept_service(_continuation, Details("WatchJob", _new_key()))
    first: Any = refusals[0]
    assert watch is not None and watch.response_streaming and not first.response_streaming


async def test_below_debug_a_unary_call_runs_the_servicers_own_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(auth, "log", Log())
    gate = _gate(Keys())
    admitted = await gate.intercept_service(_continuation, Details("GetJob", GOOD))
    assert admitted is HANDLERS["GetJob"]
    # A watch still takes a stream slot, so it keeps its wrapper.
    watch = await gate.intercept_service(_continuation, Details("WatchJob", GOOD))
    assert watch is not HANDLERS["WatchJob"]


class WorkerKeys(Keys):
    """One known key, a worker's."""

    def __init__(self) -> None:
        self.worker = WorkerIdentity("key_fedcba9876543210")

    async def resolve(self, key: str) -> Any:
        return self.worker if key == GOOD else None


async def _refused_with(handler: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(Aborted) as aborted:
        await handler.unary_unary(object(), ServicerContext())
    return aborted.value.status.code, aborted.value.status.details


async def test_a_key_of_the_other_scope_is_refused_and_a_worker_key_served_as_a_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(auth, "log", Log())
    store: Any = WorkerKeys()
    tenant_gate = CallGate(SERVICE, store, TenantLimiter(TenantLimits()), clock=Clock())
    refused = await tenant_gate.intercept_service(_continuation, Details("GetJob", GOOD))
    assert await _refused_with(refused) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "a worker key cannot call GetJob; it needs a tenant key",
    )
    worker_gate = CallGate(
        SERVICE, store, TenantLimiter(TenantLimits()), clock=Clock(), scope=KeyScope.WORKER
    )

    async def admitted() -> Any:
        handler = await worker_gate.intercept_service(_continuation, Details("GetJob", GOOD))
        assert handler is HANDLERS["GetJob"]  # admitted: the servicer's own handler
        return current_worker(), structlog.contextvars.get_contextvars()

    worker, bound = await asyncio.create_task(admitted())
    assert worker == store.worker
    assert (bound["api_key_id"], bound["rpc"]) == (store.worker.key_id, "GetJob")
    assert "tenant_id" not in bound
    # A tenant key at the worker gate is refused alike.
    tenant_keys: Any = Keys()
    worker_only = CallGate(
        SERVICE, tenant_keys, TenantLimiter(TenantLimits()), clock=Clock(), scope=KeyScope.WORKER
    )
    refused = await worker_only.intercept_service(_continuation, Details("GetJob", GOOD))
    assert await _refused_with(refused) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "a tenant key cannot call GetJob; it needs a worker key",
    )


async def test_outside_an_admitted_call_there_is_no_caller() -> None:
    async def outside() -> None:
        with pytest.raises(Unauthenticated) as tenant:
            current_identity()
        assert tenant.value.message == "the call was not authenticated"
        with pytest.raises(Unauthenticated) as worker:
            current_worker()
        assert worker.value.message == "the call was not authenticated with a worker key"

    # A fresh context: no gate ran in it.
    await asyncio.create_task(outside(), context=contextvars.Context())


async def test_an_admitted_call_binds_its_tenant_key_and_request_id() -> None:
    keys = Keys()
    gate = _gate(keys)

    async def admitted(metadata: tuple[tuple[str, str], ...]) -> dict[str, Any]:
        details = Details("GetJob", GOOD)
        details.invocation_metadata = (*details.invocation_metadata, *metadata)
        await gate.intercept_service(_continuation, details)
        return structlog.contextvars.get_contextvars()

    bound = await asyncio.create_task(admitted((("x-request-id", "req-7"),)))
    assert bound["tenant_id"] == str(keys.identity.tenant_id)
    assert (bound["api_key_id"], bound["rpc"]) == (keys.identity.key_id, "GetJob")
    assert bound["request_id"] == fingerprint("req-7")
    assert "request_id" not in await asyncio.create_task(admitted(()))


@pytest.mark.parametrize(
    "make",
    [
        grpc.unary_unary_rpc_method_handler,
        grpc.unary_stream_rpc_method_handler,
        grpc.stream_unary_rpc_method_handler,
        grpc.stream_stream_rpc_method_handler,
    ],
    ids=["unary-unary", "unary-stream", "stream-unary", "stream-stream"],
)
def test_a_refusal_has_the_shape_of_the_call_it_answers(make: Any) -> None:
    handler = make(_servicer)
    refusal = auth._refusal(handler, Unauthenticated())
    assert (refusal.request_streaming, refusal.response_streaming) == (
        handler.request_streaming,
        handler.response_streaming,
    )


async def test_submits_spend_tokens_at_the_gate_and_other_services_pass_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(auth, "log", Log())
    keys: Any = Keys()
    handlers = {
        **HANDLERS,
        "SubmitJob": grpc.unary_unary_rpc_method_handler(_servicer),
        "Check": grpc.unary_unary_rpc_method_handler(_servicer),
    }

    async def continuation(details: grpc.HandlerCallDetails) -> Any:
        return handlers[details.method.rsplit("/", 1)[1]]

    limiter = TenantLimiter(TenantLimits(submits_per_second=0.001, submit_burst=1))
    gate = CallGate([SERVICE, "jobplane.v1.EventService"], keys, limiter, clock=Clock())
    assert (
        await gate.intercept_service(continuation, Details("SubmitJob", GOOD))
        is (handlers["SubmitJob"])
    )
    for _ in range(3):  # reads spend nothing
        assert (
            await gate.intercept_service(continuation, Details("GetJob", GOOD))
            is (handlers["GetJob"])
        )
    refused = await gate.intercept_service(continuation, Details("SubmitJob", GOOD))
    code, _message = await _refused_with(refused)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Another tenant's key has a bucket of its own.
    keys.identity = KeyIdentity(uuid.uuid4(), "key_1111111111111111")
    assert (
        await gate.intercept_service(continuation, Details("SubmitJob", GOOD))
        is (handlers["SubmitJob"])
    )
    # The second service named is gated too; a service not named passes as it is, keyless.
    other = Details("GetJob", None)
    other.method = "/jobplane.v1.EventService/GetJob"
    assert await _refused_with(await gate.intercept_service(continuation, other)) == (
        grpc.StatusCode.UNAUTHENTICATED,
        "missing 'authorization: Bearer <key>' metadata",
    )
    health = Details("Check", None)
    health.method = "/grpc.health.v1.Health/Check"
    assert await gate.intercept_service(continuation, health) is handlers["Check"]
