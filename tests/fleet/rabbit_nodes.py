"""The three RabbitMQ nodes of scripts/fleet/rabbitmq.sh, for the fleet tests.

Start them, name their addresses, ask their management API (each node
answers for the whole cluster), find a queue's leader, and SIGKILL a node's
Erlang VM as a crashed machine would end.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "fleet" / "rabbitmq.sh"
DIR = Path(os.environ.get("FLEET_RABBITMQ_DIR", ROOT / "build" / "fleet" / "rabbitmq"))
NODES = ("jp1@localhost", "jp2@localhost", "jp3@localhost")
_AUTH = "Basic " + base64.b64encode(b"guest:guest").decode()


def number(node: str) -> int:
    """1 for jp1@localhost, …"""
    return int(node.partition("@")[0].removeprefix("jp"))


def amqp_address(node: str, vhost: str) -> str:
    """The AMQP URL of ``node`` for ``vhost``."""
    return f"amqp://guest:guest@127.0.0.1:{5680 + number(node)}/{quote(vhost, safe='')}"


def setting(nodes: tuple[str, ...] | list[str], vhost: str) -> str:
    """JOBPLANE_AMQP_URL naming ``nodes`` in that order."""
    return ",".join(amqp_address(n, vhost) for n in nodes)


def start() -> None:
    """Start the nodes that are down and cluster them (idempotent)."""
    # To a file, not a pipe: a node started in the background keeps the
    # script's descriptors, and a pipe would never end.
    DIR.mkdir(parents=True, exist_ok=True)
    with (DIR / "start.log").open("ab") as log:
        subprocess.run(
            [str(SCRIPT), "start"],
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            timeout=300,
        )


def api(method: str, path: str, body: Any = None, *, nodes: tuple[str, ...] = NODES) -> Any:
    """Ask the first node of ``nodes`` whose management API answers."""
    data = None if body is None else json.dumps(body).encode()
    error: Exception | None = None
    for node in nodes:
        request = urllib.request.Request(
            f"http://127.0.0.1:{15680 + number(node)}/api/{path}",
            data=data,
            method=method,
            headers={"Authorization": _AUTH, "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                text = answer.read()
                return json.loads(text) if text else None
        except urllib.error.HTTPError:
            raise
        except OSError as exc:  # this node is down: ask another
            error = exc
    raise AssertionError(f"no node's management API answers: {error!r}")


def create_vhost(name: str) -> None:
    """A vhost on the cluster the guest user may use."""
    api("PUT", f"vhosts/{quote(name, safe='')}", {})
    api(
        "PUT",
        f"permissions/{quote(name, safe='')}/guest",
        {"configure": ".*", "write": ".*", "read": ".*"},
    )


def delete_vhost(name: str) -> None:
    """Remove the vhost and its queues (best effort)."""
    with contextlib.suppress(urllib.error.HTTPError, AssertionError):
        api("DELETE", f"vhosts/{quote(name, safe='')}")


def queue(vhost: str, name: str, *, nodes: tuple[str, ...] = NODES) -> dict[str, Any]:
    """The management API's view of one queue (its ``leader``, ``members``, ``online``).

    The API learns of a queue declared a moment ago within its statistics
    interval (5 s): a 404 is asked again for a while.
    """
    deadline = time.monotonic() + 20
    while True:
        try:
            found: dict[str, Any] = api(
                "GET", f"queues/{quote(vhost, safe='')}/{quote(name, safe='')}", nodes=nodes
            )
        except urllib.error.HTTPError as exc:
            if exc.code != 404 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
            continue
        return found


def running_nodes(*, nodes: tuple[str, ...] = NODES) -> list[str]:
    """The cluster's nodes that run."""
    return [n["name"] for n in api("GET", "nodes", nodes=nodes) if n.get("running")]


def kill(node: str) -> int:
    """SIGKILL ``node``'s Erlang VM (no clean shutdown); returns its pid."""
    pid = int((DIR / node.partition("@")[0] / "pid").read_text().strip())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        time.sleep(0.05)
    raise AssertionError(f"{node} (pid {pid}) outlived SIGKILL")
