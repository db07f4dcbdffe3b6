"""Named fault points, for tests that must break a process at an exact place.

A point is armed through ``JOBPLANE_FAULTS`` (comma separated). Unarmed points
cost one check of an empty set. ``NAME`` raises :class:`InjectedFault` at every
hit; ``crash:NAME`` ends the process at its first hit, ``crash:NAME@N`` at its
N-th, with ``os._exit`` — as a SIGKILL would: no ``finally`` blocks, nothing
flushed, no ack sent.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


class InjectedFault(RuntimeError):
    """A fault point armed for a test fired."""


class FaultPoints:
    """The set of armed points, e.g. ``{"submit.after_commit"}``."""

    __slots__ = ("_armed", "_crash_at", "_hits")

    def __init__(self, armed: Iterable[str] = ()) -> None:
        self._armed: frozenset[str] = frozenset()
        self._crash_at: dict[str, int] = {}
        self._hits: dict[str, int] = {}
        plain = set()
        for spec in armed:
            if spec.startswith("crash:"):
                name, _, nth = spec[len("crash:") :].partition("@")
                self._crash_at[name] = int(nth or 1)
            else:
                plain.add(spec)
        self._armed = frozenset(plain)

    def hit(self, name: str) -> None:
        """Raise, or end the process, if ``name`` is armed (see the module doc)."""
        if not self._armed and not self._crash_at:
            return
        if name in self._armed:
            raise InjectedFault(name)
        if name in self._crash_at:
            self._hits[name] = self._hits.get(name, 0) + 1
            if self._hits[name] >= self._crash_at[name]:
                os._exit(137)


NO_FAULTS = FaultPoints()
