"""The client SDK without a server: error mapping, watch resume rules, sync bridge, CLI."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2

from jobplane.client import (
    AsyncClient,
    Client,
    EventType,
    Job,
    JobError,
    JobEvent,
    JobNotFound,
    JobplaneError,
    JobState,
    PayloadTooLarge,
    ProgressTracker,
    RetryPolicy,
    Stage,
    StageState,
    TenantLimitExceeded,
    Unavailable,
    WatchSequenceError,
    cli,
)
from jobplane.client._cli_render import state_text
from jobplane.client._errors import error_from_rpc, is_retryable, is_transient
from jobplane.client._retry import Backoff, EventCursor
from jobplane.convert import event_to_pb
from jobplane.errors import InvalidArgument
from jobplane.v1 import jobs_pb2
from tests.support.jobs import stored_job
from tests.support.rpc_errors import error_info, rpc_error, tenant_limit, unavailable

NOW = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
FAST = RetryPolicy(initial_delay=0.001, max_delay=0.01, max_elapsed=0.3, jitter=0)


def event(seq: int, kind: EventType = EventType.PROGRESS, **kw: Any) -> JobEvent:
    state = {
        EventType.QUEUED: JobState.QUEUED,
        EventType.SUCCEEDED: JobState.SUCCEEDED,
        EventType.FAILED: JobState.FAILED,
    }.get(kind, JobState.RUNNING)
    fields: dict[str, Any] = {
        "name": "jobs/1",
        "seq": seq,
        "type": kind,
        "state": state,
        "progress": seq / 10,
        "message": f"step {seq}",
        "event_time": NOW,
        "attempt": 1,
    }
    fields.update(kw)
    return JobEvent(**fields)


def job(state: JobState = JobState.SUCCEEDED, last_seq: int = 5) -> Job:
    return stored_job(
        "jobs/1",
        type="demo.progress",
        state=state,
        payload={"steps": 5},
        result={"ok": True} if state is JobState.SUCCEEDED else None,
        progress=1.0,
        attempt=1,
        request_id="r-1",
        labels={"team": "a"},
        create_time=NOW,
        update_time=NOW,
        last_seq=last_seq,
    )


# -- error mapping -------------------------------------------------------------


def test_reason_picks_the_class_and_keeps_field_and_metadata() -> None:
    original = rpc_error(
        grpc.StatusCode.NOT_FOUND,
        "no job jobs/9",
        error_info("JOB_NOT_FOUND", field="name", tenant="t1"),
    )
    error = error_from_rpc(original)
    assert type(error) is JobNotFound
    assert error.message == "no job jobs/9"
    assert error.field == "name"
    assert error.metadata == {"tenant": "t1"}
    assert error.__cause__ is original


def test_reason_wins_over_code_for_subclasses() -> None:
    error = error_from_rpc(
        rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "too big", error_info("PAYLOAD_TOO_LARGE"))
    )
    assert type(error) is PayloadTooLarge


def test_field_from_bad_request_violation() -> None:
    violation = error_details_pb2.BadRequest.FieldViolation(field="labels[x]", description="bad")
    error = error_from_rpc(
        rpc_error(
            grpc.StatusCode.INVALID_ARGUMENT,
            "bad label",
            error_info("INVALID_ARGUMENT"),
            error_details_pb2.BadRequest(field_violations=[violation]),
        )
    )
    assert type(error) is InvalidArgument
    assert error.field == "labels[x]"


def test_foreign_domain_falls_back_to_the_code() -> None:
    error = error_from_rpc(
        rpc_error(
            grpc.StatusCode.NOT_FOUND, "nope", error_info("JOB_TERMINAL", domain="example.com")
        )
    )
    assert type(error) is JobNotFound


def test_plain_status_maps_by_code() -> None:
    error = error_from_rpc(rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    assert type(error) is Unavailable
    assert error.message == "Socket closed"


def test_unmapped_code_keeps_its_name_as_reason() -> None:
    error = error_from_rpc(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    assert type(error) is JobplaneError
    assert error.reason == "DEADLINE_EXCEEDED"
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unknown_reason_of_our_domain_is_kept() -> None:
    error = error_from_rpc(
        rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down", error_info("QUOTA_EXCEEDED"))
    )
    assert type(error) is JobplaneError
    assert error.reason == "QUOTA_EXCEEDED"


def test_details_are_read_when_message_was_rewritten() -> None:
    error = error_from_rpc(
        rpc_error(
            grpc.StatusCode.NOT_FOUND,
            "no job jobs/9",
            error_info("JOB_NOT_FOUND"),
            wire_message="rewritten by a proxy",
        )
    )
    assert type(error) is JobNotFound
    assert error.message == "no job jobs/9"


def test_corrupt_details_fall_back_to_the_code() -> None:
    trailing = grpc.aio.Metadata(("grpc-status-details-bin", b"\xff\xff\xff"))
    original = grpc.aio.AioRpcError(
        grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), trailing, details="gone"
    )
    assert type(error_from_rpc(original)) is JobNotFound


@pytest.mark.parametrize(
    ("code", "details", "transient"),
    [
        (grpc.StatusCode.UNAVAILABLE, "Cancelling all calls", True),
        (grpc.StatusCode.CANCELLED, "Stream removed (Socket closed)", True),
        (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2", True),
        (grpc.StatusCode.UNKNOWN, "Connection reset by peer", True),
        (grpc.StatusCode.CANCELLED, "Cancelled", False),
        (grpc.StatusCode.NOT_FOUND, "connection", False),
        (grpc.StatusCode.INVALID_ARGUMENT, "bad", False),
    ],
)
def test_transient_errors(code: grpc.StatusCode, details: str, transient: bool) -> None:
    assert is_transient(rpc_error(code, details)) is transient


def test_server_internal_error_is_not_transient() -> None:
    error = rpc_error(grpc.StatusCode.INTERNAL, "connection pool broke", error_info("INTERNAL"))
    assert not is_transient(error)


def test_status_codes_line_up_with_google_rpc() -> None:
    assert grpc.StatusCode.NOT_FOUND.value[0] == code_pb2.NOT_FOUND


# -- resume rules --------------------------------------------------------------


def test_cursor_yields_in_order_and_drops_repeats() -> None:
    cursor = EventCursor(0)
    assert [cursor.accept(s, terminal=False) for s in (1, 2, 2, 1, 3)] == [
        True,
        True,
        False,
        False,
        True,
    ]
    assert cursor.last == 3
    assert not cursor.at_terminal
    assert cursor.accept(4, terminal=True)
    assert cursor.at_terminal


def test_cursor_starts_after_after_seq() -> None:
    cursor = EventCursor(7)
    assert not cursor.accept(7, terminal=False)
    assert cursor.accept(8, terminal=False)


def test_cursor_raises_on_a_gap() -> None:
    cursor = EventCursor(2)
    with pytest.raises(WatchSequenceError) as info:
        cursor.accept(5, terminal=False)
    assert info.value.metadata == {"last_seq": "2", "seq": "5"}
    assert cursor.last == 2


def test_cursor_rejects_negative_after_seq() -> None:
    with pytest.raises(ValueError, match="negative"):
        EventCursor(-1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_up_to_the_cap_then_gives_up() -> None:
    clock = FakeClock()
    policy = RetryPolicy(initial_delay=0.05, max_delay=0.4, max_elapsed=1.0, jitter=0)
    backoff = Backoff(policy, clock=clock)
    delays = []
    while (delay := backoff.failure()) is not None:
        delays.append(delay)
        clock.now += delay
    assert delays == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.25])
    assert clock.now == pytest.approx(101.0)


def test_backoff_reset_starts_a_new_run() -> None:
    clock = FakeClock()
    backoff = Backoff(RetryPolicy(max_elapsed=1.0, jitter=0), clock=clock)
    assert backoff.failure() == pytest.approx(0.05)
    assert backoff.failing
    clock.now += 0.9
    backoff.reset()
    assert not backoff.failing
    clock.now += 0.9
    assert backoff.failure() == pytest.approx(0.05)


def test_backoff_without_limit_and_with_jitter() -> None:
    clock = FakeClock()
    policy = RetryPolicy(initial_delay=1.0, max_delay=1.0, max_elapsed=None, jitter=0.5)
    backoff = Backoff(policy, clock=clock, rand=lambda: 1.0)
    clock.now += 1e9
    assert backoff.failure() == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_delay": 0},
        {"initial_delay": 2.0, "max_delay": 1.0},
        {"multiplier": 0.5},
        {"max_elapsed": -1},
        {"jitter": 1.0},
    ],
)
def test_retry_policy_validates(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        RetryPolicy(**kwargs)


# -- AsyncClient.watch over scripted streams ------------------------------------


class FakeCall:
    """Stands in for a grpc UnaryStreamCall: messages, then an error or OK."""

    def __init__(self, events: Iterable[JobEvent], error: BaseException | None = None) -> None:
        self._messages = [event_to_pb(e) for e in events]
        self._error = error
        self.cancelled = False

    def __aiter__(self) -> AsyncIterator[jobs_pb2.WatchJobResponse]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[jobs_pb2.WatchJobResponse]:
        for message in self._messages:
            yield message
        if self._error is not None:
            raise self._error

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class Script:
    """The streams successive WatchJob calls get, and the after_seq each asked for."""

    def __init__(self, *calls: FakeCall) -> None:
        self.calls = list(calls)
        self.after_seqs: list[int] = []
        self.opened: list[FakeCall] = []

    def __call__(self, name: str, after_seq: int) -> FakeCall:
        assert name == "jobs/1"
        self.after_seqs.append(after_seq)
        call = self.calls.pop(0) if self.calls else FakeCall([], unavailable())
        self.opened.append(call)
        return call


def scripted(monkeypatch: pytest.MonkeyPatch, script: Script, **kwargs: Any) -> AsyncClient:
    client = AsyncClient("127.0.0.1:1", "key", watch_retry=kwargs.pop("policy", FAST), **kwargs)
    monkeypatch.setattr(client, "_open_watch", script)
    return client


async def collect(events: AsyncGenerator[JobEvent, None]) -> list[int]:
    return [e.seq async for e in events]


async def drain(events: AsyncGenerator[JobEvent, None], seen: list[int]) -> None:
    async for e in events:
        seen.append(e.seq)


async def test_watch_resumes_after_last_yielded_seq(monkeypatch: pytest.MonkeyPatch) -> None:
    script = Script(
        FakeCall([event(1, EventType.QUEUED), event(2), event(3)], unavailable()),
        FakeCall([], unavailable()),
        FakeCall([event(2), event(3), event(4), event(5, EventType.SUCCEEDED)]),
    )
    client = scripted(monkeypatch, script)
    assert await collect(client.watch("jobs/1")) == [1, 2, 3, 4, 5]
    assert script.after_seqs == [0, 3, 3]
    assert all(call.cancelled for call in script.opened)


async def test_watch_accepts_a_job_and_after_seq(monkeypatch: pytest.MonkeyPatch) -> None:
    script = Script(FakeCall([event(4), event(5, EventType.SUCCEEDED)]))
    client = scripted(monkeypatch, script)
    assert await collect(client.watch(job(JobState.RUNNING, 3), after_seq=3)) == [4, 5]


async def test_watch_follows_the_stream_past_a_terminal_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A retried job: FAILED, then a new attempt that succeeds, in one stream.
    script = Script(
        FakeCall(
            [event(1, EventType.FAILED), event(2, EventType.QUEUED), event(3, EventType.SUCCEEDED)]
        )
    )
    client = scripted(monkeypatch, script)
    assert await collect(client.watch("jobs/1")) == [1, 2, 3]


async def test_watch_raises_on_a_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    client = scripted(monkeypatch, Script(FakeCall([event(1), event(3)])))
    seen: list[int] = []
    with pytest.raises(WatchSequenceError):
        await drain(client.watch("jobs/1"), seen)
    assert seen == [1]


async def test_watch_raises_refusals_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    refusal = rpc_error(grpc.StatusCode.NOT_FOUND, "no job", error_info("JOB_NOT_FOUND"))
    script = Script(FakeCall([], refusal))
    client = scripted(monkeypatch, script)
    with pytest.raises(JobNotFound) as info:
        await collect(client.watch("jobs/1"))
    assert info.value.__cause__ is refusal
    assert script.after_seqs == [0]


async def test_watch_gives_up_after_max_elapsed(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = RetryPolicy(initial_delay=0.001, max_delay=0.005, max_elapsed=0.05, jitter=0)
    script = Script(FakeCall([event(1)], unavailable()))
    client = scripted(monkeypatch, script, policy=policy)
    seen: list[int] = []
    with pytest.raises(Unavailable, match="after seq 1") as info:
        await drain(client.watch("jobs/1"), seen)
    assert seen == [1]
    assert isinstance(info.value.__cause__, grpc.aio.AioRpcError)
    assert len(script.after_seqs) > 2
    assert set(script.after_seqs[1:]) == {1}


async def test_watch_waits_out_a_tenant_stream_limit_and_resumes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The server went away; the one the watch reconnects to is at the
    # tenant's stream limit (its watchers came too) until a slot frees.
    script = Script(
        FakeCall([event(1, EventType.QUEUED), event(2)], unavailable()),
        FakeCall([], tenant_limit(0.02)),
        FakeCall([], tenant_limit(0.02)),
        FakeCall([event(3), event(4, EventType.SUCCEEDED)]),
    )
    client = scripted(monkeypatch, script)
    assert await collect(client.watch("jobs/1")) == [1, 2, 3, 4]
    assert script.after_seqs == [0, 2, 2, 2]

    # wait() follows the same watch.
    script = Script(FakeCall([], tenant_limit(0.02)), FakeCall([event(2, EventType.SUCCEEDED)]))
    client = scripted(monkeypatch, script)
    states = iter([job(JobState.RUNNING, last_seq=1), job(JobState.SUCCEEDED, last_seq=2)])

    async def get(name: str | Job, **_options: bool) -> Job:
        return next(states)

    monkeypatch.setattr(client, "get", get)
    assert (await client.wait("jobs/1")).state is JobState.SUCCEEDED
    assert script.after_seqs == [1, 1]


async def test_watch_raises_the_tenant_limit_once_its_budget_is_spent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = RetryPolicy(initial_delay=0.001, max_delay=0.002, max_elapsed=0.5, jitter=0)
    script = Script(*(FakeCall([], tenant_limit(0.05)) for _ in range(1000)))
    client = scripted(monkeypatch, script, policy=policy)
    with pytest.raises(TenantLimitExceeded) as info:
        await collect(client.watch("jobs/1"))
    assert info.value.retry_delay == pytest.approx(0.05)
    assert info.value.limit == "watch_streams"
    # It asked again, each time after the server's delay, not the backoff's
    # 2 ms: 0.5 s holds at most ten of them.
    assert 2 <= len(script.after_seqs) <= 11

    # A delay longer than the whole budget is raised at once.
    script = Script(FakeCall([], tenant_limit(5.0)))
    client = scripted(monkeypatch, script, policy=policy)
    with pytest.raises(TenantLimitExceeded) as info:
        await collect(client.watch("jobs/1"))
    assert info.value.retry_delay == pytest.approx(5.0)
    assert script.after_seqs == [0]


async def test_watch_ends_when_the_job_ended_before_after_seq(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script = Script(FakeCall([]))
    client = scripted(monkeypatch, script)

    async def get(name: str | Job, **_options: bool) -> Job:
        return job(JobState.SUCCEEDED, last_seq=5)

    monkeypatch.setattr(client, "get", get)
    assert await collect(client.watch("jobs/1", after_seq=5)) == []
    assert script.after_seqs == [5]


async def test_watch_resumes_a_stream_that_ended_early(monkeypatch: pytest.MonkeyPatch) -> None:
    script = Script(FakeCall([event(1)]), FakeCall([event(2, EventType.SUCCEEDED)]))
    client = scripted(monkeypatch, script)

    async def get(name: str | Job, **_options: bool) -> Job:
        return job(JobState.RUNNING, last_seq=1)

    monkeypatch.setattr(client, "get", get)
    assert await collect(client.watch("jobs/1")) == [1, 2]
    assert script.after_seqs == [0, 1]


async def test_closing_the_watch_cancels_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    script = Script(FakeCall([event(1), event(2)]))
    client = scripted(monkeypatch, script)
    events = client.watch("jobs/1")
    assert (await anext(events)).seq == 1
    await events.aclose()
    assert script.opened[0].cancelled


async def test_wait_returns_a_finished_job_without_watching(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script = Script()
    client = scripted(monkeypatch, script)

    async def get(name: str | Job, **_options: bool) -> Job:
        return job(JobState.FAILED, last_seq=4)

    monkeypatch.setattr(client, "get", get)
    assert (await client.wait("jobs/1")).state is JobState.FAILED
    assert script.after_seqs == []


async def test_wait_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = RetryPolicy(initial_delay=0.01, max_delay=0.01, max_elapsed=None, jitter=0)
    client = scripted(monkeypatch, Script(), policy=policy)

    async def get(name: str | Job, **_options: bool) -> Job:
        return job(JobState.RUNNING, last_seq=1)

    monkeypatch.setattr(client, "get", get)
    with pytest.raises(TimeoutError):
        await client.wait("jobs/1", timeout=0.05)


def test_from_env_reads_address_and_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOBPLANE_ADDRESS", "example:1234")
    monkeypatch.setenv("JOBPLANE_API_KEY", "k1")
    client = AsyncClient.from_env()
    assert (client.address, client.api_key) == ("example:1234", "k1")
    assert "k1" not in repr(client)
    override = Client.from_env(address="other:1", api_key="k2")
    assert (override.address, override.api_key) == ("other:1", "k2")
    monkeypatch.delenv("JOBPLANE_ADDRESS")
    monkeypatch.delenv("JOBPLANE_API_KEY")
    client = AsyncClient.from_env()
    assert (client.address, client.api_key) == ("127.0.0.1:50051", None)


@pytest.mark.parametrize("raw", ["k1\n", "k1\r\n", "  k1\t", "\nk1\n\n"])
def test_api_key_is_used_without_surrounding_whitespace(raw: str) -> None:
    client = AsyncClient("h:1", raw)
    assert client.api_key == "k1"
    assert client._metadata == (("authorization", "Bearer k1"),)
    assert Client("h:1", raw).api_key == "k1"
    env = {"JOBPLANE_API_KEY": raw}
    assert AsyncClient.from_env(env=env).api_key == "k1"
    # A blank argument does not hide the environment's key.
    assert Client.from_env(api_key="\n", env=env).api_key == "k1"
    assert AsyncClient("h:1", " \n").api_key is None


@pytest.mark.parametrize("raw", ["jp_se\ncret", "jp_se\x00cret", "jp_séc", "jp_\x7fsecret"])
def test_malformed_api_key_is_one_invalid_argument(raw: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        AsyncClient("h:1", raw)
    assert caught.value.field == "api_key"
    assert "\n" not in str(caught.value)
    assert "secret" not in str(caught.value) and "cret" not in str(caught.value)
    with pytest.raises(InvalidArgument):
        Client.from_env(env={"JOBPLANE_API_KEY": raw})


async def test_closed_client_refuses_calls() -> None:
    client = AsyncClient("127.0.0.1:1", "key")
    await client.close()
    with pytest.raises(RuntimeError, match="closed"):
        await client.get("jobs/1")


# -- the blocking client -----------------------------------------------------------


def test_sync_watch_pulls_and_closes_the_async_generator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    closed: list[bool] = []

    async def fake_watch(name: str | Job, after_seq: int = 0) -> AsyncGenerator[JobEvent, None]:
        try:
            for seq in range(after_seq + 1, after_seq + 10):
                yield event(seq)
        finally:
            closed.append(True)

    with Client("127.0.0.1:1", "key") as client:
        monkeypatch.setattr(client._async, "watch", fake_watch)
        seen = []
        for e in client.watch("jobs/1", after_seq=2):
            seen.append(e.seq)
            if e.seq == 4:
                break
        assert seen == [3, 4]
        assert closed == [True]
    with pytest.raises(RuntimeError, match="closed"):
        client.get("jobs/1")


def test_sync_wait_timeout_is_not_mistaken_for_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    async def slow_wait(name: str | Job, timeout: float | None = None, **_: bool) -> Job:
        await asyncio.sleep(0.4)
        raise TimeoutError

    async def quick_wait(name: str | Job, timeout: float | None = None, **_: bool) -> Job:
        await asyncio.sleep(0.3)
        return job()

    with Client("127.0.0.1:1", "key") as client:
        monkeypatch.setattr(client._async, "wait", slow_wait)
        with pytest.raises(TimeoutError):
            client.wait("jobs/1", timeout=0.4)
        monkeypatch.setattr(client._async, "wait", quick_wait)
        assert client.wait("jobs/1").name == "jobs/1"


def test_sync_call_raises_typed_errors() -> None:
    # Nothing listens on port 1: the call is repeated until its deadline, then
    # fails with UNAVAILABLE.
    with Client("127.0.0.1:1", "key", timeout=0.5) as client:
        with pytest.raises(Unavailable) as info:
            client.get("jobs/1")
        assert isinstance(info.value.__cause__, grpc.aio.AioRpcError)


def test_sync_close_without_use_is_fine() -> None:
    client = Client()
    client.close()
    client.close()


# -- CLI ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="jobplane")
    cli.register(root.add_subparsers(dest="command", required=True))
    return root


def test_register_adds_the_commands() -> None:
    args = parser().parse_args(
        ["submit", "a.b", "--payload", '{"x": 1}', "--label", "k=v", "--watch", "--json"]
    )
    assert callable(args.func)
    assert (args.type, args.payload, args.label, args.watch, args.json) == (
        "a.b",
        '{"x": 1}',
        ["k=v"],
        True,
        True,
    )
    args = parser().parse_args(["list", "--state", "RUNNING", "--all"])
    assert (args.state, args.all) == ("running", True)
    for argv in (["get", "x"], ["watch", "x", "--after-seq", "3"], ["cancel", "x"], ["retry", "x"]):
        assert callable(parser().parse_args(argv).func)


def test_payload_and_label_parsing(tmp_path: Any) -> None:
    assert cli.parse_payload(None, None) == {}
    assert cli.parse_payload('{"a": [1]}', None) == {"a": [1]}
    path = tmp_path / "p.json"
    path.write_text('{"b": 2}')
    assert cli.parse_payload(None, str(path)) == {"b": 2}
    with pytest.raises(cli.UsageError, match="JSON object"):
        cli.parse_payload("[1]", None)
    with pytest.raises(cli.UsageError, match="not valid JSON"):
        cli.parse_payload("{", None)
    with pytest.raises(cli.UsageError, match="cannot read"):
        cli.parse_payload(None, str(tmp_path / "missing.json"))
    assert cli.parse_labels(["a=1", "b=x=y", "c="]) == {"a": "1", "b": "x=y", "c": ""}
    with pytest.raises(cli.UsageError):
        cli.parse_labels(["novalue"])
    assert cli.full_name("abc") == "jobs/abc"
    assert cli.full_name("jobs/abc") == "jobs/abc"


def test_cli_exit_codes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("JOBPLANE_API_KEY", raising=False)
    args = parser().parse_args(["get", "x", "--address", "127.0.0.1:1"])
    assert args.func(args) == 2
    assert "API key" in capsys.readouterr().err

    args = parser().parse_args(["submit", "a.b", "--api-key", "k", "--payload", "3"])
    assert args.func(args) == 2
    assert "must be a JSON object" in capsys.readouterr().err

    args = parser().parse_args(
        ["get", "x", "--api-key", "k", "--address", "127.0.0.1:1", "--call-timeout", "0.5"]
    )
    assert args.func(args) == 1
    # Refused at once, or (on a loaded machine) not connected in time.
    assert re.match(r"error: (UNAVAILABLE|DEADLINE_EXCEEDED): ", capsys.readouterr().err)


async def test_render_watch_plain_and_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = Script(FakeCall([event(1, EventType.QUEUED), event(2), event(3, EventType.SUCCEEDED)]))
    client = scripted(monkeypatch, script)

    async def get(name: str | Job, **_options: bool) -> Job:
        return job(JobState.SUCCEEDED, last_seq=3)

    monkeypatch.setattr(client, "get", get)
    assert await cli.render_watch(client, "jobs/1") == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5
    assert "#2" in out[1]
    assert "step 2" in out[1]
    assert out[3] == "jobs/1 succeeded"
    assert out[4] == 'result: {"ok": true}'

    script.calls.append(FakeCall([event(1, EventType.QUEUED), event(2, EventType.FAILED)]))

    async def get_failed(name: str | Job) -> Job:
        return job(JobState.FAILED, last_seq=2)

    monkeypatch.setattr(client, "get", get_failed)
    assert await cli.render_watch(client, "jobs/1", as_json=True) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line.get("seq") for line in lines[:2]] == [1, 2]
    assert lines[1]["type"] == "failed"
    assert lines[1]["event_time"] == NOW.isoformat()
    assert lines[2]["state"] == "failed"
    assert lines[2]["create_time"] == NOW.isoformat()


def test_bar_only_moves_on_progress() -> None:
    tracker = ProgressTracker()
    assert tracker.update(event(2)) == pytest.approx(0.2)
    assert tracker.update(event(3, EventType.QUEUED)) is None
    assert tracker.update(event(4, EventType.SUCCEEDED, progress=0.0)) == 1.0
    assert "[bold]" in cli.describe(event(1, message="[not markup]"))
    assert "\\[not markup]" in cli.describe(event(1, message="[not markup]"))


def test_bar_never_runs_backwards_within_an_attempt_and_restarts_with_the_next() -> None:
    tracker = ProgressTracker()
    seen = [
        tracker.update(e)
        for e in [
            event(1, EventType.QUEUED, progress=0.0, attempt=0),
            event(2, EventType.STARTED, progress=0.0),
            event(3, progress=0.4),
            event(4, progress=0.3),  # behind the bar: it stays at 0.4
            event(5, EventType.RETRY_SCHEDULED, progress=0.4),
            # The next attempt starts again from 0, then reports its own progress.
            event(6, EventType.STARTED, progress=0.0, attempt=2),
            event(7, progress=0.2, attempt=2),
            event(8, progress=0.1, attempt=2),
            event(9, progress=0.9, attempt=2),
            event(10, EventType.SUCCEEDED, progress=1.0, attempt=2),
        ]
    ]
    assert seen == [None, 0.0, 0.4, None, None, 0.0, 0.2, None, 0.9, 1.0]
    # A stale attempt's report (or a STARTED that kept an old attempt's progress)
    # never moves the bar of a later attempt.
    assert tracker.update(event(11, progress=0.5, attempt=1)) is None
    assert tracker.update(event(12, progress=float("nan"), attempt=3)) is None
    assert tracker.position == 1.0


def test_get_never_shows_more_attempts_than_allowed_nor_a_final_retryable() -> None:
    retried = dataclasses.replace(
        job(JobState.FAILED),
        attempt=4,
        attempts_used=1,
        max_attempts=3,
        error=JobError("HANDLER_ERROR", "boom", retryable=True),
    )
    shown = _fields(cli.job_details(retried))
    assert shown["attempts"] == "1 of 3 used (4 started in all)"
    # Whatever an older row says, a FAILED job is not going to be retried.
    assert shown["error"] == "HANDLER_ERROR: boom"
    pending = dataclasses.replace(retried, state=JobState.QUEUED, waiting_reason="no live worker")
    shown = _fields(cli.job_details(pending))
    assert shown["error"] == "HANDLER_ERROR: boom (will be retried)"
    assert shown["waiting"] == "no live worker"
    assert "waiting" not in _fields(cli.job_details(job()))


def test_get_and_list_show_why_a_job_waits_by_its_code() -> None:
    waiting = dataclasses.replace(
        job(JobState.QUEUED),
        waiting_code="UNROUTABLE",
        waiting_reason="no queue is bound for routing key 'demo.echo'",
    )
    shown = _fields(cli.job_details(waiting))
    assert shown["waiting"] == "UNROUTABLE: no queue is bound for routing key 'demo.echo'"
    assert state_text(waiting) == "queued [dim](UNROUTABLE)[/dim]"
    assert state_text(job(JobState.QUEUED)) == "queued"


def test_details_and_event_lines_show_a_pipeline_jobs_stages() -> None:
    started = datetime(2026, 12, 1, tzinfo=UTC)
    stages = (
        Stage(
            "native",
            "native.analyze",
            "mir-1.4",
            StageState.SUCCEEDED,
            1,
            3,
            timedelta(seconds=60),
            start_time=started,
            end_time=started + timedelta(seconds=2.5),
        ),
        Stage(
            "neural",
            "neural.embed",
            "",
            StageState.FAILED,
            3,
            3,
            timedelta(seconds=60),
            error=JobError("HANDLER_FAILED", "model down"),
        ),
        Stage("index", "index.upsert", "qdrant-1", StageState.PENDING, 0, 5, timedelta(seconds=60)),
    )
    failed = dataclasses.replace(
        job(JobState.FAILED),
        stage="neural",
        stages=stages,
        pipeline_version="2026.12",
        attempt=4,
        attempts_used=3,
    )
    shown = _fields(cli.job_details(failed))
    assert shown["pipeline"] == f"{failed.type} 2026.12, at stage neural"
    assert shown["stage 1"] == "native@mir-1.4 (native.analyze) succeeded, 1 of 3 attempts, 2.500s"
    assert (
        shown["stage 2"]
        == "neural (neural.embed) failed, 3 of 3 attempts: HANDLER_FAILED: model down"
    )
    assert shown["stage 3"] == "index@qdrant-1 (index.upsert) pending"
    assert "pipeline" not in _fields(cli.job_details(job()))
    event = JobEvent(
        "jobs/x", 3, EventType.PROGRESS, JobState.RUNNING, 0.5, "half", started, stage="neural"
    )
    assert "[neural]" in cli.event_line(event)
    assert "[" not in cli.event_line(dataclasses.replace(event, stage=""))
    args = parser().parse_args(["retry", "jobs/x", "--from-stage", "native"])
    assert args.from_stage == "native"


def test_get_shows_one_count_of_a_retried_pipeline_jobs_attempts() -> None:
    """As the server reports a pipeline job whose neural stage used its 3
    attempts, was retried and succeeded at the second: 7 attempts in all."""
    stages = (
        Stage("native", "native.analyze", "", StageState.SUCCEEDED, 1, 3, timedelta(60)),
        Stage("neural", "neural.embed", "", StageState.SUCCEEDED, 5, 3, timedelta(60)),
        Stage("index", "index.upsert", "", StageState.SUCCEEDED, 1, 5, timedelta(60)),
    )
    done = dataclasses.replace(
        job(JobState.SUCCEEDED),
        type="aidj.analyze",
        stage="index",
        stages=stages,
        attempt=7,
        attempts_used=1,
        max_attempts=5,
    )
    shown = _fields(cli.job_details(done))
    # The job's own count only: not its current stage's budget beside it.
    assert shown["attempts"] == "7 started in all (each stage's own count below)"
    assert shown["stage 1"].endswith("1 of 3 attempts")
    assert shown["stage 2"].endswith("5 attempts in all, at most 3 between retries")
    assert shown["stage 3"].endswith("1 of 5 attempts")
    # Retried and queued again: the stage's budget starts over, its count does not.
    requeued = dataclasses.replace(
        done,
        state=JobState.QUEUED,
        stage="neural",
        attempt=4,
        attempts_used=0,
        max_attempts=3,
        stages=(stages[0], dataclasses.replace(stages[1], attempts=3), stages[2]),
    )
    shown = _fields(cli.job_details(requeued))
    assert shown["attempts"] == "4 started in all (each stage's own count below)"
    assert shown["stage 2"].endswith("3 attempts in all, 0 of 3 since the last retry")
    for text in (cli.job_details(done), cli.job_details(requeued)):
        for used, allowed in re.findall(r"(\d+) of (\d+)", text):
            assert int(used) <= int(allowed), text


def _fields(text: str) -> dict[str, str]:
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


@pytest.mark.parametrize(
    ("code", "details", "retryable"),
    [
        (grpc.StatusCode.UNAVAILABLE, "failed to connect", True),
        (grpc.StatusCode.UNKNOWN, "Connection reset by peer", True),
        # A CANCELLED status the caller did not cause: the server shed the call.
        (grpc.StatusCode.CANCELLED, "CANCELLED", True),
        (grpc.StatusCode.NOT_FOUND, "connection", False),
        (grpc.StatusCode.INTERNAL, "boom", False),
        (grpc.StatusCode.INVALID_ARGUMENT, "bad", False),
    ],
)
def test_retryable_errors(code: grpc.StatusCode, details: str, retryable: bool) -> None:
    assert is_retryable(rpc_error(code, details)) is retryable


class Flaky:
    """A unary method that fails with ``error`` ``failures`` times, then answers."""

    def __init__(self, failures: int, error: grpc.aio.AioRpcError) -> None:
        self.failures = failures
        self.error = error
        self.calls = 0
        self.timeouts: list[float | None] = []

    async def __call__(self, request: Any, *, timeout: float | None, metadata: Any) -> str:
        self.calls += 1
        self.timeouts.append(timeout)
        if self.calls <= self.failures:
            raise self.error
        return "answer"


async def test_a_repeatable_call_is_repeated_until_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A database failover makes the server answer UNAVAILABLE for seconds,
    # not for three quick repeats.
    monkeypatch.setattr(
        "jobplane.client._channel.UNARY_RETRY",
        RetryPolicy(initial_delay=0.001, max_delay=0.02, max_elapsed=None, jitter=0),
    )
    client = AsyncClient("127.0.0.1:1", "key", timeout=5.0)
    method = Flaky(12, rpc_error(grpc.StatusCode.UNAVAILABLE, "database down"))
    assert await client._call(method, object(), repeatable=True) == "answer"  # type: ignore[arg-type]
    assert method.calls == 13
    # Each repeat gets what is left of the one deadline.
    timeouts = [t for t in method.timeouts if t is not None]
    assert len(timeouts) == 13
    assert all(t <= 5.0 for t in timeouts)
    assert timeouts == sorted(timeouts, reverse=True)


async def test_repeats_stop_at_the_deadline_and_not_for_final_errors() -> None:
    client = AsyncClient("127.0.0.1:1", "key", timeout=0.3)
    down = Flaky(10_000, rpc_error(grpc.StatusCode.UNAVAILABLE, "down"))
    with pytest.raises(Unavailable):
        await client._call(down, object(), repeatable=True)  # type: ignore[arg-type]
    assert 1 < down.calls < 100

    refused = Flaky(10_000, rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad"))
    with pytest.raises(InvalidArgument):
        await client._call(refused, object(), repeatable=True)  # type: ignore[arg-type]
    assert refused.calls == 1

    once = Flaky(10_000, rpc_error(grpc.StatusCode.UNAVAILABLE, "down"))
    with pytest.raises(Unavailable):
        await client._call(once, object(), repeatable=False)  # type: ignore[arg-type]
    assert once.calls == 1
