"""Reconnect policy and stream position for :meth:`AsyncClient.watch` and subscriptions.

Both classes are pure (no I/O, injectable clock and randomness), so the resume
rules can be tested without a server.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from jobplane.client._errors import WatchSequenceError, error_from_rpc, is_retryable
from jobplane.errors import TenantLimitExceeded


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a watch reconnects after losing its stream.

    The delay before reconnect *n* is ``initial_delay * multiplier**n``, capped
    at ``max_delay`` and shortened by up to ``jitter`` (a fraction) so that many
    clients do not reconnect in lockstep after a server restart. The watch gives
    up with :class:`~jobplane.errors.Unavailable` once it has failed for
    ``max_elapsed`` seconds in a row; ``None`` retries forever.

    A connection that delivers an event, or stays open for at least
    ``max_delay`` seconds, ends the run of failures.
    """

    initial_delay: float = 0.05
    max_delay: float = 2.0
    multiplier: float = 2.0
    max_elapsed: float | None = 60.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.initial_delay <= 0 or self.max_delay < self.initial_delay:
            raise ValueError("need 0 < initial_delay <= max_delay")
        if self.multiplier < 1:
            raise ValueError("multiplier must be at least 1")
        if self.max_elapsed is not None and self.max_elapsed < 0:
            raise ValueError("max_elapsed must not be negative")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be in [0, 1)")


class Backoff:
    """The delays of one run of consecutive failures under a :class:`RetryPolicy`."""

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._policy = policy
        self._clock = clock
        self._rand = rand
        self._failing_since: float | None = None
        self._next = policy.initial_delay

    @property
    def policy(self) -> RetryPolicy:
        """The policy this run of failures follows."""
        return self._policy

    @property
    def failing(self) -> bool:
        """True while a run of failures has not been ended by :meth:`reset`."""
        return self._failing_since is not None

    def reset(self) -> None:
        """A connection worked: the next failure starts a new run."""
        self._failing_since = None
        self._next = self._policy.initial_delay

    def remaining(self) -> float | None:
        """Seconds before this run of failures gives up; None when it never does."""
        if self._policy.max_elapsed is None:
            return None
        if self._failing_since is None:
            return self._policy.max_elapsed
        return self._failing_since + self._policy.max_elapsed - self._clock()

    def failure(self) -> float | None:
        """Record a failure; the seconds to wait before retrying, or None to give up."""
        now = self._clock()
        if self._failing_since is None:
            self._failing_since = now
        delay = self._next
        self._next = min(self._next * self._policy.multiplier, self._policy.max_delay)
        delay *= 1 - self._policy.jitter * self._rand()
        if self._policy.max_elapsed is None:
            return delay
        remaining = self._failing_since + self._policy.max_elapsed - now
        if remaining <= 0:
            return None
        # The last attempt happens at the deadline rather than a full delay after it.
        return min(delay, remaining)


def stream_failure(error: grpc.aio.AioRpcError, *, closed: bool) -> TenantLimitExceeded | None:
    """What the error that ended a stream means for resuming it.

    Raises the client's error when the stream must end: the client was
    closed, or the server refused it for good. Returns the refusal for the
    tenant's stream limit, to wait out (the streams of a server that went
    away come to the others, and slots free as streams end), or None: a
    failure to retry after the backoff.
    """
    if closed:
        raise error_from_rpc(error) from error
    if is_retryable(error):
        return None
    refusal = error_from_rpc(error)
    if isinstance(refusal, TenantLimitExceeded):
        return refusal
    raise refusal from error


def stream_retry_delay(
    backoff: Backoff,
    *,
    open_for: float,
    limited: TenantLimitExceeded | None,
    failure: BaseException | None,
) -> float | None:
    """How long to wait before reopening a lost stream; None when the budget is spent.

    ``open_for``: how long the lost stream stayed open; one open for at
    least ``max_delay`` worked, and ends the run of failures (a refusal,
    however slow to arrive, did not). ``limited``: the server refused the
    stream for the tenant's stream limit; the wait is then never shorter
    than the one it asked for, and when that would pass the budget
    ``limited`` is raised (from ``failure``).
    """
    if limited is None and open_for >= backoff.policy.max_delay:
        backoff.reset()
    delay = backoff.failure()
    if limited is not None:
        wait = max(delay or 0.0, limited.retry_delay or 0.0)
        left = backoff.remaining()
        if delay is None or (left is not None and wait > left):
            raise limited from failure
        delay = wait
    return delay


class EventCursor:
    """Where a watch stands in a job's event stream.

    Seqs of one job are 1, 2, 3 ... without gaps. After a reconnect the server
    resends from ``last``; anything at or before it was already yielded and is
    dropped, and a seq past ``last + 1`` means an event was lost.
    """

    def __init__(self, after_seq: int = 0) -> None:
        if after_seq < 0:
            raise ValueError("after_seq must not be negative")
        self.last = after_seq
        self.at_terminal = False

    def accept(self, seq: int, *, terminal: bool) -> bool:
        """True to yield the event with ``seq``; False to drop a repeat.

        Raises :class:`WatchSequenceError` when events are missing before it.
        """
        if seq <= self.last:
            return False
        if seq != self.last + 1:
            raise WatchSequenceError(
                f"event seq {seq} arrived after seq {self.last}; "
                f"seq {self.last + 1} to {seq - 1} are missing",
                metadata={"last_seq": str(self.last), "seq": str(seq)},
            )
        self.last = seq
        self.at_terminal = terminal
        return True
