"""`jobplane worker --handlers`: what a user gets wrong is one line, not a traceback;
and the registry refuses what the runtime cannot run."""

from __future__ import annotations

import functools
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from jobplane.cli import main
from jobplane.config import ConfigError, Settings
from jobplane.workers.handlers import JobContext, Registry, SyncJobContext
from jobplane.workers.loader import HandlersError, load_registry
from jobplane.workers.plain import Threaded

MODULES = {
    "jpspec_ok": """
        from jobplane.workers import Registry
        registry = Registry()
        not_registry = {}

        @registry.handler("spec.job")
        async def job(ctx):
            return {}
    """,
    "jpspec_dep": "import jpspec_not_installed_anywhere\n",
    "jpspec_raises": "x = 1\nraise RuntimeError('boom at import')\n",
    "jpspec_syntax": "def broken(:\n",
    "jpspec_exits": "import sys\nsys.exit(3)\n",
    "jpspec_empty": "from jobplane.workers import Registry\nregistry = Registry()\n",
    "jpspec_gen": """
        from jobplane.workers import Registry
        registry = Registry()

        @registry.handler("spec.gen")
        def job(ctx):
            yield {}
    """,
    "jpspec_dup": """
        from jobplane.workers import Registry
        registry = Registry()

        @registry.handler("demo.echo")
        async def echo(ctx):
            return {}
    """,
}


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory of handler modules, made the current directory."""
    for name, source in MODULES.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    # main() would point the process's logging at the captured stderr of this
    # test, closed after it: later tests' log lines would fail to print.
    monkeypatch.setattr("jobplane.process.configure", lambda *args, **kwargs: None)
    yield tmp_path
    for name in MODULES:
        sys.modules.pop(name, None)


def run_main(argv: list[str]) -> int:
    """``main(argv)``'s exit code; in a thread, so its event loop is its own."""
    codes: list[int] = []

    def target() -> None:
        try:
            main(argv)
        except SystemExit as exc:
            codes.append(int(exc.code or 0))

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    assert codes, "main did not exit"
    return codes[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["nocolon"], "--handlers must look like module:registry"),
        (["jpspec_missing:registry"], "no module named 'jpspec_missing'"),
        (
            ["jpspec_dep:registry"],
            "importing 'jpspec_dep' failed: ModuleNotFoundError: "
            "No module named 'jpspec_not_installed_anywhere'",
        ),
        (["jpspec_ok:nope"], "'jpspec_ok' has no attribute 'nope'; its registries: registry"),
        (["jpspec_ok:not_registry"], "is a dict, not a jobplane.workers.Registry"),
        (["jpspec_raises:registry"], "RuntimeError: boom at import (at "),
        (["jpspec_syntax:registry"], "SyntaxError: "),
        (["jpspec_exits:registry"], "importing 'jpspec_exits' failed: SystemExit: 3"),
        (["jpspec_empty:registry"], "jpspec_empty:registry has no handlers registered"),
        (["jpspec_gen:registry"], "is a generator function (it must return its result)"),
        # The line of the generator function.
        pytest.param(["jpspec_gen:registry"], "jpspec_gen.py:5)", marks=pytest.mark.source_lines),
        (["jpspec_dup:registry", "--demo"], "a handler for 'demo.echo' is already registered"),
    ],
)
def test_a_bad_handlers_spec_is_one_line_and_exit_code_2(
    project: Path, capsys: pytest.CaptureFixture[str], args: list[str], expected: str
) -> None:
    code = run_main(["worker", "--handlers", *args])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert expected in err
    assert "Traceback" not in err


def test_a_module_in_the_current_directory_is_found(project: Path) -> None:
    registry = load_registry("jpspec_ok:registry")
    assert list(registry) == ["spec.job"]
    assert sys.path[0] == str(project)
    with pytest.raises(HandlersError, match="line 1"):
        load_registry("jpspec_syntax:registry")


async def _async_handler(ctx: JobContext) -> dict[str, Any]:
    return {}


class AsyncCallable:
    async def __call__(self, ctx: JobContext) -> dict[str, Any]:
        return {}


class SyncCallable:
    def __call__(self, ctx: SyncJobContext) -> dict[str, Any]:
        return {}


def _sync_handler(ctx: SyncJobContext) -> dict[str, Any]:
    return {}


async def _async_generator(ctx: JobContext) -> AsyncIterator[dict[str, Any]]:
    yield {}


def _sync_generator(ctx: JobContext) -> Iterator[dict[str, Any]]:
    yield {}


class GeneratorCallable:
    def __call__(self, ctx: JobContext) -> Iterator[dict[str, Any]]:
        yield {}


def test_the_registry_takes_async_and_plain_functions_and_refuses_the_rest() -> None:
    registry = Registry()
    registry.add("a.plain", _async_handler)
    registry.add("a.instance", AsyncCallable())
    registry.add("a.partial", functools.partial(_async_handler))
    # Plain functions run in the worker's threads, behind an async face.
    registry.add("s.plain", _sync_handler)
    registry.add("s.lambda", lambda ctx: {})
    registry.add("s.instance", SyncCallable())
    assert list(registry) == [
        "a.instance",
        "a.partial",
        "a.plain",
        "s.instance",
        "s.lambda",
        "s.plain",
    ]
    assert registry.get("a.plain") is _async_handler
    assert isinstance(registry.get("s.plain"), Threaded)
    # A merged registry keeps them as they were wrapped.
    assert isinstance(registry.merge(Registry()).get("s.plain"), Threaded)
    refused: list[tuple[Any, str]] = [
        (AsyncCallable, "is a class"),  # calling it makes an instance, not a result
        (_async_generator, "is a generator function"),
        (_sync_generator, "is a generator function"),
        (GeneratorCallable(), "is a generator function"),
        (42, "is not callable"),
    ]
    for n, (fn, why) in enumerate(refused):
        with pytest.raises(TypeError, match=why):
            registry.add(f"b.refused{n}", fn)
    assert len(registry) == 6


def test_a_refused_handler_is_named_by_its_module_and_name_or_a_question_mark() -> None:
    """Code run by exec() with no ``__name__`` makes functions with no module."""
    made: dict[str, Any] = {}
    exec("def gen(ctx):\n    yield {}\n", made)
    assert made["gen"].__module__ is None
    tail = "handlers are `async def` or plain `def` functions taking the job's context"
    refused_handlers: list[tuple[Any, str, str]] = [
        (_sync_generator, f"{__name__}._sync_generator", "is a generator function"),
        (made["gen"], "?.gen", "is a generator function"),
        (42, "?.int", "is not callable"),
    ]
    for fn, name, why in refused_handlers:
        with pytest.raises(TypeError) as refused:
            Registry().add("b.refused", fn)
        assert str(refused.value).startswith(f"the handler for 'b.refused' ({name}) {why}")
        assert str(refused.value).endswith(tail)


def test_the_sync_threads_setting() -> None:
    assert Settings.from_env({}).sync_threads is None  # the worker's concurrency
    assert Settings.from_env({"JOBPLANE_SYNC_THREADS": "3"}).sync_threads == 3
    for bad in ("0", "-1", "many"):
        with pytest.raises(ConfigError, match="JOBPLANE_SYNC_THREADS"):
            Settings.from_env({"JOBPLANE_SYNC_THREADS": bad})
