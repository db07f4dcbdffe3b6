"""The fleet's Postgres pair (scripts/fleet/postgres.sh), as its tests drive it.

Patroni's REST API says who leads and takes a switchover; a node's
postmaster pid is the first line of its data directory's postmaster.pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "fleet" / "postgres.sh"
FLEET_DIR = Path(os.environ.get("FLEET_DIR", ROOT / "build" / "fleet" / "postgres"))
NODES = {"pg1": (54321, 18008), "pg2": (54322, 18009)}
BOUNCER_PORT = 64320
AUTH = "postgres:postgres"


def direct_url(database: str) -> str:
    """Both nodes, the writable one chosen at connect (libpq's form)."""
    hosts = ",".join(f"127.0.0.1:{pg}" for pg, _rest in NODES.values())
    return f"postgresql://{AUTH}@{hosts}/{database}?target_session_attrs=read-write"


def bouncer_url(database: str) -> str:
    """PgBouncer, in transaction pooling, in front of the leader."""
    return f"postgresql://{AUTH}@127.0.0.1:{BOUNCER_PORT}/{database}?pgbouncer=true"


def _get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
        return json.loads(response.read() or b"null")


def members() -> list[dict[str, Any]]:
    """The cluster's members as Patroni reports them (either node answers)."""
    for _pg, rest in NODES.values():
        try:
            found: list[dict[str, Any]] = _get(rest, "/cluster")["members"]
        except OSError:
            continue
        return found
    return []


def leader() -> str | None:
    """The leading node's name, if one leads."""
    return next((m["name"] for m in members() if m["role"] == "leader"), None)


def healthy() -> bool:
    """A leader and a synchronous standby, both running."""
    roles = {m["role"] for m in members() if m["state"] in ("running", "streaming")}
    return {"leader", "sync_standby"} <= roles


@dataclass
class Failover:
    """When a disruption started and when a new leader was reported."""

    started: float
    old_leader: str
    new_leader: str | None = None
    leader_at: float | None = None


def start() -> None:
    """Start whatever of the fleet's Postgres does not run (idempotent)."""
    subprocess.run([str(SCRIPT), "start"], check=True, cwd=ROOT, timeout=300)


async def wait_healthy(timeout: float = 120) -> None:
    """Until :func:`healthy` (restarting a node that is down)."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(healthy):
        if time.monotonic() > deadline:
            raise AssertionError(f"the Postgres pair is not healthy: {members()}")
        await asyncio.sleep(0.5)


async def wait_new_leader(failover: Failover, *, same_ok: bool, timeout: float = 90) -> None:
    """Until a leader that accepts writes is reported (another one unless ``same_ok``)."""
    deadline = time.monotonic() + timeout
    while True:
        now = await asyncio.to_thread(leader)
        if now is not None and (same_ok or now != failover.old_leader):
            rest = NODES[now][1]
            try:
                await asyncio.to_thread(_get, rest, "/primary")
            except OSError:
                pass
            else:
                failover.new_leader, failover.leader_at = now, time.monotonic()
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"no new leader: {members()}")
        await asyncio.sleep(0.2)


async def wait_database(node: str, database: str, timeout: float = 30) -> None:
    """Until ``node`` lets a session into ``database``."""
    url = f"postgresql://{AUTH}@127.0.0.1:{NODES[node][0]}/{database}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = await asyncpg.connect(url)
        except asyncpg.InvalidCatalogNameError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
        else:
            await conn.close()
            return


def switchover() -> Failover:
    """Ask Patroni to hand the lead to the other node (it waits for the standby)."""
    old = leader()
    assert old is not None
    candidate = next(name for name in NODES if name != old)
    body = json.dumps({"leader": old, "candidate": candidate}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{NODES[old][1]}/switchover", data=body, method="POST"
    )
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200, response.read()
    return Failover(started, old)


def postmaster_pid(node: str) -> int:
    """The pid of ``node``'s postmaster."""
    return int((FLEET_DIR / node / "postmaster.pid").read_text().split()[0])


def patroni_pid(node: str) -> int:
    """The pid of ``node``'s Patroni."""
    return int((FLEET_DIR / f"{node}.pid").read_text().strip())


def kill_leader(*, node_too: bool) -> Failover:
    """SIGKILL the leader's postmaster (and its Patroni, ``node_too``: the node is lost)."""
    old = leader()
    assert old is not None
    started = time.monotonic()
    if node_too:
        os.kill(patroni_pid(old), 9)
    os.kill(postmaster_pid(old), 9)
    return Failover(started, old)


def restart_node(node: str) -> None:
    """Start ``node``'s Patroni again (after :func:`kill_leader` with ``node_too``)."""
    subprocess.run([str(SCRIPT), "start-node", node], check=True, cwd=ROOT, timeout=60)
