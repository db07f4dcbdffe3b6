"""The ``jobplane`` console script, on whichever install it finds (ADR-0026).

With the server install (``pip install 'jobplane[server]'``) it is the whole
command, :func:`jobplane.cli.main`. With the SDK alone it still runs the
client commands (submit, watch, get, list, cancel, retry, events, blobs,
ingest), which need only the API and, for their progress bars and tables,
rich (``pip install 'jobplane[cli]'``); with the worker install
(``pip install 'jobplane[worker]'``, ADR-0033) ``jobplane worker`` too. A
server command it cannot run (serve, relay, migrate, keys, ...) then says in
one line which install it needs and exits 2, as a usage error does.

Nothing here imports more than the standard library until it knows which
install it is on.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from importlib.util import find_spec

SERVER_INSTALL = "pip install 'jobplane[server]'"
CLI_INSTALL = "pip install 'jobplane[cli]'"
WORKER_INSTALL = "pip install 'jobplane[worker]'"
EXIT_USAGE = 2

#: Import names of the server install's libraries (the ``server`` extra);
#: one missing and only the client commands can run. uvloop is left out: it
#: is not installed on Windows, and the server runs without it there.
SERVER_MODULES = (
    "grpc_health",
    "grpc_reflection",
    "aio_pika",
    "pamqp",
    "sqlalchemy",
    "asyncpg",
    "alembic",
    "structlog",
    "rich",
    "aioboto3",
    "prometheus_client",
    "opentelemetry.sdk",
    "opentelemetry.exporter.otlp.proto.http",
    "jinja2",
    "aiohttp",
    "cronsim",
)
#: Import names of the worker install's libraries (the ``worker`` extra,
#: ADR-0033): with them, ``jobplane worker`` runs without the server install.
WORKER_MODULES = (
    "aio_pika",
    "pamqp",
    "sqlalchemy",
    "asyncpg",
    "structlog",
    "rich",
    "opentelemetry.trace",
)
#: The server commands the worker install runs.
WORKER_COMMANDS = frozenset({"worker"})
#: The commands of :func:`jobplane.cli.build_parser` that are not client
#: commands (tests/unit/test_packaging.py checks this against the parser).
SERVER_COMMANDS = frozenset(
    {
        "migrate",
        "serve",
        "relay",
        "sweep",
        "worker",
        "dev",
        "dlq",
        "keys",
        "tenants",
        "workers",
        "ui",
        "topology",
    }
)


def installed_version() -> str:
    """The installed distribution's version ("unknown" from a bare source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jobplane")
    except PackageNotFoundError:  # run from a source tree without an install
        return "unknown"


def missing_server_modules() -> list[str]:
    """The server install's libraries that cannot be imported here."""
    return missing_modules(SERVER_MODULES)


def missing_modules(names: tuple[str, ...]) -> list[str]:
    """Those of ``names`` (import names, dotted or not) that cannot be imported here."""
    return [name for name in names if not _importable(name)]


def extra_install(extra: str) -> str:
    """The pip command that installs ``extra``."""
    return f"pip install 'jobplane[{extra}]'"


def _importable(name: str) -> bool:
    try:
        return find_spec(name) is not None
    except ModuleNotFoundError:  # a dotted name whose parent is missing
        return False


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``jobplane`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        # Looking for the server's modules reads the disk: a Ctrl-C may land
        # here too, before any command has begun.
        server = not missing_server_modules() or (
            _command(args) in WORKER_COMMANDS and not missing_modules(WORKER_MODULES)
        )
        if server:
            server_main = _load_server_main()
            server_main(args)
            return
    except KeyboardInterrupt:  # Ctrl-C before the command catches it (while importing)
        raise SystemExit(130) from None
    raise SystemExit(client_main(args))


def _quit_while_loading(signum: int, frame: object) -> None:
    """A Ctrl-C while the server's modules load: exit as a Ctrl-C before the
    interpreter started would. A KeyboardInterrupt raised inside an extension
    module's initialisation (grpc's) comes out as an ImportError and its
    traceback; nothing has begun that would need cleaning up."""
    os._exit(130)


def _load_server_main() -> Callable[[list[str]], None]:
    """``jobplane.cli.main``, imported with a Ctrl-C ending the process quietly."""
    previous = signal.signal(signal.SIGINT, _quit_while_loading)
    try:
        from jobplane.cli import main as server_main
    finally:
        signal.signal(signal.SIGINT, previous)
    return server_main


def _command(argv: list[str]) -> str | None:
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _install_error(message: str) -> None:
    """``error: message`` on stderr, or with ``JOBPLANE_LOG_FORMAT=json`` the
    ``command.failed`` line of jobplane.process._error_line: that module needs
    structlog, which the install may not have, so the line is made here."""
    from jobplane.config_parse import requested_log_format

    if requested_log_format() != "json":
        print(f"error: {message}", file=sys.stderr)
        return
    import json
    from datetime import UTC, datetime

    line = {
        "error": message,
        "event": "command.failed",
        "level": "error",
        "logger": "jobplane.cli",
        "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
    }
    print(json.dumps(line), file=sys.stderr)


def client_main(argv: list[str]) -> int:
    """The command without the server install: the client commands only."""
    command = _command(argv)
    if command in WORKER_COMMANDS:
        _install_error(
            f"jobplane {command}: this command needs the worker install: "
            f"{WORKER_INSTALL} (or the server install: {SERVER_INSTALL})"
        )
        return EXIT_USAGE
    if command in SERVER_COMMANDS:
        _install_error(
            f"jobplane {command}: this command needs the server install: {SERVER_INSTALL}"
        )
        return EXIT_USAGE
    if argv == ["--version"]:
        print(f"jobplane {installed_version()}")
        return 0
    if find_spec("rich") is None:
        _install_error(
            "the jobplane command needs the command-line install: "
            f"{CLI_INSTALL} (client commands) or {SERVER_INSTALL} (everything)"
        )
        return EXIT_USAGE
    from jobplane.client.cli import register

    parser = argparse.ArgumentParser(
        prog="jobplane",
        description="jobplane: durable jobs with live progress over gRPC (client commands).",
        epilog=f"{', '.join(sorted(SERVER_COMMANDS))}: these need the server install, "
        f"{SERVER_INSTALL}",
    )
    parser.add_argument("--version", action="version", version=f"jobplane {installed_version()}")
    register(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    parsed = parser.parse_args(argv)
    try:
        code: int = parsed.func(parsed)
    except KeyboardInterrupt:
        code = 130
    return code
