"""Fan-out and join, as handlers see them (ADR-0047): the items a stage spawns,
and the results a join stage receives.

A stage before a fan-out stage (``fan_out = true`` in the topology) returns
a list, one item per child job, each a JSON object (the child's payload).
:func:`fan_out_items` is the one check of that list, shared by the Python
worker and WorkerService, so the two kinds of worker cannot disagree on
what may be spawned. The stage after the fan-out stage receives its
children's :class:`ItemResult` in item order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobplane.types import JobError, JobState

if TYPE_CHECKING:
    from jobplane.store.claims import StageRun
    from jobplane.topology import StageSpec, Topology

#: The most items one fan-out may spawn (the children cap of ADR-0046).
MAX_FAN_OUT = 10_000
#: The error code of a fan-out stage's result that cannot be spawned.
FAN_OUT_REFUSED = "FAN_OUT_REFUSED"


class FanOutRefused(ValueError):
    """A result that cannot be spawned: not a list, too long, or an item not an object."""


@dataclass(frozen=True, slots=True)
class ItemResult:
    """One child of a fan-out, as the join stage receives it: its item's place,
    its job, how it ended and what it returned (or why it failed)."""

    index: int
    job: str  # jobs/{id}
    state: JobState
    result: Mapping[str, Any] | None = None
    error: JobError | None = None

    @property
    def ok(self) -> bool:
        """Whether the child SUCCEEDED."""
        return self.state is JobState.SUCCEEDED


def fan_out_items(value: Any, *, limit: int = MAX_FAN_OUT) -> list[dict[str, Any]]:
    """``value`` as the items of a fan-out: a list of at most ``limit`` JSON
    objects. :class:`FanOutRefused` says what is wrong otherwise."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise FanOutRefused(
            f"a stage before a fan-out stage must return a list of items, not "
            f"{type(value).__name__}"
        )
    if len(value) > limit:
        raise FanOutRefused(f"{len(value)} items to fan out; at most {limit}")
    for index, item in enumerate(value):
        if not isinstance(item, Mapping) or not all(isinstance(k, str) for k in item):
            raise FanOutRefused(
                f"item {index} is a {type(item).__name__}: each item must be an object "
                "(the child's payload)"
            )
    return [dict(item) for item in value]


__all__ = [
    "FAN_OUT_REFUSED",
    "MAX_FAN_OUT",
    "FanOutRefused",
    "ItemResult",
    "fan_out_items",
]


def next_stage(topology: Topology, stage: StageRun | None) -> StageSpec | None:
    """The stage after ``stage`` in its pipeline, as the topology has it: for a
    fan-out, the type and queue its children are jobs of (None: none)."""
    pipeline = None if stage is None else topology.pipeline(stage.pipeline)
    if stage is None or pipeline is None or stage.index + 1 >= len(pipeline.stages):
        return None
    return pipeline.stages[stage.index + 1]
