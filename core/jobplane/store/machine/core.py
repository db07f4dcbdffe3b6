"""The :class:`StateMachine`: compiles each transition's statement with its hooks' writes,
and applies it; :data:`MACHINE`, the one every store uses unless given another.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from jobplane.store import observers
from jobplane.store.db import Conn, Database
from jobplane.store.machine.compile import (
    BIND,
    BIND_TYPES,
    WRITTEN_OUT,
    changes,
    changes_many,
)
from jobplane.store.machine.dependencies import RESOLUTIONS, settle
from jobplane.store.machine.fanout import FanOut, FanProgress
from jobplane.store.machine.hooks import (
    AfterFn,
    AnyConn,
    BlobReferences,
    CancelSignal,
    Cause,
    Change,
    Dependencies,
    Dispatches,
    Hook,
    JobEvents,
    Row,
    Stages,
    _After,
)
from jobplane.store.machine.lifecycle import DomainEvents
from jobplane.store.machine.table import ENDS, RULES, Transition
from jobplane.store.rows import JOB_FIELDS
from jobplane.types import JobState


def builtin_hooks(*, lifecycle: bool = True) -> list[Hook]:
    """What every transition writes: its event, its dispatch, its signal, its domain events.

    ``lifecycle``: whether transitions publish their lifecycle events (a
    process sets :data:`MACHINE`'s from its settings'
    ``JOBPLANE_LIFECYCLE_EVENTS``: :meth:`StateMachine.set_lifecycle_events`).
    """
    return [
        JobEvents(),
        Dispatches(),
        CancelSignal(),
        Stages(),
        BlobReferences(),
        Dependencies(),
        FanOut(),
        FanProgress(),
        DomainEvents(lifecycle=lifecycle),
    ]


# What a caller wants back from a statement: columns of j (job columns, plus
# those a special statement adds: see each one).
Returning = tuple[str, ...]
ALL: Returning = JOB_FIELDS
# A transition nobody gave a reason: no message, data or emitted events.
_NO_CAUSE = Cause()
# What an end returns besides what its caller asks for: whether the job has
# dependents to settle in the end's transaction (ADR-0045).
_SETTLES: Returning = ("id", "has_dependents")


@dataclass(frozen=True, slots=True)
class _Compiled:
    statement: TextClause
    hooks: tuple[Hook, ...]  # whose binds it needs
    after: tuple[Hook, ...]  # whose after() runs


class StateMachine:
    """Compiles each transition's statement with its hooks' writes, and applies it."""

    def __init__(self, hooks: Iterable[Hook] | None = None, *, lifecycle: bool = True) -> None:
        self._hooks: list[Hook] = (
            builtin_hooks(lifecycle=lifecycle) if hooks is None else list(hooks)
        )
        for hook in self._hooks:
            if isinstance(hook, FanOut):
                hook.machine = self
        self._compiled: dict[tuple[Transition, Returning], _Compiled] = {}
        self._many: dict[
            tuple[Transition, Returning, str], tuple[TextClause, tuple[str, ...], tuple[str, ...]]
        ] = {}

    def register(self, hook: Hook) -> Hook:
        """Add ``hook`` after those registered; statements are compiled anew."""
        if isinstance(hook, FanOut):
            hook.machine = self
        self._hooks.append(hook)
        self._compiled.clear()
        self._many.clear()
        return hook

    @property
    def lifecycle_events(self) -> bool:
        """Whether transitions write their lifecycle events (:meth:`set_lifecycle_events`)."""
        return any(isinstance(h, DomainEvents) and h.lifecycle for h in self._hooks)

    def set_lifecycle_events(self, enabled: bool) -> None:
        """Turn the transitions' lifecycle events on or off (emitted events stay)."""
        for hook in self._hooks:
            if isinstance(hook, DomainEvents):
                hook.lifecycle = enabled
        self._compiled.clear()
        self._many.clear()

    def on(self, transitions: Iterable[Transition], fn: AfterFn) -> Hook:
        """Run ``fn(conn, change)`` after each of ``transitions``, in its transaction."""
        return self.register(_After(fn, frozenset(transitions)))

    def in_transaction(self, *transitions: Transition) -> bool:
        """Whether ``transitions`` must run in a transaction (a hook runs after them)."""
        return any(h.follows(t) for h in self._hooks for t in transitions)

    def connect(
        self, engine: AsyncEngine, auto: AsyncEngine, *transitions: Transition, many: bool = False
    ) -> AbstractAsyncContextManager[AsyncConnection]:
        """A connection for ``transitions``: autocommit when they are one statement.

        ``many``: the caller runs more than one statement in it.
        """
        if many or self.in_transaction(*transitions):
            return engine.begin()
        return auto.connect()

    def session(
        self, db: Database, *transitions: Transition, many: bool = False
    ) -> AbstractAsyncContextManager[Conn]:
        """:meth:`connect` on the hot paths' :class:`~jobplane.store.db.Database`."""
        if many or self.in_transaction(*transitions):
            return db.begin()
        return db.connect()

    def statement(self, transition: Transition, returning: Returning = ALL) -> TextClause:
        """The statement of ``transition`` (or of its group, for the hand-back)."""
        return self._compile(transition, returning).statement

    async def apply(
        self,
        conn: AnyConn,
        transition: Transition,
        params: Mapping[str, Any],
        cause: Cause = _NO_CAUSE,
        *,
        returning: Returning = ALL,
        settles: bool = True,
    ) -> Sequence[Row]:
        """Run ``transition``; the changed rows (none when it was refused).

        Hooks' writes ran in the statement; their :meth:`Hook.after` run now,
        for each changed row, on ``conn`` (which must be in a transaction
        when any does: see :meth:`connect`). A transition that ends jobs
        then settles their dependents on ``conn`` (``settles``: the caller
        does it itself), which must be in a transaction too (ADR-0045).
        """
        if settles and _autocommit(conn) and _ends(_group(transition)):
            # An end and the settling of its dependents commit together.
            assert isinstance(conn, Conn)
            async with conn.transaction():
                return await self.apply(conn, transition, params, cause, returning=returning)
        compiled = self._compile(transition, returning)
        binds = dict(params)
        for t in _group(transition):
            for hook in compiled.hooks:
                binds.update(hook.binds(t, cause))
        rows = await fetch_rows(conn, compiled.statement, binds)
        # Read once: with no observer registered, nothing more is called.
        observer = observers.OBSERVER
        if observer is not None and rows:
            observer.applied(transition)
        if compiled.after:
            for row in rows:
                done = Transition(row["transition"])
                from_state = None if row["from_state"] is None else JobState(row["from_state"])
                change = Change(done, row, from_state, cause)
                for hook in compiled.after:
                    if hook.follows(done):
                        await hook.after(conn, change)
        if settles and _ends(_group(transition)):
            await settle(self, conn, [row["id"] for row in rows if row["has_dependents"]])
        return rows

    def prepare(
        self, transition: Transition, params: Mapping[str, Any], cause: Cause = _NO_CAUSE
    ) -> dict[str, Any]:
        """The binds of one application of ``transition``: ``params`` and its hooks' binds.

        Taken where the application is asked for, so what a hook reads from
        the caller's context (its trace span) is the caller's, even when the
        row is applied later with others (:meth:`apply_many`).
        """
        binds = dict(params)
        for t in _group(transition):
            for hook in self._hooks:
                binds.update(hook.binds(t, cause))
        return binds

    def groupable(self, transition: Transition) -> bool:
        """Whether :meth:`apply_many` can apply ``transition``: one fenced ``UPDATE``
        built from its rule, with no :meth:`Hook.after` (which runs per row in a
        transaction)."""
        return transition not in WRITTEN_OUT and not self.in_transaction(transition)

    async def apply_many(
        self,
        conn: AnyConn,
        transition: Transition,
        rows: Sequence[Mapping[str, Any]],
        *,
        returning: Returning = ALL,
    ) -> list[Row | None]:
        """Apply ``transition`` to many jobs in one statement; for each of ``rows``
        (binds from :meth:`prepare`), in order, its changed row or None (refused).

        Each row is fenced by its own binds exactly as :meth:`apply` fences
        one, the jobs are locked in id order (two such statements never
        deadlock), and the hooks' writes apply to each changed row as they
        would alone. Two rows for one job change it once (either of them).
        """
        if not self.groupable(transition):
            raise ValueError(f"{transition} cannot be applied to many rows in one statement")
        if not rows:
            return []
        if _autocommit(conn) and _ends((transition,)):
            # An end and the settling of its dependents commit together.
            assert isinstance(conn, Conn)
            async with conn.transaction():
                return await self.apply_many(conn, transition, rows, returning=returning)
        statement, scalars, lists = self._compile_many(transition, returning)
        binds: dict[str, Any] = {name: [row[name] for row in rows] for name in scalars}
        for name in lists:
            values: list[Any] = []
            ks: list[int] = []
            ords: list[int] = []
            for k, row in enumerate(rows, start=1):
                items = list(row[name])
                values.extend(items)
                ks.extend([k] * len(items))
                ords.extend(range(1, len(items) + 1))
            binds[name], binds[f"{name}_k"], binds[f"{name}_ord"] = values, ks, ords
        changed: list[Row | None] = [None] * len(rows)
        for found in await fetch_rows(conn, statement, binds):
            changed[int(found["k"]) - 1] = found
        if _ends((transition,)):
            ended = [row["id"] for row in changed if row is not None and row["has_dependents"]]
            await settle(self, conn, ended)
        return changed

    def _compile_many(
        self, transition: Transition, returning: Returning
    ) -> tuple[TextClause, tuple[str, ...], tuple[str, ...]]:
        key = (transition, returning, "many")
        found = self._many.get(key)
        if found is not None:
            return found
        writes = [w for h in self._hooks for w in h.writes_many(transition)]
        if _ends((transition,)):
            returning = (*returning, *_SETTLES)
        needs = set(returning)
        for w in writes:
            needs |= w.columns
        rule = RULES[transition]
        raw = " ".join([rule.match, rule.sets, rule.guard, *(w.sql for w in writes)])
        names = [n for n in dict.fromkeys(BIND.findall(raw)) if not n.endswith(("_k", "_ord"))]
        unknown = [n for n in names if n not in BIND_TYPES]
        if unknown:
            raise ValueError(f"{transition}: no SQL type for the binds {unknown} (BIND_TYPES)")
        scalars = tuple(n for n in names if not BIND_TYPES[n].endswith("[]"))
        lists = tuple(n for n in names if BIND_TYPES[n].endswith("[]"))
        ctes = changes_many(transition, needs, scalars)
        notifies = []
        for n, w in enumerate(writes):
            if w.sql:
                sql = BIND.sub(
                    lambda m: (
                        m[0] if m[1] in lists or m[1].endswith(("_k", "_ord")) else f"j.b_{m[1]}"
                    ),
                    w.sql,
                )
                ctes.append(f"{w.name or f'w{n}'} AS ({sql.replace('{j}', 'j')}\n    )")
            if w.notify:
                notifies.append(f"{w.notify} AS n{n}")
        wanted = [*returning, "transition", "from_state", "k"]
        select = ", ".join([*(f"j.{c}" for c in dict.fromkeys(wanted)), *notifies])
        sql = "WITH " + ",\n".join(ctes) + f"\nSELECT {select} FROM j"
        compiled = (text(sql), scalars, lists)
        self._many[key] = compiled
        return compiled

    def _compile(self, transition: Transition, returning: Returning) -> _Compiled:
        key = (transition, returning)
        found = self._compiled.get(key)
        if found is not None:
            return found
        group = _group(transition)
        after = tuple(h for h in self._hooks if any(h.follows(t) for t in group))
        writes = [(t, w) for t in group for h in self._hooks for w in h.writes(t)]
        if _ends(group):
            returning = (*returning, *_SETTLES)
        needs = set(returning)
        for _, w in writes:
            needs |= w.columns
        # Every row says which transition changed it, and from which state
        # (NULL unless a hook asks for it: it can cost a lookup).
        wanted = [*returning, "transition", "from_state"]
        if after:
            needs |= set(JOB_FIELDS) | {"from_state"}
            wanted = [*JOB_FIELDS, *wanted]
        ctes = [f"j AS ({changes(transition, needs)})"]
        notifies = []
        for n, (t, w) in enumerate(writes):
            rows = "j" if len(group) == 1 else f"(SELECT * FROM j WHERE transition = '{t}')"
            if w.sql:
                ctes.append(f"{w.name or f'w{n}'} AS ({w.sql.replace('{j}', rows)}\n    )")
            if w.notify:
                expr = w.notify
                if len(group) > 1:
                    expr = f"CASE WHEN j.transition = '{t}' THEN {expr} END"
                notifies.append(f"{expr} AS n{n}")
        select = ", ".join([*(f"j.{c}" for c in dict.fromkeys(wanted)), *notifies])
        sql = "WITH " + ",\n".join(ctes) + f"\nSELECT {select} FROM j"
        hooks = tuple(h for h in self._hooks if any(h.writes(t) for t in group))
        compiled = _Compiled(text(sql), hooks, after)
        self._compiled[key] = compiled
        return compiled


