"""How an attempt that did not succeed ends: the one decision every caller writes.

The decision is pure, so its rules are tested here once; the callers (the
Python worker, WorkerService, the sweeper) are tested for writing it in
tests/integration (test_worker_service.py, test_recovery.py).
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import create_async_engine

from jobplane.attempt_end import Decision, EndCause, Fail, Retry, RetryPolicy, decide
from jobplane.store.deadlines import DeadlineStore
from jobplane.store.sweeps import EventsBehind, ExpiredLease, LeaseRepair, SweepStore
from jobplane.topology import parse_topology
from jobplane.workers.outcome import Failure
from jobplane.workers.sweeper import Sweeper, lease_expired

delays = st.floats(min_value=0.0, max_value=7 * 24 * 3600.0, allow_nan=False)
attempts = st.integers(min_value=1, max_value=10_000)
codes = st.from_regex(r"[A-Z][A-Z0-9_]{0,20}", fullmatch=True)
causes = st.sampled_from([EndCause.FAILED, EndCause.LEASE_EXPIRED])


@st.composite
def policies(draw: st.DrawFn) -> RetryPolicy:
    base = draw(delays)
    return RetryPolicy(base, draw(st.floats(min_value=base, max_value=base * 4 + 3600.0)))


@st.composite
def failures(draw: st.DrawFn, *, retryable: bool | None = None) -> Failure:
    return Failure(
        draw(codes),
        draw(st.text(max_size=40)),
        draw(st.booleans()) if retryable is None else retryable,
        delay=draw(st.none() | delays),
        traceback=draw(st.sampled_from(["", "Traceback (most recent call last): ..."])),
    )


def _exhausted(decision: Decision) -> bool:
    return isinstance(decision, Fail) and decision.attempts_exhausted


@given(policies(), attempts, st.randoms(use_true_random=False))
def test_the_backoff_stays_within_half_the_ceiling_and_the_cap(
    policy: RetryPolicy, attempt: int, rng: random.Random
) -> None:
    ceiling = policy.ceiling(attempt)
    assert ceiling == min(policy.max_delay, policy.base_delay * 2.0 ** min(attempt - 1, 1000))
    delay = policy.delay(attempt, rng)
    assert ceiling / 2 <= delay <= ceiling <= policy.max_delay
    # The first retry waits about the base; later ones never less.
    assert delay >= min(policy.base_delay, policy.max_delay) / 2


@given(policies(), attempts, attempts, failures(retryable=True), causes)
def test_a_retryable_failure_is_retried_while_attempts_are_left(
    policy: RetryPolicy, attempt: int, max_attempts: int, failure: Failure, cause: EndCause
) -> None:
    decision = decide(attempt, max_attempts, failure, policy, cause)
    if attempt >= max_attempts:
        # Never past max_attempts: the attempt's own error ends the job now.
        assert isinstance(decision, Fail)
        assert decision.code == failure.code and decision.attempts_exhausted
        return
    assert isinstance(decision, Retry)
    assert (decision.code, decision.message, decision.refund) == (
        failure.code,
        failure.message,
        False,
    )
    if failure.delay is not None:
        assert decision.delay == failure.delay  # asked for by the handler or the worker
    else:
        ceiling = policy.ceiling(attempt)
        assert ceiling / 2 <= decision.delay <= ceiling <= policy.max_delay


@given(policies(), attempts, attempts, failures(retryable=False))
def test_a_failure_that_is_not_retryable_fails_at_once_as_itself(
    policy: RetryPolicy, attempt: int, max_attempts: int, failure: Failure
) -> None:
    decision = decide(attempt, max_attempts, failure, policy)
    assert isinstance(decision, Fail)
    assert (decision.code, decision.message) == (failure.code, failure.message)
    assert not decision.attempts_exhausted
    assert "attempts_exhausted" not in decision.details


@given(policies(), attempts, failures())
def test_the_last_attempts_retryable_failure_fails_with_its_own_code_and_message(
    policy: RetryPolicy, last: int, failure: Failure
) -> None:
    decision = decide(last, last, failure, policy)
    assert isinstance(decision, Fail)
    assert (decision.code, decision.message) == (failure.code, failure.message)
    assert decision.attempts_exhausted is failure.retryable
    assert decision.details.get("traceback", "") == failure.traceback


@given(policies(), attempts, attempts, failures())
def test_a_shutdown_is_refunded_and_runs_again_at_once(
    policy: RetryPolicy, attempt: int, max_attempts: int, failure: Failure
) -> None:
    decision = decide(attempt, max_attempts, failure, policy, EndCause.SHUTDOWN)
    assert decision == Retry(
        failure.code,
        failure.message,
        0.0,
        refund=True,
        details={"traceback": failure.traceback} if failure.traceback else {},
    )


def test_the_traceback_goes_with_a_retry_and_a_failure() -> None:
    failure = Failure("BOOM", "boom", True, traceback="Traceback ...")
    retried = decide(1, 3, failure, RetryPolicy())
    failed = decide(3, 3, failure, RetryPolicy())
    assert retried.details == {"traceback": "Traceback ..."}
    assert failed.details == {"traceback": "Traceback ...", "attempts_exhausted": True}


def test_an_expiry_of_the_last_lease_says_no_attempts_are_left() -> None:
    failure = Failure("LEASE_EXPIRED", "attempt 3 stopped heartbeating", True)
    decision = decide(3, 3, failure, RetryPolicy(), EndCause.LEASE_EXPIRED)
    assert decision == Fail(
        "LEASE_EXPIRED",
        "attempt 3 stopped heartbeating; no attempts left",
        {"attempts_exhausted": True},
    )


TOPOLOGY = parse_topology(
    {
        "queues": [
            {"name": "slow", "retry_base_delay": 400.0, "retry_max_delay": 500.0},
            {"name": "plain"},
        ]
    }
)


@pytest.mark.parametrize(
    ("queue", "override", "expected"),
    [
        ("slow", None, RetryPolicy(400.0, 500.0)),
        ("slow", 0.5, RetryPolicy(0.5, 500.0)),
        ("plain", None, RetryPolicy(1.0, 300.0)),
        # A queue that left the topology: the defaults.
        ("gone", None, RetryPolicy(1.0, 300.0)),
        ("gone", 0.25, RetryPolicy(0.25, 300.0)),
    ],
)
def test_a_queues_policy_is_its_retry_base_and_max_delay(
    queue: str, override: float | None, expected: RetryPolicy
) -> None:
    assert RetryPolicy.of_queue(TOPOLOGY, queue, base_override=override) == expected


class _MemorySweeps(SweepStore):
    """Expired leases held in memory: the sweeper's decisions, recorded, not written."""

    def __init__(self, leases: list[ExpiredLease]) -> None:
        # An engine that is never connected: every statement the sweep makes is faked.
        super().__init__(create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none"))
        self.leases = leases
        self.decided: list[Decision] = []

    async def expire_leases(self, **kwargs: Any) -> LeaseRepair:
        self.decided += [kwargs["decide"](lease) for lease in self.leases]
        self.leases = []
        retried = sum(isinstance(d, Retry) for d in self.decided)
        return LeaseRepair(requeued=retried, failed=len(self.decided) - retried)

    async def republish_unclaimed(self, **kwargs: Any) -> None:
        return None

    async def release_held(self, **kwargs: Any) -> int:
        return 0

    async def settle_dependencies(self, **kwargs: Any) -> int:
        return 0

    async def analyze_grown(self, **kwargs: Any) -> list[str]:
        return []

    async def stuck_outbox(self, **kwargs: Any) -> int:
        return 0

    async def events_behind(self, **kwargs: Any) -> EventsBehind:
        return EventsBehind(0, None)


class _NoDeadlines(DeadlineStore):
    """No job has a deadline: the sweep's deadline pass, faked."""

    def __init__(self) -> None:
        super().__init__(create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none"))

    async def end_due(self, **kwargs: Any) -> list[Any]:
        return []


def _lease(queue: str, attempt: int, max_attempts: int = 3) -> ExpiredLease:
    return ExpiredLease(uuid.uuid4(), attempt + 4, attempt, max_attempts, queue)


@pytest.mark.parametrize("attempt", [1, 2])
async def test_the_sweepers_lease_expiry_backs_off_by_the_queues_policy(attempt: int) -> None:
    sweeper = Sweeper(
        create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none"), topology=TOPOLOGY
    )
    store = _MemorySweeps([_lease("slow", attempt) for _ in range(50)])
    sweeper._store = store
    sweeper.deadlines.store = _NoDeadlines()
    await sweeper.sweep_once()
    assert all(isinstance(d, Retry) for d in store.decided)
    waits = [d.delay for d in store.decided if isinstance(d, Retry)]
    # 400 s, then 800 s capped at 500 s: half of it at least, with jitter.
    ceiling = min(400.0 * 2 ** (attempt - 1), 500.0)
    assert all(ceiling / 2 <= w <= ceiling for w in waits)
    assert len(set(waits)) > 1


def test_an_expired_lease_is_the_attempts_retryable_failure() -> None:
    # By the budget's attempt (a stage's), not the job's: attempt 5 is the stage's 1st.
    retried = lease_expired(_lease("slow", 1), RetryPolicy(400.0, 500.0))
    assert isinstance(retried, Retry) and 200.0 <= retried.delay <= 400.0
    assert (retried.code, retried.message, retried.details) == (
        "LEASE_EXPIRED",
        "attempt 5 stopped heartbeating (its worker died or hung)",
        {},
    )
    assert lease_expired(_lease("slow", 3), RetryPolicy()) == Fail(
        "LEASE_EXPIRED",
        "attempt 7 stopped heartbeating (its worker died or hung); no attempts left",
        {"attempts_exhausted": True},
    )
