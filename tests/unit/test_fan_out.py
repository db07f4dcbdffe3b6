"""Fan-out and join without a database (ADR-0047): the topology's checks, the one
check of a fan-out's items, and a handler's ``spawn``, ``results`` and items
under ``jobplane.testing``."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from jobplane.fanout import MAX_FAN_OUT, FanOutRefused, ItemResult, fan_out_items
from jobplane.testing import run_handler
from jobplane.topology import TopologyError, parse_topology
from jobplane.types import JobError, JobState
from jobplane.workers.handlers import JobContext

_QUEUE = """
[[queues]]
name = "q"
bindings = ["#"]
"""


def _pipeline(*stages: str) -> str:
    body = "".join(f"[[pipelines.stages]]\n{stage}\n" for stage in stages)
    return f'{_QUEUE}\n[[pipelines]]\nname = "p.run"\n{body}'


def _parse(text: str) -> Any:
    return parse_topology(tomllib.loads(text), source="t.toml")


_SPLIT = 'name = "split"\ntype = "p.split"'
_MAP = 'name = "map"\ntype = "p.map"\nfan_out = true'
_JOIN = 'name = "join"\ntype = "p.join"'


def test_a_fan_out_stage_between_two_stages_is_read_with_its_policy() -> None:
    topology = _parse(_pipeline(_SPLIT, _MAP + "\nmax_failures = 2\nfail_fast = true", _JOIN))
    split, fan, join = topology.pipelines[0].stages
    assert (fan.fan_out, fan.max_failures, fan.fail_fast) == (True, 2, True)
    assert not split.fan_out and not join.fan_out
    assert (split.max_failures, split.fail_fast) == (0, False)


@pytest.mark.parametrize(
    ("stages", "says"),
    [
        ((_MAP, _JOIN), "is first"),
        ((_SPLIT, _MAP), "is last"),
        ((_SPLIT, _MAP, _MAP.replace('"map"', '"map2"'), _JOIN), "next to another fan-out"),
        ((_SPLIT, _MAP + '\nmax_failures = "2"', _JOIN), "max_failures must be a whole number"),
        ((_SPLIT, _MAP + "\nmax_failures = -1", _JOIN), "max_failures must be 0..10000"),
        ((_SPLIT, _MAP + "\nmax_failures = 10001", _JOIN), "max_failures must be 0..10000"),
        ((_SPLIT, _MAP + '\nfail_fast = "yes"', _JOIN), "fail_fast must be true or false"),
        ((_SPLIT, _MAP.replace("true", "1"), _JOIN), "fan_out must be true or false"),
        ((_SPLIT + "\nmax_failures = 1", _MAP, _JOIN), "need fan_out = true"),
        ((_SPLIT + "\nfail_fast = false", _JOIN), "need fan_out = true"),
    ],
)
def test_a_fan_out_that_cannot_run_is_refused_at_load(stages: tuple[str, ...], says: str) -> None:
    with pytest.raises(TopologyError, match=says):
        _parse(_pipeline(*stages))


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"a": 1}, "must return a list of items, not dict"),
        ("abc", "not str"),
        (None, "not NoneType"),
        (7, "not int"),
        ([{"a": 1}, 2], "item 1 is a int"),
        ([[1]], "item 0 is a list"),
        ([{1: "a"}], "item 0 is a dict"),
        ([{}] * (MAX_FAN_OUT + 1), f"at most {MAX_FAN_OUT}"),
    ],
)
def test_a_result_that_is_not_a_list_of_objects_is_refused(value: Any, says: str) -> None:
    with pytest.raises(FanOutRefused, match=says):
        fan_out_items(value)


def test_a_list_of_objects_is_the_items_in_order() -> None:
    assert fan_out_items([{"i": 2}, {"i": 1}]) == [{"i": 2}, {"i": 1}]
    assert fan_out_items(({"i": 1},)) == [{"i": 1}]
    assert fan_out_items([]) == []
    assert len(fan_out_items([{}] * MAX_FAN_OUT)) == MAX_FAN_OUT


async def test_spawned_items_come_before_the_returned_list() -> None:
    async def split(ctx: JobContext) -> list[dict[str, Any]]:
        assert ctx.fans_out
        ctx.spawn({"i": 0})
        ctx.spawn({"i": 1})
        return [{"i": 2}]

    outcome = await run_handler(split, "p.split", pipeline="p.run", stage="split", fans_out=True)
    assert outcome.status == "succeeded"
    assert outcome.items == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert outcome.result == {"children": 3}


async def test_spawn_alone_is_the_items() -> None:
    async def split(ctx: JobContext) -> Any:
        ctx.spawn({"i": 0})

    outcome = await run_handler(split, "p.split", pipeline="p.run", stage="split", fans_out=True)
    assert outcome.items == [{"i": 0}]


@pytest.mark.parametrize("returned", [{"not": "a list"}, [1, 2], "text"])
async def test_a_stage_before_a_fan_out_that_returns_no_list_fails(returned: Any) -> None:
    async def split(ctx: JobContext) -> Any:
        return returned

    outcome = await run_handler(split, "p.split", pipeline="p.run", stage="split", fans_out=True)
    assert outcome.status == "failed" and outcome.items is None
    assert outcome.error is not None and outcome.error.code == "FAN_OUT_REFUSED"
    assert not outcome.error.retryable


async def test_spawn_is_only_for_a_stage_before_a_fan_out() -> None:
    async def plain(ctx: JobContext) -> dict[str, Any]:
        ctx.spawn({"i": 0})
        return {}

    outcome = await run_handler(plain, "p.map", pipeline="p.run", stage="map")
    assert outcome.status == "failed" and outcome.error is not None
    assert outcome.error.code == "FAN_OUT_REFUSED" and not outcome.error.retryable
    assert "spawn() is for a stage before a fan-out stage" in outcome.error.message

    async def spawns_text(ctx: JobContext) -> Any:
        ctx.spawn("text")  # type: ignore[arg-type]

    refused = await run_handler(
        spawns_text, "p.split", pipeline="p.run", stage="split", fans_out=True
    )
    assert refused.status == "failed" and refused.error is not None
    assert "must be an object" in refused.error.message


async def test_a_join_reads_its_children_s_results_in_order() -> None:
    results = [
        ItemResult(0, "jobs/a", JobState.SUCCEEDED, {"n": 1}),
        ItemResult(1, "jobs/b", JobState.FAILED, None, JobError("BROKEN", "no")),
    ]

    async def join(ctx: JobContext) -> dict[str, Any]:
        return {
            "ok": [r.result for r in ctx.results if r.ok],
            "failed": [[r.index, r.error.code] for r in ctx.results if r.error],
        }

    outcome = await run_handler(join, "p.join", pipeline="p.run", stage="join", results=results)
    assert outcome.result == {"ok": [{"n": 1}], "failed": [[1, "BROKEN"]]}
    plain = await run_handler(join, "p.join", pipeline="p.run", stage="join")
    assert plain.result == {"ok": [], "failed": []}


async def test_the_documents_example_splits_embeds_and_joins_in_order() -> None:
    from examples.documents import BATCH, registry
    from jobplane.topology import load_topology

    topology = load_topology(Path(__file__).parents[2] / "examples/topologies/documents.toml")
    assert [s.fan_out for s in topology.pipelines[0].stages] == [False, True, False]
    text = " ".join(f"w{i}" for i in range(BATCH + 5))
    split = await run_handler(
        registry, "docs.split", {"text": text}, pipeline="docs.ingest", stage="split", fans_out=True
    )
    assert split.items is not None and [len(i["batch"]) for i in split.items] == [BATCH, 5]
    results = []
    for index, item in enumerate(split.items):
        embedded = await run_handler(registry, "docs.embed", item)
        assert embedded.result is not None
        results.append(ItemResult(index, f"jobs/{index}", JobState.SUCCEEDED, embedded.result))
    joined = await run_handler(
        registry, "docs.index", pipeline="docs.ingest", stage="index", results=results
    )
    assert joined.result == {"indexed": BATCH + 5, "failed": []}
