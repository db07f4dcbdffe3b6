"""How the worker settles a delivery it claimed or handed back, or whose handling
crashed, was cancelled or left it unsettled, and what it logs.

A fake store answers the claim or the hand-back; a fake delivery records each
ack, nack and reject with its ``requeue``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest

from jobplane.envelope import Envelope
from jobplane.faults import NO_FAULTS
from jobplane.logs import fingerprint
from jobplane.store.attempts import Attempt, ClaimResult, ClaimStatus, HandBack
from jobplane.workers import delivery as delivery_module
from jobplane.workers.bounce import Bounced, BounceFailed
from jobplane.workers.delivery import Deliveries
from jobplane.workers.group import Acks
from jobplane.workers.interceptors import chain
from jobplane.workers.recording import Stopping
from tests.support.attempts import an_attempt
from tests.support.interceptors import Recording
from tests.support.logs import Lines, module_lines


class Message:
    """A delivery: each settling as (how, requeue)."""

    def __init__(self, *, redelivered: bool = False) -> None:
        self.redelivered = redelivered
        self.settled: list[tuple[str, bool | None]] = []
        self.message_id = "m-1"
        self.queue = "q"
        self.headers: dict[str, Any] = {}

    @property
    def processed(self) -> bool:
        """Whether it was settled, as aio-pika's delivery says."""
        return bool(self.settled)

    async def ack(self) -> None:
        self.settled.append(("ack", None))

    async def nack(self, *, requeue: bool = True) -> None:
        self.settled.append(("nack", requeue))

    async def reject(self, *, requeue: bool = False) -> None:
        self.settled.append(("reject", requeue))


class Log:
    """A bound logger: each line as (level, event, fields), with the bound fields."""

    def __init__(self, lines: list[tuple[str, str, dict[str, Any]]] | None = None) -> None:
        self.lines = [] if lines is None else lines
        self.fields: dict[str, Any] = {}

    def bind(self, **fields: Any) -> Log:
        bound = Log(self.lines)
        bound.fields = {**self.fields, **fields}
        return bound

    def _line(self, level: str, event: str, fields: dict[str, Any]) -> None:
        self.lines.append((level, event, {**self.fields, **fields}))

    def info(self, event: str, **fields: Any) -> None:
        self._line("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._line("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._line("error", event, fields)


class Store:
    """Answers each claim with ``claim`` and each hand-back with ``hand_back``
    (an exception is raised)."""

    lease_seconds = 30.0
    groups_claims = False

    def __init__(self, claim: Any = None, hand_back: Any = None) -> None:
        self._claim = claim
        self._hand_back = hand_back
        self.hand_backs: list[tuple[Envelope, float, float]] = []
        self.claimed: list[Envelope] = []

    async def claim(self, envelope: Envelope, *, worker: str) -> ClaimResult:
        self.claimed.append(envelope)
        if isinstance(self._claim, BaseException):
            raise self._claim
        assert isinstance(self._claim, ClaimResult)
        return self._claim

    async def hand_back(
        self, envelope: Envelope, *, base_delay: float, max_delay: float
    ) -> tuple[HandBack, str]:
        self.hand_backs.append((envelope, base_delay, max_delay))
        if isinstance(self._hand_back, BaseException):
            raise self._hand_back
        assert isinstance(self._hand_back, tuple)
        return self._hand_back


ENVELOPE = Envelope(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), "t.job")


def deliveries(store: Store, *, intercept: Any = None, stopping: bool = False) -> Any:
    """The worker's delivery handling over ``store``; its handler runs are recorded in ``ran``."""
    made: Any = Deliveries.__new__(Deliveries)
    made._store, made._faults, made._intercept = store, NO_FAULTS, intercept
    made._stopping, made._claims, made._acks = stopping, None, None
    made._presence = SimpleNamespace(id=uuid.uuid4())
    made._handback_delay, made._handback_max_delay = 2.0, 60.0
    made.ran = []

    async def run(attempt: Attempt, bound: Any) -> None:
        made.ran.append((attempt, bound.fields))
        if made.stop_in_run:
            raise Stopping

    made._run, made.stop_in_run = run, False
    return made


def enveloped_attempt() -> Attempt:
    return an_attempt(
        job_id=ENVELOPE.job_id,
        tenant_id=ENVELOPE.tenant_id,
        type="t.job",
        attempt=2,
        request_id="req-1",
    )


@pytest.mark.parametrize("intercepted", [False, True], ids=["plain", "intercepted"])
async def test_a_redelivery_waiting_on_a_lease_while_stopping_goes_back_to_its_queue(
    intercepted: bool,
) -> None:
    seen = [Recording("a"), Recording("b")]
    store = Store(claim=ClaimResult(ClaimStatus.IN_FLIGHT))
    worker = deliveries(store, intercept=chain(seen) if intercepted else None, stopping=True)
    message, log = Message(redelivered=True), Log()
    await worker._claim_and_run(ENVELOPE, message, log)
    assert message.settled == [("nack", True)]
    assert worker.ran == [] and log.lines == []
    assert store.claimed == [ENVELOPE]
    assert [r.claims for r in seen] == ([[(ENVELOPE, message)]] * 2 if intercepted else [[], []])


