"""How a dead-lettered message is described to an operator (`jobplane dlq list`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from aio_pika.abc import AbstractIncomingMessage

from jobplane.workers.dlq import describe


@dataclass
class _Message:
    """The three things describe() reads of a delivered message."""

    headers: dict[str, Any] = field(default_factory=dict)
    body: bytes = b"not an envelope"
    message_id: str | None = "m-1"


def _described(headers: dict[str, Any]) -> Any:
    return describe(cast(AbstractIncomingMessage, _Message(headers=headers)))


def test_deaths_are_counted_over_every_x_death_entry() -> None:
    """A message rejected from the work queue twice, then expired from a retry queue."""
    failed = _described(
        {
            "x-death": [
                {"reason": "rejected", "queue": "jobs.default", "count": 2},
                {"reason": "expired", "queue": "jobs.default.retry", "count": 1},
            ],
            "x-first-death-reason": "expired",
            "x-first-death-queue": "jobs.default.retry",
        }
    )
    # The latest death comes first in x-death; the first-death headers are older.
    assert (failed.reason, failed.source_queue, failed.deaths) == ("rejected", "jobs.default", 3)
    assert failed.message_id == "m-1"
    assert failed.envelope is None and failed.problem.startswith("not a dispatch envelope")


def test_without_x_death_the_first_death_headers_say_why() -> None:
    failed = _described({"x-first-death-reason": "maxlen", "x-first-death-queue": "jobs.low"})
    assert (failed.reason, failed.source_queue, failed.deaths) == ("maxlen", "jobs.low", 1)


def test_an_x_death_entry_without_a_count_is_one_death() -> None:
    failed = _described(
        {
            "x-death": [
                {"reason": "rejected", "queue": "jobs.default"},
                "not an entry",
                {"reason": "expired", "queue": "jobs.default.retry", "count": 4},
                {"reason": "expired", "queue": "jobs.default.retry"},
            ]
        }
    )
    # Two entries without a count (one each), one of four; what is not a table is skipped.
    assert (failed.reason, failed.source_queue, failed.deaths) == ("rejected", "jobs.default", 6)
    assert _described({"x-death": [{"reason": "maxlen"}]}).deaths == 1
