"""TLS settings of the SDK: one frozen object, the client's twin of ``ServerTLS``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

_TRUE = frozenset({"1", "true", "yes", "on"})
# The variables ClientTLS.from_env reads, besides the JOBPLANE_TLS switch.
ENV_CA = "JOBPLANE_TLS_CA"
ENV_CLIENT_CERT = "JOBPLANE_TLS_CLIENT_CERT"
ENV_CLIENT_KEY = "JOBPLANE_TLS_CLIENT_KEY"
ENV_SERVER_NAME = "JOBPLANE_TLS_SERVER_NAME"
ENV_SWITCH = "JOBPLANE_TLS"


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """How a client speaks TLS to the server; ``ClientTLS()`` trusts the system's roots.

    ``root_certificates`` (PEM) are the CAs the server's certificate must be
    signed by, instead of the system's. ``client_cert`` and ``client_key``
    (PEM) are presented to a server that asks for them (mutual TLS).
    ``server_name`` is the name expected in the server's certificate when it
    differs from the host of the address dialled (a pod IP, a tunnel).
    """

    root_certificates: bytes | None = None
    client_cert: bytes | None = None
    # Kept out of repr(): a client's settings may end up in a log line.
    client_key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key go together")

    @classmethod
    def from_files(
        cls,
        ca: str | Path | None = None,
        client_cert: str | Path | None = None,
        client_key: str | Path | None = None,
        server_name: str | None = None,
    ) -> ClientTLS:
        """Read the PEM files that are given."""
        return cls(_read(ca), _read(client_cert), _read(client_key), server_name or None)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientTLS | None:
        """The settings in ``JOBPLANE_TLS*`` (of ``env``, default the process's); None: plaintext.

        ``JOBPLANE_TLS`` (1/true/yes/on) turns TLS on with the system's roots;
        ``JOBPLANE_TLS_CA``, ``JOBPLANE_TLS_CLIENT_CERT`` and
        ``JOBPLANE_TLS_CLIENT_KEY`` (PEM file paths) and
        ``JOBPLANE_TLS_SERVER_NAME`` turn it on too, and contradict a
        ``JOBPLANE_TLS`` that turns it off (ValueError).
        """
        env = os.environ if env is None else env
        given = {name: env.get(name, "").strip() or None for name in _OPTIONS}
        switch = env.get(ENV_SWITCH, "").strip()
        if switch and switch.lower() not in _TRUE:
            if any(given.values()):
                raise ValueError(f"{ENV_SWITCH}={switch} turns TLS off, but TLS options are set")
            return None
        if not switch and not any(given.values()):
            return None
        return cls.from_files(
            given[ENV_CA], given[ENV_CLIENT_CERT], given[ENV_CLIENT_KEY], given[ENV_SERVER_NAME]
        )

    @property
    def mode(self) -> str:
        """``tls`` or ``mtls``."""
        return "mtls" if self.client_cert is not None else "tls"

    def credentials(self) -> grpc.ChannelCredentials:
        """The gRPC channel credentials."""
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.client_key,
            certificate_chain=self.client_cert,
        )

    def channel_options(self) -> tuple[tuple[str, str], ...]:
        """The channel options TLS adds: the expected server name, when set."""
        if self.server_name:
            return (("grpc.ssl_target_name_override", self.server_name),)
        return ()


_OPTIONS = (ENV_CA, ENV_CLIENT_CERT, ENV_CLIENT_KEY, ENV_SERVER_NAME)


def _read(path: str | Path | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


__all__ = ["ClientTLS"]
