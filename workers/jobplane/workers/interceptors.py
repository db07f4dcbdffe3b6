"""What a process may observe of a worker's deliveries and a relay's publishes: the
interceptors it hands in.

The worker runtime, the relay and the sweeper import no observability. A
process that traces or counts passes :class:`Interceptor` implementations to
the worker it builds (``jobplane.observe.tracing.WorkerTracing``,
``jobplane.observe.metrics.WorkerMetrics``, chosen by the CLI) and
:class:`RelayInterceptor` ones to its relay and sweeper
(``tracing.RelayTracing``, ``metrics.RelayMetrics``), as temporalio's worker
is handed its interceptors rather than importing them; it is the store's
:mod:`jobplane.store.observers` on the worker's side. With none a part calls
nothing: each seam reads its interceptor once and goes on when it is None,
so the off path costs one test.

This module imports nothing of the worker, the relay, the store or the broker
at run time, so an implementation imports it without loading them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from jobplane.envelope import Envelope
    from jobplane.store.attempts import Attempt, ClaimResult
    from jobplane.store.machine import Transition
    from jobplane.topology import Topology
    from jobplane.workers.sweeper import SweepReport


class Delivered(Protocol):
    """A delivery as an interceptor sees it (the worker's
    :class:`~jobplane.workers.inbound.Delivery`): what an interceptor written
    against aio-pika's ``IncomingMessage`` read of it most, each read from
    the frames when asked for."""

    @property
    def body(self) -> bytes: ...

    delivery_tag: int

    @property
    def exchange(self) -> str: ...

    @property
    def correlation_id(self) -> str | None: ...

    @property
    def message_id(self) -> str | None: ...

    @property
    def routing_key(self) -> str: ...

    @property
    def headers(self) -> Mapping[str, Any] | None: ...

    redelivered: bool


class Run(Protocol):
    """One attempt's run as an interceptor sees it, from start to end."""

    def context(self) -> Any:
        """The contextvars the handler's task runs in (None: a copy of the current ones)."""
        ...

    def ended(self, error: BaseException | None) -> None:
        """The handler returned or raised ``error``."""
        ...


class Interceptor(Protocol):
    """Sees a worker's seams: deliveries, claims, runs and outcomes.

    Every method runs in the delivery's own context (its task), so what a
    context manager makes current is current for what the worker does inside.
    """

    def known(
        self, slots: Callable[[], tuple[int, int]], topology: Topology, types: Iterable[str]
    ) -> None:
        """The worker was built: its slots (running, total), topology and handled types."""
        ...

    def delivered(
        self, headers: Mapping[str, Any] | None
    ) -> contextlib.AbstractContextManager[Any]:
        """Around the whole handling of a delivery carrying ``headers``."""
        ...

    async def claim(
        self,
        envelope: Envelope,
        message: Delivered,
        claim: Callable[[], Awaitable[ClaimResult]],
    ) -> ClaimResult:
        """Around the fenced claim of ``envelope``: awaits ``claim()`` and returns its result."""
        ...

    def applied(self, transition: Transition) -> None:
        """``transition`` (a claim or an outcome) committed within a group."""
        ...

    def grouped(self, kind: str, size: int) -> None:
        """A group of ``size`` ``kind`` writes (``claim`` or ``outcome``) went out as one."""
        ...

    def submitted(self, job_type: str, queue: str, count: int) -> None:
        """``count`` jobs of ``job_type`` on ``queue`` committed by the worker: a child
        of ``ctx.submit``, or the children of a fan-out."""
        ...

    def started(self, attempt: Attempt) -> Run | None:
        """The handler of ``attempt`` is about to start (None: nothing to follow)."""
        ...

    def progress(self, progress: float) -> None:
        """The handler reported ``progress``, in its own context."""
        ...

    def outcome(self, attempt: Attempt) -> contextlib.AbstractContextManager[Any]:
        """Around the write of ``attempt``'s outcome."""
        ...

    def ended(self, attempt: Attempt, outcome: str, seconds: float) -> None:
        """``attempt`` ended with ``outcome`` (:mod:`jobplane.attempt_end`'s labels)
        after its handler ran ``seconds``."""
        ...


def chain(interceptors: Sequence[Interceptor]) -> Interceptor | None:
    """The one interceptor a worker calls for ``interceptors``, in order (None: none)."""
    if not interceptors:
        return None
    if len(interceptors) == 1:
        return interceptors[0]
    return _Chain(tuple(interceptors))


