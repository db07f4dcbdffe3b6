"""Every JobService and EventService request the fuzzer can make gets a precise answer.

Requests are drawn from the proto descriptors (see strategies.py), raw bodies
are random or mutated bytes, metadata is odd; each call is judged by the
oracle on a real server with Postgres and RabbitMQ behind it.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import replace
from typing import Any

import pytest
from google.protobuf import message, text_format
from google.protobuf.message import DecodeError
from hypothesis import given, note, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.topology import PipelineSpec, StageSpec, Topology
from jobplane.v1 import jobs_pb2
from jobplane.workers.relay import FairSettings
from tests.fuzz.conftest import PROFILE
from tests.fuzz.oracle import METHODS, Metadata, Oracle, Seeds, raw_channel, seed
from tests.fuzz.strategies import Hints, fill_struct, json_values, plain, requests, texts
from tests.support.parts import Started
from tests.support.stack import eventually, start_stack

# The quick profile's whole run stays within a minute; a deep one runs long.
pytestmark = [
    pytest.mark.timeout(150 if PROFILE == "quick" else 3600),
    # Hypothesis warns when the global random state moves while it draws; here
    # the server's own tasks (watch rechecks with jitter) run meanwhile on the
    # event loop's thread, so it moves without any strategy touching it.
    pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies"),
]

_JOB_TYPES = st.from_regex(
    r"[a-z0-9][a-z0-9_-]{0,12}(\.[a-z0-9][a-z0-9_-]{0,12}){0,3}", fullmatch=True
)
_EVENT_ID = "01937a2e-5b7c-7f00-8a1b-2c3d4e5f6a7b"
_LABEL_KEYS = st.from_regex(r"[a-z0-9]([a-z0-9._/-]{0,61}[a-z0-9])?", fullmatch=True)


def _token_of(data: Any) -> str:
    raw = data if isinstance(data, bytes) else json.dumps(plain(data)).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decoded(token: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
    return data


def _token_shapes(tokens: list[str]) -> st.SearchStrategy[str]:
    """Tokens the server never issued: any JSON, issued ones with one value
    changed, or JSON nested past any parser's patience."""
    issued = st.sampled_from([_decoded(t) for t in tokens])
    one_changed = st.tuples(issued, st.sampled_from(["t", "i", "f"]), json_values(4)).map(
        lambda p: {**p[0], p[1]: p[2]}
    )
    nested = st.sampled_from([10, 1000, 100_000]).map(lambda n: b"[" * n)
    return st.one_of(json_values(max_leaves=6), one_changed, nested).map(_token_of)


def _struct_filler(value: dict[str, Any]) -> Callable[[Any], None]:
    return lambda struct: fill_struct(struct, value)


_PIPELINE = "fuzz.pipeline"


def _pipeline(queue: str) -> PipelineSpec:
    stages = tuple(
        StageSpec(name, f"fuzz.stage.{name}", queue, 3, 60.0, version="v1")
        for name in ("first", "second")
    )
    return PipelineSpec(_PIPELINE, stages, version="1")


