"""Who is calling, decided before the request body is read.

:class:`CallGate` is a server interceptor: from a JobService or EventService
call's metadata alone it resolves the bearer key to a tenant and spends a
submit token (SubmitJob, PublishEvent). A call
it refuses is answered by a handler without a request deserializer, so the
body of an unauthenticated call is never parsed and the servicer never runs.
An admitted call runs with its :class:`KeyIdentity` in a contextvar
(:func:`current_identity`) and bound to the structlog context (``tenant_id``,
``api_key_id``, ``rpc``), and a stream (WatchJob, SubscribeEvents) holds one
of its tenant's stream slots for its life. Health and reflection stay open.
A gate admits keys of one scope: the tenant gate (JobService, EventService)
refuses a worker key, the worker gate (WorkerService) a tenant key, both with
PERMISSION_DENIED (reason KEY_SCOPE_MISMATCH); an admitted worker call runs
with its :class:`WorkerIdentity` (:func:`current_worker`), and with no tenant.
Refusals for a missing or bad key are logged (``auth.refused``) at most once
a second per reason, with the number held back since.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeAlias

import grpc
import structlog

from jobplane.errors import JobplaneError, KeyScopeMismatch, Unauthenticated
from jobplane.logs import fingerprint
from jobplane.server.limits import TenantLimiter
from jobplane.server.status import error_for, to_grpc_status
from jobplane.store.keys import Identity, KeyIdentity, KeyScope, KeyStore, WorkerIdentity

log = structlog.get_logger("jobplane.server")

Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

_IDENTITY: contextvars.ContextVar[KeyIdentity | None] = contextvars.ContextVar(
    "jobplane_identity", default=None
)
_WORKER: contextvars.ContextVar[WorkerIdentity | None] = contextvars.ContextVar(
    "jobplane_worker", default=None
)

# The calls the gate counts against a tenant's limits: writes that go through
# the outbox spend submit tokens, streams hold stream slots. A batch spends
# one here, before its body is read, and one for each further job once it is
# (JobServiceServicer.BatchSubmitJobs).
SUBMIT_RPCS = frozenset({"SubmitJob", "PublishEvent", "BatchSubmitJobs", "TriggerSchedule"})
STREAM_RPCS = frozenset({"WatchJob", "SubscribeEvents"})


def current_identity() -> KeyIdentity:
    """The caller of the call being served; :class:`Unauthenticated` outside one."""
    identity = _IDENTITY.get()
    if identity is None:
        # Only reachable if a servicer is served without the gate: fail closed.
        raise Unauthenticated("the call was not authenticated")
    return identity


def current_worker() -> WorkerIdentity:
    """The worker key of the WorkerService call being served; :class:`Unauthenticated` outside."""
    worker = _WORKER.get()
    if worker is None:
        raise Unauthenticated("the call was not authenticated with a worker key")
    return worker


def bearer_token(metadata: Any) -> str:
    """The token of the first ``authorization: Bearer …``; :class:`Unauthenticated` if none."""
    for key, value in metadata or ():
        if key == "authorization":
            scheme, _, token = value.partition(" ") if isinstance(value, str) else ("", "", "")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            raise Unauthenticated("the API key is not valid")
    raise Unauthenticated("missing 'authorization: Bearer <key>' metadata")


class LogSampler:
    """Lets through one line a second (``every``) per key, and counts the rest.

    A flood of refused calls would otherwise write a line per call.
    """

    def __init__(self, every: float = 1.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._every = every
        self._clock = clock
        # key -> [when its last line was let through, lines held back since]
        self._last: dict[str, list[float]] = {}

    def take(self, key: str) -> int | None:
        """None to hold this line back; else how many of ``key`` were held back before it."""
        now = self._clock()
        last = self._last.get(key)
        if last is None or now - last[0] >= self._every:
            self._last[key] = [now, 0]
            return 0 if last is None else int(last[1])
        last[1] += 1
        return None


class CallGate(grpc.aio.ServerInterceptor):
    """Authenticates and admits the calls of some services; others pass untouched.

    ``scope``: the keys it admits; a valid key of another scope is refused
    with :class:`KeyScopeMismatch`.
    """

    def __init__(
        self,
        services: str | Iterable[str],
        keys: KeyStore,
        limiter: TenantLimiter,
        *,
        clock: Callable[[], float] = time.monotonic,
        scope: KeyScope = KeyScope.TENANT,
    ) -> None:
        names = (services,) if isinstance(services, str) else tuple(services)
        self._prefixes = tuple(f"/{name}/" for name in names)
        self._scope = scope
        self._keys = keys
        self._limiter = limiter
        # The handlers of admitted calls, made once per method: who the caller
        # is travels in contextvars, not in the handler.
        self._admitted: dict[str, Handler] = {}
        # (method, message) -> the handler answering an unauthenticated call;
        # the messages are a few fixed ones.
        self._unauthenticated: dict[tuple[str, str], Handler] = {}
        self._refusals_logged = LogSampler(clock=clock)
        # Read once: the level is set before a server starts. Below debug
        # nothing times a call, and a unary call needs no wrapper at all.
        self._timed = log.is_enabled_for(logging.DEBUG)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        """Admit the call with its identity, or answer it with a refusal."""
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefixes):
            return handler
        rpc = method.rsplit("/", 1)[-1]
        try:
            identity = await self._admit(rpc, handler_call_details.invocation_metadata)
        except Exception as exc:
            error = error_for(exc, rpc)
            if isinstance(error, Unauthenticated | KeyScopeMismatch):
                held_back = self._refusals_logged.take(error.message)
                if held_back is not None:
                    # The reason only: the metadata may hold a real key mistyped.
                    log.info("auth.refused", rpc=rpc, reason=error.message, suppressed=held_back)
                return self._unauthenticated_handler(method, handler, error)
            return _refusal(handler, error)
        # grpc.aio runs the interceptors and then the handler in one task per
        # call, so what is set here is what the servicer sees, and no other
        # call sees it (tests/integration/test_auth_door.py checks both).
        if isinstance(identity, WorkerIdentity):
            _WORKER.set(identity)
            structlog.contextvars.bind_contextvars(api_key_id=identity.key_id, rpc=rpc)
        else:
            _IDENTITY.set(identity)
            structlog.contextvars.bind_contextvars(
                tenant_id=str(identity.tenant_id), api_key_id=identity.key_id, rpc=rpc
            )
        if request_id := _request_id(handler_call_details.invocation_metadata):
            structlog.contextvars.bind_contextvars(request_id=request_id)
        admitted = self._admitted.get(method)
        if admitted is None:
            admitted = self._admitted[method] = self._admitting(handler, rpc)
        return admitted

    async def _admit(self, rpc: str, metadata: Any) -> Identity:
        identity = await self._keys.resolve(bearer_token(metadata))
        if identity is None:
            raise Unauthenticated("the API key is not valid")
        scope = KeyScope.WORKER if isinstance(identity, WorkerIdentity) else KeyScope.TENANT
        if scope is not self._scope:
            raise KeyScopeMismatch(
                f"a {scope.value} key cannot call {rpc}; it needs a {self._scope.value} key"
            )
        if rpc in SUBMIT_RPCS and isinstance(identity, KeyIdentity):
            try:
                self._limiter.take_submit(identity.tenant_id)
            except JobplaneError as error:
                log.debug(
                    "tenant.limit_exceeded",
                    rpc=rpc,
                    tenant_id=str(identity.tenant_id),
                    api_key_id=identity.key_id,
                    limit=error.metadata.get("limit"),
                )
                raise
        return identity

    def _unauthenticated_handler(
        self, method: str, handler: Handler, error: Unauthenticated | KeyScopeMismatch
    ) -> Handler:
        made = self._unauthenticated.get((method, error.message))
        if made is None:
            made = self._unauthenticated[(method, error.message)] = _refusal(handler, error)
        return made

    def _admitting(self, handler: Handler, rpc: str) -> Handler:
        """``handler`` for admitted calls of ``rpc``: with timing, and a watch's stream slot."""
        timed = self._timed
        if handler.unary_unary is not None:
            if not timed:
                return handler
            # The stubs type behaviours as synchronous; under grpc.aio they are async.
            unary: Any = handler.unary_unary

            async def call(request: Any, context: Context) -> Any:
                started = time.monotonic()
                try:
                    return await unary(request, context)
                finally:
                    log.debug("rpc.finished", seconds=round(time.monotonic() - started, 6))

            return grpc.unary_unary_rpc_method_handler(
                call, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream is not None:
            limited = rpc in STREAM_RPCS
            if not (timed or limited):
                return handler
            streamed: Any = handler.unary_stream
            limiter = self._limiter

            async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
                started = time.monotonic()
                tenant = current_identity().tenant_id if limited else None
                try:
                    if tenant is not None:
                        try:
                            limiter.acquire_stream(tenant)
                        except JobplaneError as error:
                            log.debug("tenant.limit_exceeded", limit=error.metadata.get("limit"))
                            await context.abort_with_status(to_grpc_status(error))
                    try:
                        async for response in streamed(request, context):
                            yield response
                    finally:
                        if tenant is not None:
                            limiter.release_stream(tenant)
                finally:
                    if timed:
                        log.debug("rpc.finished", seconds=round(time.monotonic() - started, 6))

            return grpc.unary_stream_rpc_method_handler(
                stream, handler.request_deserializer, handler.response_serializer
            )
        if handler.stream_unary is not None:
            # UploadBlob: the identity set above is in this call's task, where
            # the handler reads its request stream.
            return handler
        # No API call streams both ways; refuse rather than run one
        # unauthenticated should one be added without a gate for it.
        return _refusal(handler, Unauthenticated("this call cannot be authenticated"))


def _request_id(metadata: Any) -> str:
    """The fingerprint of the caller's ``x-request-id`` metadata, or ""."""
    for key, value in metadata or ():
        if key == "x-request-id" and isinstance(value, str):
            return fingerprint(value)
    return ""


def _refusal(handler: Handler, error: JobplaneError) -> Handler:
    """A handler of the same shape that answers ``error`` without reading the body."""
    status = to_grpc_status(error)

    async def refuse(_request: Any, context: Context) -> None:
        await context.abort_with_status(status)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
