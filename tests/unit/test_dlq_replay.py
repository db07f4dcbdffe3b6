"""What `jobplane dlq` does with each failed message, over a broker and a store faked
at their seams: which are acked, which stay queued, and how each is reported."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from jobplane import broker
from jobplane.envelope import Envelope
from jobplane.topology import Topology
from jobplane.workers import dlq
from jobplane.workers.dlq import FailedQueue, ReplayReport

TENANT, OTHER = uuid.uuid4(), uuid.uuid4()
#: The engine the caller hands replay, for its store.
ENGINE: Any = object()


@dataclass
class _Message:
    body: bytes
    message_id: str | None
    headers: dict[str, Any] = field(default_factory=dict)
    acked: bool = False

    async def ack(self) -> None:
        self.acked = True


class _Queue:
    def __init__(self, messages: list[_Message]) -> None:
        self.messages = list(messages)
        self.taken: list[_Message] = []

    async def get(self, *, no_ack: bool, fail: bool) -> _Message | None:
        assert (no_ack, fail) == (False, False)
        if not self.messages:
            return None
        message = self.messages.pop(0)
        self.taken.append(message)
        return message

    async def purge(self) -> Any:
        count, self.messages = len(self.messages), []
        return type("Purged", (), {"message_count": count})()


class _Broker:
    """One connection, one channel, the failed queue; what was asked of each."""

    def __init__(self, messages: list[_Message]) -> None:
        self.queue = _Queue(messages)
        self.urls: list[str] = []
        self.queues: list[str] = []
        self.declared: list[Topology] = []
        self.channel_closed = self.connection_closed = False

    async def connect(self, url: str) -> _Broker:
        self.urls.append(url)
        return self

    async def __aenter__(self) -> _Broker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.connection_closed = True

    async def channel(self) -> _Broker:
        return self

    async def get_queue(self, name: str) -> _Queue:
        self.queues.append(name)
        return self.queue

    async def close(self) -> None:
        """The channel's close puts back every message taken and not acked."""
        self.channel_closed = True
        queue = self.queue
        queue.messages = [m for m in queue.taken if not m.acked] + queue.messages
        queue.taken = []


class _Store:
    """Jobs of TENANT by id: re-dispatched (True), their state, whether they wait for others."""

    def __init__(self, jobs: dict[uuid.UUID, tuple[bool, str, bool]]) -> None:
        self.jobs = jobs
        self.redispatched: list[tuple[uuid.UUID, uuid.UUID, str]] = []

    def _job(self, tenant: uuid.UUID, job: uuid.UUID) -> tuple[bool, str, bool]:
        assert tenant == TENANT
        return self.jobs[job]

    async def redispatch(self, tenant: uuid.UUID, job: uuid.UUID, reason: str) -> object | None:
        self.redispatched.append((tenant, job, reason))
        return object() if self._job(tenant, job)[0] else None

    async def state_of(self, tenant: uuid.UUID, job: uuid.UUID) -> str:
        return self._job(tenant, job)[1]

    async def waits_for_jobs(self, tenant: uuid.UUID, job: uuid.UUID) -> bool:
        return self._job(tenant, job)[2]


def _message(job: uuid.UUID, tenant: uuid.UUID = TENANT) -> _Message:
    envelope = Envelope(uuid.uuid4(), job, tenant, "demo.echo")
    return _Message(envelope.encode(), str(envelope.event_id))


@pytest.fixture
def topology() -> Topology:
    return Topology().prefixed("t1.")


def _faked(monkeypatch: pytest.MonkeyPatch, messages: list[_Message], store: _Store) -> _Broker:
    fake = _Broker(messages)
    monkeypatch.setattr(broker, "connect", fake.connect)

    async def declare(channel: object, topology: Topology) -> None:
        assert channel is fake
        fake.declared.append(topology)

    monkeypatch.setattr(dlq, "declare", declare)

    def store_of(engine: object) -> _Store:
        assert engine is ENGINE
        return store

    monkeypatch.setattr(dlq, "SweepStore", store_of)
    return fake


async def test_replay_acks_what_it_dispatched_or_what_is_stale_and_keeps_the_rest(
    monkeypatch: pytest.MonkeyPatch, topology: Topology
) -> None:
    jobs = {
        "again": (True, "queued", False),
        "succeeded": (False, "succeeded", False),
        "failed": (False, "failed", False),
        "cancelled": (False, "cancelled", False),
        "waiting": (False, "waiting", True),
        "running": (False, "running", False),
    }
    ids = {name: uuid.uuid4() for name in jobs}
    store = _Store({ids[name]: fate for name, fate in jobs.items()})
    messages = [_message(ids[name]) for name in jobs]
    messages += [_Message(b"not an envelope", None), _Message(b"{}", "m-9")]
    fake = _faked(monkeypatch, messages, store)

    report = await FailedQueue("amqp://failed", topology).replay(ENGINE)

    name = {key: f"jobs/{job}" for key, job in ids.items()}
    assert report == ReplayReport(
        replayed=[name["again"]],
        finished=[name["succeeded"], name["failed"], name["cancelled"]],
        waiting=[name["waiting"]],
        kept=[name["running"], "(no id)", "m-9"],
    )
    assert [m.acked for m in messages] == [True] * 5 + [False] * 3
    assert store.redispatched == [
        (TENANT, ids[key], "re-dispatched from the failed queue") for key in jobs
    ]
    assert (fake.urls, fake.queues, fake.declared) == (
        ["amqp://failed"],
        ["t1.jobplane.failed"],
        [topology],
    )
    # Closing the channel puts back what was not acked.
    assert fake.channel_closed and fake.connection_closed


