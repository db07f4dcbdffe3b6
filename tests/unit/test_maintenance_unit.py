"""The maintenance handlers' payload rules and their retry of a transient statement failure."""

from __future__ import annotations

import uuid

import pytest

from jobplane.store.maintenance import Tenant
from jobplane.workers import maintenance
from jobplane.workers.handlers import PermanentError
from tests.support.logs import module_lines


class _Deadlock(Exception):
    sqlstate = "40P01"


class _Refused(Exception):
    sqlstate = "23505"


def _tenant(days: int | None) -> Tenant:
    return Tenant(uuid.uuid4(), "acme", days)


def test_the_horizon_is_the_tenants_and_a_payload_only_keeps_more() -> None:
    assert maintenance._horizon({}, _tenant(30)) == 30
    assert maintenance._horizon({}, _tenant(None)) is None
    assert maintenance._horizon({"older_than_days": 30}, _tenant(30)) == 30
    assert maintenance._horizon({"older_than_days": 90}, _tenant(30)) == 90
    for payload, tenant in (
        ({"older_than_days": 29}, _tenant(30)),
        ({"older_than_days": 30}, _tenant(None)),
        ({"older_than_days": 0}, _tenant(30)),
        ({"older_than_days": 30.5}, _tenant(30)),
        ({"older_than_days": True}, _tenant(1)),
        ({"older_than_days": "40"}, _tenant(30)),
    ):
        with pytest.raises(PermanentError) as refused:
            maintenance._horizon(payload, tenant)
        assert refused.value.code == "INVALID_PAYLOAD", payload


def test_batch_sizes_and_unknown_fields() -> None:
    assert maintenance._batch_size({}) == maintenance.DEFAULT_BATCH
    assert maintenance._batch_size({"batch_size": 1}) == 1
    assert maintenance._batch_size({"batch_size": 10_000}) == 10_000
    for bad in (0, 10_001, -1, "10", 2.5):
        with pytest.raises(PermanentError):
            maintenance._batch_size({"batch_size": bad})
    maintenance._only({"batch_size": 5}, frozenset({"batch_size"}))
    with pytest.raises(PermanentError, match="tenant"):
        maintenance._only({"tenant": "globex"}, frozenset({"batch_size"}))


async def test_a_deadlocked_statement_is_tried_again_and_a_refused_one_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    async def deadlocks_twice() -> int:
        calls.append(1)
        if len(calls) <= 2:
            raise _Deadlock("deadlock detected")
        return 7

    with module_lines(monkeypatch, maintenance, "jobplane.maintenance.retries") as lines:
        assert await maintenance._again_if_transient(deadlocks_twice) == 7
    assert len(calls) == 3
    # Tried again soon (a deadlock is over once Postgres has ended one side),
    # a little later each time.
    assert [(line["event"], line["delay"]) for line in lines] == [
        ("maintenance.batch.retry", 0.1),
        ("maintenance.batch.retry", 0.2),
    ]

    refusals = []

    async def refused() -> int:
        refusals.append(1)
        raise _Refused("duplicate key")

    with pytest.raises(_Refused):
        await maintenance._again_if_transient(refused)
    assert len(refusals) == 1
