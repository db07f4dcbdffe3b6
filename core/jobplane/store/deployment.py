"""The deployment's identity: which database a message belongs to.

Two deployments (two databases) may share one RabbitMQ vhost and the same
queue names; their messages then reach each other's workers. A message
carries the identity of the deployment that published it, so a worker can
tell "not mine" from "broken" and hand a stranger's message back instead of
dead-lettering it.

The identity is derived, not stored: the cluster's ``system_identifier``
(fixed at initdb, shared by its physical replicas, so a failover keeps it)
with the database name, hashed to a short id. Databases cloned from one
template on one cluster still differ by name; the same name on two clusters
differs by the cluster. Nothing to create, migrate or back up.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import structlog
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.logs import describe_error
from jobplane.store.down import sqlstate

log = structlog.get_logger("jobplane.deployment")

_INSUFFICIENT_PRIVILEGE = "42501"

_IDENTITY = text(
    "SELECT (SELECT system_identifier FROM pg_control_system())::text, current_database()"
)
# A server that refuses pg_control_system() (some managed services): the
# address and the database's oid still tell two installations apart.
_FALLBACK = text(
    "SELECT coalesce(host(inet_server_addr()), 'local') || ':' "
    "|| coalesce(inet_server_port()::text, '') || ':' "
    "|| (SELECT oid::text FROM pg_database WHERE datname = current_database()), "
    "current_database()"
)


@dataclass(frozen=True, slots=True)
class Deployment:
    """One deployment: its id, and its database's name (for people reading logs)."""

    id: str
    database: str

    def __str__(self) -> str:
        return f"{self.id} (database {self.database!r})"


def identity_of(cluster: str, database: str) -> str:
    """The short deployment id of ``database`` on the cluster ``cluster``."""
    digest = hashlib.sha256(f"{cluster}/{database}".encode()).hexdigest()
    return digest[:16]


async def this_deployment(engine: AsyncEngine) -> Deployment:
    """This deployment, derived from its database (the id is 16 hex characters)."""
    try:
        async with engine.connect() as conn:
            cluster, database = (await conn.execute(_IDENTITY)).one()
    except DBAPIError as exc:
        if sqlstate(exc) != _INSUFFICIENT_PRIVILEGE:
            raise
        log.warning("deployment.id.fallback", reason=describe_error(exc))
        async with engine.connect() as conn:
            cluster, database = (await conn.execute(_FALLBACK)).one()
    return Deployment(identity_of(str(cluster), str(database)), str(database))
