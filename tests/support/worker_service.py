"""Stand-ins for WorkerService's seams, for unit tests of what it checks, writes and says.

:func:`claimed_attempt` is an attempt as the service holds it after a claim;
:class:`AttemptStoreFake` records the writes WorkerService makes (its lease can
be lost at any), :class:`ClaimsFake` adds the claim and hand-back answers the
test sets, :class:`HeldAttemptsFake` holds attempts in a dict,
:class:`RenewalsFake` answers a worker's renewal and :class:`WorkersFake` its
registration and stop too; :func:`worker_service_on` is the service on them.
:class:`Recorded` records every metric counted.
"""

from __future__ import annotations

import uuid
from typing import Any

from jobplane.envelope import Envelope
from jobplane.server.worker_protocol import WorkerService
from jobplane.store.attempts import Attempt, ClaimResult, HandBack, LeaseLost, ProgressUpdate
from jobplane.topology import load_topology
from tests.support.attempts import an_attempt


def claimed_attempt(**changes: Any) -> Attempt:
    """The first of three attempts of a ``reports.render`` job on the default queue,
    with fresh ids; ``changes`` replace any field."""
    defaults: dict[str, Any] = {
        "type": "reports.render",
        "payload": {"a": 1},
        "correlation_id": "c",
        "timeout_seconds": 60.0,
        "queue": "jobplane.default",
    }
    return an_attempt(**{**defaults, **changes})


class AttemptStoreFake:
    """The AttemptStore calls WorkerService makes, recorded; the lease can be lost at any."""

    lease_seconds = 30.0

    def __init__(self) -> None:
        self.lost: str | None = None  # the write whose fence fails
        self.cancel = False
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fences: list[dict[str, Any]] = []
        self.unparked: list[tuple[list[str], list[str]]] = []

    def _write(self, name: str, attempt: Attempt, **args: Any) -> None:
        self.fences.append(attempt.fence())  # what the real statement binds
        if self.lost == name:
            raise LeaseLost("moved on")
        self.calls.append((name, args))

    async def heartbeat(self, attempt: Attempt) -> bool:
        self._write("heartbeat", attempt)
        return self.cancel

    async def write_progress(self, attempt: Attempt, updates: Any) -> bool:
        self._write("write_progress", attempt, updates=updates)
        return self.cancel

    async def succeed(self, attempt: Attempt, result: Any, pending: Any = (), **kw: Any) -> None:
        self._write("succeed", attempt, result=result, pending=pending, **kw)

    async def fail(self, attempt: Attempt, code: str, message: str, **kw: Any) -> None:
        self._write("fail", attempt, code=code, message=message, **kw)

    async def schedule_retry(self, attempt: Attempt, code: str, message: str, **kw: Any) -> None:
        self._write("schedule_retry", attempt, code=code, message=message, **kw)

    async def cancelled(self, attempt: Attempt, pending: Any = ()) -> None:
        self._write("cancelled", attempt, pending=pending)

    async def unpark(self, types: Any, queues: Any) -> int:
        self.unparked.append((list(types), list(queues)))
        return 0


class HeldAttemptsFake:
    """HeldAttempts over a dict; counts the reads."""

    def __init__(self, *attempts: Attempt) -> None:
        self.attempts = {(a.job_id, a.attempt, a.lease_token): a for a in attempts}
        self.reads = 0

    async def get(self, job_id: uuid.UUID, attempt: int, lease_token: uuid.UUID) -> Attempt | None:
        self.reads += 1
        return self.attempts.get((job_id, attempt, lease_token))


class RenewalsFake:
    """WorkerStore.renew: the registration's types and queues, or None when it is gone."""

    def __init__(self, found: tuple[list[str], list[str]] | None) -> None:
        self.found = found
        self.renewed: list[tuple[uuid.UUID, float]] = []

    async def renew(self, worker_id: uuid.UUID, *, ttl: float) -> Any:
        self.renewed.append((worker_id, ttl))
        return self.found


class WorkersFake(RenewalsFake):
    """WorkerStore's register, renew and stop, each call named in ``calls`` in
    order; a renewal finds the registration (``found``: its types and queues)."""

    def __init__(self, found: tuple[list[str], list[str]] | None = ([], [])) -> None:
        super().__init__(found)
        self.calls: list[tuple[str, uuid.UUID]] = []
        self.registered: list[dict[str, Any]] = []

    async def register(self, worker_id: uuid.UUID, **fields: Any) -> None:
        self.calls.append(("register", worker_id))
        self.registered.append(fields)

    async def renew(self, worker_id: uuid.UUID, *, ttl: float) -> Any:
        self.calls.append(("renew", worker_id))
        return await super().renew(worker_id, ttl=ttl)

    async def stop(self, worker_id: uuid.UUID) -> None:
        self.calls.append(("stop", worker_id))


def worker_service_on(
    store: AttemptStoreFake,
    held: HeldAttemptsFake,
    workers: RenewalsFake | None = None,
    **options: Any,
) -> WorkerService:
    """The WorkerService on the fakes, over the default topology."""
    fakes: Any = (store, held, workers)
    return WorkerService(fakes[0], fakes[1], load_topology(), workers=fakes[2], **options)


class Recorded:
    """Every metric WorkerService counts, by name, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append((name, args))


class ClaimsFake(AttemptStoreFake):
    """AttemptStore.claim and hand_back answering what the test set; both recorded."""

    def __init__(self, result: ClaimResult, lease_seconds: float = 30.0) -> None:
        super().__init__()
        self.result, self.lease_seconds = result, lease_seconds
        self.claimed: list[Envelope] = []
        self.handed_back: list[tuple[Envelope, float, float]] = []
        self.hand_back_answer = (HandBack.HANDED_BACK, "")

    async def claim(self, envelope: Envelope) -> ClaimResult:
        self.claimed.append(envelope)
        return self.result

    async def hand_back(
        self, envelope: Envelope, *, base_delay: float, max_delay: float
    ) -> tuple[HandBack, str]:
        self.handed_back.append((envelope, base_delay, max_delay))
        return self.hand_back_answer


# Progress reports a worker sends with its outcome.
PENDING = [ProgressUpdate(0.5, "half", {})]
