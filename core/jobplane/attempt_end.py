"""How an attempt that did not succeed ends: one decision, then a write (ADR-0034).

The Python worker (``jobplane.workers.runtime``), WorkerService
(``jobplane.server.worker_protocol``, for workers in any language) and the sweeper
(an attempt whose lease ran out) each ask :func:`decide` and only write its
answer: a :class:`Retry` after a delay, or :class:`Fail`. The function reads
no clock but the jitter's random source and writes nothing, so every rule of
retrying is tested once, without a database (tests/unit/test_attempt_end.py).

The store takes the decision's types (the sweeper's expiry runs inside its
transaction), so this module imports nothing of the worker at run time.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobplane.topology import Topology, TopologyError

if TYPE_CHECKING:
    from jobplane.workers.outcome import Failure

#: How an attempt ended, as the worker tells its interceptors (the metrics'
#: ``outcome`` label).
COMPLETED, FAILED, CANCELLED, RETRY = "completed", "failed", "cancelled", "retry_scheduled"
#: A pipeline stage before the last completed: the job goes on to the next stage.
ADVANCED = "advanced"


def completed(stage: Any) -> str:
    """The outcome of a completed attempt of ``stage`` (an attempt's StageRun or None):
    :data:`ADVANCED` for a stage before the pipeline's last, else :data:`COMPLETED`."""
    return ADVANCED if stage is not None and not stage.last else COMPLETED


#: Past this many doublings the ceiling is the cap anyway; 2.0 ** 1024 overflows.
_MAX_DOUBLINGS = 1000


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Exponential backoff with jitter, from ``base_delay``, capped at ``max_delay``."""

    base_delay: float = 1.0
    max_delay: float = 300.0

    @classmethod
    def of_queue(
        cls, topology: Topology, queue: str, *, base_override: float | None = None
    ) -> RetryPolicy:
        """The queue's ``retry_base_delay`` and ``retry_max_delay`` (``base_override``
        replaces the base); plain defaults when the queue left the topology."""
        try:
            found = topology.queue(queue)
        except TopologyError:
            return cls(base_override or 1.0)
        base = found.retry_base_delay if base_override is None else base_override
        return cls(base, found.retry_max_delay)

    def ceiling(self, attempt: int) -> float:
        """The longest wait after attempt ``attempt``: base·2^(attempt-1), at most the cap."""
        doublings = min(max(0, attempt - 1), _MAX_DOUBLINGS)
        return min(self.max_delay, self.base_delay * 2.0**doublings)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait after attempt ``attempt``: at least half the ceiling, at most all of it.

        The jitter spreads the retries of jobs that failed together (a
        dependency that went away) instead of sending them back at once.
        """
        ceiling = self.ceiling(attempt)
        return (rng or random).uniform(ceiling / 2, ceiling)


class EndCause(enum.Enum):
    """Why an attempt ended without a result."""

    #: The handler's error, or the worker's for it (a timeout, a blob store away).
    FAILED = "failed"
    #: The worker shut down during the attempt: not the job's doing, so it is
    #: refunded and runs again at once, whatever attempts are left.
    SHUTDOWN = "shutdown"
    #: Nobody reported: the sweeper found the attempt's lease run out.
    LEASE_EXPIRED = "lease_expired"


@dataclass(frozen=True, slots=True)
class Retry:
    """A new attempt, due after ``delay`` seconds.

    ``refund``: this attempt does not count against max_attempts.
    ``details`` go into the event's ``data.error`` (the traceback).
    """

    code: str
    message: str
    delay: float
    refund: bool = False
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Fail:
    """FAILED, not retryable, with the attempt's own code and message.

    ``details`` go into the failed event's ``data.error``: the traceback, and
    ``attempts_exhausted`` when the error was retryable but no attempt is left.
    """

    code: str
    message: str
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def attempts_exhausted(self) -> bool:
        """Whether the job fails because its attempts ran out, not for its error."""
        return bool(self.details.get("attempts_exhausted"))


Decision = Retry | Fail


def decide(
    attempt: int,
    max_attempts: int,
    failure: Failure,
    policy: RetryPolicy,
    cause: EndCause = EndCause.FAILED,
    *,
    rng: random.Random | None = None,
) -> Decision:
    """How an attempt that ended with ``failure`` ends the job's attempt.

    ``attempt`` is the attempt's number within its budget, from 1
    (``Attempt.budget_attempt``: a pipeline stage's own). A retryable failure
    with attempts left is retried after the delay it asked for, else after
    ``policy``'s backoff; any other ends the job at once with the attempt's
    own code and message. A retryable failure of the last attempt is not
    retried to fail later as something else: it fails now, and says its
    attempts are exhausted.
    """
    details: dict[str, Any] = {"traceback": failure.traceback} if failure.traceback else {}
    if cause is EndCause.SHUTDOWN:
        return Retry(failure.code, failure.message, 0.0, refund=True, details=details)
    if failure.retryable and attempt < max_attempts:
        delay = failure.delay if failure.delay is not None else policy.delay(attempt, rng)
        return Retry(failure.code, failure.message, delay, details=details)
    message = failure.message
    if failure.retryable:
        details["attempts_exhausted"] = True
        if cause is EndCause.LEASE_EXPIRED:
            # Nobody reported an error: the message says why this expiry is final.
            message = f"{message}; no attempts left"
    return Fail(failure.code, message, details)
