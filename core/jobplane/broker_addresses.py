"""Several RabbitMQ addresses: parsing them, and which one to try next.

``JOBPLANE_AMQP_URL`` names one broker node or several nodes of one cluster,
as AMQP URLs separated by commas (the form of RabbitMQ's own clients: a list
of addresses, each a full URL)::

    amqp://app:secret@mq1:5672/prod,amqp://app:secret@mq2:5672/prod

A process connects to the first address that answers and, when its node is
lost, to another: :class:`Failover` orders the addresses for each attempt,
the configured order first, an address that failed lately last (it is
probably still down: trying it first would cost its connect timeout on every
reconnect). Every address must name the same vhost: the nodes of one cluster
share its queues, and two vhosts would be two deployments.

Pure logic, no I/O: :mod:`jobplane.broker` connects.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

#: The schemes of an AMQP address.
SCHEMES = ("amqp", "amqps")
#: Seconds an address that failed is tried after the others.
DEFAULT_HOLD = 30.0


def split_addresses(value: str) -> tuple[str, ...]:
    """The addresses of ``value`` (one AMQP URL, or several separated by commas), checked.

    Raises ValueError with a reason that never quotes an address (it may hold
    a password): which address (by position) and what is wrong with it.
    """
    parts = [part.strip() for part in value.split(",")]
    addresses = tuple(part for part in parts if part)
    if not addresses:
        raise ValueError("names no address (amqp://user:password@host:5672/vhost)")
    vhosts = set()
    for position, address in enumerate(addresses, start=1):
        where = f"address {position} of {len(addresses)}" if len(addresses) > 1 else "the address"
        vhosts.add(_checked_vhost(address, where))
    if len(vhosts) > 1:
        raise ValueError(
            "its addresses name different vhosts; the nodes of one cluster share one vhost"
        )
    if len(set(addresses)) != len(addresses):
        raise ValueError("names one address twice")
    return addresses


def _checked_vhost(address: str, where: str) -> str:
    """The vhost ``address`` names ('/' when none); ValueError when it is no AMQP URL."""
    parts = urlsplit(address)
    if parts.scheme.lower() not in SCHEMES:
        raise ValueError(f"{where} must be an amqp:// or amqps:// URL")
    if not parts.hostname:
        raise ValueError(f"{where} names no host")
    try:
        parts.port  # noqa: B018 - a bad port raises here
    except ValueError:
        raise ValueError(f"{where} has a bad port") from None
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    return unquote(path) or "/"


def describe(value: str) -> str:
    """``value``'s addresses without their passwords, for logs and messages."""
    return ",".join(_without_password(a) for a in value.split(",") if a.strip())


def _without_password(address: str) -> str:
    parts = urlsplit(address.strip())
    if parts.password is None:
        return address.strip()
    user = parts.username or ""
    netloc = f"{user}:***@{parts.netloc.rpartition('@')[2]}"
    return parts._replace(netloc=netloc).geturl()


@dataclass
class Failover:
    """The addresses of one setting and when each last failed, for one process.

    :meth:`order` is the order to try them in: the configured order, except
    that an address which failed within ``hold`` seconds goes after those
    that did not (the longest-failed first among them, so that all are tried
    in turn when all are failing). A success forgets the address's failure.
    """

    addresses: tuple[str, ...]
    hold: float = DEFAULT_HOLD
    clock: Callable[[], float] = time.monotonic
    _failed: dict[str, float] = field(default_factory=dict)

    def order(self) -> list[str]:
        """The addresses, in the order to try them now."""
        held = self.failing()
        fresh = [a for a in self.addresses if a not in held]
        return fresh + sorted(held, key=lambda a: self._failed[a])

    def failed(self, address: str) -> None:
        """``address`` did not answer, or its connection was lost."""
        self._failed[address] = self.clock()

    def succeeded(self, address: str) -> None:
        """A connection to ``address`` opened."""
        self._failed.pop(address, None)

    def failing(self) -> list[str]:
        """The addresses that failed within ``hold`` seconds (for logs)."""
        now = self.clock()
        return [
            a for a in self.addresses if a in self._failed and now - self._failed[a] < self.hold
        ]


_lock = threading.Lock()
_known: dict[str, Failover] = {}


def failover_of(value: str) -> Failover:
    """This process's :class:`Failover` of the setting ``value``.

    One per setting, shared by every connection a process opens with it: the
    relay's next connection skips the node its last one lost.
    """
    with _lock:
        found = _known.get(value)
        if found is None:
            found = _known[value] = Failover(split_addresses(value))
        return found
