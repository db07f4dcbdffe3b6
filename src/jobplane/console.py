"""The ``jobplane`` console script, on whichever install it finds (ADR-0026).

With the server install (``pip install 'jobplane[server]'``) it is the whole
command, :func:`jobplane.cli.main`. With the SDK alone it still runs the
client commands (submit, watch, get, list, cancel, retry, events, blobs,
ingest), which need only the API and, for their progress bars and tables,
rich (``pip install 'jobplane[cli]'``); a server command (serve, relay,
worker, migrate, keys, ...) then says in one line which install it needs and
exits 2, as a usage error does.

Nothing here imports more than the standard library until it knows which
install it is on.
"""

from __future__ import annotations

import argparse
import sys
from importlib.util import find_spec

SERVER_INSTALL = "pip install 'jobplane[server]'"
CLI_INSTALL = "pip install 'jobplane[cli]'"
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
)
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
    return [name for name in SERVER_MODULES if not _importable(name)]


def _importable(name: str) -> bool:
    try:
        return find_spec(name) is not None
    except ModuleNotFoundError:  # a dotted name whose parent is missing
        return False


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``jobplane`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not missing_server_modules():
        from jobplane.cli import main as server_main

        server_main(args)
        return
    raise SystemExit(client_main(args))


def client_main(argv: list[str]) -> int:
    """The command without the server install: the client commands only."""
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    if command in SERVER_COMMANDS:
        print(
            f"error: jobplane {command}: this command needs the server install: {SERVER_INSTALL}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if argv == ["--version"]:
        print(f"jobplane {installed_version()}")
        return 0
    if find_spec("rich") is None:
        print(
            "error: the jobplane command needs the command-line install: "
            f"{CLI_INSTALL} (client commands) or {SERVER_INSTALL} (everything)",
            file=sys.stderr,
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
