"""`jobplane dev --processes`: how many, and each worker part's command line."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobplane.cli import build_parser
from jobplane.config import ListenAddress
from jobplane.server import devparts
from jobplane.server.devparts import (
    GRACE,
    MOST,
    MOST_AUTO,
    Layout,
    Parts,
    _until_stopped_or_part_exit,
    part_command,
    part_metrics,
    part_queues,
    relay_command,
    resolve_processes,
)
from jobplane.topology import load_topology


@given(st.integers(min_value=0, max_value=512))
def test_auto_gives_server_relay_and_workers_their_own_processes(cpus: int) -> None:
    found = resolve_processes("auto", cpus=cpus)
    assert resolve_processes(" AUTO ", cpus=cpus) == found
    if cpus <= 1:
        assert found == 1
    else:
        # The server and the relay, and a worker per CPU but the first.
        assert found == min(cpus + 1, MOST_AUTO)
        layout = Layout(found)
        assert layout.relay_apart and layout.workers == found - 2 >= 1


def test_the_layouts() -> None:
    assert (Layout(1).relay_apart, Layout(1).workers) == (False, 0)
    assert (Layout(2).relay_apart, Layout(2).workers) == (False, 1)
    assert (Layout(3).relay_apart, Layout(3).workers) == (True, 1)
    assert (Layout(6).relay_apart, Layout(6).workers) == (True, 4)


def test_the_relay_parts_command_line_is_one_the_dev_parser_takes() -> None:
    command = relay_command(parent_pid=77, metrics_listen="127.0.0.1:9466")
    args = build_parser().parse_args(command[3:])
    assert args.relay_part and args.worker_part is None
    assert (args.parent_pid, args.metrics_listen) == (77, "127.0.0.1:9466")
    assert not args.metrics_fallback
    fallback = relay_command(parent_pid=77, metrics_listen="127.0.0.1:9466", metrics_fallback=True)
    assert build_parser().parse_args(fallback[3:]).metrics_fallback


@given(st.integers(min_value=1, max_value=MOST))
def test_a_number_in_range_is_taken(n: int) -> None:
    assert resolve_processes(str(n)) == n


@given(st.text().filter(lambda t: t.strip().lower() != "auto"))
def test_anything_else_is_refused_with_the_rule(value: str) -> None:
    raw = value.strip()
    if raw.isascii() and raw.isdigit() and 1 <= int(raw) <= MOST:
        assert resolve_processes(value) == int(raw)
        return
    with pytest.raises(ValueError, match=r"--processes must be auto or a number of 1\.\.64"):
        resolve_processes(value)


def test_zero_and_too_many_are_refused() -> None:
    for value in ("0", str(MOST + 1), "-1", "2.0", "٣"):
        with pytest.raises(ValueError, match="--processes must be"):
            resolve_processes(value)


def test_parts_serve_metrics_after_the_commands_port() -> None:
    assert part_metrics(ListenAddress("127.0.0.1", 9464), 0) == "127.0.0.1:9465"
    assert part_metrics(ListenAddress("127.0.0.1", 9464), 2) == "127.0.0.1:9467"
    assert part_metrics(ListenAddress("::1", 9000), 0) == "[::1]:9001"
    assert part_metrics(ListenAddress("0.0.0.0", 0), 3) == "0.0.0.0:0"
    assert part_metrics(None, 0) == "off"


def _plain_part(part: int, metrics_listen: str, *, metrics_fallback: bool = False) -> list[str]:
    """Worker part ``part``'s command line without handlers, maintenance left on,
    nothing to ingest."""
    return part_command(
        part,
        parent_pid=1,
        metrics_listen=metrics_listen,
        handlers=None,
        concurrency=8,
        no_maintenance=False,
        ingest=(),
        metrics_fallback=metrics_fallback,
    )


def test_a_parts_command_line_is_one_the_dev_parser_takes() -> None:
    command = part_command(
        1,
        parent_pid=1234,
        metrics_listen="off",
        handlers="pkg.mod:registry",
        concurrency=16,
        no_maintenance=True,
        ingest=["a.pdf", "b.md"],
    )
    assert command[:3] == [sys.executable, "-m", "jobplane"]
    args = build_parser().parse_args(command[3:])
    assert args.command == "dev"
    assert (args.worker_part, args.parent_pid, args.concurrency) == (1, 1234, 16)
    assert args.handlers == "pkg.mod:registry" and args.no_maintenance
    assert args.ingest == ["a.pdf", "b.md"] and args.metrics_listen == "off"
    plain = build_parser().parse_args(_plain_part(0, "127.0.0.1:0")[3:])
    assert plain.handlers is None and not plain.no_maintenance and plain.ingest is None
    assert not args.metrics_fallback and not plain.metrics_fallback
    fallback = _plain_part(2, "127.0.0.1:9467", metrics_fallback=True)
    taken = build_parser().parse_args(fallback[3:])
    assert (taken.worker_part, taken.metrics_listen) == (2, "127.0.0.1:9467")
    assert taken.metrics_fallback


def test_dev_defaults_to_automatic_processes() -> None:
    assert build_parser().parse_args(["dev"]).processes == "auto"
    assert build_parser().parse_args(["dev"]).worker_part is None
    assert not build_parser().parse_args(["dev"]).relay_part


def test_later_parts_leave_the_ingest_stage_queues_to_part_zero() -> None:
    ingest = load_topology(Path("builtin:ingest"))
    assert part_queues(ingest) == ["jobplane.default"]
    plain = load_topology(None)
    assert part_queues(plain) == [q.name for q in plain.queues]


def test_parts_get_time_past_their_grace_to_write_what_they_cut_short() -> None:
    # A part cancels its handlers after GRACE, then writes their refunded outcome
    # and acks; a SIGKILL before that counts the attempt (the sweeper's lease expiry).
    assert Parts([], []).grace >= GRACE + 2.0


class _ExitedAtOnce:
    """Parts of which one exited (status 0) as the Ctrl-C reached it too."""

    async def exited(self) -> tuple[str, int]:
        return "worker part 0", 0


async def test_a_part_leaving_at_the_same_ctrl_c_is_a_stop_not_a_crash(
    capsys: pytest.CaptureFixture[str],
) -> None:
    stop = asyncio.Event()
    stop.set()
    assert await _until_stopped_or_part_exit(stop, _ExitedAtOnce()) == 0
    assert "exited" not in capsys.readouterr().err


async def test_a_part_exiting_on_its_own_ends_the_command_with_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert await _until_stopped_or_part_exit(asyncio.Event(), _ExitedAtOnce()) == 1
    assert "worker part 0 exited (status 0)" in capsys.readouterr().err


class _Made:
    """Stands in for :class:`Parts` in ``_dev_parts``: the command lines it was given."""

    def __init__(self, commands: list[list[str]], names: list[str]) -> None:
        self.commands, self.names = commands, names

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def not_ready(self) -> str | None:
        return None


@pytest.mark.parametrize("fallback", [True, False, None], ids=["default", "asked", "off"])
async def test_parts_give_up_a_taken_metrics_port_only_when_the_commands_was_a_default(
    monkeypatch: pytest.MonkeyPatch, fallback: bool | None
) -> None:
    monkeypatch.setattr(devparts, "Parts", _Made)
    checks: list[str] = []
    ops = (
        None
        if fallback is None
        else SimpleNamespace(
            listen=ListenAddress("127.0.0.1", 9464),
            fallback=fallback,
            add_check=lambda name, _check: checks.append(name),
        )
    )
    args = argparse.Namespace(handlers=None, concurrency=4, no_maintenance=False, ingest=None)
    async with AsyncExitStack() as stack:
        made = await devparts._dev_parts(stack, args, Layout(4), cast(Any, ops))
    assert made.names == ["worker part 0", "worker part 1", "relay part"]
    flags = [c[c.index("--metrics-listen") + 1] for c in made.commands]
    if fallback is None:
        assert flags == ["off"] * 3
    else:
        assert flags == ["127.0.0.1:9465", "127.0.0.1:9466", "127.0.0.1:9467"]
        assert checks == ["parts"]
    assert ["--metrics-fallback" in c for c in made.commands] == [bool(fallback)] * 3


class _Stubborn:
    """A part's process that ignores SIGTERM: it ends only when killed."""

    def __init__(self) -> None:
        self.returncode: int | None = None
        self.signals: list[int] = []
        self._ended = asyncio.Event()

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)

    def kill(self) -> None:
        self.signals.append(signal.SIGKILL)
        self.returncode = -signal.SIGKILL
        self._ended.set()

    async def wait(self) -> int:
        await self._ended.wait()
        assert self.returncode is not None
        return self.returncode


async def test_a_part_that_ignores_the_stop_is_killed_after_the_grace() -> None:
    stubborn = _Stubborn()
    parts = Parts([["part"]], ["worker part 0"], grace=0.05, _procs=[cast(Any, stubborn)])
    started = time.monotonic()
    await asyncio.wait_for(parts.stop(), timeout=5)
    assert stubborn.signals == [signal.SIGTERM, signal.SIGKILL]
    assert 0.05 <= time.monotonic() - started < 5
    assert parts.not_ready() == "worker part 0 exited (status -9)"
