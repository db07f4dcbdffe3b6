"""The declarative RabbitMQ topology: exchange, queues, bindings, dead letters.

A topology is a TOML file (``JOBPLANE_TOPOLOGY``; ``topologies/default.toml``
when unset). The server uses it to refuse job types that no queue takes; the
relay publishes job dispatches to its jobs exchange and domain events to its
events exchange (``[events] exchange``, ``jobplane.events`` by default: a
durable topic exchange with no queues of jobplane's own, each consuming
service binds its own); workers consume its queues.

``jobplane topology apply`` declares it (:func:`declare`, which needs the
RabbitMQ *configure* permission). Relays and workers only check it
(:func:`ensure`): passive declares, which need no permission at all, and a
declaration of what is missing, which works for an account that may
configure (``jobplane dev`` on a fresh vhost) and otherwise ends in one
:class:`TopologyMissing` line. Their accounts need no configure rights.
``jobplane serve`` reports SERVING only once the topology is there
(:func:`until_declared`: the same check, tried again until it passes), and
``jobplane dev`` applies the topology it runs, bindings included (:func:`apply`).

The topology also records its owner: a small classic queue (``<exchange>.owner``)
holding one message with the id of the deployment that declared it first.
Relays and workers of another deployment (another database) find a stranger's
id there and report the collision at start.

The package holds one part a module: :mod:`~jobplane.topology.model` (the
topology and its errors), :mod:`~jobplane.topology.parse` (reading and
checking a topology file) and :mod:`~jobplane.topology.on_broker`
(declaring it on RabbitMQ, and its owner record).
"""

from __future__ import annotations

from jobplane.topology.model import (
    PipelineSpec,
    QueueSpec,
    RateLimitSpec,
    StageSpec,
    Topology,
    TopologyError,
    TopologyMissing,
)
from jobplane.topology.on_broker import (
    Ownership,
    apply,
    claim_ownership,
    declare,
    declare_missing,
    ensure,
    log,
    until_declared,
)
from jobplane.topology.parse import (
    BUILTIN,
    MAX_STAGES,
    PRIORITIES,
    load_topology,
    parse_topology,
)

__all__ = [
    "BUILTIN",
    "MAX_STAGES",
    "PRIORITIES",
    "Ownership",
    "PipelineSpec",
    "QueueSpec",
    "RateLimitSpec",
    "StageSpec",
    "Topology",
    "TopologyError",
    "TopologyMissing",
    "apply",
    "claim_ownership",
    "declare",
    "declare_missing",
    "ensure",
    "load_topology",
    "log",
    "parse_topology",
    "until_declared",
]
