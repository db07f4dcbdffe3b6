"""Reading a topology's flow limits: ``[[rate_limits]]`` and a queue's ``max_running_per_tenant``.

Checked here, with errors that name the entry and the key; what they mean
is docs/flow-control.md ("Rate limits", "Per-tenant limits").
"""

from __future__ import annotations

import math
import re
from typing import Any

from jobplane.topology.model import RateLimitSpec, TopologyError

_KEYS = frozenset({"name", "types", "per_second", "burst", "max_running", "per_tenant"})
# A limit's name is part of its budget's key: stable across applies.
_NAME = re.compile(r"[A-Za-z0-9*#][A-Za-z0-9._:*#,-]{0,127}")
_PATTERN = re.compile(r"^(\*|#|[A-Za-z0-9_-]+)(\.(\*|#|[A-Za-z0-9_-]+))*$")
#: Highest starts per second a limit may allow (a limit this high limits nothing).
MAX_PER_SECOND = 1_000_000.0
#: Highest ``max_running`` and ``max_running_per_tenant``.
MAX_RUNNING = 1_000_000


def parse_rate_limits(data: dict[str, Any], source: str) -> tuple[RateLimitSpec, ...]:
    """The ``[[rate_limits]]`` entries of parsed TOML ``data``, checked."""
    found = data.get("rate_limits", [])
    if not isinstance(found, list) or not all(isinstance(t, dict) for t in found):
        raise TopologyError(f"{source}: [[rate_limits]] must be an array of tables")
    limits = tuple(_parse(table, i, source) for i, table in enumerate(found))
    names = [limit.name for limit in limits]
    for name in names:
        if names.count(name) > 1:
            raise TopologyError(f"{source}: two [[rate_limits]] are named {name!r}")
    return limits


def _parse(table: dict[str, Any], index: int, source: str) -> RateLimitSpec:
    where = f"{source}: rate_limits[{index}]"
    unknown = set(table) - _KEYS
    if unknown:
        raise TopologyError(
            f"{where}: unknown keys {sorted(unknown)}; allowed: {', '.join(sorted(_KEYS))}"
        )
    types = table.get("types")
    if isinstance(types, str):
        types = [types]
    if not isinstance(types, list) or not types or not all(isinstance(t, str) for t in types):
        raise TopologyError(f"{where}: types must be a pattern or a non-empty list of them")
    for pattern in types:
        if not _PATTERN.match(pattern):
            raise TopologyError(f"{where}: types: {pattern!r} is not a job type or topic pattern")
    name = table.get("name", ",".join(types))
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TopologyError(
            f"{where}: name {name!r} must be up to 128 letters, digits and '._:*#,-' "
            "(give one when the types do not make one)"
        )
    where = f"{source}: rate limit {name!r}"
    per_second = _number(table, "per_second", where)
    max_running = _number(table, "max_running", where)
    if per_second is None and max_running is None:
        raise TopologyError(f"{where}: needs per_second, max_running or both")
    if per_second is not None and not 0 < per_second <= MAX_PER_SECOND:
        raise TopologyError(f"{where}: per_second must be > 0 and at most {MAX_PER_SECOND:g}")
    if max_running is not None and (
        max_running != int(max_running) or not 1 <= max_running <= MAX_RUNNING
    ):
        raise TopologyError(f"{where}: max_running must be a whole number 1..{MAX_RUNNING}")
    burst = _number(table, "burst", where)
    if burst is not None and per_second is None:
        raise TopologyError(f"{where}: burst needs per_second")
    if burst is None:
        burst = max(1.0, per_second or 1.0)
    if not 1 <= burst <= MAX_PER_SECOND * 3600:
        raise TopologyError(f"{where}: burst must be at least 1 (and at most an hour's worth)")
    per_tenant = table.get("per_tenant", False)
    if not isinstance(per_tenant, bool):
        raise TopologyError(f"{where}: per_tenant must be true or false")
    return RateLimitSpec(
        name=name,
        types=tuple(types),
        per_second=per_second,
        burst=burst,
        max_running=None if max_running is None else int(max_running),
        per_tenant=per_tenant,
    )


def _number(table: dict[str, Any], key: str, where: str) -> float | None:
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TopologyError(f"{where}: {key} must be a number, not {value!r}")
    return float(value)


def queue_running_limit(queue: dict[str, Any], source: str) -> int:
    """A ``[[queues]]`` entry's ``max_running_per_tenant`` (0: none), checked."""
    value = queue.get("max_running_per_tenant", 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RUNNING:
        raise TopologyError(
            f"{source}: queue {queue.get('name')!r}: max_running_per_tenant must be a whole "
            f"number 1..{MAX_RUNNING} (0 or absent: no limit), not {value!r}"
        )
    return value
