"""The topology's flow limits: ``[[rate_limits]]`` and ``max_running_per_tenant`` parsed,
and bad ones refused with an error naming the entry and the key."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobplane.store.flow_sync import flow_rows
from jobplane.topology import RateLimitSpec, TopologyError, parse_topology

_QUEUE = {"name": "q", "bindings": ["#"]}


def _parse(limits: list[dict[str, Any]], **queue: Any) -> Any:
    return parse_topology({"queues": [{**_QUEUE, **queue}], "rate_limits": limits})


def test_a_rate_limit_is_parsed_with_its_defaults() -> None:
    topology = _parse([{"types": "partner.*", "per_second": 10, "max_running": 5}])
    assert topology.rate_limits == (
        RateLimitSpec("partner.*", ("partner.*",), per_second=10.0, burst=10.0, max_running=5),
    )
    assert topology.rate_limit("partner.call") is topology.rate_limits[0]
    assert topology.rate_limit("other.call") is None
    limits, queues = flow_rows(topology)
    assert limits[0]["regexes"] == [r"^\.partner\.[^.]+$"] and queues == []


def test_a_queue_takes_max_running_per_tenant() -> None:
    topology = _parse([], max_running_per_tenant=2)
    assert topology.queues[0].max_running_per_tenant == 2
    assert flow_rows(topology)[1] == [{"queue": "q", "max_running": 2}]


def test_a_pattern_matching_no_type_is_fine() -> None:
    assert _parse([{"types": ["nothing.here"], "max_running": 1}]).rate_limits[0].name


@pytest.mark.parametrize(
    ("limit", "message"),
    [
        ({"types": "a.*", "per_second": 0}, "per_second must be > 0"),
        ({"types": "a.*", "per_second": -1}, "per_second must be > 0"),
        ({"types": "a.*", "max_running": 0}, "max_running must be a whole number"),
        ({"types": "a.*", "max_running": 1.5}, "max_running must be a whole number"),
        ({"types": "a.*"}, "needs per_second, max_running or both"),
        ({"types": "a.*", "per_second": 1, "rate": 2}, "unknown keys ['rate']"),
        ({"types": [], "per_second": 1}, "types must be"),
        ({"types": "a..b", "per_second": 1}, "is not a job type or topic pattern"),
        ({"types": "a", "per_second": "ten"}, "per_second must be a number"),
        ({"types": "a", "per_second": 1, "burst": 0.5}, "burst must be at least 1"),
        ({"types": "a", "max_running": 1, "burst": 2}, "burst needs per_second"),
        ({"types": "a", "max_running": 1, "per_tenant": "yes"}, "per_tenant must be true"),
        ({"types": "a b", "max_running": 1}, "is not a job type"),
    ],
)
def test_a_bad_rate_limit_is_refused_naming_the_key(limit: dict[str, Any], message: str) -> None:
    with pytest.raises(TopologyError) as refused:
        _parse([limit])
    assert message in str(refused.value)
    assert "rate" in str(refused.value)


def test_two_limits_of_one_name_are_refused() -> None:
    with pytest.raises(TopologyError, match="two \\[\\[rate_limits\\]\\] are named 'x'"):
        _parse([{"name": "x", "types": "a", "max_running": 1}] * 2)


@given(st.one_of(st.integers(max_value=0), st.booleans(), st.text(), st.floats()))
def test_a_bad_max_running_per_tenant_is_refused(value: Any) -> None:
    if type(value) is int and value == 0:
        assert _parse([], max_running_per_tenant=value).queues[0].max_running_per_tenant == 0
        return
    with pytest.raises(TopologyError, match="max_running_per_tenant"):
        _parse([], max_running_per_tenant=value)


@given(st.floats(min_value=0.001, max_value=1e6), st.integers(min_value=1, max_value=10**6))
def test_any_positive_rate_and_limit_are_taken(per_second: float, max_running: int) -> None:
    spec = _parse([{"types": "a.#", "per_second": per_second, "max_running": max_running}])
    limit = spec.rate_limits[0]
    assert limit.per_second == per_second and limit.max_running == max_running
    assert limit.burst == max(1.0, per_second)
