"""What a service that only calls the API must never load: the server's libraries
and what they bring (ADR-0026)."""

from __future__ import annotations

SERVER_MODULES = (
    "sqlalchemy",
    "asyncpg",
    "aio_pika",
    "aiormq",
    "pamqp",
    "alembic",
    "structlog",
    "rich",
    "uvloop",
    "aioboto3",
    "botocore",
    "prometheus_client",
    "opentelemetry",
    "jinja2",
    "aiohttp",
    "grpc_health",
    "grpc_reflection",
    "qdrant_client",
    "pypdf",
)
#: In an environment where they are installed, `import grpc` itself imports
#: these (with grpc_tools): only a venv without them can show the SDK does not.
LOADED_BY_GRPC_WHEN_INSTALLED = frozenset({"grpc_health", "grpc_reflection"})
