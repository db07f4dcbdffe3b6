"""Several AMQP addresses: the setting's form, and which address a process tries next."""

from __future__ import annotations

import re
from typing import Any

import aio_pika
import aiormq
import pytest

from jobplane import broker
from jobplane.broker_addresses import Failover, describe, failover_of, split_addresses
from jobplane.config import ConfigError, Settings

A = "amqp://app:s3cret@mq1:5672/prod"
B = "amqp://app:s3cret@mq2:5672/prod"
C = "amqps://app:s3cret@mq3:5671/prod"


def test_one_address_or_several_separated_by_commas() -> None:
    assert split_addresses(A) == (A,)
    assert split_addresses(f" {A} , {B},{C} ,") == (A, B, C)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("", "names no address"),
        (" , ", "names no address"),
        ("http://app:s3cret@mq1/prod", "the address must be an amqp:// or amqps:// URL"),
        (f"{A},mq2:5672", "address 2 of 2 must be an amqp:// or amqps:// URL"),
        (f"{A},amqp://app:s3cret@:5672/prod", "address 2 of 2 names no host"),
        ("amqp://app:s3cret@mq1:99999/prod", "the address has a bad port"),
        (f"{A},amqp://app:s3cret@mq2:5672/other", "different vhosts"),
        (f"{A},amqp://app:s3cret@mq2:5672/", "different vhosts"),
        (f"{A},{A}", "names one address twice"),
    ],
)
def test_a_bad_setting_is_refused_without_quoting_its_password(value: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)) as refused:
        split_addresses(value)
    assert "s3cret" not in str(refused.value)


def test_the_default_vhost_is_the_same_however_it_is_written() -> None:
    assert split_addresses("amqp://mq1/,amqp://mq2,amqp://mq3/%2F") == (
        "amqp://mq1/",
        "amqp://mq2",
        "amqp://mq3/%2F",
    )


def test_the_settings_refuse_a_bad_amqp_url_as_a_config_error() -> None:
    with pytest.raises(ConfigError) as refused:
        Settings.from_env({"JOBPLANE_AMQP_URL": f"{A},amqp://app:s3cret@mq2/other"})
    assert str(refused.value).startswith("JOBPLANE_AMQP_URL: ")
    assert "s3cret" not in str(refused.value)
    settings = Settings.from_env({"JOBPLANE_AMQP_URL": f"{A},{B}"})
    assert settings.amqp_url == f"{A},{B}"


def test_describe_hides_every_password() -> None:
    assert describe(f"{A},amqp://mq2/prod") == "amqp://app:***@mq1:5672/prod,amqp://mq2/prod"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_failover_tries_the_configured_order_first() -> None:
    failover = Failover((A, B, C), clock=Clock())
    assert failover.order() == [A, B, C]
    assert failover.failing() == []


def test_an_address_that_failed_lately_is_tried_last_until_its_hold_ends() -> None:
    clock = Clock()
    failover = Failover((A, B, C), hold=30.0, clock=clock)
    failover.failed(A)
    assert failover.order() == [B, C, A]
    assert failover.failing() == [A]
    clock.now = 29.9
    assert failover.order() == [B, C, A]
    clock.now = 30.0
    assert failover.order() == [A, B, C]


def test_when_all_failed_the_longest_failed_comes_first() -> None:
    clock = Clock()
    failover = Failover((A, B, C), clock=clock)
    for address in (B, A, C):
        failover.failed(address)
        clock.now += 1
    assert failover.order() == [B, A, C]
    failover.failed(B)  # tried again and still down: now the freshest failure
    assert failover.order() == [A, C, B]


def test_a_success_forgets_the_failure() -> None:
    failover = Failover((A, B), clock=Clock())
    failover.failed(A)
    failover.succeeded(A)
    assert failover.order() == [A, B]


def test_one_failover_per_setting_per_process() -> None:
    value = "amqp://guest:guest@failover-of-test:5672/x,amqp://guest:guest@other:5672/x"
    assert failover_of(value) is failover_of(value)
    assert failover_of(value).addresses == tuple(value.split(","))


