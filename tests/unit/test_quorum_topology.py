"""A topology's quorum queues: the initial group size, set or left to the broker."""

from __future__ import annotations

from typing import Any

import pytest

from jobplane.topology import TopologyError, load_topology, parse_topology

_QUEUES = [{"name": "q", "bindings": ["#"]}]


def test_unset_the_broker_decides_and_no_argument_is_sent() -> None:
    topology = parse_topology({"queues": _QUEUES})
    assert topology.quorum_group_size is None
    assert topology.quorum_arguments() == {"x-queue-type": "quorum"}
    assert load_topology().quorum_group_size is None  # the built-in default too


def test_a_set_size_becomes_the_initial_group_size_argument() -> None:
    topology = parse_topology({"queues": _QUEUES, "quorum": {"initial_group_size": 3}})
    assert topology.quorum_group_size == 3
    assert topology.quorum_arguments() == {
        "x-queue-type": "quorum",
        "x-quorum-initial-group-size": 3,
    }
    assert topology.prefixed("t.").quorum_group_size == 3


@pytest.mark.parametrize(
    ("quorum", "says"),
    [
        ({"initial_group_size": 0}, "from 1 to 99, not 0"),
        ({"initial_group_size": 100}, "from 1 to 99, not 100"),
        ({"initial_group_size": 3.0}, "not 3.0"),
        ({"initial_group_size": "3"}, "not '3'"),
        ({"initial_group_size": True}, "not True"),
        ({"size": 3}, "[quorum] has unknown keys ['size']"),
        ([1], "[quorum] must be a table"),
    ],
)
def test_a_bad_quorum_table_is_refused(quorum: Any, says: str) -> None:
    with pytest.raises(TopologyError) as refused:
        parse_topology({"queues": _QUEUES, "quorum": quorum}, source="t.toml")
    assert says in str(refused.value)
    assert str(refused.value).startswith("t.toml: [quorum]")
