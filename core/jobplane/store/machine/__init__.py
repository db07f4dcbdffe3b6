"""The job state machine: every transition of a job, its table, and its hooks.

A job changes only through a named :class:`Transition`. The package holds
one concept a module:

- :mod:`~jobplane.store.machine.table`: :data:`RULES`, the one table of
  transitions: the states each may start from, the state it ends in, the row
  it matches (its fence), the guard beyond the state, the columns it sets,
  the event it appends and whether it writes the job's next dispatch; and
  :func:`where_sources`, the SQL of its from-states, so nothing else in the
  store spells a job state by hand (``tests/unit/test_machine.py`` holds the
  store to that).
- :mod:`~jobplane.store.machine.stages`: the stage machine, a table of its
  own: what each transition does to a pipeline job's stages.
- :mod:`~jobplane.store.machine.hooks`: :class:`Hook`, what follows a
  transition inside its transaction (the WatchJob event, the next dispatch,
  the stages, the signal to a cancelled attempt), and
  :mod:`~jobplane.store.machine.lifecycle`, the domain events' hook.
- :mod:`~jobplane.store.machine.compile`: each transition's statement, built
  from its rule, and the four written out.
- :mod:`~jobplane.store.machine.core`: :class:`StateMachine`, which folds the
  hooks' writes into the statements and applies them.

What a process observes of the transitions (tracing) it registers in
:mod:`jobplane.store.observers`: the store imports no observability.
See ADR-0010 and ADR-0036.
"""

from __future__ import annotations

from jobplane.store.machine.compile import BIND_TYPES, HEARTBEAT, SUBMIT_COLUMNS
from jobplane.store.machine.core import (
    ALL,
    MACHINE,
    Returning,
    StateMachine,
    builtin_hooks,
    fetch_rows,
)
from jobplane.store.machine.hooks import (
    AnyConn,
    BlobReferences,
    CancelSignal,
    Cause,
    Change,
    Dispatches,
    Emitted,
    Hook,
    JobEvents,
    NewStage,
    Row,
    Stages,
    Write,
)
from jobplane.store.machine.lifecycle import (
    MAX_EMITTED_BYTES,
    MAX_EMITTED_EVENTS,
    DomainEvents,
    lifecycle_event_id,
)
from jobplane.store.machine.table import (
    ATTEMPT_FENCE,
    RULES,
    Lifecycle,
    Phase,
    Rule,
    Transition,
    state_is,
    where_phases,
    where_sources,
)

__all__ = [
    "ALL",
    "ATTEMPT_FENCE",
    "BIND_TYPES",
    "HEARTBEAT",
    "MACHINE",
    "MAX_EMITTED_BYTES",
    "MAX_EMITTED_EVENTS",
    "RULES",
    "SUBMIT_COLUMNS",
    "AnyConn",
    "BlobReferences",
    "CancelSignal",
    "Cause",
    "Change",
    "Dispatches",
    "DomainEvents",
    "Emitted",
    "Hook",
    "JobEvents",
    "Lifecycle",
    "NewStage",
    "Phase",
    "Returning",
    "Row",
    "Rule",
    "Stages",
    "StateMachine",
    "Transition",
    "Write",
    "builtin_hooks",
    "fetch_rows",
    "lifecycle_event_id",
    "state_is",
    "where_phases",
    "where_sources",
]
