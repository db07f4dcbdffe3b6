"""docs/cli.md is the `jobplane` command as its parser has it, and the parser does what
that reference says: the defaults a bare command line gets, the values it refuses."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from jobplane.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "cli.md"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "cli_reference", ROOT / "scripts" / "cli_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return _script()


def test_the_reference_is_what_the_parser_says(script: ModuleType) -> None:
    generated: str = script.render()
    committed = REFERENCE.read_text(encoding="utf-8")
    if generated != committed:
        differ = next(
            (
                f"line {n}: {old!r} != {new!r}"
                for n, (old, new) in enumerate(
                    zip(committed.splitlines(), generated.splitlines(), strict=False), 1
                )
                if old != new
            ),
            "the length differs",
        )
        pytest.fail(
            f"docs/cli.md is stale ({differ}): run `python scripts/cli_reference.py`",
            pytrace=False,
        )


def test_the_reference_depends_on_neither_terminal_nor_environment(
    script: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("JOBPLANE_UI_LISTEN", "0.0.0.0:1")
    monkeypatch.setenv("JOBPLANE_METRICS_LISTEN", "off")
    monkeypatch.setenv("JOBPLANE_ADDRESS", "elsewhere:1")
    assert script.render() == REFERENCE.read_text(encoding="utf-8")


def test_a_default_read_from_the_environment_is_shown_as_its_variable(
    script: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from jobplane.workers import cli

    register_sweep = cli.register_sweep

    def reading_the_environment(parser: argparse.ArgumentParser) -> None:
        register_sweep(parser)
        parser.add_argument("--batch", default=os.environ.get("JOBPLANE_SWEEP_BATCH", "100"))

    monkeypatch.setattr(cli, "register_sweep", reading_the_environment)
    monkeypatch.setenv("JOBPLANE_SWEEP_BATCH", "7")
    found = script.env_names(["JOBPLANE_LOG_LEVEL", "JOBPLANE_SWEEP_BATCH"])
    assert found == {("sweep", "--batch"): "JOBPLANE_SWEEP_BATCH"}


# -- What the reference says, parsed ------------------------------------------


def _sections() -> dict[str, list[list[str]]]:
    """Each command of docs/cli.md (its words after `jobplane`): its options' table rows."""
    sections: dict[str, list[list[str]]] = {}
    rows: list[list[str]] = []
    for line in REFERENCE.read_text(encoding="utf-8").splitlines():
        heading = re.fullmatch(r"## `jobplane ?(.*)`", line)
        if heading:
            rows = sections.setdefault(heading.group(1), [])
        elif line.startswith("| `") and not line.startswith("| `jobplane"):
            rows.append([cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]])
    return sections


