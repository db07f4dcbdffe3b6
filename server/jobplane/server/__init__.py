"""The jobplane gRPC server: JobService, health and reflection."""

from __future__ import annotations

from jobplane.server.app import JobplaneServer

__all__ = ["JobplaneServer"]
