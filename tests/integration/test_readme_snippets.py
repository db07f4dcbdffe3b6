"""The README's first snippets run as written against the README's first command.

The snippets are read from README.md and the way `make dev` starts `jobplane dev`
(its topology and handlers) from the Makefile, so a change to either that
breaks a newcomer's first hour breaks this test.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobplane.client import AsyncClient
from tests.support import services
from tests.support.serve import interrupt

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()
#: The address the snippets are written for (the server's default).
WRITTEN_FOR = "127.0.0.1:50051"


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def _make_dev() -> tuple[str, str]:
    """(JOBPLANE_TOPOLOGY, --handlers) as the Makefile's dev target sets them."""
    topology = re.search(r"JOBPLANE_TOPOLOGY=\$\$\{JOBPLANE_TOPOLOGY:-([^}]+)\}", MAKEFILE)
    handlers = re.search(r"^DEV_HANDLERS \?= (\S+)$", MAKEFILE, flags=re.MULTILINE)
    assert topology and handlers, "the Makefile's dev target changed shape"
    assert "--handlers $(DEV_HANDLERS)" in MAKEFILE
    return topology.group(1), handlers.group(1)


async def _run_snippet(code: str, names: dict[str, Any], address: str) -> dict[str, Any]:
    """Run ``code`` (top-level awaits and all) as an async function, with ``names``."""
    body = textwrap.indent(code.replace(WRITTEN_FOR, address), "    ")
    source = f"async def snippet():\n{body}\n    return locals()\n"
    scope: dict[str, Any] = dict(names)
    exec(compile(source, "README.md", "exec"), scope)  # the README's own code
    found: dict[str, Any] = await asyncio.wait_for(scope["snippet"](), timeout=120)
    return found


@pytest.fixture
def vhost_url() -> Iterator[str]:
    name = f"jobplane-readme-{uuid.uuid4().hex[:8]}"
    yield services.create_vhost(name)
    services.delete_vhost(name)


def test_the_handler_make_dev_runs_is_the_readmes() -> None:
    (handlers,) = _python_blocks(_section("Handlers"))[:1]
    module = (ROOT / "examples" / "reports.py").read_text()
    handler = handlers[handlers.index("@registry.handler") :]
    assert handler in module


async def test_the_first_snippets_run_against_make_dev(
    database_url: str, vhost_url: str, tmp_path: Path
) -> None:
    topology, handlers = _make_dev()
    first, *_ = _python_blocks(_section("From another service, in ten lines"))
    many = next(b for b in _python_blocks(README) if "submit_many" in b)
    env = {
        **os.environ,
        "JOBPLANE_DATABASE_URL": database_url,
        "JOBPLANE_AMQP_URL": vhost_url,
        "JOBPLANE_LISTEN": "127.0.0.1:0",
        "JOBPLANE_UI_LISTEN": "off",
        "JOBPLANE_TOPOLOGY": topology,
    }
    output = tmp_path / "dev.log"
    with output.open("wb") as out:
        # From the repository's root, as `make dev` runs it.
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "jobplane",
            "dev",
            "--handlers",
            handlers,
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )
    try:
        address, key = await _address_and_key(output, process)
        await _printed_commands_run_in_a_new_shell(_text(output), tmp_path)
        first_ran = await _run_snippet(first, {"api_key": key}, address)
        done = first_ran["done"]
        assert done.result["url"].startswith("https://example.invalid/"), done
        # submit_many, in the client of the first snippet's kind.
        async with AsyncClient(address, key) as jobs:
            made = await _run_snippet(many, {"jobs": jobs}, address)
            jobs_made = made["jobs_made"]
            assert len(jobs_made) == 5000
            # report-42 is the first snippet's job: the replay created nothing.
            assert jobs_made[42].name == done.name
            # A type of yours that no handler runs is routed, and its watcher is told
            # it waits for one.
            other = await jobs.submit("reports.archive", {"report": 42})
            async with asyncio.timeout(60):
                async for event in jobs.watch(other.name):
                    if "no live worker handles type reports.archive" in event.message:
                        break
            assert "no live worker handles" in (await jobs.get(other.name)).waiting_reason
    finally:
        await interrupt(process)


async def _printed_commands_run_in_a_new_shell(out: str, home: Path) -> None:
    """The export and submit lines `jobplane dev` printed, pasted into a new shell:
    no virtualenv on its PATH, nothing of this process's environment."""
    lines = [line.strip() for line in out.splitlines()]
    export = next(line for line in lines if line.startswith("export JOBPLANE_ADDRESS="))
    submit = next(line for line in lines if " submit demo.progress " in line)
    shell = await asyncio.create_subprocess_exec(
        "/bin/bash",
        "--noprofile",
        "--norc",
        "-c",
        f"{export}\n{submit}\n",
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home)},
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    shown, _ = await asyncio.wait_for(shell.communicate(), timeout=120)
    assert shell.returncode == 0, f"{submit}\n{shown.decode(errors='replace')}"
    assert b"succeeded" in shown, shown


def _text(path: Path) -> str:
    return path.read_text(errors="replace")


async def _address_and_key(path: Path, process: asyncio.subprocess.Process) -> tuple[str, str]:
    async with asyncio.timeout(90):
        while True:
            out = _text(path)
            assert process.returncode is None, out
            address = re.search(r"address:\s+(\S+)", out)
            key = re.search(r"api key:\s+(\S+)", out)
            if address and key and "serving; Ctrl-C to stop" in out:
                return address.group(1), key.group(1)
            await asyncio.sleep(0.2)
