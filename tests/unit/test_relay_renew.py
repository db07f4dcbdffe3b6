"""The relay renews its link after batches the broker nacked whole (ADR-0049)."""

from __future__ import annotations

from typing import Any

import aiormq
from pamqp.commands import Basic

from jobplane.workers.relay_messages import PublishFailed
from jobplane.workers.relay_outbox import RENEW_AFTER_NACKED_BATCHES, OutboxDispatch
from jobplane.workers.relay_record import Fate, RowOutcome


def _nack() -> RowOutcome:
    error = aiormq.exceptions.DeliveryError(None, Basic.Nack(delivery_tag=1))
    return RowOutcome(row=None, fate=Fate.FAILED, error=error)  # type: ignore[arg-type]


def _dispatch() -> OutboxDispatch:
    return OutboxDispatch.__new__(OutboxDispatch)


def test_only_batches_nacked_whole_count_and_any_other_resets() -> None:
    dispatch = _dispatch()
    for _ in range(RENEW_AFTER_NACKED_BATCHES):
        dispatch._note_nacks([_nack(), _nack()])
    assert dispatch.nacked_batches == RENEW_AFTER_NACKED_BATCHES
    dispatch._note_nacks([_nack(), RowOutcome(None, Fate.CONFIRMED)])  # type: ignore[arg-type]
    assert dispatch.nacked_batches == 0
    dispatch._note_nacks([_nack()])
    timeout = RowOutcome(None, Fate.FAILED, PublishFailed("no confirm in time"))  # type: ignore[arg-type]
    dispatch._note_nacks([timeout])  # a timeout or a lost channel is no nack
    assert dispatch.nacked_batches == 0
    dispatch._note_nacks([])
    assert dispatch.nacked_batches == 0


async def test_renew_closes_the_link_and_starts_counting_again() -> None:
    closed: list[bool] = []

    class Link:
        async def close(self) -> None:
            closed.append(True)

    dispatch = _dispatch()
    dispatch.nacked_batches = RENEW_AFTER_NACKED_BATCHES
    link: Any = Link()
    await dispatch._renew(link)
    assert closed == [True]
    assert dispatch.nacked_batches == 0
