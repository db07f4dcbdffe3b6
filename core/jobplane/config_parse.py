"""Reading JOBPLANE_* values: the error they raise, and the parsers of addresses,
networks and origins.

:class:`~jobplane.config.Settings` reads the environment through these (the
``env_*`` readers take one variable each, refusing at start what would
otherwise be quietly replaced by a default); the parsers also serve values
read elsewhere (a topology's log prefix, the dashboard's command-line listen address).
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

#: What ``JOBPLANE_LOG_LEVEL`` and ``JOBPLANE_LOG_FORMAT`` accept.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("console", "json")
#: What ``JOBPLANE_LOG_JOB_PREFIX`` (and a queue's ``log_prefix``) accepts: dot-separated
#: lower-case words ending in a dot, e.g. ``ingestion.`` (``job.completed`` becomes
#: ``ingestion.job.completed``).
LOG_PREFIX = re.compile(r"(?:[a-z][a-z0-9_-]*\.)+")
LOG_PREFIX_HINT = "dot-separated lower-case words ending in a dot (e.g. 'ingestion.')"

#: An address or network (of a trusted proxy).
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class ConfigError(ValueError):
    """A JOBPLANE_* setting has a value that cannot be used."""


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """A parsed ``host:port`` (``[v6]:port`` for IPv6)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_listen(value: str, *, name: str = "JOBPLANE_METRICS_LISTEN") -> ListenAddress | None:
    """``host:port`` (port 0: any free one) as a :class:`ListenAddress`; None for ``off``.

    Anything else is a :class:`ConfigError` naming ``name``.
    """
    raw = value.strip()
    if raw.lower() == "off":
        return None
    host, sep, port_text = raw.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        bad_host = not host or "[" in host or "]" in host
    else:
        bad_host = not host or ":" in host or "[" in host or "]" in host
    if not sep or bad_host or any(c.isspace() or not c.isprintable() for c in host):
        raise ConfigError(f"{name} must be host:port or off, not {value!r}")
    if not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"{name} must be host:port with a port of 0..65535, not {value!r}")
    return ListenAddress(host, int(port_text))


def check_log_prefix(value: str, name: str) -> str:
    """``value`` when it is a valid log prefix (or empty); else a ConfigError naming ``name``."""
    if value and not LOG_PREFIX.fullmatch(value):
        raise ConfigError(f"{name} must be {LOG_PREFIX_HINT}, not {value!r}")
    return value


def parse_networks(value: str, *, name: str) -> tuple[Network, ...]:
    """Comma-separated addresses or CIDR networks; a ConfigError naming ``name``."""
    networks = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        try:
            networks.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ConfigError(
                f"{name} must be addresses or networks (e.g. 10.0.0.0/8,::1), not {part!r}"
            ) from None
    return tuple(networks)


def parse_origin(value: str, *, name: str) -> str:
    """A web origin (``scheme://host[:port]``, http or https, nothing after it), normalised."""
    parts = urlsplit(value.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    if (
        parts.scheme.lower() not in ("http", "https")
        or not parts.hostname
        or port == -1
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ConfigError(
            f"{name} must be an origin such as https://jobs.example (scheme, host and "
            f"optional port only), not {value!r}"
        )
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}"


def requested_log_format(env: Mapping[str, str] | None = None) -> str:
    """``JOBPLANE_LOG_FORMAT`` as asked for, "console" when unset or not one of
    :data:`LOG_FORMATS`: the format of a start-up error's line, when the settings
    themselves could not be read."""
    env = os.environ if env is None else env
    found = env.get("JOBPLANE_LOG_FORMAT", "").strip().lower()
    return found if found in LOG_FORMATS else "console"


def env_choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str | None:
    """``name``'s value, lower-cased, when it is one of ``choices``; None when unset.

    Anything else is refused at start: a typo would otherwise log at a
    level, or in a format, nobody asked for.
    """
    raw = env.get(name, "").strip().lower()
    if not raw:
        return None
    if raw not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, not {raw!r}")
    return raw


def env_positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    """``name`` as an integer above 0 (``default`` when unset)."""
    try:
        value = int(env.get(name, default))
    except ValueError as exc:
        raise ConfigError(f"{name} must be an integer") from exc
    if value <= 0:
        raise ConfigError(f"{name} must be positive")
    return value


def env_float(env: Mapping[str, str], name: str, default: float, what: str) -> float:
    """``name`` as a float (``default`` when unset or blank); ``what`` names it in the error."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} must be {what}") from exc


def env_non_negative(env: Mapping[str, str], name: str, default: float) -> float:
    """``name`` as a finite number, 0 or more (0: no limit)."""
    value = env_float(env, name, default, "a number")
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"{name} must be 0 (no limit) or more")
    return value


def env_non_negative_int(env: Mapping[str, str], name: str, default: int) -> int:
    """``name`` as an integer, 0 or more (0: no limit; ``default`` when unset or empty)."""
    try:
        value = int(env.get(name) or default)
    except ValueError as exc:
        raise ConfigError(f"{name} must be an integer") from exc
    if value < 0:
        raise ConfigError(f"{name} must be 0 (no limit) or more")
    return value


def env_seconds(
    env: Mapping[str, str], name: str, default: float, low: float, high: float
) -> float:
    """``name`` as seconds from ``low`` to ``high``."""
    value = env_float(env, name, default, "a number of seconds")
    if not low <= value <= high:  # NaN too
        raise ConfigError(f"{name} must be {low:g}..{high:g} seconds")
    return value


def env_path(env: Mapping[str, str], name: str) -> Path | None:
    """``name`` as a path; None when unset or blank."""
    raw = env.get(name, "").strip()
    return Path(raw) if raw else None
