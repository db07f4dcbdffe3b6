"""``ctx.submit`` without a database: jobplane.testing keeps children by key, and a
child's request is checked as a worker checks it."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from jobplane.errors import InvalidArgument, PayloadTooLarge
from jobplane.server.page_tokens import extra_filters, filter_key
from jobplane.testing import MemoryChildren, run_handler, run_handler_sync
from jobplane.topology import QueueSpec, Topology, load_topology
from jobplane.workers import JobContext, SubmitError, SyncJobContext
from jobplane.workers.children import ChildRequest, check_key, child_job


async def fan_out(ctx: JobContext) -> dict[str, Any]:
    names = [await ctx.submit("fan.leaf", {"i": i}, key=f"chunk-{i}") for i in range(3)]
    if ctx.attempt == 1:
        raise RuntimeError("crashed after submitting")
    return {"children": names}


async def test_a_handler_run_again_gets_the_children_it_submitted_before() -> None:
    kept = MemoryChildren()
    first = await run_handler(fan_out, "fan.out", children=kept, attempt=1)
    second = await run_handler(fan_out, "fan.out", children=kept, attempt=2)
    assert first.status == "retry" and second.status == "succeeded"
    assert [c.name for c in first.children] == [c.name for c in second.children]
    assert second.result == {"children": [c.name for c in second.children]}
    assert len(kept.by_key) == 3
    assert [created for _, _, created in kept.submits] == [True] * 3 + [False] * 3
    assert [c.payload for c in second.children] == [{"i": 0}, {"i": 1}, {"i": 2}]


def test_a_plain_handler_submits_from_its_thread() -> None:
    def plain(ctx: SyncJobContext) -> dict[str, Any]:
        return {"child": ctx.submit("fan.leaf", {"x": 1}, key="only")}

    outcome = run_handler_sync(plain, "fan.out")
    assert outcome.status == "succeeded"
    assert outcome.result == {"child": outcome.children[0].name}


# A time already past is taken (the child runs at once): no horizon to stay within.
_AT = datetime(2020, 1, 2, 3, 4, 5, tzinfo=UTC)
_ASKED = [
    ChildRequest(
        key="at",
        type="fan.leaf",
        payload={"i": 1},
        max_attempts=7,
        timeout_seconds=90.5,
        correlation_id="corr-1",
        schedule_time=_AT,
    ),
    ChildRequest(key="later", type="fan.leaf", payload={}, schedule_delay_seconds=12.5),
]


#: The calls of ``ctx.submit`` that ask for :data:`_ASKED`.
_SUBMITS: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
    (
        ("fan.leaf", {"i": 1}),
        {
            "key": "at",
            "max_attempts": 7,
            "timeout": 90.5,
            "correlation_id": "corr-1",
            "schedule_time": _AT,
        },
    ),
    (("fan.leaf",), {"key": "later", "schedule_delay": 12.5}),
]


async def test_every_option_of_ctx_submit_reaches_the_childs_request() -> None:
    async def handler(ctx: JobContext) -> dict[str, Any]:
        for args, options in _SUBMITS:
            await ctx.submit(*args, **options)
        return {}

    kept = MemoryChildren()
    assert (await run_handler(handler, "fan.out", children=kept)).status == "succeeded"
    assert [child.request for child in kept.by_key.values()] == _ASKED


def test_every_option_of_a_plain_handlers_submit_reaches_the_childs_request() -> None:
    def plain(ctx: SyncJobContext) -> dict[str, Any]:
        for args, options in _SUBMITS:
            ctx.submit(*args, **options)
        return {}

    kept = MemoryChildren()
    assert run_handler_sync(plain, "fan.out", children=kept).status == "succeeded"
    assert [child.request for child in kept.by_key.values()] == _ASKED


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"key": ""}, "key"),
        ({"key": "k" * 201}, "key"),
        ({"key": "a\nb"}, "key"),
        ({"key": "a\ud800b"}, "key"),
        ({"correlation_id": "x\ud800"}, "correlation_id"),
        ({"job_type": "Bad Type"}, "type"),
        ({"payload": {"x": float("nan")}}, "payload"),
    ],
)
async def test_a_bad_child_raises_submit_error_naming_the_field(
    kwargs: dict[str, Any], field: str
) -> None:
    arguments: dict[str, Any] = {"job_type": "fan.leaf", "payload": {}, "key": "k", **kwargs}

    async def handler(ctx: JobContext) -> dict[str, Any]:
        await ctx.submit(arguments.pop("job_type"), arguments.pop("payload"), **arguments)
        return {}

    outcome = await run_handler(handler, "fan.out")
    assert outcome.error is not None
    assert isinstance(outcome.error.exception, SubmitError)
    assert outcome.error.exception.field == field
    assert outcome.children == []


async def test_the_same_key_with_another_request_is_refused() -> None:
    async def handler(ctx: JobContext) -> dict[str, Any]:
        await ctx.submit("fan.leaf", {"i": 1}, key="k")
        await ctx.submit("fan.leaf", {"i": 2}, key="k")
        return {}

    outcome = await run_handler(handler, "fan.out")
    assert outcome.error is not None and isinstance(outcome.error.exception, SubmitError)
    assert outcome.error.exception.field == "key"


def test_a_child_request_is_checked_against_the_topology() -> None:
    topology = load_topology()

    def job(**fields: Any) -> Any:
        values: dict[str, Any] = {"key": "k", "type": "fan.leaf", "payload": {}, **fields}
        return child_job(
            topology, ChildRequest(**values), parent_correlation_id="p", max_payload_bytes=64
        )

    made = job(max_attempts=0, timeout_seconds=None)
    assert made.correlation_id == "p" and made.queue == topology.route("fan.leaf").name  # type: ignore[union-attr]
    assert job(correlation_id="").correlation_id == ""
    with pytest.raises(PayloadTooLarge):
        job(payload={"x": "y" * 100})
    refusals: list[tuple[dict[str, Any], str]] = [
        ({"max_attempts": -1}, "max_attempts"),
        ({"timeout_seconds": 0.0}, "timeout"),
        ({"schedule_delay_seconds": -1.0}, "schedule_delay"),
    ]
    for fields, name in refusals:
        with pytest.raises(InvalidArgument) as refused:
            job(**fields)
        assert refused.value.field == name
    assert check_key("x" * 200) == "x" * 200


def test_a_list_token_holds_to_its_parent() -> None:
    a, b = "jobs/00000000-0000-0000-0000-00000000000a", "jobs/00000000-0000-0000-0000-00000000000b"
    keys = {filter_key(None, "", extra_filters(None, None, None, "", parent)) for parent in (a, b)}
    assert len(keys) == 2
    # Lists without a parent keep the key their tokens had before.
    assert extra_filters(None, None, None, "") == ""
    assert extra_filters(None, None, None, "SCHEDULED") == json.dumps([[], "", "", "SCHEDULED"])
    assert filter_key(None, "", extra_filters(None, None, None, "", a)) not in {
        filter_key(None, "", extra_filters(None, None, None, "SCHEDULED", a)),
        filter_key(None, "", ""),
    }


def test_each_refusal_of_a_child_request_names_its_field_and_why() -> None:
    topology = Topology(queues=(QueueSpec("fan.work", ("fan.#",)),))
    attempts = "max_attempts must be 0 (queue default) .. 100"
    timeout = "timeout must be at least 0.001 and at most 604800 seconds"
    correlation = "correlation_id must be at most 255 bytes in UTF-8 without control characters"
    refusals: list[tuple[dict[str, Any], str, str]] = [
        ({"key": ""}, "key", "key is required: it names the child among its parent's"),
        ({"key": "k" * 201}, "key", "key is longer than 200 characters"),
        (
            {"type": "nobody.takes"},
            "type",
            "no queue of the topology takes job type 'nobody.takes'",
        ),
        ({"payload": []}, "payload", "payload must be a JSON object"),
        (
            {"payload": {"x": float("nan")}},
            "payload",
            "payload cannot be stored: $.x: nan is not a finite number",
        ),
        ({"payload": {"x": "y" * 100}}, "payload", "payload is larger than 64 bytes"),
        ({"max_attempts": -1}, "max_attempts", attempts),
        ({"max_attempts": 101}, "max_attempts", attempts),
        ({"timeout_seconds": 0.0}, "timeout", timeout),
        ({"timeout_seconds": 604800.5}, "timeout", timeout),
        ({"correlation_id": "a\nb"}, "correlation_id", correlation),
        ({"correlation_id": "x" * 256}, "correlation_id", correlation),
    ]
    for fields, name, message in refusals:
        values: dict[str, Any] = {"key": "k", "type": "fan.leaf", "payload": {}, **fields}
        with pytest.raises(InvalidArgument) as refused:
            child_job(
                topology, ChildRequest(**values), parent_correlation_id="p", max_payload_bytes=64
            )
        assert (refused.value.field, str(refused.value)) == (name, message), fields


def test_a_child_request_at_each_limit_is_taken_as_asked() -> None:
    topology = load_topology()
    queue = topology.route("fan.leaf")
    assert queue is not None

    def job(**fields: Any) -> Any:
        values: dict[str, Any] = {"key": "k", "type": "fan.leaf", "payload": {}, **fields}
        return child_job(
            topology, ChildRequest(**values), parent_correlation_id="p", max_payload_bytes=64
        )

    most = job(max_attempts=100, timeout_seconds=604800.0, correlation_id="x" * 255)
    assert (most.max_attempts, most.timeout_seconds) == (100, 604800.0)
    assert most.correlation_id == "x" * 255
    least = job(max_attempts=1, timeout_seconds=0.001)
    assert (least.max_attempts, least.timeout_seconds) == (1, 0.001)
    default = job()
    assert (default.max_attempts, default.timeout_seconds) == (
        queue.max_attempts,
        queue.timeout_seconds,
    )
    assert (default.type, default.queue, default.payload) == ("fan.leaf", queue.name, {})
    assert (default.request_id, default.schedule_time) == ("", None)
