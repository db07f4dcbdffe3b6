"""The blob commands: ``blobs put``, ``blobs get``, ``blobs list``, ``blobs delete``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from jobplane.client._cli_input import blob_name_of
from jobplane.client._cli_render import blob_line, blob_to_json, print_json
from jobplane.client._cli_run import EXIT_OK, Parents, Subparsers, UsageError, command
from jobplane.client.aio import AsyncClient


def register_blob_commands(subparsers: Subparsers, parents: Parents) -> None:
    """Add ``blobs`` and its commands to ``subparsers``, each with the flags of ``parents``."""
    blobs = subparsers.add_parser(
        "blobs",
        help="store, fetch, list and delete blobs",
        description="Blobs: files stored by their SHA-256 (blobs/<sha256>), for job payloads "
        "to reference by name. The same bytes are the same blob, stored once.",
    ).add_subparsers(dest="blobs", required=True, metavar="COMMAND")
    put = blobs.add_parser(
        "put",
        parents=parents,
        help="upload a file and print its name",
        description="Upload "
        "FILE ('-' for stdin) and print the blob's name (blobs/<sha256>); --json prints it all.",
    )
    put.add_argument("file", metavar="FILE", help="the file to upload, '-' for stdin")
    put.add_argument("--content-type", metavar="TYPE", help="e.g. application/pdf")
    put.set_defaults(func=command(_blobs_put))
    get_blob = blobs.add_parser(
        "get",
        parents=parents,
        help="download a blob",
        description="Write the blob to FILE "
        "(whole or not at all), or to stdout without -o. The bytes are checked against the name.",
    )
    get_blob.add_argument("name", metavar="NAME", help="blobs/<sha256>, or just the sha256")
    get_blob.add_argument("-o", "--output", metavar="FILE", help="write here (default stdout)")
    get_blob.set_defaults(func=command(_blobs_get))
    list_blobs = blobs.add_parser("list", parents=parents, help="list your blobs")
    list_blobs.set_defaults(func=command(_blobs_list))
    delete = blobs.add_parser(
        "delete", parents=parents, help="delete a blob (refused while a job references it)"
    )
    delete.add_argument("name", metavar="NAME", help="blobs/<sha256>, or just the sha256")
    delete.set_defaults(func=command(_blobs_delete))


async def _blobs_put(client: AsyncClient, args: argparse.Namespace) -> int:
    source: Any = sys.stdin.buffer if args.file == "-" else Path(args.file)
    if isinstance(source, Path) and not source.is_file():
        raise UsageError(f"no file {args.file}")
    blob = await client.upload(source, content_type=args.content_type)
    if args.json:
        print_json(blob_to_json(blob))
    else:
        print(blob.name, flush=True)
    return EXIT_OK


async def _blobs_get(client: AsyncClient, args: argparse.Namespace) -> int:
    name = blob_name_of(args.name)
    if args.output:
        blob = await client.download(name, Path(args.output))
        if args.json:
            print_json(blob_to_json(blob))
    else:
        await client.download(name, sys.stdout.buffer)
        sys.stdout.buffer.flush()
    return EXIT_OK


async def _blobs_list(client: AsyncClient, args: argparse.Namespace) -> int:
    async for blob in client.iter_blobs():
        if args.json:
            print_json(blob_to_json(blob))
        else:
            print(blob_line(blob), flush=True)
    return EXIT_OK


async def _blobs_delete(client: AsyncClient, args: argparse.Namespace) -> int:
    await client.delete_blob(blob_name_of(args.name))
    return EXIT_OK
