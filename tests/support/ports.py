"""Ports for the servers tests start.

A port is drawn below the kernel's ephemeral range (32768 to 60999 on Linux by
default), never by binding port 0: a port the kernel handed out once it may
hand out again at any moment — as the source port of any outbound connection
on the machine, or to another listener on port 0 (an ops listener, another
test process's server) — so a server told to listen there later, or again
after a restart, could find it taken. Below that range only another test's
own draw can take it.
"""

from __future__ import annotations

import errno
import random
import socket

#: Where tests' own ports are drawn from.
OWN_PORTS = (20000, 32000)


def free_ports(count: int) -> tuple[int, ...]:
    """``count`` different ports of :data:`OWN_PORTS` nothing on 127.0.0.1 listens on now."""
    ports: list[int] = []
    for _ in range(100 * count):
        port = random.randrange(*OWN_PORTS)
        if port in ports:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError as error:
                if error.errno != errno.EADDRINUSE:
                    raise
                continue
        ports.append(port)
        if len(ports) == count:
            return tuple(ports)
    raise OSError(errno.EADDRINUSE, f"no {count} free ports in {OWN_PORTS}")


def free_port() -> int:
    """A port of :data:`OWN_PORTS` nothing on 127.0.0.1 listens on now."""
    return free_ports(1)[0]
