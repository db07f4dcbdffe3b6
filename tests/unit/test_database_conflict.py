"""A deadlock or a serialization failure that reaches a call is ABORTED, never
INTERNAL: the transaction was rolled back for another's sake and the same
call passes when repeated; the store runs such a transaction again itself."""

from __future__ import annotations

import uuid
from typing import Any, cast

import asyncpg
import grpc
import pytest
import structlog
from sqlalchemy.ext.asyncio import create_async_engine

from jobplane.errors import Aborted, InvalidArgument
from jobplane.server.status import error_for, to_grpc_status
from jobplane.store import jobs as jobs_module
from jobplane.store.db import Database, _wrapped
from jobplane.store.down import CONFLICT_TRIES, again_on_conflict
from jobplane.store.jobs import JobStore
from jobplane.types import Job, JobState
from tests.support.db_errors import asyncpg_error, through_sqlalchemy
from tests.support.jobs import stored_job
from tests.support.logs import module_lines

log = structlog.get_logger("tests")
_TENANT, _JOB = uuid.UUID(int=1), uuid.UUID(int=2)


@pytest.mark.parametrize("state", ["40P01", "40001"])  # deadlock, serialization failure
def test_a_conflict_is_aborted_with_a_retry_delay(state: str) -> None:
    raw = asyncpg_error(state)
    for error in (raw, through_sqlalchemy(raw), _wrapped(raw, "SELECT 1", None)):
        answer = error_for(error, "CancelJob")
        assert isinstance(answer, Aborted), repr(error)
        assert answer.code is grpc.StatusCode.ABORTED
        assert answer.retry_delay is not None and answer.retry_delay > 0
        assert to_grpc_status(answer).code is grpc.StatusCode.ABORTED


def test_a_deadlock_from_asyncpg_is_its_deadlock_class() -> None:
    assert isinstance(asyncpg_error("40P01"), asyncpg.DeadlockDetectedError)


class _Flaky:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "done"


async def test_a_transaction_runs_again_after_conflicts() -> None:
    op = _Flaky([through_sqlalchemy(asyncpg_error("40P01")), asyncpg_error("40001")])
    assert await again_on_conflict(op, log, "test") == "done"
    assert op.calls == 3


async def test_a_conflict_every_time_is_raised_after_the_last_try() -> None:
    op = _Flaky([asyncpg_error("40P01") for _ in range(CONFLICT_TRIES)])
    with pytest.raises(asyncpg.DeadlockDetectedError):
        await again_on_conflict(op, log, "test")
    assert op.calls == CONFLICT_TRIES


@pytest.mark.parametrize(
    "failure", [asyncpg_error("42P01"), InvalidArgument("no", field="x"), RuntimeError("bug")]
)
async def test_any_other_failure_is_raised_at_once(failure: Any) -> None:
    op = _Flaky([failure])
    with pytest.raises(type(failure)):
        await again_on_conflict(op, log, "test")
    assert op.calls == 1


def _stored(state: JobState) -> Job:
    return stored_job(f"jobs/{_JOB}", state=state, attempt=1, max_attempts=1, request_id="r")


async def test_a_job_call_run_again_after_a_conflict_says_which_call_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An engine never connected: each call's transaction is faked.
    engine = create_async_engine("postgresql+asyncpg://nobody@127.0.0.1:1/none")
    store = JobStore(engine, cast(Database, None))
    running, queued = _stored(JobState.RUNNING), _stored(JobState.QUEUED)
    cancel = _Flaky([asyncpg_error("40P01")])
    retry = _Flaky([asyncpg_error("40001")])

    async def cancelled(*args: Any) -> tuple[Job, Job, list[str]]:
        await cancel()
        return running, running, []

    async def retried(*args: Any) -> Job:
        await retry()
        return queued

    monkeypatch.setattr(store, "_cancel", cancelled)
    monkeypatch.setattr(store, "_retry", retried)
    with module_lines(monkeypatch, jobs_module, "jobplane.store") as lines:
        assert await store.cancel(_TENANT, _JOB, "") is running
        assert await store.retry(_TENANT, _JOB) is queued
    assert (cancel.calls, retry.calls) == (2, 2)
    assert [(line["event"], line["log_level"], line["what"]) for line in lines] == [
        ("database.conflict.retry", "info", "cancel"),
        ("database.conflict.retry", "info", "retry"),
    ]
    assert [line["error"] for line in lines] == [
        f"asyncpg.exceptions.{name}: [message withheld: sqlstate={state}]"
        for name, state in (("DeadlockDetectedError", "40P01"), ("SerializationError", "40001"))
    ]
