"""A worker's presence: its registration in the database, kept live by a heartbeat.

Other workers read it to decide, for a job they have no handler for, whether
to hand it back (someone live handles it) or park it (nobody does). On start
and on every beat the worker also re-dispatches the parked jobs it can run:
the beat covers a job parked by a worker that had not yet seen this one.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Sequence

import structlog
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane import __version__
from jobplane.ids import new_id
from jobplane.logs import describe_error
from jobplane.store.attempts import AttemptStore
from jobplane.store.workers import WorkerStore
from jobplane.tasks import cancel_and_wait

log = structlog.get_logger("jobplane.worker")

# Registrations dead for longer than this are deleted by any worker's beat.
_FORGET_AFTER = 7 * 24 * 3600.0


class Presence:
    """Registers one worker, beats every ``interval`` s, marks it stopped at the end."""

    def __init__(
        self,
        engine: AsyncEngine,
        attempts: AttemptStore,
        *,
        types: Sequence[str],
        queues: Sequence[str],
        concurrency: int,
        interval: float = 5.0,
    ) -> None:
        self.id: uuid.UUID = new_id()
        self._store = WorkerStore(engine)
        self._attempts = attempts
        self._types = list(types)
        self._queues = list(queues)
        self._concurrency = concurrency
        self._interval = interval
        # Three beats may be missed before others stop counting on us.
        self._ttl = interval * 3 + 1.0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register, re-dispatch the parked jobs we can run, and keep beating."""
        await self._register()
        await self._unpark()
        self._task = asyncio.create_task(self._loop(), name="jobplane-worker-presence")

    async def stop(self) -> None:
        """Stop beating and say so, so that nobody waits for us."""
        await cancel_and_wait(self._task)
        self._task = None
        try:
            await self._store.stop(self.id)
        except Exception as exc:
            # We expire by ourselves after the lifetime we registered with.
            log.warning("worker.presence.stop_failed", error=describe_error(exc))

    async def _register(self) -> None:
        await self._store.register(
            self.id,
            host=socket.gethostname(),
            pid=os.getpid(),
            types=self._types,
            queues=self._queues,
            concurrency=self._concurrency,
            version=__version__,
            ttl=self._ttl,
        )

    async def _unpark(self) -> None:
        while True:
            count = await self._attempts.unpark(self._types, self._queues)
            if count:
                log.info("worker.jobs.unparked", jobs=count)
            if count < 500:
                return

    async def _loop(self) -> None:
        beats = 0
        while True:
            await asyncio.sleep(self._interval)
            beats += 1
            try:
                if not await self._store.beat(self.id, ttl=self._ttl):
                    # Our row was pruned while we could not beat: come back.
                    await self._register()
                await self._unpark()
                if beats % 100 == 1:
                    await self._store.prune(older_than=_FORGET_AFTER)
            except Exception as exc:
                # A beat that fails is retried at the next one; the loop must
                # not die, or we would look dead to the others for good.
                log.warning("worker.presence.beat_failed", error=describe_error(exc))
