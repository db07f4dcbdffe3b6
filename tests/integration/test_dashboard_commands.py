"""The dashboard in `jobplane serve` (on its own port) and alone in `jobplane ui`."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.store.keys import KeyStore
from tests.support.dashboard import browserless
from tests.support.serve import serve_process
from tests.support.stack import eventually

pytestmark = pytest.mark.timeout(90)


async def _check_signed_in(url: str, key: str) -> None:
    async with browserless(url, key) as http:
        for path in ("/jobs", "/queues", "/workers"):
            async with http.get(path) as response:
                assert response.status == 200, path


async def test_serve_runs_the_dashboard_on_a_second_port(
    database_url: str, engine: AsyncEngine, amqp_url: str
) -> None:
    key = (await KeyStore(engine).create("acme")).key
    async with serve_process(
        database_url,
        JOBPLANE_UI_LISTEN="127.0.0.1:0",
        JOBPLANE_AMQP_URL=amqp_url,
        JOBPLANE_LOG_FORMAT="json",
    ) as serve:

        async def logged() -> bool:
            return any(r.get("event") == "ui.listening" for r in serve.records())

        await eventually(logged, timeout=20)
        # With JSON logs, its log line is the one line that says where it serves.
        assert not any(line.startswith("dashboard on ") for line in serve.lines)
        listening = [r for r in serve.records() if r.get("event") == "ui.listening"]
        url = str(listening[0]["url"]).rstrip("/")
        assert url.rsplit(":", 1)[1] != serve.address.rsplit(":", 1)[1]
        await _check_signed_in(url, key)


async def test_ui_runs_the_dashboard_alone(
    database_url: str, engine: AsyncEngine, amqp_url: str
) -> None:
    key = (await KeyStore(engine).create("acme")).key
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        "ui",
        "--listen",
        "127.0.0.1:0",
        env={**os.environ, "JOBPLANE_DATABASE_URL": database_url, "JOBPLANE_AMQP_URL": amqp_url},
        stderr=asyncio.subprocess.PIPE,
    )
    assert process.stderr is not None
    try:
        async with asyncio.timeout(30):
            while True:
                line = (await process.stderr.readline()).decode()
                assert line, "jobplane ui ended before it served"
                if line.startswith("dashboard on "):
                    break
        await _check_signed_in(line.split()[2].rstrip("/"), key)
    finally:
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), timeout=20) == 0


async def test_a_taken_port_is_a_clear_error(database_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "jobplane",
            "ui",
            env={
                **os.environ,
                "JOBPLANE_DATABASE_URL": database_url,
                "JOBPLANE_UI_LISTEN": f"127.0.0.1:{port}",
            },
            stderr=asyncio.subprocess.PIPE,
        )
        _out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 2
    assert "JOBPLANE_UI_LISTEN" in err.decode() and "Traceback" not in err.decode()


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["ui", "--listen", "foo"], {}, "--listen"),
        (["ui", "--listen", "127.0.0.1:99999"], {}, "--listen"),
        (["serve", "--ui-listen", "foo"], {}, "--ui-listen"),
        (["ui"], {"JOBPLANE_UI_LISTEN": "OFF"}, "JOBPLANE_UI_LISTEN"),
    ],
)
async def test_a_bad_or_off_listen_address_is_a_clear_error(
    database_url: str, args: list[str], env: dict[str, str], named: str
) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        *args,
        env={
            **os.environ,
            "JOBPLANE_DATABASE_URL": database_url,
            "JOBPLANE_LISTEN": "127.0.0.1:0",
            "JOBPLANE_METRICS_LISTEN": "off",
            **env,
        },
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        _out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 2, err.decode()
    assert named in err.decode() and "Traceback" not in err.decode()
