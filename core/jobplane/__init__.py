"""jobplane: a gRPC job control plane on Postgres and RabbitMQ."""

from __future__ import annotations

__version__ = "0.1.0"
