"""The request_ids the system gives the jobs it submits are in the space
SubmitJob refuses to callers (ADR-0046, ADR-0047)."""

from __future__ import annotations

import uuid

import pytest

from jobplane.errors import InvalidArgument
from jobplane.server.job_requests import SYSTEM_REQUEST_ID_PREFIXES, check_request_id
from jobplane.store.children import child_request_id
from jobplane.store.machine.fanout import fan_request_id


def test_the_systems_request_ids_are_refused_to_callers() -> None:
    job = uuid.uuid4()
    for own in (fan_request_id(job, 1, 3, 0), child_request_id(job, "k")):
        assert own.startswith(SYSTEM_REQUEST_ID_PREFIXES)
        with pytest.raises(InvalidArgument) as refused:
            check_request_id(own, 256)
        assert refused.value.field == "request_id"


@pytest.mark.parametrize("mine", ["", "fan", "fanout:1", "my-child:1", "Fan:1", "x" * 256])
def test_a_callers_request_id_passes(mine: str) -> None:
    check_request_id(mine, 256)