async def fetch_rows(
    conn: AnyConn, statement: TextClause, binds: Mapping[str, Any]
) -> Sequence[Row]:
    """``statement``'s rows on either kind of connection, read by column name."""
    if isinstance(conn, Conn):
        return await conn.fetch(statement, binds)
    return (await conn.execute(statement, binds)).mappings().all()


def _group(transition: Transition) -> tuple[Transition, ...]:
    # The hand-back and the park are one statement: it decides between them.
    if transition in (Transition.HAND_BACK, Transition.PARK):
        return (Transition.HAND_BACK, Transition.PARK)
    # ... and so are a flow limit's hold and throttle (ADR-0043).
    if transition in (Transition.HOLD, Transition.THROTTLE):
        return (Transition.HOLD, Transition.THROTTLE)
    # ... and so are the three ways a job's dependencies settle it (ADR-0045).
    if transition in RESOLUTIONS:
        return RESOLUTIONS
    return (transition,)


def _autocommit(conn: AnyConn) -> bool:
    """Whether ``conn`` is the hot paths' connection outside a transaction (a
    SQLAlchemy connection is always in one the caller chose)."""
    return isinstance(conn, Conn) and not conn.raw.is_in_transaction()


def _ends(transitions: Iterable[Transition]) -> bool:
    """Whether any of ``transitions`` ends a job (and so settles its dependents)."""
    return any(t in ENDS for t in transitions)


#: The machine every store uses unless given another.
MACHINE = StateMachine()