async def test_a_claimed_job_runs_then_is_acked_and_a_stopped_run_is_requeued() -> None:
    attempt = enveloped_attempt()
    worker = deliveries(Store(claim=ClaimResult(ClaimStatus.CLAIMED, attempt)))
    message, log = Message(), Log()
    await worker._claim_and_run(ENVELOPE, message, log)
    assert message.settled == [("ack", None)]
    assert worker.ran == [(attempt, {"request_id": fingerprint("req-1")})]
    assert log.lines == [
        (
            "info",
            "job.received",
            {"request_id": fingerprint("req-1"), "attempt": 2, "type": "t.job"},
        )
    ]
    worker.stop_in_run = True
    stopped = Message()
    await worker._claim_and_run(ENVELOPE, stopped, Log())
    assert stopped.settled == [("nack", True)]


@pytest.mark.parametrize("status", [ClaimStatus.FINISHED, ClaimStatus.STALE, ClaimStatus.HELD])
async def test_a_duplicate_delivery_is_acked_without_running(status: ClaimStatus) -> None:
    worker = deliveries(Store(claim=ClaimResult(status)))
    message, log = Message(), Log()
    await worker._claim_and_run(ENVELOPE, message, log)
    assert message.settled == [("ack", None)]
    assert worker.ran == []
    assert log.lines == [("info", "job.message.duplicate", {"status": status.value})]


async def test_a_delivery_of_no_known_job_is_rejected_to_the_dead_letters() -> None:
    worker = deliveries(Store(claim=ClaimResult(ClaimStatus.NOT_FOUND)))
    message, log = Message(), Log()
    await worker._claim_and_run(ENVELOPE, message, log)
    assert message.settled == [("reject", False)]
    assert log.lines == [("error", "job.message.unknown_job", {})]


@pytest.mark.parametrize(
    ("status", "line"),
    [
        (HandBack.PARKED, ("warning", "job.parked", {"type": "t.job", "reason": "NO_WORKER"})),
        (HandBack.HANDED_BACK, ("info", "job.handed_back", {"type": "t.job"})),
        (HandBack.NOT_QUEUED, ("info", "job.message.duplicate", {"status": "not_queued"})),
    ],
    ids=["parked", "handed-back", "not-queued"],
)
async def test_a_job_handed_back_is_acked_and_logged_as_what_became_of_it(
    status: HandBack, line: tuple[str, str, dict[str, Any]]
) -> None:
    store = Store(hand_back=(status, "NO_WORKER"))
    worker = deliveries(store)
    message, log = Message(), Log()
    await worker._hand_back_job(ENVELOPE, message, log)
    assert message.settled == [("ack", None)]
    assert log.lines == [line]
    assert store.hand_backs == [(ENVELOPE, 2.0, 60.0)]


async def test_a_hand_back_of_no_known_job_is_rejected_and_one_while_stopping_requeued() -> None:
    unknown = deliveries(Store(hand_back=(HandBack.NOT_FOUND, "")))
    message, log = Message(), Log()
    await unknown._hand_back_job(ENVELOPE, message, log)
    assert message.settled == [("reject", False)]
    assert log.lines == [("error", "job.message.unknown_job", {})]
    stopping = deliveries(Store(hand_back=Stopping()), stopping=True)
    message, log = Message(), Log()
    await stopping._hand_back_job(ENVELOPE, message, log)
    assert message.settled == [("nack", True)]
    assert log.lines == []


async def test_a_foreign_delivery_goes_back_to_its_queue_even_when_its_bounce_fails(
    monkeypatch: pytest.MonkeyPatch, lines: Lines
) -> None:
    """No such job here and another deployment's: bounced; a bounce the broker did not
    confirm leaves the original unsettled, so it is nacked back to its queue."""
    bounced: list[tuple[Any, Message, str | None, str | None]] = []
    answers: list[tuple[Bounced, int] | BaseException] = [
        (Bounced.REQUEUED, 4),
        BounceFailed("no confirm within 10 s"),
    ]

    async def bounce(
        channel: Any, message: Message, queue: str | None, *, this_deployment: str | None
    ) -> tuple[Bounced, int]:
        bounced.append((channel, message, queue, this_deployment))
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(delivery_module, "bounce_foreign", bounce)
    worker = deliveries(Store(claim=ClaimResult(ClaimStatus.NOT_FOUND)))
    channel = object()
    worker._deployment, worker._bounce_channel = SimpleNamespace(id="ours"), channel
    theirs = replace(ENVELOPE, deployment="theirs")
    requeued, failed, log = Message(), Message(), Log()
    await worker._claim_and_run(theirs, requeued, log)
    await worker._claim_and_run(theirs, failed, log)
    assert bounced == [(channel, requeued, "q", "ours"), (channel, failed, "q", "ours")]
    # The copy went out and bounce_foreign settled the original itself.
    assert requeued.settled == []
    assert failed.settled == [("nack", True)]
    assert worker.bounced == 1
    assert log.lines == [
        ("info", "job.message.bounced", {"owner": "theirs", "this": "ours", "bounces": 4}),
        (
            "warning",
            "job.message.bounce_failed",
            {"error": f"{BounceFailed.__module__}.BounceFailed: no confirm within 10 s"},
        ),
    ]
    assert lines == []  # each settled as it should be: no settle failed


