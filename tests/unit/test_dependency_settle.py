"""Settling the dependents of ended jobs, with the statements faked: a chain of
failures settles a round per job, and no more rounds than MAX_ROUNDS (the SQL
itself is pinned by tests/integration/test_dependencies*.py)."""

from __future__ import annotations

import uuid
from typing import Any, cast

import pytest

from jobplane.store.machine import StateMachine, Transition, dependencies
from jobplane.store.machine.dependencies import settle


class _Rows:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def mappings(self) -> _Rows:
        return self

    def all(self) -> list[dict[str, Any]]:
        return self.rows


class _Chain:
    """An endless chain: each ended job decides the next, which fails and has
    dependents of its own. The connection and the machine both."""

    def __init__(self) -> None:
        self.recorded: list[list[Any]] = []
        self.failed: list[list[Any]] = []

    async def execute(self, statement: Any, binds: dict[str, Any]) -> _Rows:
        assert statement is dependencies.RECORD
        self.recorded.append(binds["ended"])
        if len(self.recorded) > 50:
            raise AssertionError("settled past its bound")
        return _Rows([{"id": uuid.uuid4(), "decided": True}])

    async def apply(
        self, conn: Any, transition: Transition, params: dict[str, Any], **options: Any
    ) -> list[dict[str, Any]]:
        assert transition is Transition.DEPENDENCIES_MET
        self.failed.append(params["ids"])
        (job,) = params["ids"]
        row = {"id": job, "transition": Transition.DEPENDENCY_FAILED, "has_dependents": True}
        return [{**row, "fan_stage": None, "stage": 0}]


async def test_a_chain_of_failures_settles_a_round_per_job_up_to_max_rounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dependencies, "MAX_ROUNDS", 3)
    chain = _Chain()
    first = uuid.uuid4()
    assert await settle(cast(StateMachine, chain), chain, [first]) == 3  # type: ignore[arg-type]
    assert len(chain.recorded) == len(chain.failed) == 3
    # Each round settles the dependents of the job the round before ended.
    assert chain.recorded[0] == [first]
    assert chain.recorded[1:] == chain.failed[:2]
