"""How :class:`~jobplane.client.AsyncClient` reaches its server: the connection settings
(from arguments or ``JOBPLANE_*``), the channel opened on first use, its stubs, and
the unary call with its retries. The calls themselves are in ``_job_calls``,
``_blob_calls`` and ``_event_calls``, each a part of the client built on this one.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from typing import TypeVar

import grpc

from jobplane.client._errors import error_from_rpc, is_retryable
from jobplane.client._retry import Backoff, RetryPolicy
from jobplane.client.tls import ClientTLS
from jobplane.errors import InvalidArgument, TenantLimitExceeded
from jobplane.v1 import blobs_pb2_grpc, events_pb2_grpc, jobs_pb2_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"
#: Payloads larger than this (compact JSON) are uploaded as a blob and
#: submitted by reference (the server's JOBPLANE_INLINE_BYTES default).
DEFAULT_INLINE_BYTES = 64 * 1024

Req = TypeVar("Req")
Resp = TypeVar("Resp")

# A call that is safe to repeat (reads, and submit with its request_id) is
# repeated while the server cannot be reached or its database is down, with
# these pauses, until the call's deadline (the client's ``timeout``) passes.
UNARY_RETRY = RetryPolicy(initial_delay=0.05, max_delay=1.0, max_elapsed=None, jitter=0.2)
# The deadline of repeated calls of a client created with ``timeout=None``.
UNBOUNDED_CALL_BUDGET = 60.0

# A submit refused by the tenant's rate limit is repeated after the delay the
# server asks for, when that is this short, at most _LIMIT_RETRIES times;
# otherwise the caller gets TenantLimitExceeded with its retry_delay.
_LIMIT_WAIT_MAX = 2.0
_LIMIT_RETRIES = 3

# The largest reply the SDK reads. A Job holds a payload and a result, each at
# most 5.5 times its JSON size as a protobuf Struct, and the server bounds
# that JSON size at 4 MiB (jobplane.config.MAX_PAYLOAD_BYTES_LIMIT): at most
# 44 MiB and the rest of the Job, which this leaves room for. gRPC's default
# of 4 MiB would refuse the reply of a job the server accepted.
MAX_RECEIVE_BYTES = 64 * 1024 * 1024

# grpc waits up to two minutes between reconnects of a broken channel by
# default, and calls fail at once in between; a restarted server should be
# found again within the watch backoff instead.
_CHANNEL_OPTIONS: tuple[tuple[str, int | str], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
)


def inline_bytes_from_env(env: Mapping[str, str] | None = None) -> int:
    """``JOBPLANE_INLINE_BYTES`` (positive), else the default."""
    env = os.environ if env is None else env
    raw = env.get("JOBPLANE_INLINE_BYTES", "").strip()
    if not raw:
        return DEFAULT_INLINE_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"JOBPLANE_INLINE_BYTES must be a positive integer, not {raw!r}")
    return value


def _tls_of(tls: ClientTLS | bool | None) -> ClientTLS | None:
    if isinstance(tls, ClientTLS):
        return tls
    return ClientTLS() if tls else None


def clean_api_key(api_key: str | None) -> str | None:
    """``api_key`` without the whitespace around it; None when nothing is left.

    Keys are read from files and secrets, which end in a newline more often
    than not; gRPC refuses such a metadata value with a traceback that names
    neither the key nor the cause. What gRPC cannot send after stripping
    (characters outside printable ASCII) raises :class:`InvalidArgument`
    with ``field="api_key"``, in one line that does not repeat the key.
    """
    if api_key is None:
        return None
    key = api_key.strip()
    for position, char in enumerate(key):
        if not " " <= char <= "~":
            raise InvalidArgument(
                f"the API key is malformed: character {position + 1} is {char!a}, "
                "and a key is printable ASCII",
                field="api_key",
            )
    return key or None


def connection_from_env(
    address: str | None = None,
    api_key: str | None = None,
    tls: ClientTLS | bool | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[str, str | None, ClientTLS | None]:
    """Address, API key and TLS settings: the arguments given, else ``env``'s ``JOBPLANE_*``.

    ``env`` defaults to the process's environment; see :meth:`AsyncClient.from_env`.
    """
    env = os.environ if env is None else env
    return (
        address or env.get("JOBPLANE_ADDRESS") or DEFAULT_ADDRESS,
        clean_api_key(api_key) or clean_api_key(env.get("JOBPLANE_API_KEY")),
        ClientTLS.from_env(env) if tls is None else _tls_of(tls),
    )


class ChannelBase:
    """The connection of one client: its settings, the channel and stubs, the unary call.

    :class:`~jobplane.client.AsyncClient` is built on it (its constructor is
    this one); each part of the client (jobs, blobs, events) calls through
    :meth:`_call` or a stub it gets here.
    """

    def __init__(
        self,
        address: str = DEFAULT_ADDRESS,
        api_key: str | None = None,
        *,
        timeout: float | None = 30.0,
        watch_retry: RetryPolicy | None = None,
        tls: ClientTLS | bool | None = None,
        inline_bytes: int = DEFAULT_INLINE_BYTES,
        tracing: bool = False,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> None:
        if inline_bytes <= 0:
            raise ValueError("inline_bytes must be positive")
        self._interceptors = list(interceptors)
        if tracing:
            # Imported only when asked for: the base install has no opentelemetry.
            from jobplane.client.tracing import client_interceptors

            self._interceptors[:0] = client_interceptors()
        self._inline_bytes = inline_bytes
        self._address = address
        api_key = clean_api_key(api_key)
        self._api_key = api_key
        self._timeout = timeout
        self._watch_retry = watch_retry or RetryPolicy()
        self._tls = _tls_of(tls)
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {api_key}"),) if api_key else ()
        )
        self._channel: grpc.aio.Channel | None = None
        self._stub: jobs_pb2_grpc.JobServiceAsyncStub | None = None
        self._event_stub: events_pb2_grpc.EventServiceAsyncStub | None = None
        self._blob_stub: blobs_pb2_grpc.BlobServiceAsyncStub | None = None
        self._closed = False

    async def close(self) -> None:
        """Close the channel; calls still running fail. Safe to call twice."""
        self._closed = True
        channel, self._channel = self._channel, None
        self._stub = self._event_stub = None
        self._blob_stub = None
        if channel is not None:
            await channel.close()

    def _get_channel(self) -> grpc.aio.Channel:
        if self._closed:
            raise RuntimeError("the client has been closed")
        if self._channel is None:
            self._channel = self._open_channel()
        return self._channel

    def _get_stub(self) -> jobs_pb2_grpc.JobServiceAsyncStub:
        channel = self._get_channel()
        if self._stub is None:
            self._stub = jobs_pb2_grpc.JobServiceStub(channel)
        return self._stub

    def _get_event_stub(self) -> events_pb2_grpc.EventServiceAsyncStub:
        channel = self._get_channel()
        if self._event_stub is None:
            self._event_stub = events_pb2_grpc.EventServiceStub(channel)
        return self._event_stub

    def _get_blob_stub(self) -> blobs_pb2_grpc.BlobServiceAsyncStub:
        channel = self._get_channel()
        if self._blob_stub is None:
            self._blob_stub = blobs_pb2_grpc.BlobServiceStub(channel)
        return self._blob_stub

    def _open_channel(self) -> grpc.aio.Channel:
        interceptors = self._interceptors or None
        if self._tls is None:
            return grpc.aio.insecure_channel(
                self._address, options=_CHANNEL_OPTIONS, interceptors=interceptors
            )
        return grpc.aio.secure_channel(
            self._address,
            self._tls.credentials(),
            options=(*_CHANNEL_OPTIONS, *self._tls.channel_options()),
            interceptors=interceptors,
        )

    async def _call(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[Req, Resp],
        request: Req,
        *,
        repeatable: bool = False,
        timeout: float | None = None,
    ) -> Resp:
        """One unary call; a ``repeatable`` one is retried while it is refused.

        Refused means UNAVAILABLE (the server or its database is down), a lost
        connection or a call the server shed (:func:`is_retryable`); also a
        tenant limit whose ``retry_delay`` is short (at most
        ``_LIMIT_WAIT_MAX``), after that delay. ``timeout``, else the
        client's, is the deadline of the call with all its repeats.
        """
        timeout = self._timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout or UNBOUNDED_CALL_BUDGET)
        backoff = Backoff(UNARY_RETRY)
        limited = 0
        refused: grpc.aio.AioRpcError | None = None
        while True:
            remaining = deadline - loop.time()
            try:
                return await method(
                    request,
                    timeout=remaining if timeout is not None else None,
                    metadata=self._metadata,
                )
            except grpc.aio.AioRpcError as exc:
                if not repeatable or self._closed:
                    raise error_from_rpc(exc) from exc
                if refused is not None and exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                    # The budget ran out in a repeat of a refused call (one
                    # still connecting, say): why it failed is the refusal.
                    raise error_from_rpc(refused) from exc
                delay: float | None
                if is_retryable(exc):
                    refused = exc
                    delay = backoff.failure()
                else:
                    error = error_from_rpc(exc)
                    delay = error.retry_delay
                    if (
                        not isinstance(error, TenantLimitExceeded)
                        or delay is None
                        or delay > _LIMIT_WAIT_MAX
                        or limited >= _LIMIT_RETRIES
                    ):
                        raise error from exc
                    limited += 1
                if delay is None or loop.time() + delay >= deadline:
                    raise error_from_rpc(exc) from exc
            await asyncio.sleep(delay)
