"""Deployment identity: derived ids, the envelope field, and ownership."""

from __future__ import annotations

import json
import uuid

import pytest

from jobplane.envelope import Envelope, EnvelopeError
from jobplane.store.deployment import Deployment, identity_of
from jobplane.topology import Ownership


def test_identity_differs_by_database_and_by_cluster() -> None:
    ids = {identity_of("7713", "jp_a"), identity_of("7713", "jp_b"), identity_of("9999", "jp_a")}
    assert len(ids) == 3
    assert identity_of("7713", "jp_a") == identity_of("7713", "jp_a")
    assert all(len(i) == 16 for i in ids)


def _v1_body() -> dict[str, object]:
    return {
        "v": 1,
        "kind": "jobplane.job.dispatch",
        "event_id": str(uuid.uuid4()),
        "job_id": str(uuid.uuid4()),
        "tenant_id": str(uuid.uuid4()),
        "type": "demo.echo",
        "correlation_id": "",
    }


def test_a_v1_message_without_deployment_is_still_read() -> None:
    envelope = Envelope.decode(json.dumps(_v1_body()).encode())
    assert envelope.deployment is None
    assert b"deployment" not in envelope.encode()


def test_the_deployment_round_trips_and_old_readers_can_ignore_it() -> None:
    envelope = Envelope(uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), "demo.echo", deployment="ab12")
    body = json.loads(envelope.encode())
    assert body["v"] == 1 and body["deployment"] == "ab12"
    assert Envelope.decode(envelope.encode()) == envelope
    # A reader of a later version's additive keys still reads the message.
    assert Envelope.decode(json.dumps({**body, "later": {"x": 1}}).encode()) == envelope


@pytest.mark.parametrize("value", [7, "", "x" * 65, ["a"]])
def test_a_malformed_deployment_is_not_an_envelope(value: object) -> None:
    with pytest.raises(EnvelopeError):
        Envelope.decode(json.dumps({**_v1_body(), "deployment": value}).encode())


def test_ownership_conflict_only_for_another_recorded_owner() -> None:
    ours = Deployment("aaaa", "jp_a")
    assert not Ownership(ours, None).conflict
    assert not Ownership(ours, "aaaa", "jp_a").conflict
    other = Ownership(ours, "bbbb", "jp_b")
    assert other.conflict
    assert other.describe_owner() == "bbbb (database 'jp_b')"
    assert str(ours) == "aaaa (database 'jp_a')"
