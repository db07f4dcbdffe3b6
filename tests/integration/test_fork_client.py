"""The blocking Client made before fork() works in the children and still in the parent."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from tests.support.stack import Stack

PROGRAM = Path(__file__).parent / "forked" / "program.py"


@pytest.mark.parametrize("mode", ["fork", "pool"])
async def test_client_made_before_fork_works_in_child_and_parent(stack: Stack, mode: str) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(PROGRAM),
        stack.server.address,
        stack.key,
        mode,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=100)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, err.decode()
    seen = json.loads(out)
    assert seen["before"] is True
    assert seen["children"] == ([True] if mode == "fork" else [True, True, True]), err.decode()
    assert seen["after"] is True
    assert seen.get("watch refused", True) is True
