"""What an attempt writes, made ready: its outcome, its progress reports and their binds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jobplane.store.claims import Attempt
from jobplane.store.machine import Cause, Transition
from jobplane.store.rows import dumps


@dataclass(frozen=True, slots=True)
class Outcome:
    """How an attempt ends, ready to write: its transition, its fence and values
    (``params``), why (``cause``), and the statement's binds taken where the
    outcome was made (its trace context)."""

    attempt: Attempt
    transition: Transition
    params: Mapping[str, Any]
    cause: Cause
    binds: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class ProgressUpdate:
    """One progress report of a handler, waiting to be written."""

    progress: float
    message: str
    data: dict[str, Any]


def progress_binds(
    batches: Sequence[tuple[Attempt, Sequence[ProgressUpdate]]],
) -> dict[str, list[Any]]:
    """Per attempt (index k from 1) its fence, report count and last report; per
    report its attempt's k, its place and its values (see the PROGRESS statement)."""
    names = "ids attempts tokens ns last_progress last_message ks ords progresses messages datas"
    params: dict[str, list[Any]] = {name: [] for name in names.split(" ")}
    for k, (attempt, updates) in enumerate(batches, start=1):
        params["ids"].append(attempt.job_id)
        params["attempts"].append(attempt.attempt)
        params["tokens"].append(attempt.lease_token)
        params["ns"].append(len(updates))
        params["last_progress"].append(updates[-1].progress)
        params["last_message"].append(updates[-1].message)
        for ord_, update in enumerate(updates, start=1):
            params["ks"].append(k)
            params["ords"].append(ord_)
            params["progresses"].append(update.progress)
            params["messages"].append(update.message)
            params["datas"].append(dumps(update.data))
    return params
