"""A loopback TCP proxy that can be cut: makes a real broker unreachable on demand."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import random
import socket
import struct
import threading
from typing import Literal

from tests.support.ports import OWN_PORTS

#: How an address in front of a service that is down answers a connection it
#: accepted: a FIN at once, or a reset (RST).
HangUp = Literal["close", "reset"]

#: Where a proxy listens: below Linux's ephemeral ports (32768-60999 by default).


def _hang_up(sock: socket.socket, how: HangUp) -> None:
    if how == "reset":
        # Linger 0: close() sends RST instead of FIN.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to a target; ``cut()`` drops and refuses connections."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self._target = (target_host, target_port)
        #: When set, each connection is accepted and ended that way instead of
        #: forwarded: a load balancer in front of a target that is down.
        self.hang_up: HangUp | None = None
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> None:
        """Listen (on the same port as before, after a cut).

        The first port is drawn below the kernel's ephemeral range: a port the
        kernel handed out (to this listener, as port 0 would) it may hand to
        another socket while the proxy is cut — the source port of any outbound
        connection on the machine, or another run's listener — and the proxy
        could not listen there again.
        """
        if self.port:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
            return
        for _ in range(100):
            port = random.randrange(*OWN_PORTS)
            try:
                self._server = await asyncio.start_server(self._accept, "127.0.0.1", port)
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    raise
                continue
            self.port = port
            return
        raise OSError(errno.EADDRINUSE, f"no free port in {OWN_PORTS}")

    async def cut(self) -> None:
        """Close every connection and stop listening: the target is now unreachable."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._pipes):
            task.cancel()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.hang_up == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return
        if self.hang_up == "close":
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pipe(src, dst))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.transport.abort()


class HangingUpListener:
    """A loopback address that accepts every connection and ends it at once.

    It runs on a thread of its own, so it hangs up as fast as a process in
    front of a dead service does, not when the test's event loop gets to it.
    """

    def __init__(self, how: HangUp = "close") -> None:
        self._how = how
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.1)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="hanging-up", daemon=True)
        self.port: int = self._sock.getsockname()[1]
        self.accepted = 0

    def __enter__(self) -> HangingUpListener:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stopping.set()
        self._thread.join(timeout=5)
        self._sock.close()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            _hang_up(conn, self._how)


# What a Postgres that is starting up (or shutting down) answers a new session.
_STARTING_UP = (
    ("S", "FATAL"),
    ("V", "FATAL"),
    ("C", "57P03"),
    ("M", "the database system is starting up"),
)
_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104


class PostgresProxy(CuttableProxy):
    """A :class:`CuttableProxy` to Postgres that can answer as a restarting server does.

    With ``starting_up`` set, a new session is refused at its start with
    SQLSTATE 57P03 ("the database system is starting up"), as every restart
    and failover refuses sessions for a while; sessions already open are
    forwarded as before.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        super().__init__(target_host, target_port)
        self.starting_up = False
        self.refused = 0

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.starting_up:
            await super()._accept(reader, writer)
            return
        try:
            while True:
                (length,) = struct.unpack("!I", await reader.readexactly(4))
                body = await reader.readexactly(length - 4)
                (code,) = struct.unpack("!I", body[:4])
                if code not in (_SSL_REQUEST, _GSSENC_REQUEST):
                    break
                writer.write(b"N")  # no TLS, no GSS: the startup message follows
                await writer.drain()
            fields = b"".join(k.encode() + v.encode() + b"\0" for k, v in _STARTING_UP) + b"\0"
            writer.write(b"E" + struct.pack("!I", len(fields) + 4) + fields)
            await writer.drain()
            self.refused += 1
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
