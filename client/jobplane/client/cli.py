"""The client commands of ``jobplane``: submit, watch, get, list, cancel, retry, events.

:func:`register` adds them to the top-level parser. Each command talks to the
server named by ``--address`` / ``JOBPLANE_ADDRESS`` with the key from
``--api-key`` / ``JOBPLANE_API_KEY`` (over TLS with ``--tls`` and its
options, or their ``JOBPLANE_TLS*`` variables), and returns the process exit code: 0 on
success, 1 when the call failed or the watched job did not succeed, 2 for bad
usage (a missing API key, a payload that is not a JSON object, ...).

The commands are kept by what they serve: ``_cli_run`` (the connection flags, the
client made from them, errors as exit codes), ``_cli_input`` (what the command line
says), ``_cli_render`` (lines, tables, progress bars, JSON), and one module each for
the job, event, blob and schedule commands. The names other modules use are re-exported here.
"""

from __future__ import annotations

import argparse

from jobplane.client._cli_blobs import register_blob_commands
from jobplane.client._cli_events import register_event_commands
from jobplane.client._cli_input import (
    blob_name_of,
    full_name,
    parse_labels,
    parse_payload,
    read_job_lines,
)
from jobplane.client._cli_jobs import register_job_commands
from jobplane.client._cli_render import (
    attempts_text,
    blob_line,
    blob_to_json,
    describe,
    domain_event_details,
    domain_event_line,
    domain_event_to_json,
    event_line,
    event_to_json,
    job_details,
    job_line,
    job_to_json,
    outcome,
    print_json,
    render_watch,
    stage_attempts_text,
    stage_text,
    subscribed_to_json,
)
from jobplane.client._cli_run import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    Command,
    Parents,
    Subparsers,
    UsageError,
    command,
    common_parents,
)
from jobplane.client._cli_schedules import register_schedule_commands


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the client commands to ``subparsers``; each sets ``func`` (args -> exit code)."""
    parents = common_parents()
    register_job_commands(subparsers, parents)
    register_event_commands(subparsers, parents)
    _register_ingest(subparsers, parents)
    register_blob_commands(subparsers, parents)
    register_schedule_commands(subparsers, parents)


def _register_ingest(subparsers: Subparsers, parents: Parents) -> None:
    """``jobplane ingest`` (jobplane.contrib.ingest.cli: needs only the SDK)."""
    from jobplane.contrib.ingest.cli import register as register_ingest

    register_ingest(subparsers, parents)


__all__ = [
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "Command",
    "UsageError",
    "attempts_text",
    "blob_line",
    "blob_name_of",
    "blob_to_json",
    "command",
    "describe",
    "domain_event_details",
    "domain_event_line",
    "domain_event_to_json",
    "event_line",
    "event_to_json",
    "full_name",
    "job_details",
    "job_line",
    "job_to_json",
    "outcome",
    "parse_labels",
    "parse_payload",
    "print_json",
    "read_job_lines",
    "register",
    "render_watch",
    "stage_attempts_text",
    "stage_text",
    "subscribed_to_json",
]