def _command(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> argparse.ArgumentParser:
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


def _leaf_commands() -> list[tuple[str, ...]]:
    def walk(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> list[tuple[str, ...]]:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None:
            return [words]
        return [leaf for name, p in sub.choices.items() for leaf in walk(p, (*words, name))]

    return walk(build_parser(), ())


def _long(name: str) -> str:
    """The long flag of an option's cell (`-o`, `--output`), or a positional's name."""
    flags = name.strip("`").split("`, `")
    return next((f for f in flags if f.startswith("--")), flags[0])


#: A value every required positional or option of a bare command line accepts.
_ANY = {"weight": "1", "days": "1", "key_id": "key_1", "schedule": "schedules/s"}


def _minimal(words: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    """The shortest command line of ``words``: each required argument once, the first
    of each required exclusive choice (the section's first "exactly one of")."""
    argv = list(words)
    for name, _metavar, kind, _default, _choices, required, *_ in rows:
        if required != "yes":
            continue
        flag = _long(name)
        if flag.startswith("-"):
            argv += [flag] if kind == "flag" else [flag, "1"]
        else:
            argv.append(_ANY.get(flag, "1"))
    return argv


_EXCLUSIVE_CHOICE: dict[tuple[str, ...], list[str]] = {
    ("keys", "create"): ["--worker"],
    ("tenants", "retention"): ["--all"],
}


def test_every_command_parses_to_its_documented_defaults() -> None:
    sections = _sections()
    parser = build_parser()
    for words in _leaf_commands():
        rows = sections[" ".join(words)]
        argv = _minimal(words, rows) + _EXCLUSIVE_CHOICE.get(words, [])
        args = parser.parse_args(argv)
        assert callable(args.func), argv
        parsed = vars(args)
        for name, _metavar, _kind, default, _choices, required, *_ in rows:
            flag = _long(name)
            if required == "yes" or default == "-" or flag in argv:
                continue
            dest = (
                _command(parser, words)._option_string_actions[flag].dest
                if flag[0] == "-"
                else flag
            )
            assert f"`{parsed[dest]!r}`" == default, f"jobplane {' '.join(words)} {flag}"


def test_each_subcommand_is_in_its_commands_attribute() -> None:
    parser = build_parser()
    for words in _leaf_commands():
        argv = _minimal(words, _sections()[" ".join(words)])
        args = parser.parse_args(argv + _EXCLUSIVE_CHOICE.get(words, []))
        assert args.command == words[0]
        if len(words) == 2:
            assert getattr(args, words[0]) == words[1]


def test_bare_commands_parse_as_documented() -> None:
    """The values the processes start with when given nothing, spelled out."""
    parser = build_parser()
    worker = parser.parse_args(["worker"])
    assert (worker.concurrency, worker.prefetch, worker.reserve, worker.queue) == (
        64,
        None,
        None,
        None,
    )
    assert (worker.grace, worker.lease_seconds, worker.group_window, worker.group_max) == (
        10.0,
        30.0,
        2.0,
        64,
    )
    relay = parser.parse_args(["relay"])
    assert (relay.sweep_interval, relay.lease_grace, relay.no_sweep, relay.no_fair) == (
        5.0,
        5.0,
        False,
        False,
    )
    assert (relay.republish_after, relay.unroutable_after) == (600.0, 300.0)
    assert (
        relay.credit_min,
        relay.credit_per_consumer,
        relay.credit_horizon,
        relay.credit_max,
    ) == (
        4,
        2,
        0.5,
        2000,
    )
    dev = parser.parse_args(["dev"])
    assert (dev.tenant, dev.processes, dev.concurrency, dev.demo_steps, dev.ingest) == (
        "dev",
        "auto",
        64,
        20,
        None,
    )
    revoke = parser.parse_args(["keys", "revoke", "key_1"])
    assert (revoke.key_id, revoke.after) == ("key_1", "0")
    assert parser.parse_args(["workers"]).dead_for == 3600.0
    assert parser.parse_args(["tenants", "retention", "acme", "beta"]).tenant == ["acme", "beta"]
    assert parser.parse_args(["worker", "--queue", "a", "--queue", "b"]).queue == ["a", "b"]


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["worker", "--concurrency", "x"], "argument --concurrency: invalid int value: 'x'"),
        (["workers", "--dead-for", "soon"], "argument --dead-for: invalid float value: 'soon'"),
        (["relay", "--credit-horizon", "x"], "argument --credit-horizon: invalid float value: 'x'"),
        (["dev", "--demo-steps", "x"], "argument --demo-steps: must be a whole number, got 'x'"),
        (["dlq", "list", "--limit", "x"], "argument --limit: must be a whole number, got 'x'"),
        (
            ["tenants", "set-weight", "acme", "heavy"],
            "argument WEIGHT: WEIGHT must be a whole number, got 'heavy'",
        ),
        (
            ["tenants", "set-retention", "acme", "1.5"],
            "argument DAYS: DAYS must be a whole number of days or 'none', got '1.5'",
        ),
        (
            ["keys", "create", "--tenant", "acme", "--worker"],
            "argument --worker: not allowed with argument --tenant",
        ),
        (["keys", "create"], "one of the arguments --tenant --worker is required"),
        (
            ["tenants", "retention", "acme", "--all"],
            "argument --all: not allowed with argument TENANT",
        ),
        (["tenants", "retention"], "one of the arguments TENANT --all is required"),
        (["topology"], "the following arguments are required: topology"),
        (["keys", "revoke"], "the following arguments are required: KEY_ID"),
        (["dlq", "list", "--limit", "0"], "argument --limit: must be 1 or more, got 0"),
        (["dlq", "replay", "--limit", "-5"], "argument --limit: must be 1 or more, got -5"),
        (["dlq", "list", "--limit", "all"], "argument --limit: must be a whole number, got 'all'"),
        (["dev", "--demo-steps", "0"], "argument --demo-steps: must be 1 or more, got 0"),
    ],
    ids=lambda value: "-".join(value) if isinstance(value, list) else "",
)
def test_a_bad_command_line_is_one_error_line_and_exit_2(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    prog = " ".join(["jobplane", *argv[: 2 if argv[0] in ("tenants", "keys", "dlq") else 1]])
    assert last == f"{prog}: error: {error}"


def test_every_option_a_user_sees_says_what_it_does() -> None:
    for words, rows in _sections().items():
        for name, *_, help_text in rows:
            assert help_text not in ("-", ""), f"jobplane {words} {name} has no help"


def test_retention_days_take_a_number_or_none() -> None:
    parser = build_parser()
    for days, parsed in (("30", 30), ("0", 0), ("none", None), ("Off", None), ("FOREVER", None)):
        assert parser.parse_args(["tenants", "set-retention", "acme", days]).days == parsed
    assert parser.parse_args(["tenants", "set-weight", "acme", "7"]).weight == 7


#: A command line of each process and operator command, and the body that runs it.
_BODIES = (
    (["migrate"], "jobplane.server.cli", "_migrate"),
    (["serve"], "jobplane.server.cli", "_serve"),
    (["ui"], "jobplane.server.cli", "_ui"),
    (["topology", "apply"], "jobplane.server.cli", "_topology_apply"),
    (["relay"], "jobplane.workers.cli", "_relay"),
    (["sweep"], "jobplane.workers.cli", "_sweep"),
    (["worker"], "jobplane.workers.cli", "_worker"),
    (["dlq", "list"], "jobplane.workers.cli", "_dlq"),
    (["dlq", "replay"], "jobplane.workers.cli", "_dlq"),
    (["dlq", "purge"], "jobplane.workers.cli", "_dlq"),
    (["keys", "create", "--worker"], "jobplane.server.admin", "_keys"),
    (["keys", "list"], "jobplane.server.admin", "_keys"),
    (["keys", "revoke", "key_1"], "jobplane.server.admin", "_keys"),
    (["keys", "rotate", "key_1"], "jobplane.server.admin", "_keys"),
    (["tenants", "list"], "jobplane.server.admin", "_tenants"),
    (["tenants", "set-retention", "acme", "1"], "jobplane.server.admin", "_tenants"),
    (["tenants", "set-weight", "acme", "1"], "jobplane.server.admin", "_tenants"),
    (["tenants", "retention", "--all"], "jobplane.server.admin", "_tenants"),
    (["tenants", "erase", "acme"], "jobplane.server.admin", "_tenants"),
    (["workers"], "jobplane.server.admin", "_workers"),
)


def test_each_command_runs_its_own_body(monkeypatch: pytest.MonkeyPatch) -> None:
    """`args.func` of a command line runs that command's body, its exit code returned."""
    ran: list[tuple[str, list[str]]] = []

    def fake(body: str) -> Callable[[argparse.Namespace], Coroutine[Any, Any, int]]:
        async def run(args: argparse.Namespace) -> int:
            ran.append((body, args.argv))
            return 3

        return run

    for _argv, module, body in _BODIES:
        monkeypatch.setattr(importlib.import_module(module), body, fake(body))

    def dev_command(args: argparse.Namespace) -> int:  # not a coroutine: dev runs its own loop
        ran.append(("_dev_command", args.argv))
        return 3

    monkeypatch.setattr(importlib.import_module("jobplane.server.dev"), "_dev_command", dev_command)
    parser = build_parser()
    for argv, _module, body in (*_BODIES, (["dev"], "jobplane.server.dev", "_dev_command")):
        ran.clear()
        args = parser.parse_args(argv)
        args.argv = argv
        assert args.func(args) == 3
        assert ran == [(body, argv)]