class Opened:
    """What _connect_one returns in these tests: a connection with close callbacks."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.close_callbacks: aio_pika.tools.CallbackCollection[Any, Any] = (
            aio_pika.tools.CallbackCollection(self)
        )
        self.close_called = False


def _fake_connect(
    monkeypatch: pytest.MonkeyPatch, answers: dict[str, BaseException | None]
) -> list[str]:
    tried: list[str] = []

    async def connect_one(address: str, timeout: float) -> Any:
        tried.append(address)
        error = answers[address]
        if error is not None:
            raise error
        return Opened(address)

    monkeypatch.setattr(broker, "_connect_one", connect_one)
    return tried


async def test_connect_passes_over_an_address_that_is_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, c = (f"amqp://guest:guest@pass-over-{n}:5672/v" for n in "abc")
    tried = _fake_connect(
        monkeypatch, {a: ConnectionRefusedError(111, "refused"), b: None, c: None}
    )
    connection: Any = await broker.connect(f"{a},{b},{c}")
    assert connection.address == b
    assert tried == [a, b]
    # The next connection of this process tries the live one first.
    tried.clear()
    await broker.connect(f"{a},{b},{c}")
    assert tried == [b]
    assert failover_of(f"{a},{b},{c}").order() == [b, c, a]


async def test_connect_raises_a_refusal_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = (f"amqp://guest:guest@refusal-{n}:5672/v" for n in "ab")
    refusal = aiormq.exceptions.ProbableAuthenticationError("ACCESS_REFUSED")
    tried = _fake_connect(monkeypatch, {a: refusal, b: None})
    with pytest.raises(aiormq.exceptions.ProbableAuthenticationError):
        await broker.connect(f"{a},{b}")
    assert tried == [a]  # the cluster's users are the same on every node


async def test_connect_raises_the_last_error_when_every_address_is_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = (f"amqp://guest:guest@all-down-{n}:5672/v" for n in "ab")
    last = TimeoutError("b")
    tried = _fake_connect(monkeypatch, {a: ConnectionRefusedError(111, "a"), b: last})
    with pytest.raises(TimeoutError) as raised:
        await broker.connect(f"{a},{b}")
    assert raised.value is last
    assert tried == [a, b]
    assert failover_of(f"{a},{b}").failing() == [a, b]


async def test_a_connection_lost_marks_its_address_and_one_closed_by_us_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = (f"amqp://guest:guest@lost-{n}:5672/v" for n in "ab")
    _fake_connect(monkeypatch, {a: None, b: None})
    failover = failover_of(f"{a},{b}")
    connection: Any = await broker.connect(f"{a},{b}")
    connection.close_called = True
    await connection.close_callbacks(None)
    assert failover.order() == [a, b]
    connection = await broker.connect(f"{a},{b}")
    await connection.close_callbacks(ConnectionResetError())
    assert failover.order() == [b, a]


def test_the_robust_connection_replaces_aio_pikas_connection_attempt() -> None:
    # FailoverConnection hooks aio-pika's private attempt method; an aio-pika
    # without it would reconnect to one address only: say so here.
    name = "_RobustConnection__connect_transport"
    assert callable(getattr(aio_pika.RobustConnection, name))
    assert getattr(broker.FailoverConnection, name) is broker.FailoverConnection._attempt


def test_a_classic_queue_whose_node_is_down_is_told_from_a_missing_one() -> None:
    down = aiormq.exceptions.ChannelNotFoundEntity(
        "NOT_FOUND - home node 'jp1@localhost' of durable queue 'jobplane.jobs.owner' in "
        "vhost 'prod' is down or inaccessible"
    )
    missing = aiormq.exceptions.ChannelNotFoundEntity("NOT_FOUND - no queue 'q' in vhost 'prod'")
    assert broker.home_node_down(down)
    assert not broker.home_node_down(missing)
    assert not broker.home_node_down(ConnectionResetError("is down or inaccessible"))


def _fake_attempts(
    monkeypatch: pytest.MonkeyPatch, answers: dict[str, BaseException | None]
) -> list[str]:
    """aio-pika's attempt replaced: each address answers as ``answers`` says."""
    tried: list[str] = []

    async def attempt(connection: broker.FailoverConnection) -> None:
        tried.append(connection.address)
        assert str(connection.url) == connection.address
        error = answers[connection.address]
        if error is not None:
            raise error

    monkeypatch.setattr(broker, "_ROBUST_ATTEMPT", attempt)
    return tried


async def test_a_robust_attempt_goes_through_the_addresses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b, c = (f"amqp://guest:guest@robust-{n}:5672/v" for n in "abc")
    tried = _fake_attempts(monkeypatch, {a: ConnectionRefusedError(111, "a"), b: None, c: None})
    connection = broker.FailoverConnection(failover_of(f"{a},{b},{c}"))
    try:
        await connection._attempt()
        assert tried == [a, b]
        assert connection.address == b
        # Lost while connected: the next attempt tries the others first.
        connection.failover.failed(b)
        tried.clear()
        await connection._attempt()
        assert tried == [c]
        assert connection.failover.order() == [c, a, b]
    finally:
        await connection.close()  # not left to the garbage collector's close()


async def test_a_robust_attempt_raises_a_refusal_at_once_and_the_last_outage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = (f"amqp://guest:guest@robust-refused-{n}:5672/v" for n in "ab")
    refusal = aiormq.exceptions.ProbableAuthenticationError("ACCESS_REFUSED")
    tried = _fake_attempts(monkeypatch, {a: refusal, b: None})
    connection = broker.FailoverConnection(failover_of(f"{a},{b}"))
    with pytest.raises(aiormq.exceptions.ProbableAuthenticationError):
        await connection._attempt()
    await connection.close()
    assert tried == [a]

    c, d = (f"amqp://guest:guest@robust-down-{n}:5672/v" for n in "cd")
    last = TimeoutError("d")
    tried = _fake_attempts(monkeypatch, {c: ConnectionRefusedError(111, "c"), d: last})
    connection = broker.FailoverConnection(failover_of(f"{c},{d}"))
    with pytest.raises(TimeoutError) as raised:
        await connection._attempt()
    await connection.close()
    assert raised.value is last
    assert tried == [c, d]
    assert connection.failover.failing() == [c, d]
