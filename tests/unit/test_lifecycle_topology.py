"""A topology's ``[events] publish_lifecycle``: which lifecycle events reach the broker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jobplane.store.machine import Lifecycle
from jobplane.topics import LIFECYCLE_EVENT_TYPES
from jobplane.topology import TopologyError, load_topology, parse_topology

_QUEUES = [{"name": "q", "bindings": ["#"]}]


def test_the_types_a_topology_chooses_among_are_the_machines() -> None:
    assert set(LIFECYCLE_EVENT_TYPES) == {str(t) for t in Lifecycle}
    assert len(LIFECYCLE_EVENT_TYPES) == len(Lifecycle)


def test_unset_none_is_published() -> None:
    topology = parse_topology({"queues": _QUEUES})
    assert topology.publish_lifecycle == ()
    assert topology.published_lifecycle() == ()
    for name in ("default", "dev", "ingest"):
        assert load_topology(Path(f"builtin:{name}")).published_lifecycle() == ()


@pytest.mark.parametrize(
    ("patterns", "published"),
    [
        (["job.#"], LIFECYCLE_EVENT_TYPES),
        (["#"], LIFECYCLE_EVENT_TYPES),
        (["job.*"], LIFECYCLE_EVENT_TYPES),
        (["job.failed", "job.cancelled"], ("job.failed", "job.cancelled")),
        (["*.succeeded"], ("job.succeeded",)),
        (["job.failed", "job.failed", "#.failed"], ("job.failed",)),
        ([], ()),
    ],
)
def test_patterns_choose_types_in_the_docs_order(
    patterns: list[str], published: tuple[str, ...]
) -> None:
    topology = parse_topology({"queues": _QUEUES, "events": {"publish_lifecycle": patterns}})
    assert topology.published_lifecycle() == published
    assert topology.prefixed("t.").published_lifecycle() == published
    assert len(topology.publish_lifecycle) == len(set(patterns))


@pytest.mark.parametrize(
    ("events", "says"),
    [
        ({"publish_lifecycle": "job.#"}, "publish_lifecycle must be a list of topic patterns"),
        ({"publish_lifecycle": [1]}, "publish_lifecycle must be a list of topic patterns"),
        ({"publish_lifecycle": ["Job.failed"]}, "'Job.failed' is not a topic pattern"),
        ({"publish_lifecycle": ["job..failed"]}, "'job..failed' is not a topic pattern"),
        ({"publish_lifecycle": ["job.finished"]}, "'job.finished' matches no lifecycle event"),
        ({"publish_lifecycle": ["thing.#"]}, "'thing.#' matches no lifecycle event"),
        ({"publish_lifecycle": ["job.#"] * 33}, "at most 32"),
        ({"publish_lifecyle": ["job.#"]}, "[events] has unknown keys ['publish_lifecyle']"),
        ([1], "[events] must be a table"),
    ],
)
def test_a_bad_declaration_is_refused_naming_the_key(events: Any, says: str) -> None:
    with pytest.raises(TopologyError) as refused:
        parse_topology({"queues": _QUEUES, "events": events}, source="t.toml")
    assert says in str(refused.value)
    assert str(refused.value).startswith("t.toml: [events]")
