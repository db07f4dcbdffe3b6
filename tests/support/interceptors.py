"""A worker interceptor that writes down each seam it sees, in order."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Any

from jobplane.store.attempts import ClaimResult
from jobplane.store.machine import Transition
from jobplane.topology import Topology


class Recording:
    """Each seam as ``name.what`` in ``seen`` (shared by several to see their order).

    ``run``: whether :meth:`started` follows the run; its handler's context is
    a copy of the current one, kept in :attr:`contexts`.
    """

    def __init__(self, name: str, seen: list[str] | None = None, *, run: bool = True) -> None:
        self.name = name
        self.seen = [] if seen is None else seen
        self.run = run
        self.contexts: list[contextvars.Context] = []
        #: The (envelope, message) of each claim it saw.
        self.claims: list[tuple[Any, Any]] = []

    def saw(self, what: str) -> None:
        self.seen.append(f"{self.name}.{what}")

    def known(
        self, slots: Callable[[], tuple[int, int]], topology: Topology, types: Iterable[str]
    ) -> None:
        self.saw(f"known:{slots()}:{','.join(sorted(types))}")

    @contextlib.contextmanager
    def _block(self, what: str) -> Iterator[None]:
        self.saw(f"{what}>")
        try:
            yield
        finally:
            self.saw(f"<{what}")

    def delivered(
        self, headers: Mapping[str, Any] | None
    ) -> contextlib.AbstractContextManager[Any]:
        return self._block("delivered")

    async def claim(
        self, envelope: Any, message: Any, claim: Callable[[], Awaitable[ClaimResult]]
    ) -> ClaimResult:
        self.claims.append((envelope, message))
        with self._block("claim"):
            found = await claim()
            self.saw(f"claimed:{found.status.value}")
            return found

    def applied(self, transition: Transition) -> None:
        self.saw(f"applied:{transition.value}")

    def grouped(self, kind: str, size: int) -> None:
        self.saw(f"grouped:{kind}:{size}")

    def submitted(self, job_type: str, queue: str, count: int) -> None:
        self.saw(f"submitted:{job_type}:{queue}:{count}")

    def started(self, attempt: Any) -> RecordedRun | None:
        self.saw("started")
        return RecordedRun(self) if self.run else None

    def progress(self, progress: float) -> None:
        self.saw(f"progress:{progress}")

    def outcome(self, attempt: Any) -> contextlib.AbstractContextManager[Any]:
        return self._block("outcome")

    def ended(self, attempt: Any, outcome: str, seconds: float) -> None:
        assert seconds >= 0
        self.saw(f"ended:{outcome}")


class RecordedRun:
    """One run :class:`Recording` follows."""

    def __init__(self, owner: Recording) -> None:
        self.owner = owner

    def context(self) -> contextvars.Context:
        self.owner.saw("context")
        context = contextvars.copy_context()
        self.owner.contexts.append(context)
        return context

    def ended(self, error: BaseException | None) -> None:
        self.owner.saw(f"run.ended:{type(error).__name__}")