@pytest.fixture
def lines(monkeypatch: pytest.MonkeyPatch) -> Iterator[Lines]:
    with module_lines(monkeypatch, delivery_module, "jobplane.worker") as captured:
        yield captured


def handling(worker: Any, handle: Callable[[Message], Awaitable[None]]) -> Any:
    """``worker`` with ``handle`` as what it does with a delivery."""
    worker._handle = handle
    return worker


@pytest.mark.parametrize("intercepted", [False, True], ids=["plain", "intercepted"])
async def test_a_delivery_its_handling_left_unsettled_is_requeued_and_said_so(
    intercepted: bool, lines: Lines
) -> None:
    seen = [Recording("a")]
    worker = deliveries(Store(), intercept=chain(seen) if intercepted else None)

    async def settles(message: Message) -> None:
        await message.ack()

    async def leaves(message: Message) -> None:
        return None

    acked, left = Message(), Message()
    await handling(worker, settles)._handle_and_nack(acked)
    await handling(worker, leaves)._handle_and_nack(left)
    assert (acked.settled, left.settled) == ([("ack", None)], [("nack", True)])
    assert lines == [{"event": "job.message.unsettled", "log_level": "error", "message_id": "m-1"}]
    if intercepted:
        assert seen[0].seen == ["a.delivered>", "a.<delivered"] * 2


async def test_a_crashed_handling_is_logged_and_its_delivery_requeued_unless_settled(
    lines: Lines,
) -> None:
    bug = RuntimeError("a bug")

    async def crashes(message: Message) -> None:
        raise bug

    async def acks_then_crashes(message: Message) -> None:
        await message.ack()
        raise bug

    crashed, acked = Message(), Message()
    await handling(deliveries(Store()), crashes)._handle_and_nack(crashed)
    await handling(deliveries(Store()), acks_then_crashes)._handle_and_nack(acked)
    assert (crashed.settled, acked.settled) == ([("nack", True)], [("ack", None)])
    line = {
        "event": "job.message.crashed",
        "log_level": "error",
        "message_id": "m-1",
        "error": "RuntimeError: a bug",
        "exc_info": bug,
    }
    assert lines == [line, line]


@pytest.mark.parametrize(
    ("ack_first", "settled"),
    [(False, [("nack", True)]), (True, [("ack", None)])],
    ids=["unsettled", "acked"],
)
async def test_a_cancelled_handling_requeues_its_delivery_unless_settled_and_stays_cancelled(
    ack_first: bool, settled: list[tuple[str, bool | None]], lines: Lines
) -> None:
    started = asyncio.Event()

    async def waits(message: Message) -> None:
        if ack_first:
            await message.ack()
        started.set()
        await asyncio.sleep(60)

    message = Message()
    task = asyncio.create_task(handling(deliveries(Store()), waits)._handle_and_nack(message))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert message.settled == settled
    assert lines == []


async def test_a_handled_delivery_is_forgotten_by_the_ack_groups_and_none_are_needed() -> None:
    """Once its handling ends, a delivery is no longer outstanding on its channel
    (a later multiple ack may reach past it); a worker acking alone has no groups."""

    async def settles(message: Message) -> None:
        await message.ack()

    grouped = handling(deliveries(Store()), settles)
    grouped._acks = Acks()
    message = Message()
    message.delivery_tag, message.channel = 7, object()  # type: ignore[attr-defined]
    grouped._acks.delivered(message)
    await grouped._handle_settled(message)
    assert message.settled == [("ack", None)] and grouped._acks._delivered == {}
    alone, other = handling(deliveries(Store()), settles), Message()
    assert alone._acks is None
    await alone._handle_settled(other)
    assert other.settled == [("ack", None)]


async def test_a_message_that_is_no_envelope_is_rejected_to_the_dead_letters_and_said_so(
    lines: Lines,
) -> None:
    message = Message()
    message.body = b"not json"  # type: ignore[attr-defined]
    await deliveries(Store())._handle(message)
    assert message.settled == [("reject", False)]
    (line,) = lines
    assert (line["event"], line["log_level"], line["message_id"]) == (
        "job.message.rejected",
        "error",
        "m-1",
    )
    assert line["reason"] and set(line) == {"event", "log_level", "message_id", "reason"}