async def test_replay_for_a_tenant_leaves_every_other_message_unreported(
    monkeypatch: pytest.MonkeyPatch, topology: Topology
) -> None:
    mine, listed, theirs = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    store = _Store({job: (True, "queued", False) for job in (mine, listed, theirs)})
    messages = [
        _Message(b"not an envelope", "m-0"),
        _message(theirs, tenant=OTHER),
        _message(mine),
        _message(listed),
    ]
    _faked(monkeypatch, messages, store)
    queue = FailedQueue("amqp://failed", topology)

    report = await queue.replay(ENGINE, tenant=TENANT, jobs=frozenset({listed}))
    assert report == ReplayReport(replayed=[f"jobs/{listed}"])
    assert [m.acked for m in messages] == [False, False, False, True]

    report = await queue.replay(ENGINE, tenant=TENANT)
    assert report == ReplayReport(replayed=[f"jobs/{mine}"])
    assert [m.acked for m in messages] == [False, False, True, True]


async def test_replay_and_list_take_at_most_their_limit(
    monkeypatch: pytest.MonkeyPatch, topology: Topology
) -> None:
    jobs = [uuid.uuid4() for _ in range(4)]
    store = _Store({job: (False, "running", False) for job in jobs})
    fake = _faked(monkeypatch, [_message(job) for job in jobs], store)
    queue = FailedQueue("amqp://failed", topology)

    report = await queue.replay(ENGINE, limit=2)
    assert report.kept == [f"jobs/{job}" for job in jobs[:2]]
    listed = await queue.list(limit=3)
    assert [m.as_dict()["job"] for m in listed] == [f"jobs/{job}" for job in jobs[:3]]
    assert len(fake.queue.messages) == 4  # kept, and back in the queue
    assert fake.channel_closed and fake.queues == ["t1.jobplane.failed"] * 2


async def test_list_describes_each_message_and_leaves_them_queued(
    monkeypatch: pytest.MonkeyPatch, topology: Topology
) -> None:
    job = uuid.uuid4()
    messages = [_message(job), _Message(b"[]", None)]
    messages[0].headers = {"x-death": [{"reason": "delivery_limit", "queue": "jobs", "count": 3}]}
    fake = _faked(monkeypatch, messages, _Store({}))

    listed = await FailedQueue("amqp://failed", topology).list()

    assert [m.as_dict() for m in listed] == [
        {
            "message_id": messages[0].message_id,
            "reason": "delivery_limit",
            "source_queue": "jobs",
            "deaths": 3,
            "job": f"jobs/{job}",
            "tenant_id": str(TENANT),
            "type": "demo.echo",
            "problem": "",
        },
        {
            "message_id": "",
            "reason": "",
            "source_queue": "",
            "deaths": 1,
            "job": None,
            "tenant_id": None,
            "type": None,
            "problem": listed[1].problem,
        },
    ]
    assert listed[1].problem.startswith("not a dispatch envelope: ")
    assert not any(m.acked for m in messages)
    assert fake.channel_closed and fake.declared == [topology]
    assert fake.urls == ["amqp://failed"]


async def test_purge_says_how_many_messages_it_dropped(
    monkeypatch: pytest.MonkeyPatch, topology: Topology
) -> None:
    fake = _faked(monkeypatch, [_message(uuid.uuid4()) for _ in range(3)], _Store({}))
    assert await FailedQueue("amqp://failed", topology).purge() == 3
    assert fake.queue.messages == [] and fake.queues == ["t1.jobplane.failed"]
    assert fake.declared == [topology] and fake.urls == ["amqp://failed"]


async def test_by_default_list_and_replay_take_a_hundred_messages(
    monkeypatch: pytest.MonkeyPatch, topology: Topology
) -> None:
    jobs = [uuid.uuid4() for _ in range(101)]
    store = _Store({job: (False, "running", False) for job in jobs})
    _faked(monkeypatch, [_message(job) for job in jobs], store)
    queue = FailedQueue("amqp://failed", topology)
    assert len(await queue.list()) == 100
    assert len((await queue.replay(ENGINE)).kept) == 100
