"""The store imports no observability: the process registers tracing as its observer."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from jobplane import logs, process, store
from jobplane.config import Settings
from jobplane.store import observers
from jobplane.store.machine import Cause, StateMachine, Transition

_STORE = Path(store.__file__).parent


class _Context:
    """An observer with a trace context of its own."""

    def binds(self) -> Mapping[str, Any]:
        return {"trace_parent": "p", "trace_state": "s", "trace_inherit": True}

    def applied(self, transition: Transition) -> None:
        raise AssertionError("prepare applies nothing")


@pytest.fixture
def no_observer() -> Iterator[None]:
    # Logging's trace ids too: turning tracing on registers both.
    before = (observers.OBSERVER, logs._TRACE_IDS)
    observers.register(None)
    yield
    observers.register(before[0])
    logs.register_trace_ids(before[1])


def test_no_module_of_the_store_imports_observe() -> None:
    imported = set()
    for path in _STORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {(path.name, a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported |= {(path.name, f"{node.module}.{a.name}") for a in node.names}
    assert ("core.py", "jobplane.store.observers") in imported
    assert sorted(i for i in imported if i[1].startswith("jobplane.observe")) == []


def test_the_state_machine_loads_no_observe() -> None:
    # A fresh interpreter: the machine and everything it imports.
    program = (
        "import json, sys\n"
        "import jobplane.store.machine\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('jobplane.'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True
    )
    loaded = json.loads(out.stdout)
    assert "jobplane.store.machine.core" in loaded
    assert [m for m in loaded if m.startswith("jobplane.observe")] == []


def test_without_an_observer_a_transition_binds_no_trace_context(no_observer: None) -> None:
    binds = StateMachine().prepare(Transition.RETRY, {"id": 1}, Cause())
    assert {k: binds[k] for k in observers.NO_TRACE} == observers.NO_TRACE


def test_a_registered_observer_gives_the_trace_binds(no_observer: None) -> None:
    observers.register(_Context())
    binds = StateMachine().prepare(Transition.RETRY, {"id": 1}, Cause())
    assert (binds["trace_parent"], binds["trace_state"], binds["trace_inherit"]) == (
        "p",
        "s",
        True,
    )


def test_the_process_registers_no_observer_when_tracing_is_off(no_observer: None) -> None:
    # Off (no exporter asked for): the store is given nothing to call. On,
    # configure_tracing registers tracing's observer itself
    # (test_tracing_unit.py::test_configure_tracing_alone_traces_the_store_transitions).
    process._tracing("jobplane-test", Settings())
    assert observers.OBSERVER is None