class _Chain:
    """Several interceptors as one: the first given is the outermost."""

    def __init__(self, interceptors: tuple[Interceptor, ...]) -> None:
        self._all = interceptors

    def known(
        self, slots: Callable[[], tuple[int, int]], topology: Topology, types: Iterable[str]
    ) -> None:
        names = list(types)
        for each in self._all:
            each.known(slots, topology, names)

    @contextlib.contextmanager
    def delivered(self, headers: Mapping[str, Any] | None) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for each in self._all:
                stack.enter_context(each.delivered(headers))
            yield

    async def claim(
        self,
        envelope: Envelope,
        message: Delivered,
        claim: Callable[[], Awaitable[ClaimResult]],
    ) -> ClaimResult:
        inner = claim
        for each in reversed(self._all):
            inner = _bound_claim(each, envelope, message, inner)
        return await inner()

    def applied(self, transition: Transition) -> None:
        for each in self._all:
            each.applied(transition)

    def grouped(self, kind: str, size: int) -> None:
        for each in self._all:
            each.grouped(kind, size)

    def submitted(self, job_type: str, queue: str, count: int) -> None:
        for each in self._all:
            each.submitted(job_type, queue, count)

    def started(self, attempt: Attempt) -> Run | None:
        runs = [run for each in self._all if (run := each.started(attempt)) is not None]
        if not runs:
            return None
        return runs[0] if len(runs) == 1 else _Runs(runs)

    def progress(self, progress: float) -> None:
        for each in self._all:
            each.progress(progress)

    @contextlib.contextmanager
    def outcome(self, attempt: Attempt) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for each in self._all:
                stack.enter_context(each.outcome(attempt))
            yield

    def ended(self, attempt: Attempt, outcome: str, seconds: float) -> None:
        for each in self._all:
            each.ended(attempt, outcome, seconds)


def _bound_claim(
    interceptor: Interceptor,
    envelope: Envelope,
    message: Delivered,
    inner: Callable[[], Awaitable[ClaimResult]],
) -> Callable[[], Awaitable[ClaimResult]]:
    return lambda: interceptor.claim(envelope, message, inner)


class _Runs:
    """Several runs as one: the handler's context is the first that gives one."""

    def __init__(self, runs: list[Run]) -> None:
        self._runs = runs

    def context(self) -> Any:
        for run in self._runs:
            found = run.context()
            if found is not None:
                return found
        return None

    def ended(self, error: BaseException | None) -> None:
        for run in reversed(self._runs):
            run.ended(error)


class RelayInterceptor(Protocol):
    """Sees a relay's and a sweeper's seams: publishes, what the broker did, repairs."""

    def publish(
        self,
        row_headers: Mapping[str, str],
        *,
        exchange: str,
        routing_key: str,
        message_id: object,
        job_id: object,
        tenant_id: object,
    ) -> contextlib.AbstractContextManager[Mapping[str, str]]:
        """Around the publish of a dispatch whose outbox row carries ``row_headers``;
        the block gets the headers the message carries on (empty: none)."""
        ...

    def trace_id(self, headers: Mapping[str, Any] | None) -> str | None:
        """The trace a log line about a row carrying ``headers`` names (None: none).

        The line is logged with no span of the row's current, so the log's own
        trace ids cannot name it.
        """
        ...

    def relayed(self, kind: str, outcome: str, count: int) -> None:
        """``count`` messages of ``kind`` were handed to the broker, with ``outcome``."""
        ...

    def confirmed(self, seconds: float) -> None:
        """A batch's publishes were confirmed (or not) after ``seconds``."""
        ...

    def batched(self, seconds: float) -> None:
        """A batch went from its claim to its record in ``seconds``."""
        ...

    def repaired(self, report: SweepReport) -> None:
        """A sweep ended with ``report``."""
        ...


#: The headers a publish carries on when nothing adds any.
NO_HEADERS: Mapping[str, str] = {}


def chain_relay(interceptors: Sequence[RelayInterceptor]) -> RelayInterceptor | None:
    """The one interceptor a relay or sweeper calls for ``interceptors``, in order
    (None: none)."""
    if not interceptors:
        return None
    if len(interceptors) == 1:
        return interceptors[0]
    return _RelayChain(tuple(interceptors))


class _RelayChain:
    """Several relay interceptors as one: the first given is the outermost."""

    def __init__(self, interceptors: tuple[RelayInterceptor, ...]) -> None:
        self._all = interceptors

    @contextlib.contextmanager
    def publish(
        self,
        row_headers: Mapping[str, str],
        *,
        exchange: str,
        routing_key: str,
        message_id: object,
        job_id: object,
        tenant_id: object,
    ) -> Iterator[Mapping[str, str]]:
        headers: dict[str, str] = {}
        with contextlib.ExitStack() as stack:
            for each in self._all:
                headers.update(
                    stack.enter_context(
                        each.publish(
                            row_headers,
                            exchange=exchange,
                            routing_key=routing_key,
                            message_id=message_id,
                            job_id=job_id,
                            tenant_id=tenant_id,
                        )
                    )
                )
            yield headers

    def trace_id(self, headers: Mapping[str, Any] | None) -> str | None:
        for each in self._all:
            found = each.trace_id(headers)
            if found is not None:
                return found
        return None

    def relayed(self, kind: str, outcome: str, count: int) -> None:
        for each in self._all:
            each.relayed(kind, outcome, count)

    def confirmed(self, seconds: float) -> None:
        for each in self._all:
            each.confirmed(seconds)

    def batched(self, seconds: float) -> None:
        for each in self._all:
            each.batched(seconds)

    def repaired(self, report: SweepReport) -> None:
        for each in self._all:
            each.repaired(report)
