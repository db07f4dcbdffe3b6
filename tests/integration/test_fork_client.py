"""The blocking Client made before fork() works in the children and still in the parent."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.stack import Stack

PROGRAM = Path(__file__).parent / "forked" / "program.py"


async def _run(stack: Stack, mode: str) -> tuple[dict[str, Any], str]:
    """What the program saw in ``mode``, once it exited cleanly, and its stderr."""
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
    seen: dict[str, Any] = json.loads(out)
    return seen, err.decode()


@pytest.mark.parametrize("mode", ["fork", "pool"])
async def test_client_made_before_fork_works_in_child_and_parent(stack: Stack, mode: str) -> None:
    seen, err = await _run(stack, mode)
    assert seen["before"] is True
    assert seen["children"] == ([True] if mode == "fork" else [True, True, True]), err
    assert seen["after"] is True
    assert seen.get("watch refused", True) is True


async def test_a_wait_in_another_thread_neither_holds_up_a_fork_nor_ends_by_it(
    stack: Stack,
) -> None:
    seen, err = await _run(stack, "wait")
    # Well under the 5 seconds a call in flight is given before the fork.
    assert seen["fork seconds"] < 2.5, err
    assert seen["children"] == [True], err
    # The parent's wait went on over the new channel to the job's end.
    assert seen["wait"] == ["succeeded"], err
    assert seen["after"] is True
