"""A stand-in for the servicer context gRPC hands a handler, as far as ours use it."""

from __future__ import annotations

from typing import Any

import grpc


class Aborted(Exception):
    """The end of a call its handler aborted, holding the status it aborted with."""

    def __init__(self, status: grpc.Status) -> None:
        self.status = status


class ServicerContext:
    """The call's metadata, and an abort that ends the call as gRPC's does: it
    raises :class:`Aborted` with the status."""

    def __init__(self, metadata: tuple[tuple[str, Any], ...] = ()) -> None:
        self.metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self.metadata

    async def abort_with_status(self, status: grpc.Status) -> None:
        raise Aborted(status)