def hints(seeds: Seeds) -> Hints:
    """Plausible values per field, so that draws also get past validation."""
    every_job = st.sampled_from(seeds.queued + seeds.terminal)
    # Cancelling a queued job is where a cancel's reason gets written.
    mostly_queued = st.sampled_from(seeds.queued * 3 + seeds.terminal)
    return {
        "jobplane.v1.SubmitJobRequest.type": st.one_of(
            st.sampled_from(["demo.echo", "a" * 128, _PIPELINE]), _JOB_TYPES
        ),
        "jobplane.v1.SubmitJobRequest.payload": st.dictionaries(
            _LABEL_KEYS, st.one_of(st.integers(-5, 5), texts(), st.lists(st.booleans()))
        ).map(_struct_filler),
        "jobplane.v1.SubmitJobRequest.request_id": st.sampled_from(["", "fuzz-1", "fuzz-2"]),
        "jobplane.v1.SubmitJobRequest.correlation_id": st.sampled_from(
            ["", "order-42", "c" * 255, "\u00e9" * 127 + "c"]
        ),
        "jobplane.v1.SubmitJobRequest.max_attempts": st.integers(0, 100),
        "jobplane.v1.SubmitJobRequest.labels.key": _LABEL_KEYS,
        "jobplane.v1.SubmitJobRequest.labels.value": texts(),
        "jobplane.v1.GetJobRequest.name": every_job,
        "jobplane.v1.CancelJobRequest.name": mostly_queued,
        "jobplane.v1.RetryJobRequest.name": every_job,
        "jobplane.v1.RetryJobRequest.from_stage": st.one_of(
            st.sampled_from(["", "first", "second", "third"]), texts()
        ),
        # A watch of a job that is not terminal would wait for ever.
        "jobplane.v1.WatchJobRequest.name": st.sampled_from(seeds.terminal),
        "jobplane.v1.WatchJobRequest.after_seq": st.integers(0, 6),
        "jobplane.v1.ListJobsRequest.page_size": st.integers(0, 3),
        "jobplane.v1.ListJobsRequest.type": st.sampled_from(["demo.echo", "seed.queued"]),
        "jobplane.v1.ListJobsRequest.page_token": st.one_of(
            st.sampled_from(seeds.page_tokens), _token_shapes(seeds.page_tokens)
        ),
        # One id often, so replays and reuses get drawn too.
        "jobplane.v1.PublishEventRequest.event_id": st.one_of(
            st.just(_EVENT_ID), st.uuids().map(str)
        ),
        "jobplane.v1.PublishEventRequest.event_type": st.one_of(
            st.sampled_from(["artifact.created", "a" * 128]), _JOB_TYPES
        ),
        "jobplane.v1.PublishEventRequest.payload": st.dictionaries(
            _LABEL_KEYS, st.one_of(st.integers(-5, 5), texts(), st.lists(st.booleans()))
        ).map(_struct_filler),
        "jobplane.v1.PublishEventRequest.correlation_id": st.sampled_from(
            ["", "order-42", "c" * 255, "\u00e9" * 127 + "c"]
        ),
        "jobplane.v1.PublishEventRequest.project_id": st.sampled_from(["web", "p" * 255]),
        "jobplane.v1.PublishEventRequest.causation_id": st.sampled_from(["cause-1", _EVENT_ID]),
    }


@pytest.fixture
async def oracle(
    engine: AsyncEngine, database_url: str, amqp_url: str, topology: Topology, started: Started
) -> AsyncIterator[Oracle]:
    """A server and relay (no worker: jobs stay where the oracle puts them)."""
    # With a pipeline: its jobs are submitted, read, cancelled and retried too.
    staged = replace(topology, pipelines=(_pipeline(topology.queues[0].name),))
    # Fair dispatch off: with no worker it would hold all but a few dispatches
    # back, and the check below is that the broker takes every one.
    stack = await started(
        start_stack(
            engine,
            database_url,
            amqp_url,
            staged,
            worker=False,
            relay_options={"fair": FairSettings(enabled=False)},
        )
    )
    client = stack.client()
    seeds = await seed(stack, client)
    async with raw_channel(stack) as channel:
        judge = Oracle(stack, channel, client, seeds)
        yield judge
    # Shown with `pytest -s` (as `make fuzz` runs): what the run reached.
    print(f"\n{sum(judge.codes.values())} calls:")
    for outcome, n in sorted(judge.outcomes.items()):
        print(f"{n:6d}  {outcome}")
    # Whatever was accepted, the broker took: no row the relay cannot publish.
    await eventually(_all_published(judge), timeout=20)
    failed = await stack.scalar(
        "SELECT count(*) FROM jobs WHERE error_code IS DISTINCT FROM 'CANCELLED' "
        "AND error_code IS NOT NULL"
    )
    assert failed == 0


