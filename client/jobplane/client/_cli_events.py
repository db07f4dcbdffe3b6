"""The domain event commands: ``events publish`` and ``events tail``."""

from __future__ import annotations

import argparse
import sys

from jobplane.client._cli_input import parse_payload
from jobplane.client._cli_render import (
    domain_event_details,
    domain_event_line,
    domain_event_to_json,
    print_json,
    subscribed_to_json,
)
from jobplane.client._cli_run import EXIT_OK, Parents, Subparsers, command
from jobplane.client.aio import AsyncClient


def register_event_commands(subparsers: Subparsers, parents: Parents) -> None:
    """Add ``events`` and its commands to ``subparsers``, each with the flags of ``parents``."""
    events = subparsers.add_parser(
        "events",
        help="publish domain events, or follow them",
        description="Domain events: facts that happened, such as artifact.created, "
        "that other services react to (docs/events.md).",
    ).add_subparsers(dest="events", required=True, metavar="COMMAND")
    _register_publish(events, parents)
    _register_tail(events, parents)


def _register_publish(events: Subparsers, parents: Parents) -> None:
    """``events publish``: one event, idempotent on its id."""
    publish = events.add_parser(
        "publish",
        parents=parents,
        help="publish an event and print it as stored",
        description="Publish a domain event of your tenant and print it as the server stored "
        "it. Publishing is idempotent on the event id: run it again with the same --id and the "
        "same event to get the stored one back (nothing new is written); with a different event "
        "it fails with EVENT_ID_REUSED.",
    )
    publish.add_argument(
        "event_type", metavar="TYPE", help="lowercase dotted words, e.g. artifact.created"
    )
    event_payload = publish.add_mutually_exclusive_group()
    event_payload.add_argument(
        "--payload", metavar="JSON", help="what the fact says, a JSON object (default {})"
    )
    event_payload.add_argument(
        "--payload-file", metavar="PATH", help="read the JSON payload from PATH ('-' for stdin)"
    )
    publish.add_argument(
        "--id",
        metavar="UUID",
        dest="event_id",
        help="the event id, the idempotency key (default: a new UUID)",
    )
    publish.add_argument(
        "--correlation-id",
        metavar="ID",
        help="the chain of work it belongs to (default: the event starts one, its own id)",
    )
    publish.add_argument(
        "--causation-id", metavar="ID", help="what caused it, usually the causing event's id"
    )
    publish.add_argument(
        "--project", metavar="PROJECT", dest="project_id", help="the project it belongs to"
    )
    publish.set_defaults(func=command(_events_publish))


def _register_tail(events: Subparsers, parents: Parents) -> None:
    """``events tail``: follow events by type pattern, resuming from a cursor."""
    tail = events.add_parser(
        "tail",
        parents=parents,
        help="follow events until Ctrl-C",
        description="Print your tenant's events whose type matches any PATTERN, in commit "
        "order, one line each (time, type, id, payload), until Ctrl-C; --json prints one JSON "
        "object per event with its cursor. Lost connections are resumed where they broke off, "
        "with no gap and no repeat. On Ctrl-C the cursor of the last event printed goes to "
        "stderr: pass it to --after to go on from there.",
    )
    tail.add_argument(
        "patterns",
        metavar="PATTERN",
        nargs="+",
        help="event types in topic syntax: a word '*' matches one word, '#' any number "
        "(e.g. 'job.*', 'artifact.#', '#' for all)",
    )
    where = tail.add_mutually_exclusive_group()
    where.add_argument(
        "--after", metavar="CURSOR", help="start right after the event with this cursor"
    )
    where.add_argument(
        "--from-start",
        dest="start",
        action="store_const",
        const="earliest",
        help="start with the oldest event kept",
    )
    where.add_argument(
        "--latest",
        dest="start",
        action="store_const",
        const="latest",
        help="show only events committed from now on (the default)",
    )
    tail.set_defaults(func=command(_events_tail), start="latest")


async def _events_publish(client: AsyncClient, args: argparse.Namespace) -> int:
    payload = parse_payload(args.payload, args.payload_file)
    event = await client.publish(
        args.event_type,
        payload,
        event_id=args.event_id,
        project_id=args.project_id,
        correlation_id=args.correlation_id,
        causation_id=args.causation_id,
    )
    if args.json:
        print_json(domain_event_to_json(event))
    else:
        print(domain_event_details(event), flush=True)
    return EXIT_OK


async def _events_tail(client: AsyncClient, args: argparse.Namespace) -> int:
    subscription = client.subscribe(args.patterns, after_cursor=args.after, start=args.start)
    try:
        async with subscription:
            async for item in subscription:
                if args.json:
                    print_json(subscribed_to_json(item))
                else:
                    print(domain_event_line(item.event), flush=True)
    finally:
        # Ctrl-C cancels this task: say where to go on from, on stderr so
        # that stdout stays one line (or one JSON object) per event.
        if subscription.cursor:
            print(f"resume with: --after {subscription.cursor}", file=sys.stderr, flush=True)
    return EXIT_OK
