"""WatchJob encodes each event once for all of its job's streams."""

from __future__ import annotations

from datetime import UTC, datetime

from hypothesis import given
from hypothesis import strategies as st

from jobplane.convert import event_to_pb
from jobplane.server.decode import _passing_bytes
from jobplane.server.servicer import EncodedEvents
from jobplane.types import EventType, JobEvent, JobState
from jobplane.v1 import jobs_pb2


def _event(name: str, seq: int, progress: float = 0.5, message: str = "step") -> JobEvent:
    return JobEvent(
        name=name,
        seq=seq,
        type=EventType.PROGRESS,
        state=JobState.RUNNING,
        progress=progress,
        message=message,
        event_time=datetime(2026, 12, 2, tzinfo=UTC),
        attempt=1,
        data={"k": [1, "two"]},
    )


@given(
    st.floats(min_value=0, max_value=1, allow_nan=False),
    st.text(max_size=50),
    st.integers(min_value=1, max_value=2**40),
)
def test_the_bytes_are_the_message_a_stream_would_have_sent(
    progress: float, message: str, seq: int
) -> None:
    event = _event("jobs/a", seq, progress, message)
    encoded = EncodedEvents()(event)
    assert encoded == event_to_pb(event).SerializeToString()
    assert jobs_pb2.WatchJobResponse.FromString(encoded) == event_to_pb(event)


def test_one_encoding_serves_every_stream_and_the_oldest_go_first() -> None:
    encoded = EncodedEvents(most=3)
    first = encoded(_event("jobs/a", 1))
    assert encoded(_event("jobs/a", 1)) is first  # kept, not encoded again
    assert encoded(_event("jobs/b", 1)) != first  # another job's seq 1
    encoded(_event("jobs/a", 2))
    encoded(_event("jobs/a", 3))  # four kept at most three: (a, 1) is dropped
    again = encoded(_event("jobs/a", 1))
    assert again == first and again is not first


def test_the_streaming_serializer_sends_bytes_as_they_are() -> None:
    serialize = _passing_bytes(jobs_pb2.WatchJobResponse.SerializeToString)
    assert serialize is not None
    message = event_to_pb(_event("jobs/a", 7))
    assert serialize(b"\x08\x07") == b"\x08\x07"
    assert serialize(message) == message.SerializeToString()
    assert _passing_bytes(None) is None
