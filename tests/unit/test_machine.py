"""The transition table is the one truth about job states.

Every transition the store applies has one rule; no other module of the
store updates the job table, inserts job events or spells a job state in
SQL: those come from :mod:`jobplane.store.machine`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jobplane.config import Settings
from jobplane.store import machine
from jobplane.store.machine import (
    RULES,
    AnyConn,
    Change,
    Phase,
    StateMachine,
    Transition,
    where_phases,
    where_sources,
)
from jobplane.store.machine.compile import changes_many
from jobplane.store.machine.stages import STAGE_STEPS, STAGE_WRITES, stage_update
from jobplane.types import JobState

# The machine is a package of the store; every other module is checked.
_STORE = Path(machine.__file__).parent.parent
_OTHERS = sorted(_STORE.glob("*.py"))
# What only the machine may write: a job's state, its row, its events.
_FORBIDDEN = {
    "a job state literal": re.compile(
        r"\bstate\s*(=|IN\s*\()\s*'(queued|running|succeeded|failed|cancelled)'", re.I
    ),
    "an update of jobs": re.compile(r"\bUPDATE\s+jobs\b", re.I),
    "an insert into jobs": re.compile(r"\bINSERT\s+INTO\s+jobs\b", re.I),
    "an insert into job_events": re.compile(r"\bINSERT\s+INTO\s+job_events\b", re.I),
}


def test_every_transition_has_one_rule_from_real_states() -> None:
    assert set(RULES) == set(Transition)
    for transition, rule in RULES.items():
        assert rule.target in JobState, transition
        assert rule.sources <= set(Phase), transition
        # A transition that may start from several states is matched by id
        # (the machine reads the state it changed by it).
        if len({p.state for p in rule.sources}) > 1:
            assert "id = :id" in rule.match, transition
    # Only SUBMIT starts from no row; only the terminal states end a job.
    assert [t for t, r in RULES.items() if not r.sources] == [Transition.SUBMIT]


@pytest.mark.parametrize("path", _OTHERS, ids=lambda p: p.name)
def test_no_store_module_changes_a_job_by_hand(path: Path) -> None:
    source = path.read_text()
    for what, pattern in _FORBIDDEN.items():
        found = pattern.search(source)
        assert found is None, f"{path.name} has {what}: {found.group(0) if found else ''}"


def test_the_store_uses_every_transition_of_the_table() -> None:
    used = set()
    for path in _OTHERS:
        used |= set(re.findall(r"Transition\.([A-Z_]+)", path.read_text()))
    assert used == {t.name for t in Transition}


def test_where_clauses_come_from_the_table() -> None:
    assert where_sources(Transition.SUCCEED) == "state = 'running'"
    assert where_sources(Transition.RETRY) == "state IN ('failed', 'cancelled')"
    assert where_sources(Transition.CLAIM) == (
        "(state = 'queued' OR (state = 'running' AND lease_expires_at < now()))"
    )
    assert where_sources(Transition.EXPIRE_LEASE) == (
        "(state = 'running' AND lease_expires_at < now())"
    )
    assert where_phases([Phase.RUNNING], "jobs") == (
        "(jobs.state = 'running' AND jobs.lease_expires_at >= now())"
    )
    with pytest.raises(ValueError, match="no phase"):
        where_sources(Transition.SUBMIT)


def test_each_statement_sets_the_declared_state_and_matches_the_declared_sources() -> None:
    machine_ = StateMachine()
    for transition, rule in RULES.items():
        sql = machine_.statement(transition).text
        if transition is not Transition.SUBMIT:
            assert where_sources(transition) in sql or where_sources(transition, "jobs") in sql
        if transition not in (
            Transition.PROGRESS,
            Transition.HAND_BACK,
            Transition.PARK,
            Transition.UNPARK,
        ):
            assert f"'{rule.target.value}'" in sql, transition


def test_stage_writes_come_from_the_stage_table() -> None:
    machine_ = StateMachine()
    for transition, step in STAGE_STEPS.items():
        sql = stage_update(step)
        # Each stage it touches gets the state the table declares, and the
        # transition's statement carries that update.
        for becomes in step.becomes.values():
            assert f"'{becomes.state}'" in sql, transition
        assert STAGE_WRITES[transition] == (sql, step.columns)
        # A transition of a group (one statement deciding between several)
        # reads its own rows of j.
        mine = f"(SELECT * FROM j WHERE transition = '{transition}')"
        statement = machine_.statement(transition).text
        assert sql.replace("{j}", "j") in statement or sql.replace("{j}", mine) in statement, (
            transition
        )
    cancel = stage_update(STAGE_STEPS[Transition.CANCEL])
    assert "'cancelled' ELSE 'skipped'" in cancel
    assert "s.state NOT IN ('succeeded', 'failed')" in cancel
    # Only a pipeline job's transitions that leave its stage as it was have no step.
    assert set(Transition) - set(STAGE_STEPS) == {
        Transition.SUBMIT,
        Transition.PROGRESS,
        Transition.HAND_BACK,
        Transition.PARK,
        Transition.UNPARK,
        Transition.REQUEST_CANCEL,
        Transition.REDISPATCH,
        Transition.WAIT,
        Transition.HOLD,
        Transition.RELEASE,
        Transition.THROTTLE,
        Transition.RELEASE_LIMIT,
        Transition.DEPENDENCIES_MET,
    }


@pytest.mark.parametrize(
    ("value", "on"),
    [(None, True), ("1", True), ("yes", True), ("0", False), ("off", False), (" False ", False)],
)
def test_the_settings_say_whether_transitions_publish_lifecycle_events(
    value: str | None, on: bool
) -> None:
    env = {} if value is None else {"JOBPLANE_LIFECYCLE_EVENTS": value}
    assert Settings.from_env(env).lifecycle_events is on


def test_the_machine_reads_no_environment_and_the_process_sets_its_lifecycle_events() -> None:
    # A fresh interpreter: MACHINE is built at import, and the CLI sets it for good.
    program = (
        "from jobplane import process\n"
        "from jobplane.store.machine import MACHINE, DomainEvents, StateMachine\n"
        "def on(m):\n"
        "    (hook,) = [h for h in m._hooks if isinstance(h, DomainEvents)]\n"
        "    return hook.lifecycle\n"
        "print(on(MACHINE), on(StateMachine()))\n"
        "process._settings_and_topology()\n"
        "print(on(MACHINE))\n"
    )
    env = {**os.environ, "JOBPLANE_LIFECYCLE_EVENTS": "0", "JOBPLANE_TOPOLOGY": ""}
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split() == ["True", "True", "False"]
    for path in sorted(_STORE.rglob("*.py")):
        assert "os.environ" not in path.read_text(), path


def test_a_claim_group_calls_no_function_that_takes_a_lock() -> None:
    # Its guard reads only the job's columns: the planner may evaluate it on
    # rows the group was not given, before their fence (ADR-0043).
    sql = "\n".join(changes_many(Transition.CLAIM, {"id"}, ["id", "tenant_id", "dispatch_id"]))
    assert "flow_check" not in sql and "concurrency_blocker" not in sql
    assert "concurrency_key IS NULL" in sql


def test_setting_lifecycle_events_recompiles_what_was_compiled() -> None:
    with_events = [t for t, rule in RULES.items() if rule.lifecycle is not None]
    # What a worker's group commit applies many at a time (ADR-0028).
    grouped = [Transition.CLAIM, Transition.SUCCEED, Transition.FAIL]
    assert set(grouped) <= set(with_events)

    def texts(m: StateMachine) -> list[str]:
        one = [str(m.statement(t, ("id",))) for t in with_events]
        return one + [str(m._compile_many(t, ("id",))[0]) for t in grouped]

    on, off = texts(StateMachine()), texts(StateMachine(lifecycle=False))
    assert all(a != b for a, b in zip(on, off, strict=True))
    switched = StateMachine(lifecycle=False)
    assert texts(switched) == off  # compiled, and cached, without them
    switched.set_lifecycle_events(True)
    assert texts(switched) == on
    switched.set_lifecycle_events(False)
    assert texts(switched) == off


async def test_a_function_registered_with_on_runs_its_transitions_in_a_transaction() -> None:
    """``machine.on`` costs the transitions it names their autocommit and their
    group commit (ADR-0010, ADR-0028), and only those."""

    async def audit(conn: AnyConn, change: Change) -> None:
        return None

    machine_ = StateMachine()
    hot = (Transition.CLAIM, Transition.SUCCEED, Transition.FAIL)
    assert not any(machine_.in_transaction(t) for t in hot)
    assert all(machine_.groupable(t) for t in hot)
    machine_.on([Transition.SUCCEED], audit)
    assert machine_.in_transaction(Transition.SUCCEED)
    assert not machine_.groupable(Transition.SUCCEED)
    with pytest.raises(ValueError, match="cannot be applied to many rows"):
        await machine_.apply_many(None, Transition.SUCCEED, [{}])  # type: ignore[arg-type]
    assert [machine_.in_transaction(t) for t in hot] == [False, True, False]
    assert [machine_.groupable(t) for t in hot] == [True, False, True]
    # The shared machine is not touched.
    assert not machine.MACHINE.in_transaction(Transition.SUCCEED)
