"""Configuration: one frozen object, built once from the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/jobplane"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_LISTEN = "127.0.0.1:50051"


class ConfigError(ValueError):
    """A JOBPLANE_* setting has a value that cannot be used."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything a jobplane process reads from its environment."""

    database_url: str = DEFAULT_DATABASE_URL
    amqp_url: str = DEFAULT_AMQP_URL
    listen: str = DEFAULT_LISTEN
    address: str = DEFAULT_LISTEN
    api_key: str | None = None
    topology_path: Path | None = None
    max_payload_bytes: int = 256 * 1024
    # Postgres connections per process (a fixed pool: opening and closing
    # connections under load costs Postgres a process each time).
    db_pool_size: int = 20
    # None: the process decides (info; warning for `jobplane dev`, whose
    # terminal shows the demo's progress bar).
    log_level: str | None = None
    log_format: str = "console"
    # Named fault points (see jobplane.faults); empty in production.
    faults: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read the JOBPLANE_* variables; unset ones keep their defaults."""
        env = os.environ if env is None else env
        base = cls()
        topology = env.get("JOBPLANE_TOPOLOGY")
        max_payload = _positive_int(env, "JOBPLANE_MAX_PAYLOAD_BYTES", base.max_payload_bytes)
        pool = _positive_int(env, "JOBPLANE_DB_POOL_SIZE", base.db_pool_size)
        faults = frozenset(p for p in env.get("JOBPLANE_FAULTS", "").split(",") if p.strip())
        return replace(
            base,
            database_url=env.get("JOBPLANE_DATABASE_URL", base.database_url),
            amqp_url=env.get("JOBPLANE_AMQP_URL", base.amqp_url),
            listen=env.get("JOBPLANE_LISTEN", base.listen),
            address=env.get("JOBPLANE_ADDRESS", base.address),
            api_key=env.get("JOBPLANE_API_KEY") or None,
            topology_path=Path(topology) if topology else None,
            max_payload_bytes=max_payload,
            db_pool_size=pool,
            log_level=(env.get("JOBPLANE_LOG_LEVEL") or "").lower() or None,
            log_format=env.get("JOBPLANE_LOG_FORMAT", base.log_format).lower(),
            faults=frozenset(f.strip() for f in faults),
        )


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        value = int(env.get(name, default))
    except ValueError as exc:
        raise ConfigError(f"{name} must be an integer") from exc
    if value <= 0:
        raise ConfigError(f"{name} must be positive")
    return value
