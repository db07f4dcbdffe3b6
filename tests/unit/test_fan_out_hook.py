"""The fan-out hook, with its statements faked: the children it submits for a
FAN_OUT's items, and the refusal of an item naming a blob that is not there
(the SQL itself is pinned by tests/integration/test_fan_out*.py)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any, cast

import asyncpg
import pytest
from sqlalchemy.exc import IntegrityError

from jobplane.errors import BlobReferenceNotFound
from jobplane.store.machine import Cause, StateMachine, Transition
from jobplane.store.machine.fanout import FanOut
from jobplane.store.machine.hooks import Change
from jobplane.types import JobState

_JOB, _TENANT = uuid.UUID(int=0x10B), uuid.UUID(int=0x7E)
_DEADLINE = datetime(2040, 1, 1, tzinfo=UTC)
_ROW = {
    "id": _JOB,
    "tenant_id": _TENANT,
    "type": "fan.pipeline",
    "queue": "fan.work",
    "stage": 1,
    "attempt": 2,
    "max_attempts": 4,
    "correlation_id": None,
    "timeout_seconds": 30,
    "deadline": _DEADLINE,
}


class _Rows:
    def mappings(self) -> _Rows:
        return self

    def all(self) -> list[dict[str, Any]]:
        return []


class _Conn:
    """A connection whose every statement returns no rows."""

    async def execute(self, statement: Any, binds: Any = None) -> _Rows:
        return _Rows()


class _Machine:
    """Submits every child asked for, or fails the submit with ``refusal``."""

    def __init__(self, refusal: Exception | None = None) -> None:
        self.refusal = refusal
        self.submitted: list[dict[str, Any]] = []

    async def apply(
        self, conn: Any, transition: Transition, params: dict[str, Any], cause: Cause
    ) -> list[dict[str, Any]]:
        assert transition is Transition.SUBMIT
        if self.refusal is not None:
            raise self.refusal
        self.submitted.append(params)
        return [{"id": job_id} for job_id in params["new_id"]]


async def _fan_out(machine: _Machine, items: list[dict[str, Any]]) -> None:
    hook = FanOut()
    hook.machine = cast(StateMachine, machine)
    cause = Cause("stage split succeeded", items=items)
    await hook.after(_Conn(), Change(Transition.FAN_OUT, _ROW, JobState.RUNNING, cause))  # type: ignore[arg-type]


async def test_each_item_is_a_child_of_the_job_under_its_settings() -> None:
    machine = _Machine()
    await _fan_out(machine, [{"i": 0}, {"i": 1}])
    (params,) = machine.submitted
    assert params["tenant_id"] == _TENANT
    # Submitted in request_id order: the item's index is the last part.
    assert params["new_request_id"] == [f"fan:{_JOB}:1:2:{i}" for i in range(2)]
    assert params["new_payload"] == ['{"i":0}', '{"i":1}']
    assert params["new_parent_id"] == [_JOB, _JOB]
    assert (params["new_type"], params["new_queue"]) == (["fan.pipeline"] * 2, ["fan.work"] * 2)
    assert (params["new_max_attempts"], params["new_timeout_seconds"]) == ([4, 4], [30.0, 30.0])
    assert (params["new_correlation_id"], params["new_deadline"]) == (["", ""], [_DEADLINE] * 2)


async def test_an_item_naming_a_blob_that_is_not_there_is_refused_naming_the_items() -> None:
    gone = asyncpg.PostgresError.new({"C": "23503", "M": "violates foreign key", "S": "ERROR"})
    machine = _Machine(IntegrityError("INSERT INTO jobs ...", {}, gone))
    with pytest.raises(BlobReferenceNotFound) as refused:
        await _fan_out(machine, [{"doc": "blobs/" + "0" * 64}])
    assert (refused.value.field, refused.value.message) == (
        "items",
        "the payload references a blob that does not exist",
    )