def _all_published(oracle: Oracle) -> Callable[[], Coroutine[Any, Any, bool]]:
    async def check() -> bool:
        # A delayed job's dispatch is not due before its schedule_time.
        pending = await oracle.stack.scalar(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL AND NOT EXISTS ("
            "SELECT 1 FROM jobs j WHERE j.id = outbox.job_id AND j.schedule_time > now())"
        )
        return int(pending) == 0

    return check


def describe(drawn: Any) -> str:
    """What a failing example sent, readable (and cut short)."""
    if isinstance(drawn, message.Message):
        try:
            text = text_format.MessageToString(drawn, as_utf8=True, as_one_line=True)
        except DecodeError:  # nested past what protobuf parses, even to print it
            text = repr(drawn.SerializeToString())
        return f"{type(drawn).__name__}: {text[:3000]}"
    return repr(drawn)[:3000]


async def fuzz(
    oracle: Oracle,
    strategy: st.SearchStrategy[Any],
    judge: Callable[[Any], Coroutine[Any, Any, None]],
    *,
    scale: float = 1.0,
) -> None:
    """Run hypothesis in a thread; each example's calls run on the test's loop."""
    loop = asyncio.get_running_loop()
    profile = settings.default
    assert profile is not None
    examples = max(1, int(profile.max_examples * scale))

    @settings(max_examples=examples)
    @given(strategy)
    def check(drawn: Any) -> None:
        try:
            asyncio.run_coroutine_threadsafe(judge(drawn), loop).result()
        except BaseException:
            note(describe(drawn))
            raise
        finally:
            oracle.report()

    await asyncio.to_thread(check)


@pytest.mark.parametrize(
    ("method", "odd", "scale"),
    [
        ("SubmitJob", None, 2.0),
        # The payload holds the most kinds of trouble: it gets runs of its own.
        ("SubmitJob", "payload", 1.0),
        ("GetJob", None, 0.5),
        ("ListJobs", None, 1.5),
        ("CancelJob", None, 1.0),
        ("RetryJob", None, 0.5),
        ("WatchJob", None, 0.5),
        ("BatchSubmitJobs", None, 1.0),
        ("PublishEvent", None, 1.0),
        ("PublishEvent", "payload", 0.5),
    ],
)
async def test_every_request_message(
    oracle: Oracle, method: str, odd: str | None, scale: float
) -> None:
    strategy = requests(METHODS[method].input_type, hints(oracle.seeds), odd=odd)

    async def judge(request: Any) -> None:
        await oracle.call(method, request.SerializeToString())

    await fuzz(oracle, strategy, judge, scale=scale)
    # The draws must also get past validation, or the read-back checks never run.
    assert oracle.codes[method, "OK"] > 0, oracle.outcomes


def _varint(value: int) -> bytes:
    """``value`` as a protobuf varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _fresh_submits(n: int) -> st.SearchStrategy[list[jobs_pb2.SubmitJobRequest]]:
    """``n`` valid SubmitJob requests, each with a request_id of its own."""
    return st.lists(st.uuids(), min_size=n, max_size=n, unique=True).map(
        lambda ids: [jobs_pb2.SubmitJobRequest(type="demo.echo", request_id=str(i)) for i in ids]
    )


async def test_one_drawn_request_among_valid_ones_decides_the_whole_batch(
    oracle: Oracle,
) -> None:
    """A batch of valid requests and one drawn one: all created, or none and the
    refusal names the drawn one's index (the oracle checks that nothing was written)."""
    # Now and then a valid one, so that whole batches are accepted too.
    drawn = st.one_of(
        requests(jobs_pb2.SubmitJobRequest.DESCRIPTOR, hints(oracle.seeds)),
        _fresh_submits(1).map(lambda one: one[0]),
    )
    strategy = st.integers(0, 4).flatmap(
        lambda n: st.tuples(_fresh_submits(n), drawn, st.integers(0, n))
    )

    async def judge(case: tuple[list[jobs_pb2.SubmitJobRequest], Any, int]) -> None:
        valid, request, at = case
        # Encoded by hand: protobuf would parse a request nested past its
        # depth limit again to copy it into the batch.
        items = [r.SerializeToString() for r in [*valid[:at], request, *valid[at:]]]
        body = b"".join(b"\x0a" + _varint(len(item)) + item for item in items)
        refusal = await oracle.call("BatchSubmitJobs", body)
        if refusal is not None and refusal.field is not None:
            assert refusal.field.startswith(f"requests[{at}]"), refusal

    await fuzz(oracle, strategy, judge, scale=0.5)
    assert oracle.codes["BatchSubmitJobs", "OK"] > 0, oracle.outcomes


def _mutations(body: bytes) -> st.SearchStrategy[bytes]:
    spot = st.integers(0, len(body))
    return st.one_of(
        spot.map(lambda i: body[:i]),
        st.tuples(spot, st.binary(min_size=1, max_size=8)).map(
            lambda p: body[: p[0]] + p[1] + body[p[0] + 1 :]
        ),
        st.tuples(spot, st.binary(min_size=1, max_size=8)).map(
            lambda p: body[: p[0]] + p[1] + body[p[0] :]
        ),
    )


def _deep_struct_body(depth: int) -> bytes:
    """A SubmitJobRequest whose payload nests ``depth`` objects and lists."""
    request = jobs_pb2.SubmitJobRequest(type="demo.echo")
    target = request.payload.fields["k"]
    for level in range(depth):
        target = (
            target.list_value.values.add() if level % 3 == 2 else target.struct_value.fields["k"]
        )
    target.string_value = "leaf"
    return request.SerializeToString()


def bodies(seeds: Seeds) -> st.SearchStrategy[tuple[str, bytes]]:
    """A method, and a body that may or may not be a request of it."""

    def for_method(method: str) -> st.SearchStrategy[tuple[str, bytes]]:
        valid = requests(METHODS[method].input_type, hints(seeds)).map(
            lambda r: r.SerializeToString()
        )
        mutated = valid.flatmap(_mutations)
        noise = st.binary(max_size=256)
        kinds = [noise, mutated]
        if method == "SubmitJob":
            kinds.append(st.integers(0, 120).map(_deep_struct_body))
        return st.one_of(kinds).map(lambda body: (method, body))

    return st.sampled_from(sorted(METHODS)).flatmap(for_method)


async def test_raw_bodies(oracle: Oracle) -> None:
    async def judge(drawn: tuple[str, bytes]) -> None:
        method, body = drawn
        if method == "WatchJob":
            # A body that decodes to a live job's watch would wait for ever.
            try:
                request = jobs_pb2.WatchJobRequest.FromString(body)
            except DecodeError:
                request = None
            if request is not None and request.name in oracle.seeds.queued:
                return
        await oracle.call(method, body)

    await fuzz(oracle, bodies(oracle.seeds), judge, scale=2.0)


_HEADER_NAMES = st.from_regex(r"[a-z0-9][a-z0-9_.-]{0,15}", fullmatch=True).filter(
    lambda k: not k.startswith("grpc-") and k not in {"te", "content-type", "host"}
)
_HEADER_VALUES = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=300)


