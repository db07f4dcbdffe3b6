"""Which lifecycle events reach the broker, in the database for the relays to read (ADR-0052).

``lifecycle_publish`` holds, in its one row, the topology's ``[events]
publish_lifecycle`` patterns and the lifecycle event types they match.
:func:`sync_lifecycle_publish` writes it in the transaction of
:func:`jobplane.store.routes.sync_submit_rules`, so ``jobplane migrate``,
``jobplane topology apply`` and every server start keep it as the topology
says. The relays' event feed reads it on every pass
(:class:`jobplane.store.event_feed.EventFeed`): a change takes effect at the
feed's next pass, without a restart. Lifecycle events written while a type
was left out are not published later: the feed has moved past them.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from jobplane.topology import Topology

_READ = text("SELECT patterns, event_types FROM lifecycle_publish")
_WRITE = text(
    "INSERT INTO lifecycle_publish (singleton, patterns, event_types) "
    "VALUES (true, :patterns, :event_types) "
    "ON CONFLICT (singleton) DO UPDATE SET patterns = EXCLUDED.patterns, "
    "event_types = EXCLUDED.event_types, update_time = now()"
)


async def sync_lifecycle_publish(conn: AsyncConnection, topology: Topology) -> bool:
    """Make ``lifecycle_publish`` say what ``topology`` says; whether anything was written.

    Run under the sync's lock, in its transaction."""
    wanted = (list(topology.publish_lifecycle), list(topology.published_lifecycle()))
    row = (await conn.execute(_READ)).first()
    if row is not None and (list(row.patterns), list(row.event_types)) == wanted:
        return False
    await conn.execute(_WRITE, {"patterns": wanted[0], "event_types": wanted[1]})
    return True
