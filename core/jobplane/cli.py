"""The ``jobplane`` command: processes (migrate, serve, relay, worker, dev), keys,
topology, workers, and the client commands (submit, watch, get, list, cancel, retry, events).

This module knows each process command by name and by the module that
implements it (:data:`_COMMANDS`), and imports that module only when the
command runs: the server's in jobplane.server.cli, jobplane.server.admin and
jobplane.server.dev, the worker side's in jobplane.workers.cli, the client's in
jobplane.client.cli. What is left here is what every command shares: the
parser's root, the drivers' logging, and how a failure ends the process.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Collection
from importlib import import_module

from jobplane.config import ConfigError, Settings
from jobplane.console import installed_version
from jobplane.process import _error_line, _first_line
from jobplane.topology import TopologyError

#: Each process command, in the order ``jobplane --help`` lists them: its one-line
#: help, and the function (``module:name``) that adds its arguments to its parser.
#: The module is imported only for the command that runs (or for the whole parser).
_COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("migrate", "create the database if needed and migrate it", "server.cli:register_migrate"),
    ("serve", "run the gRPC server (and the dashboard, if asked)", "server.cli:register_serve"),
    ("ui", "serve the dashboard alone (docs/dashboard.md)", "server.cli:register_ui"),
    ("relay", "publish the outbox to RabbitMQ (and sweep)", "workers.cli:register_relay"),
    ("sweep", "repair expired leases and stuck outbox rows", "workers.cli:register_sweep"),
    ("worker", "run job handlers", "workers.cli:register_worker"),
    ("dev", "migrate, then serve + relay + worker in one command", "server.dev:register"),
    ("dlq", "the failed (dead-letter) queue", "workers.cli:register_dlq"),
    ("keys", "API keys", "server.admin:register_keys"),
    (
        "tenants",
        "tenants: retention horizons, retention runs, erasure",
        "server.admin:register_tenants",
    ),
    (
        "workers",
        "list live workers (and those that stopped recently)",
        "server.admin:register_workers",
    ),
    ("topology", "RabbitMQ topology", "server.cli:register_topology"),
)


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The argument parser of the ``jobplane`` command.

    ``commands``: the process commands whose arguments it holds (their modules
    imported); the others it only lists. None: every one.
    """
    parser = argparse.ArgumentParser(
        prog="jobplane",
        description="jobplane: durable jobs with live progress over gRPC.",
    )
    parser.add_argument("--version", action="version", version=f"jobplane {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text, where in _COMMANDS:
        command = sub.add_parser(name, help=help_text)
        if commands is None or name in commands:
            module, _, function = where.partition(":")
            getattr(import_module(f"jobplane.{module}"), function)(command)

    from jobplane.client.cli import register

    register(sub)
    return parser


def _command(argv: list[str]) -> str | None:
    """The command ``argv`` runs: its first word that is not an option."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


_OPERATOR_COMMANDS = frozenset({"migrate", "keys", "tenants", "dlq", "topology", "sweep"})


def _service_of(exc: BaseException) -> str | None:
    """ "database" or "broker": whose driver raised ``exc`` (None: neither)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        modules = []
        while tb is not None:
            modules.append(str(tb.tb_frame.f_globals.get("__name__", "")))
            tb = tb.tb_next
        for module in reversed(modules):  # the innermost frame decides
            if module.startswith(("asyncpg", "sqlalchemy", "alembic")):
                return "database"
            if module.startswith(("aiormq", "aio_pika", "pamqp")):
                return "broker"
        current = current.__cause__ or current.__context__
    return None


def _fatal_message(exc: Exception) -> str | None:
    """One line for an operator when a service is down or refuses; None: a bug."""
    from jobplane.store.down import database_down, sqlstate

    settings = Settings.from_env()
    first = _first_line(exc)
    service = _service_of(exc)
    if service == "database":
        where = _without_password(settings.database_url)
        if database_down(exc):
            return f"cannot reach Postgres at {where}: {first}"
        state = sqlstate(exc)
        if state == "42P01":
            return f"the database at {where} has no jobplane tables: run `jobplane migrate`"
        if state == "3D000":
            return f"the database at {where} does not exist: run `jobplane migrate`"
        return f"Postgres at {where} refused: {first}"
    if service == "broker":
        from jobplane.broker_addresses import describe

        where = describe(settings.amqp_url)
        import aiormq

        if isinstance(exc, aiormq.exceptions.ProbableAuthenticationError):
            return f"RabbitMQ at {where} refused the login: {first}"
        if isinstance(exc, OSError | aiormq.exceptions.AMQPConnectionError | TimeoutError):
            return f"cannot reach RabbitMQ at {where}: {first}"
        return f"RabbitMQ at {where} refused: {first}"
    return None


def _without_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    from jobplane.store.dsn import SCHEMES, redacted

    if url.partition("://")[0] in SCHEMES:  # libpq's forms too (several hosts, ?password=)
        return redacted(url)

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # an AMQP URL SQLAlchemy cannot parse: say only the scheme
        return url.rsplit("@", maxsplit=1)[-1] if "@" in url else url


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``jobplane`` console script."""
    named = _command(sys.argv[1:] if argv is None else argv)
    parser = build_parser(() if named is None else (named,))
    args = parser.parse_args(argv)
    if args.command in _OPERATOR_COMMANDS:
        # The drivers log a failed connect themselves; the command says it
        # once, in its own line.
        logging.getLogger("aiormq").setLevel(logging.CRITICAL)
    try:
        code = args.func(args)
    except (ConfigError, TopologyError) as exc:
        _error_line(str(exc))
        code = 2
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        # The reader went away (``| head``): point stdout at /dev/null so the
        # flush at exit does not fail a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        code = 1
    except Exception as exc:
        message = _fatal_message(exc)
        if message is None:
            raise
        _error_line(message)
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    raise SystemExit(code)