def metadata(key: str) -> st.SearchStrategy[Metadata]:
    """Odd metadata, around the call's real key or none."""
    pairs = st.one_of(
        st.tuples(_HEADER_NAMES.map(lambda k: k + "-bin"), st.binary(max_size=64)),
        st.tuples(_HEADER_NAMES, _HEADER_VALUES),
    )
    authorization = st.one_of(
        st.just(f"Bearer {key}"),
        st.sampled_from(
            [
                f"bearer {key}",
                f"Bearer  {key}",
                f"Bearer {key} ",
                f"Bearer {key}x",
                f"Bearer {key[:-1]}",
                f"Basic {key}",
                "Bearer",
                "Bearer ",
                key,
                "",
            ]
        ),
        _HEADER_VALUES,
        _HEADER_VALUES.map(lambda v: f"Bearer {v}"),
    ).map(lambda v: ("authorization", v))
    binary_authorization = st.binary(max_size=64).map(lambda v: ("authorization-bin", v))
    return st.lists(st.one_of(pairs, authorization, binary_authorization), max_size=4).map(tuple)


async def test_odd_metadata(oracle: Oracle) -> None:
    requests_to_send = {
        "SubmitJob": jobs_pb2.SubmitJobRequest(type="demo.echo"),
        "ListJobs": jobs_pb2.ListJobsRequest(),
        "GetJob": jobs_pb2.GetJobRequest(name=oracle.seeds.terminal[0]),
        "WatchJob": jobs_pb2.WatchJobRequest(name=oracle.seeds.terminal[0]),
    }
    strategy = st.tuples(st.sampled_from(sorted(requests_to_send)), metadata(oracle.stack.key))

    async def judge(drawn: tuple[str, Metadata]) -> None:
        method, md = drawn
        await oracle.call(method, requests_to_send[method].SerializeToString(), md)

    await fuzz(oracle, strategy, judge)
    assert sum(n for (_, code), n in oracle.codes.items() if code == "UNAUTHENTICATED") > 0
    assert sum(n for (_, code), n in oracle.codes.items() if code == "OK") > 0
