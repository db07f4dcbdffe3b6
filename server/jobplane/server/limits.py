"""Per-tenant limits of one server process: streams held, submits per second.

Streams are WatchJob and SubscribeEvents calls, counted together; submits
are SubmitJob and PublishEvent calls (each writes an outbox row) and the jobs
of BatchSubmitJobs calls (one submit a job), counted together.

The counts live in the process, not in the database: with N server processes
behind a balancer a tenant may hold N x ``max_streams`` streams and submit at
N x ``submits_per_second``. That is enough for what the limits are for, that
one tenant cannot take a process's memory or event loop from the others;
checking them costs no round trip.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from jobplane.config import (
    DEFAULT_TENANT_MAX_STREAMS,
    DEFAULT_TENANT_SUBMIT_BURST,
    DEFAULT_TENANT_SUBMITS_PER_SECOND,
    Settings,
)
from jobplane.errors import TenantLimitExceeded

# What a refused watch is told to wait: a slot frees when one of the
# tenant's streams ends, which nobody can predict.
STREAM_RETRY_SECONDS = 2.0
# Past this many tenants with a bucket, full buckets (those that are the same
# as a new one) are dropped.
_PRUNE_AT = 10_000


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """The limits of each tenant in one server process; 0 turns a limit off.

    The defaults are the settings' (``JOBPLANE_TENANT_…`` unset).
    """

    max_streams: int = DEFAULT_TENANT_MAX_STREAMS
    submits_per_second: float = DEFAULT_TENANT_SUBMITS_PER_SECOND
    submit_burst: int = DEFAULT_TENANT_SUBMIT_BURST

    @classmethod
    def from_settings(cls, settings: Settings) -> TenantLimits:
        """The limits ``settings`` set."""
        return cls(
            max_streams=settings.tenant_max_streams,
            submits_per_second=settings.tenant_submits_per_second,
            submit_burst=settings.tenant_submit_burst,
        )


@dataclass(slots=True)
class _Bucket:
    tokens: float
    stamp: float


class TenantLimiter:
    """Counts each tenant's open watch streams and submits, and refuses the excess."""

    def __init__(
        self, limits: TenantLimits, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._streams: dict[uuid.UUID, int] = {}
        self._buckets: dict[uuid.UUID, _Bucket] = {}

    def take_submit(self, tenant: uuid.UUID, count: int = 1, *, taken: int = 0) -> None:
        """Spend ``count`` of the tenant's submit tokens, all or none;
        :class:`TenantLimitExceeded` if it has fewer.

        A token bucket: ``submit_burst`` tokens at most, refilled at
        ``submits_per_second``. The error's ``retry_delay`` is when enough
        tokens have come. ``taken``: tokens the same call spent before (a
        batch spends one before its body is read); a call of more submits
        than the burst can never pass, and is refused without a delay.
        """
        rate, burst = self.limits.submits_per_second, max(1, self.limits.submit_burst)
        if rate <= 0 or count <= 0:
            return
        metadata = {"limit": "submits_per_second", "max": f"{rate:g}", "burst": str(burst)}
        if count + taken > burst:
            raise TenantLimitExceeded(
                f"{count + taken} submits at once are more than this tenant's burst of {burst}; "
                f"send at most {burst} a call",
                metadata=metadata,
            )
        now = self._clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            if len(self._buckets) >= _PRUNE_AT:
                self._prune(now, rate, burst)
            bucket = self._buckets[tenant] = _Bucket(float(burst), now)
        bucket.tokens = min(float(burst), bucket.tokens + (now - bucket.stamp) * rate)
        bucket.stamp = now
        if bucket.tokens >= count:
            bucket.tokens -= count
            return
        raise TenantLimitExceeded(
            f"more than {rate:g} submits and publishes per second (burst {burst}) from this "
            "tenant; slow down",
            metadata=metadata,
            retry_delay=(count + taken - bucket.tokens) / rate,
        )

    def _prune(self, now: float, rate: float, burst: int) -> None:
        full = [t for t, b in self._buckets.items() if b.tokens + (now - b.stamp) * rate >= burst]
        for tenant in full:
            del self._buckets[tenant]

    def acquire_stream(self, tenant: uuid.UUID) -> None:
        """Take one of the tenant's watch-stream slots; give it back with :meth:`release_stream`.

        :class:`TenantLimitExceeded` when the tenant holds ``max_streams``.
        """
        limit = self.limits.max_streams
        held = self._streams.get(tenant, 0)
        if limit > 0 and held >= limit:
            raise TenantLimitExceeded(
                f"this tenant already has {held} watch and subscribe streams open on this "
                "server; close some first",
                metadata={"limit": "watch_streams", "max": str(limit)},
                retry_delay=STREAM_RETRY_SECONDS,
            )
        self._streams[tenant] = held + 1

    def release_stream(self, tenant: uuid.UUID) -> None:
        """Give back a slot taken by :meth:`acquire_stream`."""
        left = self._streams.get(tenant, 0) - 1
        if left > 0:
            self._streams[tenant] = left
        else:
            self._streams.pop(tenant, None)

    def open_streams(self) -> int:
        """Watch streams all tenants hold now."""
        return sum(self._streams.values())

    def streams(self, tenant: uuid.UUID) -> int:
        """Watch streams the tenant holds now."""
        return self._streams.get(tenant, 0)
