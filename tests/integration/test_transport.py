"""The call gate (authentication before the body is read) and TLS / mutual TLS.

Health and reflection answering without a key: test_lifecycle.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import trustme
from google.rpc import error_details_pb2
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.client import (
    AsyncClient,
    Client,
    ClientTLS,
    JobState,
    Unauthenticated,
    Unavailable,
)
from jobplane.client._errors import rich_status
from jobplane.server import JobplaneServer
from jobplane.server.app import ServerTLS
from jobplane.store.keys import KeyStore
from jobplane.topology import Topology
from tests.support.serve import serve_process
from tests.support.servers import Servers

SUBMIT = "/jobplane.v1.JobService/SubmitJob"
WATCH = "/jobplane.v1.JobService/WatchJob"
# Not a protobuf message: field 0 with an invalid wire type.
GARBAGE = b"\x07\xff\xff\xff\xff"


@pytest.fixture
async def servers(
    engine: AsyncEngine, database_url: str, topology: Topology
) -> AsyncIterator[Servers]:
    running = Servers(engine, database_url, topology)
    yield running
    await running.close()


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def client_ca() -> trustme.CA:
    return trustme.CA()


def _server_tls(ca: trustme.CA, client_ca: trustme.CA | None = None) -> ServerTLS:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    return ServerTLS(
        cert.cert_chain_pems[0].bytes() + b"".join(p.bytes() for p in cert.cert_chain_pems[1:]),
        cert.private_key_pem.bytes(),
        client_ca.cert_pem.bytes() if client_ca else None,
    )


def _mutual(roots: bytes, ca: trustme.CA) -> ClientTLS:
    """TLS trusting ``roots``, presenting a client certificate signed by ``ca``."""
    cert = ca.issue_cert("worker@example.test")
    return ClientTLS(
        root_certificates=roots,
        client_cert=b"".join(p.bytes() for p in cert.cert_chain_pems),
        client_key=cert.private_key_pem.bytes(),
    )


async def _round_trip(client: AsyncClient) -> None:
    job = await client.submit("demo.echo", {"over": "tls"})
    assert (await client.get(job.name)).payload == {"over": "tls"}
    assert [j.name for j in (await client.list()).jobs] == [job.name]
    async for event in client.watch(job.name):
        assert event.seq == 1 and event.state is JobState.QUEUED
        break


async def _raw_call(
    server: JobplaneServer, method: str, body: bytes, key: str | None, *, stream: bool = False
) -> grpc.aio.AioRpcError:
    """The error of one call sending ``body`` as it is (no serializer)."""
    metadata = None if key is None else (("authorization", f"Bearer {key}"),)

    async def call(channel: grpc.aio.Channel) -> None:
        # Without serializers the stubs cannot type the call; bytes go as they are.
        if stream:
            streamed: Any = channel.unary_stream(method)
            async for _ in streamed(body, metadata=metadata, timeout=10):
                pass
        else:
            unary: Any = channel.unary_unary(method)
            await unary(body, metadata=metadata, timeout=10)

    async with grpc.aio.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(channel)
    return info.value


# -- the gate ------------------------------------------------------------------


@pytest.mark.parametrize(("method", "stream"), [(SUBMIT, False), (WATCH, True)])
async def test_a_call_without_a_valid_key_is_refused_before_its_body_is_read(
    servers: Servers, method: str, stream: bool
) -> None:
    server = await servers.start()
    key, _tenant = await server.keys.create_key("acme")
    for bad_key in (None, "jp_not-a-key"):
        error = await _raw_call(server, method, GARBAGE, bad_key, stream=stream)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        status = rich_status(error)
        assert status is not None
        info = error_details_pb2.ErrorInfo()
        assert status.details[0].Unpack(info)
        assert info.reason == "UNAUTHENTICATED"
    # With a valid key the same bytes are read, and fail as the body they are.
    error = await _raw_call(server, method, GARBAGE, key, stream=stream)
    assert error.code() not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK)


# -- TLS -------------------------------------------------------------------------


async def test_tls_round_trip(servers: Servers, ca: trustme.CA) -> None:
    server = await servers.start(tls=_server_tls(ca))
    key, _tenant = await server.keys.create_key("acme")
    tls = ClientTLS(root_certificates=ca.cert_pem.bytes())
    await _round_trip(servers.client(server, key, tls=tls))

    def blocking() -> int:
        # The blocking client takes the same options.
        with Client(server.address, key, tls=tls) as client:
            assert client.tls == tls
            return len(client.list().jobs)

    # In a thread: the server runs on this test's event loop.
    assert await asyncio.to_thread(blocking) == 1


async def test_a_plaintext_client_is_refused_by_a_tls_server(
    servers: Servers, ca: trustme.CA
) -> None:
    server = await servers.start(tls=_server_tls(ca))
    key, _tenant = await server.keys.create_key("acme")
    # A refused handshake looks like a server that is down, which the SDK
    # keeps trying until the call's deadline: a short one.
    with pytest.raises(Unavailable):
        await servers.client(server, key, timeout=1).list()
    # A client that does not trust the server's CA is refused too.
    with pytest.raises(Unavailable):
        await servers.client(
            server, key, timeout=1, tls=ClientTLS(root_certificates=trustme.CA().cert_pem.bytes())
        ).list()
    # The server is unharmed.
    roots = ClientTLS(root_certificates=ca.cert_pem.bytes())
    await _round_trip(servers.client(server, key, tls=roots))


async def test_mutual_tls_round_trip_and_a_client_without_a_certificate_is_refused(
    servers: Servers, ca: trustme.CA, client_ca: trustme.CA
) -> None:
    server = await servers.start(tls=_server_tls(ca, client_ca))
    key, _tenant = await server.keys.create_key("acme")
    roots = ca.cert_pem.bytes()
    await _round_trip(servers.client(server, key, tls=_mutual(roots, client_ca)))

    with pytest.raises(Unavailable):
        await servers.client(server, key, timeout=1, tls=ClientTLS(root_certificates=roots)).list()
    # A certificate from a CA the server does not trust is no better.
    stranger = _mutual(roots, trustme.CA())
    with pytest.raises(Unavailable):
        await servers.client(server, key, timeout=1, tls=stranger).list()
    # Mutual TLS does not replace the API key.
    with pytest.raises(Unauthenticated):
        await servers.client(server, "jp_wrong", tls=_mutual(roots, client_ca)).list()
    assert int(await _count_jobs(servers)) == 1


async def _count_jobs(servers: Servers) -> int:
    async with servers.engine.connect() as conn:
        return int((await conn.execute(text("SELECT count(*) FROM jobs"))).scalar_one())


async def test_serve_and_the_cli_speak_mutual_tls(
    database_url: str, engine: AsyncEngine, ca: trustme.CA, client_ca: trustme.CA, tmp_path: Path
) -> None:
    server_cert = ca.issue_cert("localhost")
    client_cert = client_ca.issue_cert("cli@example.test")
    files = {
        "server.pem": server_cert.cert_chain_pems[0].bytes(),
        "server.key": server_cert.private_key_pem.bytes(),
        "clients-ca.pem": client_ca.cert_pem.bytes(),
        "ca.pem": ca.cert_pem.bytes(),
        "client.pem": client_cert.cert_chain_pems[0].bytes(),
        "client.key": client_cert.private_key_pem.bytes(),
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    key, _tenant = await KeyStore(engine).create_key("acme")
    tls_env = {
        "JOBPLANE_TLS_CERT": str(tmp_path / "server.pem"),
        "JOBPLANE_TLS_KEY": str(tmp_path / "server.key"),
        "JOBPLANE_TLS_CLIENT_CA": str(tmp_path / "clients-ca.pem"),
    }
    async with serve_process(database_url, **tls_env) as serve:
        assert "(mutual TLS)" in "\n".join(serve.lines)
        # The certificate names localhost; the CLI connects to 127.0.0.1.
        flags = ["--tls-ca", str(tmp_path / "ca.pem"), "--tls-server-name", "localhost"]
        identity = [
            "--tls-client-cert",
            str(tmp_path / "client.pem"),
            "--tls-client-key",
            str(tmp_path / "client.key"),
        ]
        code, out, err = await cli(
            serve.address, key, "submit", "demo.echo", "--json", *flags, *identity
        )
        assert code == 0, err
        assert json.loads(out)["state"] == "queued"
        # No client certificate: refused by the handshake.
        code, out, err = await cli(serve.address, key, "list", "--call-timeout", "1", *flags)
        assert code == 1
        assert "UNAVAILABLE" in err
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM jobs"))).scalar_one() == 1
    # A bad certificate path is one line and a usage error.
    code, _out, err = await cli("127.0.0.1:1", key, "list", "--tls-ca", str(tmp_path / "nope"))
    assert code == 2 and err.count("\n") == 1 and "nope" in err


async def cli(address: str, key: str, *args: str) -> tuple[int, str, str]:
    """Run a client command of `jobplane`."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        *args,
        env={**os.environ, "JOBPLANE_ADDRESS": address, "JOBPLANE_API_KEY": key},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()
