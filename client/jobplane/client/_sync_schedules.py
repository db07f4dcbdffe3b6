"""The schedule calls of the blocking :class:`~jobplane.client.Client`: each runs
:class:`~jobplane.client.AsyncClient`'s on the client's loop (docs/scheduling.md)."""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from jobplane.schedule_types import Overlap, Schedule, SchedulePage
from jobplane.types import Job

if TYPE_CHECKING:
    from jobplane.client._loop import LoopThread
    from jobplane.client.aio import AsyncClient


class SyncScheduleCalls:
    """ScheduleService, blocking; the arguments are :class:`AsyncClient`'s."""

    _async: AsyncClient
    _loop: LoopThread

    def create_schedule(
        self, type: str, payload: dict[str, Any] | None = None, **options: Any
    ) -> Schedule:
        """A schedule that submits a job of ``type`` on every tick; see
        :meth:`AsyncClient.create_schedule`."""
        return self._loop.run(self._async.create_schedule(type, payload, **options))

    def get_schedule(self, name: str | Schedule) -> Schedule:
        """The schedule as stored now."""
        return self._loop.run(self._async.get_schedule(name))

    def list_schedules(self, *, page_size: int = 0, page_token: str = "") -> SchedulePage:
        """One page of the caller's schedules, newest first."""
        return self._loop.run(
            self._async.list_schedules(page_size=page_size, page_token=page_token)
        )

    def iter_schedules(self, *, page_size: int = 0) -> Generator[Schedule, None, None]:
        """Every schedule of the caller, page after page."""
        token = ""
        while True:
            page = self.list_schedules(page_size=page_size, page_token=token)
            yield from page.schedules
            if not page.next_page_token:
                return
            token = page.next_page_token

    def update_schedule(self, name: str | Schedule, **changes: Any) -> Schedule:
        """Change the fields given; see :meth:`AsyncClient.update_schedule`."""
        return self._loop.run(self._async.update_schedule(name, **changes))

    def pause_schedule(self, name: str | Schedule) -> Schedule:
        """Stop its ticks until :meth:`resume_schedule`."""
        return self._loop.run(self._async.pause_schedule(name))

    def resume_schedule(self, name: str | Schedule) -> Schedule:
        """Tick again, from the first tick after now."""
        return self._loop.run(self._async.resume_schedule(name))

    def trigger_schedule(
        self, name: str | Schedule, *, request_id: str = "", overlap: Overlap | None = None
    ) -> Job:
        """Submit one run now (``overlap``: as :meth:`AsyncClient.trigger_schedule`); the job."""
        return self._loop.run(
            self._async.trigger_schedule(name, request_id=request_id, overlap=overlap)
        )

    def delete_schedule(self, name: str | Schedule) -> None:
        """Delete it; the jobs it started stay."""
        self._loop.run(self._async.delete_schedule(name))
