"""How a client command runs: the connection flags every command takes, the client
built from them (or ``JOBPLANE_*``), and its errors turned into exit codes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeAlias

from jobplane.client.aio import AsyncClient
from jobplane.client.tls import ENV_CA, ENV_CLIENT_CERT, ENV_CLIENT_KEY, ENV_SERVER_NAME, ENV_SWITCH
from jobplane.errors import JobplaneError

Command = Callable[[AsyncClient, argparse.Namespace], Awaitable[int]]

#: What ``add_subparsers()`` returns: each command group adds its commands to it.
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
#: The parent parsers whose flags every client command takes (:func:`common_parents`).
Parents: TypeAlias = list[argparse.ArgumentParser]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """A command line the command cannot act on; exit code 2."""


def common_parents() -> Parents:
    """The parent parsers of every client command: the connection flags and ``--json``."""
    connection = argparse.ArgumentParser(add_help=False)
    group = connection.add_argument_group("connection")
    group.add_argument(
        "--address",
        metavar="HOST:PORT",
        help="server address (default: $JOBPLANE_ADDRESS, else 127.0.0.1:50051)",
    )
    key = group.add_mutually_exclusive_group()
    key.add_argument("--api-key", metavar="KEY", help="API key (default: $JOBPLANE_API_KEY)")
    key.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="read the API key from PATH, e.g. a mounted secret ('-' for stdin)",
    )
    group.add_argument(
        "--call-timeout",
        metavar="SECONDS",
        type=float,
        default=10.0,
        help="give up on a call (and its repeats while the server is unreachable) after "
        "this long (default 10)",
    )
    group.add_argument(
        "--tls",
        action="store_true",
        default=None,
        help="connect with TLS (default: $JOBPLANE_TLS; implied by the options below)",
    )
    group.add_argument(
        "--tls-ca", metavar="PEM", help="CA that signed the server's certificate ($JOBPLANE_TLS_CA)"
    )
    group.add_argument(
        "--tls-client-cert",
        metavar="PEM",
        help="certificate for mutual TLS ($JOBPLANE_TLS_CLIENT_CERT)",
    )
    group.add_argument(
        "--tls-client-key",
        metavar="PEM",
        help="key of --tls-client-cert ($JOBPLANE_TLS_CLIENT_KEY)",
    )
    group.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="name in the server's certificate, if not the host of --address",
    )
    json_flag = argparse.ArgumentParser(add_help=False)
    json_flag.add_argument("--json", action="store_true", help="print JSON instead of text")
    return [connection, json_flag]


def command(fn: Command) -> Callable[[argparse.Namespace], int]:
    """Wrap ``fn`` as an argparse ``func``: client from flags/env, errors as exit codes."""

    def run(args: argparse.Namespace) -> int:
        try:
            api_key = _read_key_file(args.api_key_file) or args.api_key
            if args.api_key_file is not None and not (api_key or "").strip():
                print_error(f"no API key in {args.api_key_file}")
                return EXIT_USAGE
            client = AsyncClient.from_env(
                address=args.address,
                api_key=api_key,
                timeout=args.call_timeout,
                env=_with_tls_flags(args),
            )
        except OSError as exc:
            print_error(f"cannot read {exc.filename}: {exc.strerror or exc}")
            return EXIT_USAGE
        except (ValueError, JobplaneError) as exc:
            # A malformed key or setting: one line, not gRPC's traceback.
            print_error(str(exc))
            return EXIT_USAGE
        if client.api_key is None:
            print_error("no API key: set JOBPLANE_API_KEY or pass --api-key")
            return EXIT_USAGE
        try:
            return asyncio.run(_with_client(client, fn, args))
        except UsageError as exc:
            print_error(str(exc))
            return EXIT_USAGE
        except JobplaneError as exc:
            print_error(f"{exc.reason}: {exc.message}")
            return EXIT_FAILED
        except BrokenPipeError:
            # The reader went away (``| head``); point stdout at /dev/null so
            # the flush at exit does not fail a second time.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return EXIT_FAILED

    return run


def _read_key_file(path: str | None) -> str | None:
    """The key in ``path`` ('-': stdin), or None without a path; the client strips it."""
    if path is None:
        return None
    if path == "-":
        return sys.stdin.read()
    return Path(path).read_text(encoding="utf-8", errors="replace")


def _with_tls_flags(args: argparse.Namespace) -> dict[str, str]:
    """The environment with each TLS flag given in place of its variable."""
    flags = {
        ENV_SWITCH: "1" if args.tls else None,
        ENV_CA: args.tls_ca,
        ENV_CLIENT_CERT: args.tls_client_cert,
        ENV_CLIENT_KEY: args.tls_client_key,
        ENV_SERVER_NAME: args.tls_server_name,
    }
    return {**os.environ, **{name: value for name, value in flags.items() if value}}


async def _with_client(client: AsyncClient, fn: Command, args: argparse.Namespace) -> int:
    async with client:
        return await fn(client, args)


def print_error(message: str) -> None:
    """``message`` as one ``error:`` line on stderr, not a traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
