"""Several processes on one host: a default ops port that is taken gives way to a
free one (logged), a port asked for stays strict."""

from __future__ import annotations

import asyncio
import errno
import re
import socket
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

from jobplane.process import METRICS_DEFAULTS
from tests.support.serve import serve_process, start_serve


@contextmanager
def _taken(address: str) -> Iterator[None]:
    """``address`` listened on here (or by another process already: taken either way)."""
    host, port = address.rsplit(":", 1)
    with socket.socket() as sock:
        try:
            sock.bind((host, int(port)))
            sock.listen()
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
        yield


def _livez(address: str) -> int:
    with urllib.request.urlopen(f"http://{address}/livez", timeout=5) as reply:
        status: int = reply.status
        return status


async def test_a_taken_default_port_gives_way_to_a_free_one(
    database_url: str, amqp_url: str
) -> None:
    default = METRICS_DEFAULTS["serve"]
    with _taken(default):
        # Empty: unset, so the default applies (tests/conftest.py sets port 0).
        env = {"JOBPLANE_METRICS_LISTEN": "", "JOBPLANE_AMQP_URL": amqp_url}
        async with serve_process(database_url, **env) as serve:
            taken = [line for line in serve.lines if "ops.port.taken" in line]
            assert taken, "\n".join(serve.lines)
            picked = re.search(r"address.{0,4}?(127\.0\.0\.1:\d+)", taken[0])
            assert picked is not None, taken[0]
            assert picked.group(1) != default
            assert default in taken[0]
            assert await asyncio.to_thread(_livez, picked.group(1)) == 200
            assert serve.process.returncode is None


async def test_a_taken_port_asked_for_stops_the_process_in_one_line(database_url: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        process = await start_serve(
            database_url, stdout=asyncio.subprocess.PIPE, JOBPLANE_METRICS_LISTEN=address
        )
        _, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 2
    lines = err.decode().strip().splitlines()
    assert lines[-1] == (
        f"error: JOBPLANE_METRICS_LISTEN: {address} is in use; choose another host:port or off"
    ), lines
    assert not any("Traceback" in line for line in lines), lines
