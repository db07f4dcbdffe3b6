"""The fair claim of job dispatches: each queue's credit, shared across its tenants.

The relay says how many dispatches each queue may take now (its credit, see
``jobplane.workers.relay_credit``) and where each queue's round stands
(:class:`FairRound`); one statement then

1. walks ``outbox_dispatch_fair`` (queue, tenant, due time) pair by pair (a
   loose index scan: one index probe per (queue, tenant) with waiting
   dispatches, however many dispatches each has);
2. counts each tenant's due dispatches, up to its queue's credit and the
   batch limit (no tenant gets more slots in one claim than the batch holds);
3. gives the queue's credit out slot by slot, by start tag: a tenant's k-th
   slot starts at ``base + (k - 1) / weight``, where ``base`` is where its
   last slot ended, or the queue's virtual time when it had none since
   (stride scheduling: over time a tenant of weight 3 gets three slots to a
   tenant of weight 1's, and a tenant that comes back after a pause starts
   level with the others, with no credit saved up). Equal tags go first to
   the tenants after the queue's cursor (the tenant served last): small
   credits still rotate;
4. takes the slots in queue priority order (high first) up to the batch
   limit: a high queue's dispatches go before a low queue's backlog;
5. locks each tenant's share from the front of its rows, FOR UPDATE SKIP
   LOCKED: relays sharing the table take different rows.

A dispatch whose queue the relay does not know (a queue gone from its
topology, or a row written before the queue was recorded: '') gets the
``spare`` credit, the batch limit: claimed as before, without flow control.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

# The dispatches still to be published, as outbox_dispatch_fair holds them.
_WAITING = "kind = 'job.dispatch' AND published_at IS NULL AND failed_at IS NULL"
_WAITING_O = "o.kind = 'job.dispatch' AND o.published_at IS NULL AND o.failed_at IS NULL"
_SKIP = "NOT (o.id = ANY(CAST(:skip AS uuid[])))"
# A (queue, tenant)'s due dispatches, ``{s}`` the row naming them: queue = s.queue
# AND tenant_id = s.tenant_id AND available_at <= now(), read as one range of
# outbox_dispatch_fair. With the equalities alone, the planner may walk
# outbox_due (every tenant's waiting rows by due time) and filter: a tenant
# queued behind another's 20,000 dispatches cost each claim 20,000 index
# entries, twice. The row comparison, a lower bound only that index serves,
# keeps the planner on it; the equalities and the bound on available_at end the
# scan. An upper bound written as a row comparison does not: Postgres 15 ends a
# scan on a row comparison only when its first column (the queue) passes it, so
# the range walked every later entry of the queue (another tenant's backlog,
# the tenant's own dispatches not yet due).
_TENANT_DUE = (
    "(o.queue, o.tenant_id, o.available_at) >= ({s}.queue, {s}.tenant_id, "
    "CAST('-infinity' AS timestamptz)) "
    "AND o.queue = {s}.queue AND o.tenant_id = {s}.tenant_id AND o.available_at <= now()"
)
# What the relay reads of a row (jobplane.store.outbox's claim reads the same).
_COLUMNS = (
    "o.id, o.tenant_id, o.kind, o.job_id, o.routing_key, o.correlation_id, o.exchange, "
    "o.body, o.headers, o.last_error IS NOT NULL AS retried"
)

#: The fair claim's common table expressions, up to ``claimed`` (the locked
#: dispatches, with their places): the relay's claim adds its other rows to them.
FAIR_CTES = f"""
    WITH RECURSIVE pairs AS (
        (SELECT queue, tenant_id FROM outbox WHERE {_WAITING}
         ORDER BY queue, tenant_id LIMIT 1)
        UNION ALL
        SELECT n.queue, n.tenant_id FROM pairs p, LATERAL (
            SELECT queue, tenant_id FROM outbox
            WHERE {_WAITING} AND (queue, tenant_id) > (p.queue, p.tenant_id)
            ORDER BY queue, tenant_id LIMIT 1) n
    ),
    q AS (
        SELECT * FROM unnest(CAST(:queues AS text[]), CAST(:credits AS integer[]),
                             CAST(:ranks AS integer[]), CAST(:vtimes AS float8[]),
                             CAST(:cursors AS uuid[]))
            AS q(name, credit, rank, vtime, cursor)
    ),
    passes AS (
        SELECT * FROM unnest(CAST(:pass_queues AS text[]), CAST(:pass_tenants AS uuid[]),
                             CAST(:pass_values AS float8[])) AS s(queue, tenant_id, pass)
    ),
    shares AS (
        SELECT p.queue, p.tenant_id, c.credit, coalesce(q.rank, 1) AS rank,
               greatest(coalesce(q.vtime, 0), coalesce(s.pass, 0)) AS base,
               CAST(coalesce(t.dispatch_weight, 1) AS float8) AS weight,
               coalesce(p.tenant_id > q.cursor, false) AS after_cursor
        FROM pairs p
        LEFT JOIN q ON q.name = p.queue
        LEFT JOIN passes s ON s.queue = p.queue AND s.tenant_id = p.tenant_id
        LEFT JOIN tenants t ON t.id = p.tenant_id
        CROSS JOIN LATERAL (SELECT coalesce(q.credit, :spare) AS credit) c
        WHERE c.credit > 0
    ),
    counted AS (
        SELECT h.*, d.n FROM shares h CROSS JOIN LATERAL (
            SELECT count(*) AS n FROM (
                SELECT 1 FROM outbox o
                WHERE {_TENANT_DUE.format(s="h")} AND {_WAITING_O} AND {_SKIP}
                ORDER BY o.queue, o.tenant_id, o.available_at
                LIMIT least(h.credit, :limit)) x) d
        WHERE d.n > 0
    ),
    slots AS (
        SELECT c.queue, c.tenant_id, c.rank, c.credit, c.base, c.weight, c.after_cursor,
               c.base + (k - 1) / c.weight AS start_tag
        FROM counted c, generate_series(1, c.n) k
    ),
    in_queue AS (
        SELECT s.*, row_number() OVER (
            PARTITION BY s.queue
            ORDER BY s.start_tag, s.after_cursor DESC, s.tenant_id) AS place
        FROM slots s
    ),
    granted AS (
        SELECT queue, tenant_id, rank, base, weight, after_cursor, count(*) AS quota
        FROM (SELECT i.*, row_number() OVER (
                  ORDER BY i.rank, i.start_tag, i.after_cursor DESC, i.tenant_id) AS overall
              FROM in_queue i WHERE i.place <= i.credit) w
        WHERE overall <= :limit
        GROUP BY queue, tenant_id, rank, base, weight, after_cursor
    ),
    claimed AS (
        SELECT o.*, g.rank, g.after_cursor,
               g.base + (row_number() OVER (
                   PARTITION BY g.queue, g.tenant_id ORDER BY o.available_at, o.id) - 1)
                   / g.weight AS start_tag,
               g.weight
        FROM granted g CROSS JOIN LATERAL (
            SELECT {_COLUMNS}, o.queue, o.available_at FROM outbox o
            WHERE {_TENANT_DUE.format(s="g")} AND {_WAITING_O} AND {_SKIP}
            ORDER BY o.queue, o.tenant_id, o.available_at
            LIMIT g.quota
            FOR UPDATE OF o SKIP LOCKED) o
    )
