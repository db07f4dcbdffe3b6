"""Named fault points, for tests that must break a process at an exact place.

A point is armed through ``JOBPLANE_FAULTS`` (comma separated). Unarmed points
cost one set lookup. ``raise`` points raise :class:`InjectedFault`; ``crash``
points end the process at once with ``os._exit``, as a SIGKILL would, without
running ``finally`` blocks or flushing anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


class InjectedFault(RuntimeError):
    """A fault point armed for a test fired."""


class FaultPoints:
    """The set of armed points, e.g. ``{"submit.after_job_insert"}``."""

    __slots__ = ("_armed",)

    def __init__(self, armed: Iterable[str] = ()) -> None:
        self._armed = frozenset(armed)

    def hit(self, name: str) -> None:
        """Raise (or exit, for ``crash:NAME``) if ``name`` is armed."""
        if not self._armed:
            return
        if name in self._armed:
            raise InjectedFault(name)
        if f"crash:{name}" in self._armed:
            os._exit(137)


NO_FAULTS = FaultPoints()
