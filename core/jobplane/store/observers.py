"""What a process may observe of the store's transitions: one observer it registers.

The store imports no observability. A process that traces registers an
:class:`Observer` at start (``jobplane.observe.tracing.TransitionTracing``,
registered by ``configure_tracing`` when it turns tracing on), as temporalio's
interceptors are passed in rather than imported. With none registered the
store calls nothing: each use reads :data:`OBSERVER` once and goes on when it
is None, so the off path costs one test, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from jobplane.store.machine.table import Transition

#: The binds of a transition's statement when nothing observes it: no trace
#: context for its dispatch and events, and none inherited.
NO_TRACE: Mapping[str, Any] = {"trace_parent": None, "trace_state": None, "trace_inherit": False}


class Observer(Protocol):
    """Sees each transition: the context its writes carry, and that it applied."""

    def binds(self) -> Mapping[str, Any]:
        """The trace binds of a transition about to run (the keys of :data:`NO_TRACE`).

        Read where the transition is asked for, in the caller's context, for
        the dispatch and domain events it writes.
        """
        ...

    def applied(self, transition: Transition) -> None:
        """``transition`` changed at least one row, in the caller's context."""
        ...


#: The observer registered (None: none). Read it as ``observers.OBSERVER``: an
#: import of the name would copy None for good.
OBSERVER: Observer | None = None


def register(observer: Observer | None) -> None:
    """Make ``observer`` the one that sees every transition (None: none)."""
    global OBSERVER  # noqa: PLW0603 - the one switch the hot paths read
    OBSERVER = observer


def trace_binds() -> Mapping[str, Any]:
    """The observer's binds, or :data:`NO_TRACE` when none is registered."""
    observer = OBSERVER
    return NO_TRACE if observer is None else observer.binds()
