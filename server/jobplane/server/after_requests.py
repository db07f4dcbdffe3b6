"""A SubmitJob request's ``after`` and ``after_failure``, checked (docs/workflows.md).

What is here refuses what can never be a list of jobs to run after:
INVALID_ARGUMENT on the field, before anything is written. Whether each name
is a job of the caller is the store's to say, in the submit's transaction
(:mod:`jobplane.store.dependencies`): another tenant's job reads as none.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

from jobplane.convert import POLICY_FROM_PB
from jobplane.errors import InvalidArgument
from jobplane.names import parse_job_name
from jobplane.store.dependencies import MAX_AFTER
from jobplane.store.job_submit import NewJob
from jobplane.types import DependencyFailurePolicy


def check_after(names: tuple[str, ...], policy: int) -> tuple[uuid.UUID, ...]:
    """The ids ``names`` name, in order; INVALID_ARGUMENT on the first field wrong."""
    if policy not in POLICY_FROM_PB:
        raise InvalidArgument(f"unknown after_failure {policy}", field="after_failure")
    if policy and not names:
        raise InvalidArgument("after_failure needs after", field="after_failure")
    if len(names) > MAX_AFTER:
        raise InvalidArgument(f"after names at most {MAX_AFTER} jobs", field="after")
    ids: list[uuid.UUID] = []
    for k, name in enumerate(names):
        job_id = parse_job_name(name, field=f"after[{k}]")
        if job_id in ids:
            raise InvalidArgument(
                f"after[{k}] names jobs/{job_id} again (after[{ids.index(job_id)}])",
                field=f"after[{k}]",
            )
        ids.append(job_id)
    return tuple(ids)


def with_after(new: NewJob, names: tuple[str, ...], policy: int) -> NewJob:
    """``new`` with the request's ``after`` and policy, checked."""
    ids = check_after(names, policy)
    if not ids:
        return new
    return replace(
        new, after=ids, after_failure=POLICY_FROM_PB.get(policy, DependencyFailurePolicy.FAIL)
    )
