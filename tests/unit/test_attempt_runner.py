"""A claimed attempt run to its end and its outcome written, over a fake store.

The store's outcome builders return plain tuples and ``finish`` records each
with the progress committed alongside it, so what the worker writes (and
what an interceptor sees) is checked without Postgres.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jobplane.faults import NO_FAULTS
from jobplane.store.attempts import Attempt, ProgressUpdate, StageRun
from jobplane.topology import load_topology
from jobplane.workers import JobContext, Registry
from jobplane.workers.attempt import AttemptRunner
from jobplane.workers.interceptors import Interceptor, chain
from jobplane.workers.progress import ProgressFlusher
from tests.support.attempts import an_attempt
from tests.support.interceptors import Recording


class Store:
    """The attempt store's outcomes as tuples; each ``finish`` recorded with its progress."""

    lease_seconds = 30.0

    def __init__(self) -> None:
        self.finished: list[tuple[Any, list[ProgressUpdate]]] = []

    def groups(self, outcome: Any) -> bool:
        return False

    async def finish(self, outcome: Any, pending: list[ProgressUpdate]) -> None:
        self.finished.append((outcome, pending))

    async def write_progress_many(self, batches: Sequence[Any]) -> list[bool | None]:
        raise AssertionError("progress is written with the outcome here")

    async def heartbeat(self, attempt: Attempt) -> bool:
        return False

    def succeeded(self, attempt: Attempt, result: Any, **kwargs: Any) -> Any:
        return ("succeeded", result)

    def fanned_out(self, attempt: Attempt, items: Any, **kwargs: Any) -> Any:
        return ("fanned_out", items)

    def failed(self, attempt: Attempt, code: str, message: str, **kwargs: Any) -> Any:
        return ("failed", code, message, kwargs["retryable"])

    def retried(self, attempt: Attempt, code: str, message: str, **kwargs: Any) -> Any:
        return ("retried", code, message)


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def _line(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))

    info = warning = error = _line


def runner(registry: Registry, intercept: Interceptor | None) -> tuple[Any, Store]:
    store = Store()
    made: Any = AttemptRunner.__new__(AttemptRunner)
    made._registry, made._store, made._intercept = registry, store, intercept
    # A long window: what the handler reports is still pending at its end.
    made._progress = ProgressFlusher(store, window=60)  # type: ignore[arg-type]
    made._running, made._cancel_grace, made._db = {}, 1.0, None
    made._topology, made._blobs, made._outcomes = load_topology(), None, None
    made._max_result_bytes, made._inline_bytes = 1024, 1024
    made._retry_base_delay, made._faults = None, NO_FAULTS
    return made, store


def attempt_of(job_type: str, stage: StageRun | None = None) -> Attempt:
    return an_attempt(type=job_type, stage=stage)


async def test_progress_still_pending_is_committed_with_the_outcome() -> None:
    registry = Registry()

    @registry.handler("t.report")
    async def report(ctx: JobContext) -> dict[str, Any]:
        await ctx.progress(0.5, "half", {"rows": 1})
        return {"ok": True}

    for intercept in (None, chain([Recording("a"), Recording("b")])):
        run, store = runner(registry, intercept)
        log = Log()
        await run._run(attempt_of("t.report"), log)
        [(outcome, pending)] = store.finished
        assert outcome == ("succeeded", {"ok": True})
        assert [(p.progress, p.message, p.data) for p in pending] == [(0.5, "half", {"rows": 1})]
        assert [event for event, _ in log.lines] == ["job.started", "job.completed"]
        assert run._running == {}


async def test_a_stage_returning_what_cannot_fan_out_fails_saying_why() -> None:
    registry = Registry()

    @registry.handler("t.split")
    async def split(ctx: JobContext) -> Any:
        return [{"i": 1}, "two"]

    stage = StageRun(
        pipeline="p",
        pipeline_version="",
        name="split",
        index=0,
        count=3,
        version="",
        inputs={},
        fans_out=True,
    )
    run, store = runner(registry, None)
    await run._run(attempt_of("t.split", stage), Log())
    [(outcome, _)] = store.finished
    assert outcome == (
        "failed",
        "FAN_OUT_REFUSED",
        "item 1 is a str: each item must be an object (the child's payload)",
        False,
    )


async def test_an_interceptor_and_the_log_see_the_base_exception_the_handler_raised() -> None:
    """SystemExit and the like are carried out of the handler's task wrapped: the
    interceptor's run, the log line and the outcome name what the handler raised."""
    registry = Registry()
    stop = SystemExit(3)

    @registry.handler("t.exits")
    async def exits(ctx: JobContext) -> Any:
        raise stop

    seen = Recording("a")
    run, store = runner(registry, seen)
    log = Log()
    await run._run(attempt_of("t.exits"), log)
    [(outcome, _)] = store.finished
    assert outcome == ("retried", "HANDLER_ERROR", "SystemExit: 3")
    assert "a.run.ended:SystemExit" in seen.seen
    [(event, fields)] = [line for line in log.lines if line[0] != "job.started"]
    assert (event, fields["exc_info"]) == ("job.retry_scheduled", stop)
