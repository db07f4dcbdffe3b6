"""The asyncio client of the JobService, EventService and BlobService APIs.

:class:`AsyncClient` is its parts put together: the connection
(``_channel``: settings, channel, the unary call and its retries) and the
calls of each service (``_job_calls``, ``_blob_calls``, ``_event_calls``,
``_schedule_calls``).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType
from typing import Self

from jobplane.client._blob_calls import BlobCalls
from jobplane.client._channel import (
    DEFAULT_ADDRESS,
    DEFAULT_INLINE_BYTES,
    MAX_RECEIVE_BYTES,
    clean_api_key,
    connection_from_env,
    inline_bytes_from_env,
)
from jobplane.client._event_calls import EventCalls
from jobplane.client._job_calls import MAX_BLOB_JSON_BYTES, JobCalls, job_name_of
from jobplane.client._retry import RetryPolicy
from jobplane.client._schedule_calls import ScheduleCalls
from jobplane.client.batch import JobSpec
from jobplane.client.tls import ClientTLS


class AsyncClient(JobCalls, BlobCalls, EventCalls, ScheduleCalls):
    """An asyncio client of one jobplane server.

    Use it as an async context manager, or call :meth:`close` when done. The
    channel opens on first use, on the event loop that makes the call; use one
    client from one event loop.

    ``tls`` is a :class:`ClientTLS` (certificates, mutual TLS, the expected
    server name), or True for TLS that trusts the system's roots; None or
    False speak plaintext.

    ``api_key`` is used without the whitespace around it (a key read from
    a file ends in a newline); a key gRPC cannot send raises
    :class:`~jobplane.errors.InvalidArgument` (``field="api_key"``) here.

    ``tracing=True`` sends the caller's OpenTelemetry trace context with
    every call, each in a client span (:mod:`jobplane.client.tracing`; needs
    ``opentelemetry-api``), so a job's trace continues the caller's.
    ``interceptors`` are grpc.aio client interceptors for the channel, after
    the tracing ones.

    The constructor, :meth:`close` and the retries of a call are the
    connection's (``client/jobplane/client/_channel.py``); each service's calls are in the
    part named for it.
    """

    @classmethod
    def from_env(
        cls,
        *,
        address: str | None = None,
        api_key: str | None = None,
        timeout: float | None = 30.0,
        watch_retry: RetryPolicy | None = None,
        tls: ClientTLS | bool | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Self:
        """A client for ``JOBPLANE_ADDRESS`` with key ``JOBPLANE_API_KEY``.

        TLS as :meth:`ClientTLS.from_env` reads it from ``JOBPLANE_TLS``,
        ``JOBPLANE_TLS_CA``, ``JOBPLANE_TLS_CLIENT_CERT``,
        ``JOBPLANE_TLS_CLIENT_KEY`` (PEM file paths) and
        ``JOBPLANE_TLS_SERVER_NAME``. Payloads over ``JOBPLANE_INLINE_BYTES``
        go by reference. Arguments, when given, win over the environment;
        ``env`` stands in for the process's environment.
        """
        address, api_key, tls = connection_from_env(address, api_key, tls, env)
        return cls(
            address,
            api_key,
            timeout=timeout,
            watch_retry=watch_retry,
            tls=tls,
            inline_bytes=inline_bytes_from_env(env),
        )

    @property
    def address(self) -> str:
        """The ``host:port`` of the server."""
        return self._address

    @property
    def api_key(self) -> str | None:
        """The API key sent with every call."""
        return self._api_key

    @property
    def tls(self) -> ClientTLS | None:
        """The channel's TLS settings; None when it speaks plaintext."""
        return self._tls

    @property
    def timeout(self) -> float | None:
        """Deadline in seconds of each unary call (watch streams have none)."""
        return self._timeout

    @property
    def watch_retry(self) -> RetryPolicy:
        """How :meth:`watch` and :meth:`subscribe` reconnect."""
        return self._watch_retry

    def __repr__(self) -> str:
        return f"{type(self).__name__}(address={self._address!r})"

    async def __aenter__(self) -> Self:
        self._get_stub()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


__all__ = [
    "DEFAULT_ADDRESS",
    "DEFAULT_INLINE_BYTES",
    "MAX_BLOB_JSON_BYTES",
    "MAX_RECEIVE_BYTES",
    "AsyncClient",
    "ClientTLS",
    "JobSpec",
    "clean_api_key",
    "connection_from_env",
    "inline_bytes_from_env",
    "job_name_of",
]
