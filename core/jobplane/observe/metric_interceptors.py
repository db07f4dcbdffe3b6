"""The interceptors that count what a worker, a relay and a sweeper do into a
process's :class:`~jobplane.observe.metrics.Metrics`.

Handed to those parts by the process that serves metrics (the CLI): they
import no metrics, and given none count nothing. Importable from
:mod:`jobplane.observe.metrics`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobplane.envelope import Envelope
    from jobplane.observe.metrics import Metrics
    from jobplane.store.attempts import Attempt, ClaimResult
    from jobplane.store.machine import Transition
    from jobplane.topology import Topology
    from jobplane.workers.interceptors import Delivered
    from jobplane.workers.sweeper import SweepReport


class WorkerMetrics:
    """A worker's :class:`~jobplane.workers.interceptors.Interceptor` that counts:
    its slots, groups and attempts into ``metrics``.

    Handed to the worker by the process that serves metrics (the CLI); the
    worker imports no metrics, and given none counts nothing.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def known(
        self, slots: Callable[[], tuple[int, int]], topology: Topology, types: Iterable[str]
    ) -> None:
        """The worker's slots as a gauge; its topology's and types' label values."""
        self.metrics.add_slots(slots)
        self.metrics.know_topology(topology)
        self.metrics.know_types(types)

    def delivered(
        self, headers: Mapping[str, Any] | None
    ) -> contextlib.AbstractContextManager[Any]:
        """Nothing to count around a delivery."""
        return _NO_BLOCK

    async def claim(
        self,
        envelope: Envelope,
        message: Delivered,
        claim: Callable[[], Awaitable[ClaimResult]],
    ) -> ClaimResult:
        """The claim; one a flow limit refused counts as a throttled start (a claimed
        attempt counts when it starts)."""
        result = await claim()
        if result.waiting_code:
            self.metrics.throttled(result.limit, envelope.job_type)
        return result

    def applied(self, transition: Transition) -> None:
        """Nothing counts a transition."""

    def grouped(self, kind: str, size: int) -> None:
        """One group of ``size`` ``kind`` writes."""
        self.metrics.grouped(kind, size)

    def submitted(self, job_type: str, queue: str, count: int) -> None:
        """Jobs the worker created (children, a fan-out's children): counted with
        SubmitJob's, so the family summed over processes sees every job."""
        self.metrics.submitted(job_type, queue, count)

    def started(self, attempt: Attempt) -> None:
        """An attempt started (and, a first, the job with its wait)."""
        self.metrics.attempt_started(
            attempt.type, attempt.queue, attempt.attempt, attempt.create_time
        )

    def progress(self, progress: float) -> None:
        """Progress is not counted."""

    def outcome(self, attempt: Attempt) -> contextlib.AbstractContextManager[Any]:
        """Nothing to count around an outcome's write."""
        return _NO_BLOCK

    def ended(self, attempt: Attempt, outcome: str, seconds: float) -> None:
        """An attempt ended with ``outcome`` after ``seconds`` of its handler."""
        self.metrics.attempt_ended(attempt.type, attempt.queue, outcome, seconds)


_NO_BLOCK = contextlib.nullcontext()


class RelayMetrics:
    """A relay's and a sweeper's :class:`~jobplane.workers.interceptors.RelayInterceptor`
    that counts: messages relayed, batches' confirms and records, repairs.

    Handed to them by the process that serves metrics (the CLI); the relay and
    the sweeper import no metrics, and given none count nothing.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

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
        """Nothing to count around a publish (its outcome counts), no headers to add."""
        return _NO_HEADERS

    def trace_id(self, headers: Mapping[str, Any] | None) -> None:
        """Metrics name no trace."""

    def relayed(self, kind: str, outcome: str, count: int) -> None:
        """``count`` messages of ``kind`` relayed with ``outcome``."""
        self.metrics.relayed(kind, outcome, count)

    def confirmed(self, seconds: float) -> None:
        """A batch's publish and confirm took ``seconds``."""
        self.metrics.relay_confirm.observe(seconds)

    def batched(self, seconds: float) -> None:
        """A batch's claim to record took ``seconds``."""
        self.metrics.relay_dispatch.observe(seconds)

    def repaired(self, report: SweepReport) -> None:
        """What a sweep repaired."""
        self.metrics.count_repairs(report)


_NO_HEADERS: contextlib.AbstractContextManager[Mapping[str, str]] = contextlib.nullcontext({})
