"""Progress of running attempts: queued per attempt, written for all of a worker's
attempts together in one statement per window (see ADR-0005)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
from sqlalchemy.exc import DBAPIError

from jobplane.logs import describe_error
from jobplane.store.attempts import Attempt, AttemptStore, LeaseLost, ProgressUpdate
from jobplane.store.down import database_error_name, database_transient
from jobplane.tasks import cancel_and_wait

log = structlog.get_logger("jobplane.worker")

# The longest wait before writing progress again after failed flushes.
_MAX_RETRY_DELAY = 2.0


class ProgressRefused(Exception):
    """The database refused this attempt's progress reports for what they hold."""


class ProgressFlusher:
    """Writes the queued progress of all of a worker's attempts together.

    At most ``window`` seconds after the first unwritten report, everything
    queued by every running attempt goes out in one statement and one
    transaction (one NOTIFY per job): the number of transactions per second
    no longer grows with the number of jobs reporting progress.
    """

    def __init__(self, store: AttemptStore, *, window: float = 0.005) -> None:
        self._store = store
        self._window = window
        self._dirty: dict[int, ProgressWriter] = {}
        self._lock = asyncio.Lock()
        self._timer: asyncio.Task[None] | None = None
        self._stopped = False
        # Flushes that failed in a row: while the database is down the next
        # try waits longer each time instead of every window.
        self._failures = 0

    def mark(self, writer: ProgressWriter) -> None:
        """``writer`` has reports to write: flush within the window."""
        self._dirty[id(writer)] = writer
        if self._timer is None and not self._stopped:
            self._timer = asyncio.create_task(self._flush_later())

    def forget(self, writer: ProgressWriter) -> None:
        """``writer`` hands its reports over itself (to its outcome)."""
        self._dirty.pop(id(writer), None)

    async def _flush_later(self) -> None:
        await asyncio.sleep(min(self._window * 2**self._failures, _MAX_RETRY_DELAY))
        self._timer = None
        try:
            await self.flush()
        except Exception as exc:
            # The reports stay queued; the next flush or the outcome writes them.
            self._failures = min(self._failures + 1, 16)
            log.warning("worker.progress.retry", error=describe_error(exc))
        else:
            self._failures = 0

    async def flush(self) -> None:
        """Write what every attempt has queued now, in one transaction."""
        async with self._lock:
            writers = list(self._dirty.values())
            self._dirty.clear()
            batches = [(w, w.take()) for w in writers]
            batches = [(w, b) for w, b in batches if b]
            if not batches:
                return
            done = asyncio.get_running_loop().create_future()
            for writer, _ in batches:
                writer.inflight = done
            try:
                written = await self._store.write_progress_many(
                    [(w.attempt, b) for w, b in batches]
                )
            except DBAPIError as exc:
                if database_transient(exc):
                    self._put_back(batches)
                    raise
                # Refused for what it holds: find whose reports, so that one
                # attempt's bad value does not hold up everyone's progress.
                await self._one_by_one(batches)
            except BaseException:
                self._put_back(batches)
                raise
            else:
                for (writer, _), cancel in zip(batches, written, strict=True):
                    writer.written(cancel)
            finally:
                for writer, _ in batches:
                    writer.inflight = None
                done.set_result(None)

    async def _one_by_one(self, batches: list[tuple[ProgressWriter, list[ProgressUpdate]]]) -> None:
        for index, (writer, batch) in enumerate(batches):
            try:
                [cancel] = await self._store.write_progress_many([(writer.attempt, batch)])
            except DBAPIError as exc:
                if database_transient(exc):
                    self._put_back(batches[index:])
                    raise
                log.error(
                    "worker.progress.refused",
                    job=f"jobs/{writer.attempt.job_id}",
                    attempt=writer.attempt.attempt,
                    error=database_error_name(exc),
                )
                writer.refused(database_error_name(exc))
            except BaseException:
                self._put_back(batches[index:])
                raise
            else:
                writer.written(cancel)

    def _put_back(self, batches: list[tuple[ProgressWriter, list[ProgressUpdate]]]) -> None:
        for writer, batch in batches:
            writer.put_back(batch)
            self.mark(writer)

    async def stop(self) -> None:
        """Stop the timer (attempts still running write with their outcome)."""
        self._stopped = True
        await cancel_and_wait(self._timer)
        self._timer = None


class ProgressWriter:
    """One attempt's queued progress reports, written by a :class:`ProgressFlusher`.

    A report is queued and written with the next flush; the outcome commit
    takes what is still queued into its own transaction.
    """

    def __init__(
        self,
        flusher: ProgressFlusher,
        attempt: Attempt,
        *,
        high_water: int = 500,
        on_cancel_requested: Callable[[], None] = lambda: None,
        on_progress: Callable[[float], None] | None = None,
    ) -> None:
        self._flusher = flusher
        self.attempt = attempt
        self._high_water = high_water
        self._on_cancel_requested = on_cancel_requested
        # The process's interceptor sees each report (tracing: an event on the
        # handler's span); None when nothing observes the worker.
        self._on_progress = on_progress
        self._pending: list[ProgressUpdate] = []
        self._error: BaseException | None = None
        self.inflight: asyncio.Future[None] | None = None

    async def add(self, update: ProgressUpdate) -> None:
        """Queue ``update``; raise what the last flush found (e.g. LeaseLost)."""
        if self._error is not None:
            raise self._error
        if self._on_progress is not None:
            self._on_progress(update.progress)
        self._pending.append(update)
        self._flusher.mark(self)
        if len(self._pending) >= self._high_water:
            # Back-pressure on a handler reporting faster than we write.
            await self._flusher.flush()
            if self._error is not None:
                raise self._error

    def take(self) -> list[ProgressUpdate]:
        """Hand the queued reports to a flush (none after a fence-out)."""
        if self._error is not None:
            return []
        batch, self._pending = self._pending, []
        return batch

    def put_back(self, batch: list[ProgressUpdate]) -> None:
        """A flush failed: its reports come first again."""
        self._pending[:0] = batch

    def refused(self, why: str) -> None:
        """The database refused our reports: the handler learns it at its next one."""
        self._error = ProgressRefused(
            f"jobs/{self.attempt.job_id} attempt {self.attempt.attempt}: the database refused "
            f"its progress reports ({why})"
        )
        self._pending.clear()

    def written(self, cancel_requested: bool | None) -> None:
        """The result of a flush for this attempt (None: fenced out)."""
        if cancel_requested is None:
            self._error = LeaseLost(
                f"jobs/{self.attempt.job_id} attempt {self.attempt.attempt} was fenced out"
            )
            self._pending.clear()
        elif cancel_requested:
            self._on_cancel_requested()

    async def drain(self) -> list[ProgressUpdate]:
        """Wait for a flush carrying our reports, then hand over what is still queued."""
        while self.inflight is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.inflight)
        # No await from here on: no flush can take reports in between.
        self._flusher.forget(self)
        batch, self._pending = self._pending, []
        return batch
