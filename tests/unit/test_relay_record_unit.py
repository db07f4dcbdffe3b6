"""What the relay decides about an outbox row without a database: which refusals
are about a row's values, what a line about a row names, a row's headers and
its envelope."""

from __future__ import annotations

import dataclasses
import uuid
from typing import cast

import pytest
from sqlalchemy.exc import DBAPIError

from jobplane.envelope import Envelope
from jobplane.logs import fingerprint
from jobplane.names import job_name
from jobplane.store.outbox import OutboxKind, OutboxRow, _headers
from jobplane.topology import load_topology
from jobplane.workers.interceptors import RelayInterceptor
from jobplane.workers.relay_record import _dispatched, _refuses_the_row, _subject


class Driver(Exception):
    """A driver error carrying its SQLSTATE as asyncpg (sqlstate) or psycopg (pgcode) does."""

    def __init__(self, state: str | None, attribute: str = "sqlstate") -> None:
        super().__init__(f"driver error {state}")
        setattr(self, attribute, state)


class _Tracing:
    """A relay interceptor's reading of a row's trace context."""

    def trace_id(self, headers: dict[str, str]) -> str | None:
        parent = headers.get("traceparent")
        return None if parent is None else f"trace of {parent}"


def _refusal(orig: BaseException) -> DBAPIError:
    return DBAPIError("UPDATE outbox ...", {}, orig)


@pytest.mark.parametrize(
    ("state", "of_the_row"),
    [
        ("22001", True),  # string_data_right_truncation: a value
        ("23514", True),  # check_violation
        ("P0001", True),  # a trigger's RAISE
        ("44000", True),  # WITH CHECK OPTION
        ("42501", False),  # insufficient_privilege: the statement, for every row
        ("42703", False),  # undefined_column
        ("40001", False),  # serialization_failure
    ],
)
def test_a_refusal_is_the_rows_only_for_its_values(state: str, of_the_row: bool) -> None:
    assert _refuses_the_row(_refusal(Driver(state))) is of_the_row
    assert _refuses_the_row(_refusal(Driver(state, "pgcode"))) is of_the_row


def test_the_state_is_found_down_the_chain_and_none_is_no_refusal() -> None:
    outer = Driver(None)
    outer.__cause__ = Driver("23505")
    assert _refuses_the_row(_refusal(outer)) is True
    # The first state found decides, not a deeper one.
    first = Driver("42501")
    first.__cause__ = Driver("23505")
    assert _refuses_the_row(_refusal(first)) is False
    assert _refuses_the_row(_refusal(Driver(None))) is False
    assert _refuses_the_row(_refusal(Driver(""))) is False
    # An empty state says nothing: the chain below it is read.
    empty = Driver("")
    empty.pgcode = ""  # type: ignore[attr-defined]
    empty.__cause__ = Driver("22P02")
    assert _refuses_the_row(_refusal(empty)) is True


def test_a_line_names_a_dispatch_by_its_job_and_an_event_row_by_its_type() -> None:
    tenant, job = uuid.uuid4(), uuid.uuid4()
    dispatch = OutboxRow(
        uuid.uuid4(), OutboxKind.JOB_DISPATCH, tenant, "demo.echo", "order-17", job_id=job
    )
    assert _subject(dispatch, None) == {"job": job_name(job), "event_id": str(dispatch.id)}
    event = OutboxRow(uuid.uuid4(), OutboxKind.EVENT, tenant, "artifact.created", body=b"{}")
    assert _subject(event, None) == {
        "outbox_id": str(event.id),
        "kind": "event",
        "event_type": "artifact.created",
    }
    topology = load_topology()
    assert _dispatched(dispatch, topology, None) == {
        "job": job_name(job),
        "event_id": str(dispatch.id),
        "tenant_id": str(tenant),
        "correlation_id": fingerprint("order-17"),
        "type": "demo.echo",
        "queue": topology.queues[0].name,
        "exchange": topology.exchange,
    }
    elsewhere = OutboxRow(
        uuid.uuid4(), OutboxKind.JOB_DISPATCH, tenant, "demo.echo", exchange="other", job_id=job
    )
    assert _dispatched(elsewhere, topology, None)["exchange"] == "other"
    # With tracing handed over, the line names the trace of the row's own headers.
    traced = OutboxRow(
        uuid.uuid4(),
        OutboxKind.JOB_DISPATCH,
        tenant,
        "demo.echo",
        job_id=job,
        headers={"traceparent": "00-t-s-01"},
    )
    tracing = cast(RelayInterceptor, _Tracing())
    assert _dispatched(traced, topology, tracing)["trace_id"] == "trace of 00-t-s-01"
    assert "trace_id" not in _dispatched(dispatch, topology, tracing)
    # A dispatch that names no job, of a type no queue takes: empty fields, not "None".
    stray = OutboxRow(uuid.uuid4(), OutboxKind.JOB_DISPATCH, tenant, "nobody.takes.this")
    assert _dispatched(stray, dataclasses.replace(topology, queues=()), None) == {
        "job": "",
        "event_id": str(stray.id),
        "tenant_id": str(tenant),
        "correlation_id": fingerprint(""),
        "type": "nobody.takes.this",
        "queue": "",
        "exchange": topology.exchange,
    }


def test_an_outbox_rows_headers_and_envelope() -> None:
    # asyncpg hands jsonb back as text unless a codec is set: both are read.
    assert _headers('{"traceparent": "00-a-b-01", "n": 3, "gone": null}') == {
        "traceparent": "00-a-b-01",
        "n": "3",
    }
    assert _headers({"tracestate": "k=v"}) == {"tracestate": "k=v"}
    assert _headers("[1, 2]") == {} and _headers(None) == {} and _headers("null") == {}
    tenant, job = uuid.uuid4(), uuid.uuid4()
    row = OutboxRow(uuid.uuid4(), OutboxKind.JOB_DISPATCH, tenant, "demo.echo", "c-1", job_id=job)
    assert row.envelope == Envelope(row.id, job, tenant, "demo.echo", "c-1")
    event = OutboxRow(uuid.uuid4(), OutboxKind.EVENT, tenant, "artifact.created", body=b"{}")
    with pytest.raises(ValueError, match="is not a job dispatch"):
        _ = event.envelope
    jobless = OutboxRow(uuid.uuid4(), OutboxKind.JOB_DISPATCH, tenant, "demo.echo")
    with pytest.raises(ValueError, match="is not a job dispatch"):
        _ = jobless.envelope
