"""A JobplaneServer as built, before it starts: its defaults, the payload bound it
refuses to be built past, the largest request body it reads, and its TLS files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from jobplane.config import MAX_PAYLOAD_BYTES_LIMIT
from jobplane.scheduling import DEFAULT_MAX_SCHEDULE_SECONDS
from jobplane.server import JobplaneServer
from jobplane.server.app import ServerTLS, _max_receive_bytes
from jobplane.server.blob_servicer import MAX_CHUNK_BYTES
from jobplane.server.limits import TenantLimits
from jobplane.server.schedules import ScheduleService
from jobplane.server.service import MAX_BATCH_REQUEST_BYTES, max_request_bytes
from jobplane.store.engine import create_engine
from jobplane.store.keys import KEYS_CHANNEL
from jobplane.store.rows import DOMAIN_EVENTS_CHANNEL, EVENTS_CHANNEL
from jobplane.topology import Topology, load_topology

URL = "postgresql://jp:pw@127.0.0.1:1/jp_nowhere"


@pytest.fixture
def topology() -> Topology:
    return load_topology(None)


def _server(topology: Topology, **kwargs: Any) -> JobplaneServer:
    return JobplaneServer(create_engine(URL, pool_size=1), URL, topology, **kwargs)


def test_a_server_built_with_the_defaults(topology: Topology) -> None:
    server = _server(topology)
    # Not started: the default address with no port yet, and not ready.
    assert (server.address, server.port) == ("127.0.0.1:0", 0)
    assert server.not_ready() == "not serving"
    # Its own pool of the default size, and LISTEN on the database URL.
    assert server.db.size == 10
    assert [(h._url, h._channel) for h in (server.hub, server.event_hub, server.key_events)] == [
        (URL, EVENTS_CHANNEL),
        (URL, DOMAIN_EVENTS_CHANNEL),
        (URL, KEYS_CHANNEL),
    ]
    assert server.limiter.limits == TenantLimits()
    assert server.blobs is None
    # The dashboard's schedules page reads through its ScheduleService.
    assert type(server.schedules) is ScheduleService
    assert server.max_receive_bytes == _max_receive_bytes(256 * 1024)
    assert server.service.max_schedule_seconds == DEFAULT_MAX_SCHEDULE_SECONDS
    assert not server.service.metrics.enabled


@pytest.mark.parametrize("size", [0, MAX_PAYLOAD_BYTES_LIMIT + 1], ids=["zero", "past-limit"])
def test_a_server_refuses_a_payload_bound_out_of_range(topology: Topology, size: int) -> None:
    with pytest.raises(ValueError, match=r"^max_payload_bytes must be 1\.\.4194304$"):
        _server(topology, max_payload_bytes=size)


@pytest.mark.parametrize("size", [1, MAX_PAYLOAD_BYTES_LIMIT], ids=["one", "limit"])
def test_a_server_takes_a_payload_bound_at_either_end(topology: Topology, size: int) -> None:
    assert _server(topology, max_payload_bytes=size).max_receive_bytes == _max_receive_bytes(size)


def test_the_largest_body_read_fits_a_chunk_a_batch_and_a_submit() -> None:
    # A batch's bound is above the largest upload chunk's.
    assert MAX_BATCH_REQUEST_BYTES > MAX_CHUNK_BYTES + 64 * 1024
    assert _max_receive_bytes(1) == MAX_BATCH_REQUEST_BYTES
    big = MAX_PAYLOAD_BYTES_LIMIT
    assert _max_receive_bytes(big) == max(max_request_bytes(big), MAX_BATCH_REQUEST_BYTES)


def test_tls_files_are_read_as_pem(tmp_path: Path) -> None:
    for name in ("cert", "key", "ca"):
        (tmp_path / name).write_bytes(f"{name} pem".encode())
    tls = ServerTLS.from_files(tmp_path / "cert", tmp_path / "key")
    assert (tls, tls.mode) == (ServerTLS(b"cert pem", b"key pem", None), "tls")
    mutual = ServerTLS.from_files(tmp_path / "cert", tmp_path / "key", tmp_path / "ca")
    assert (mutual, mutual.mode) == (ServerTLS(b"cert pem", b"key pem", b"ca pem"), "mtls")
    assert "key pem" not in repr(mutual)
