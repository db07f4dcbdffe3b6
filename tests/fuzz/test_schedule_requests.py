"""Every CreateSchedule and UpdateSchedule request the fuzzer can make gets a precise
answer: a schedule that ticks, or INVALID_ARGUMENT naming the field and nothing written.

Requests are drawn from the proto descriptors (strategies.py), with plausible
values mixed in so that draws get past validation too.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from typing import Any, cast

import grpc
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.schedule_convert import schedule_from_pb
from jobplane.topology import Topology
from jobplane.v1 import schedules_pb2, schedules_pb2_grpc
from tests.fuzz.conftest import PROFILE
from tests.fuzz.strategies import Hints, requests
from tests.support.answers import check_refusal
from tests.support.parts import Started
from tests.support.stack import Stack, start_stack

pytestmark = [
    pytest.mark.timeout(150 if PROFILE == "quick" else 3600),
    pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies"),
]

_SECONDS = st.sampled_from([0, 1, 60, 3600, -5, 400 * 24 * 3600])


def _durations() -> st.SearchStrategy[Callable[[Any], None]]:
    """Fillers of a Duration: plausible and implausible whole seconds."""
    return _SECONDS.map(lambda s: lambda m: m.FromSeconds(s))


def _hints() -> Hints:
    return {
        "jobplane.v1.JobTemplate.type": st.sampled_from(["demo.echo", "", "Bad Type"]),
        "jobplane.v1.JobTemplate.max_attempts": st.integers(-1, 101),
        "jobplane.v1.ScheduleSpec.cron": st.sampled_from(
            ["", "*/5 * * * *", "@daily", "30 2 * * *", "61 * * * *", "* * *", "0 0 30 2 *"]
        ),
        "jobplane.v1.ScheduleSpec.time_zone": st.sampled_from(
            ["", "UTC", "Europe/Berlin", "America/New_York", "Mars/Base", "../etc/passwd"]
        ),
        "jobplane.v1.CreateScheduleRequest.schedule_id": st.sampled_from(
            ["", "nightly", "Not_An_Id", "a" * 64]
        ),
    }


async def _count(stack: Stack) -> int:
    return int(await stack.scalar("SELECT count(*) FROM schedules"))


@pytest.fixture
async def stack(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> Stack:
    """A server alone (stopped by ``started``)."""
    return await started(
        start_stack(engine, database_url, amqp_url, topology, relay=False, worker=False)
    )


async def _drive(
    strategy: st.SearchStrategy[Any], judge: Callable[[Any], Coroutine[Any, Any, None]]
) -> None:
    """Run hypothesis in a thread; each example's calls run on the test's loop."""
    loop = asyncio.get_running_loop()
    profile = settings.default
    assert profile is not None

    @settings(max_examples=profile.max_examples)
    @given(strategy)
    def check(drawn: Any) -> None:
        try:
            asyncio.run_coroutine_threadsafe(judge(drawn), loop).result()
        except BaseException:
            note(str(drawn)[:2000])
            raise

    await asyncio.to_thread(check)


async def test_create_schedule_answers_precisely(stack: Stack) -> None:
    codes: Counter[str] = Counter()
    metadata = (("authorization", f"Bearer {stack.key}"),)
    hints = {
        **_hints(),
        "jobplane.v1.ScheduleSpec.interval": _durations(),
        "jobplane.v1.ScheduleSpec.jitter": _durations(),
    }
    strategy = st.one_of(
        requests(schedules_pb2.CreateScheduleRequest.DESCRIPTOR, hints),
        requests(schedules_pb2.ScheduleSpec.DESCRIPTOR, hints).map(
            lambda spec: schedules_pb2.CreateScheduleRequest(
                schedule=schedules_pb2.Schedule(
                    job=schedules_pb2.JobTemplate(type="demo.echo"),
                    spec=cast(schedules_pb2.ScheduleSpec, spec),
                )
            )
        ),
    )
    async with grpc.aio.insecure_channel(stack.server.address) as channel:
        stub = schedules_pb2_grpc.ScheduleServiceStub(channel)

        async def judge(request: schedules_pb2.CreateScheduleRequest) -> None:
            before = await _count(stack)
            try:
                reply = await stub.CreateSchedule(request, metadata=metadata)
            except grpc.aio.AioRpcError as error:
                refusal = check_refusal(error)
                codes[refusal.code.name] += 1
                assert await _count(stack) == before, "a refused create wrote a schedule"
                if refusal.code is grpc.StatusCode.INVALID_ARGUMENT:
                    assert refusal.field is not None
                    assert refusal.field.startswith(("schedule", "schedule_id")), refusal
                else:
                    assert refusal.code is grpc.StatusCode.ALREADY_EXISTS, refusal
                return
            codes["OK"] += 1
            assert await _count(stack) == before + 1
            made = schedule_from_pb(reply)
            assert made.template.type == "demo.echo"
            if made.next_run_time is not None:
                assert made.next_run_time > datetime.now(UTC).replace(year=1999)
            await stub.DeleteSchedule(
                schedules_pb2.DeleteScheduleRequest(name=made.name), metadata=metadata
            )

        await _drive(strategy, judge)
    assert codes["OK"] > 0 and codes["INVALID_ARGUMENT"] > 0, codes
