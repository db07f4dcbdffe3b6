"""Each built-in hook declares the columns of the changed rows (``j``) its writes read.

A transition's statement returns only the columns its hooks declare (and the few
every statement has); a write that reads one it did not declare works only
while another hook happens to ask for it, and one declared under a name no
statement returns is dropped. Checked for every hook, transition and kind of
statement (one job, or many at once).
"""

from __future__ import annotations

import re

import pytest

from jobplane.store.machine import Transition
from jobplane.store.machine.compile import _HOOK_FIELDS
from jobplane.store.machine.core import builtin_hooks
from jobplane.store.machine.hooks import Write

# What a statement adds to the changed rows itself: the transition, the state
# before it (when asked for), and for a batch each row's index and report count.
_STATEMENT_COLUMNS = frozenset({"transition", "from_state", "k", "n"})
_READ = re.compile(r"\bj\.([a-z_]+)\b")


def _writes() -> list[tuple[str, Write]]:
    found = []
    for hook in builtin_hooks(lifecycle=True):
        for transition in Transition:
            for kind, writes in (
                ("one", hook.writes(transition)),
                ("many", hook.writes_many(transition)),
            ):
                name = f"{type(hook).__name__}-{transition}-{kind}"
                found += [(f"{name}-{n}", write) for n, write in enumerate(writes)]
    return found


_WRITES = _writes()


def test_the_built_in_hooks_have_writes_to_check() -> None:
    assert len(_WRITES) > 20
    assert any(name.startswith("Dependencies-submit") for name, _ in _WRITES)


@pytest.mark.parametrize("write", [w for _, w in _WRITES], ids=[n for n, _ in _WRITES])
def test_a_hook_declares_every_column_its_write_reads(write: Write) -> None:
    read = set(_READ.findall(f"{write.sql} {write.notify}"))
    assert read - _STATEMENT_COLUMNS <= write.columns
    assert write.columns <= set(_HOOK_FIELDS) | _STATEMENT_COLUMNS
