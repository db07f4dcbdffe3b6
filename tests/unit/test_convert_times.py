"""Times and durations to protobuf on the short path agree with protobuf's own conversion."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from google.protobuf import duration_pb2, timestamp_pb2
from hypothesis import given
from hypothesis import strategies as st

from jobplane.convert import duration, timestamp

_zones = st.sampled_from([UTC, None, timezone(timedelta(hours=5)), timezone(timedelta(hours=-3))])


@given(st.datetimes(), _zones)
def test_a_time_is_the_timestamp_protobuf_makes_of_it(
    naive: datetime, zone: timezone | None
) -> None:
    value = naive.replace(tzinfo=zone)
    try:
        expected = timestamp_pb2.Timestamp()
        expected.FromDatetime(value)
    except (ValueError, OverflowError):
        return  # outside a Timestamp's range once in UTC: the plain path's error stands
    assert timestamp(value) == expected


@given(st.timedeltas())
def test_a_duration_is_the_one_protobuf_makes_of_it(value: timedelta) -> None:
    expected = duration_pb2.Duration()
    try:
        expected.FromTimedelta(value)
    except ValueError:
        return  # past a Duration's range: the plain path's error stands
    assert duration(value) == expected