"""
#: The order of a fair claim's dispatches: priority, then place in the round.
FAIR_ORDER = "rank, start_tag, after_cursor DESC, tenant_id"


@dataclass(slots=True)
class QueueRound:
    """Where one queue's round stands: its virtual time, the tenant served last,
    and the tenants whose last slot ended past the virtual time."""

    vtime: float = 0.0
    cursor: uuid.UUID | None = None
    passes: dict[uuid.UUID, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class FairSlot:
    """A claimed dispatch's place in its queue's round."""

    queue: str
    tenant_id: uuid.UUID
    start_tag: float
    weight: float


@dataclass(frozen=True, slots=True)
class FairClaim:
    """What a fair claim needs: the rounds, and each queue's (credit, priority rank)."""

    round: FairRound
    credits: dict[str, tuple[int, int]]


class FairRound:
    """The rounds of a relay's queues: what the next claim starts from.

    Each relay keeps its own (in memory): relays sharing the table are each
    fair over the dispatches they take, so together too.
    """

    def __init__(self) -> None:
        self.queues: dict[str, QueueRound] = {}

    def binds(self, credits: dict[str, tuple[int, int]], *, limit: int) -> dict[str, object]:
        """The claim's binds: ``credits`` is each queue's (credit, priority rank)."""
        names = list(credits)
        rounds = [self.queues.get(n, QueueRound()) for n in names]
        pass_queues: list[str] = []
        pass_tenants: list[str] = []
        pass_values: list[float] = []
        for name, state in self.queues.items():
            for tenant, value in state.passes.items():
                pass_queues.append(name)
                pass_tenants.append(str(tenant))
                pass_values.append(value)
        return {
            "queues": names,
            "credits": [credits[n][0] for n in names],
            "ranks": [credits[n][1] for n in names],
            "vtimes": [r.vtime for r in rounds],
            "cursors": [None if r.cursor is None else str(r.cursor) for r in rounds],
            "pass_queues": pass_queues,
            "pass_tenants": pass_tenants,
            "pass_values": pass_values,
            "spare": limit,
            "limit": limit,
        }

    def served(self, slots: list[FairSlot]) -> None:
        """Move each queue's round past ``slots`` (claimed, in claim order)."""
        for slot in slots:
            state = self.queues.setdefault(slot.queue, QueueRound())
            end = slot.start_tag + 1.0 / slot.weight
            state.passes[slot.tenant_id] = max(state.passes.get(slot.tenant_id, 0.0), end)
            if slot.start_tag >= state.vtime:
                state.vtime = slot.start_tag
                state.cursor = slot.tenant_id
        for state in self.queues.values():
            # A tenant level with the virtual time starts there anyway.
            state.passes = {t: p for t, p in state.passes.items() if p > state.vtime}
