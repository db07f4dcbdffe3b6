"""The grpc.aio server and what it owns: JobService, EventService, BlobService,
ScheduleService, WorkerService, health, reflection."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.config import MAX_PAYLOAD_BYTES_LIMIT
from jobplane.faults import NO_FAULTS, FaultPoints
from jobplane.lifecycle import Lifecycle
from jobplane.logs import describe_error
from jobplane.observe import tracing
from jobplane.observe.metrics import NO_METRICS, Metrics
from jobplane.observe.tracing import ServerTracing
from jobplane.scheduling import DEFAULT_MAX_SCHEDULE_SECONDS
from jobplane.server.auth import CallGate
from jobplane.server.blob_servicer import MAX_CHUNK_BYTES, BlobServiceServicer
from jobplane.server.decode import RefuseUndecodable
from jobplane.server.events import EventService
from jobplane.server.limits import TenantLimiter, TenantLimits
from jobplane.server.schedule_builtin import sync_retention_schedules
from jobplane.server.schedule_servicer import ScheduleServiceServicer
from jobplane.server.schedules import ScheduleService
from jobplane.server.service import MAX_BATCH_REQUEST_BYTES, JobService, max_request_bytes
from jobplane.server.servicer import EventServiceServicer, JobServiceServicer
from jobplane.server.worker_protocol import WorkerService
from jobplane.server.worker_servicer import WorkerServiceServicer
from jobplane.store.attempts import AttemptStore
from jobplane.store.children import ChildStore
from jobplane.store.db import Database
from jobplane.store.deployment import this_deployment
from jobplane.store.events import EventStore
from jobplane.store.held import HeldAttempts
from jobplane.store.jobs import JobStore
from jobplane.store.keys import KEYS_CHANNEL, KeyScope, KeyStore
from jobplane.store.listen import Listener
from jobplane.store.machine import MACHINE
from jobplane.store.routes import sync_submit_rules
from jobplane.store.rows import DOMAIN_EVENTS_CHANNEL, EVENTS_CHANNEL
from jobplane.store.workers import WorkerStore
from jobplane.topology import Topology

if TYPE_CHECKING:
    from jobplane.blobs.store import BlobStore
from jobplane.v1 import (
    blobs_pb2,
    blobs_pb2_grpc,
    events_pb2,
    events_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
    schedules_pb2,
    schedules_pb2_grpc,
    workers_pb2,
    workers_pb2_grpc,
)

log = structlog.get_logger("jobplane.server")

# Calls received but not yet picked up by the event loop, before gRPC sheds
# new ones with CANCELLED (which the SDK retries).
MAX_PENDING_CALLS = 20_000

_INSUFFICIENT_PRIVILEGE = "42501"

SERVICE_NAME = jobs_pb2.DESCRIPTOR.services_by_name["JobService"].full_name
EVENT_SERVICE_NAME = events_pb2.DESCRIPTOR.services_by_name["EventService"].full_name
BLOB_SERVICE_NAME = blobs_pb2.DESCRIPTOR.services_by_name["BlobService"].full_name
SCHEDULE_SERVICE_NAME = schedules_pb2.DESCRIPTOR.services_by_name["ScheduleService"].full_name
# The API services: behind the same gate (tenant keys), reported by health.
API_SERVICES = (SERVICE_NAME, EVENT_SERVICE_NAME, BLOB_SERVICE_NAME, SCHEDULE_SERVICE_NAME)
# Behind its own gate, for worker keys only (ADR-0018).
WORKER_SERVICE_NAME = workers_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name


def _max_receive_bytes(max_payload_bytes: int) -> int:
    """The largest request body gRPC reads: past it, it refuses the body
    (RESOURCE_EXHAUSTED) before reading it whole, as no valid request needs more.

    An UploadBlob chunk of the largest size must fit too, and a BatchSubmitJobs
    body may be larger than one SubmitJob's, up to its own bound.
    """
    return max(
        max_request_bytes(max_payload_bytes),
        MAX_CHUNK_BYTES + 64 * 1024,
        MAX_BATCH_REQUEST_BYTES,
    )


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """The server's certificate chain and key (PEM); with ``client_ca``, mutual TLS.

    When ``client_ca`` is set every client must present a certificate signed
    by it.
    """

    cert_chain: bytes
    private_key: bytes = field(repr=False)
    client_ca: bytes | None = None

    @classmethod
    def from_files(cls, cert: Path, key: Path, client_ca: Path | None = None) -> ServerTLS:
        """Read the PEM files."""
        return cls(
            cert.read_bytes(), key.read_bytes(), client_ca.read_bytes() if client_ca else None
        )

    def credentials(self) -> grpc.ServerCredentials:
        """The gRPC server credentials."""
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    @property
    def mode(self) -> str:
        """``tls`` or ``mtls``."""
        return "mtls" if self.client_ca is not None else "tls"


def _worker_service(
    server: JobplaneServer,
    topology: Topology,
    lease_seconds: float,
    inline_bytes: int | None,
    max_schedule_seconds: float,
) -> WorkerService:
    """The server's WorkerService, over its pool, limits and object store."""
    service = WorkerService(
        AttemptStore(server.db, lease_seconds=lease_seconds),
        HeldAttempts(server.db),
        topology,
        workers=WorkerStore(server._engine),
        max_result_bytes=server._max_payload_bytes,
        blobs=server.blobs,
        inline_bytes=inline_bytes,
        children=ChildStore(server.db),
        max_schedule_seconds=max_schedule_seconds,
    )
    # A child a worker submits counts against its tenant's submits.
    service.take_submit = server.limiter.take_submit
    return service


class JobplaneServer(Lifecycle):
    """One server process: ``async with JobplaneServer(...) as server:`` (or
    ``await start()``, then ``await stop()``; :meth:`run` for a whole process).

    The engine belongs to the caller; the server owns its LISTEN connections
    (job events, domain events, and key revocations) and the gRPC server. ``tls`` serves
    TLS (mutual TLS when it has a client CA) instead of plaintext.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        database_url: str,
        topology: Topology,
        *,
        listen: str = "127.0.0.1:50051",
        max_payload_bytes: int = 256 * 1024,
        faults: FaultPoints = NO_FAULTS,
        recheck_seconds: float = 30.0,
        tls: ServerTLS | None = None,
        limits: TenantLimits | None = None,
        key_cache_seconds: float = 30.0,
        worker_lease_seconds: float = 30.0,
        blobs: BlobStore | None = None,
        inline_bytes: int | None = None,
        metrics: Metrics = NO_METRICS,
        db: Database | None = None,
        max_schedule_seconds: float = DEFAULT_MAX_SCHEDULE_SECONDS,
        listen_url: str | None = None,
    ) -> None:
        if not 0 < max_payload_bytes <= MAX_PAYLOAD_BYTES_LIMIT:
            # Past it, a job could be too large for the SDK to read back.
            raise ValueError(f"max_payload_bytes must be 1..{MAX_PAYLOAD_BYTES_LIMIT}")
        self._listen = listen
        self._tls = tls
        self._engine = engine
        # The hot statements' pool (ADR-0030): the caller's, or the server's own.
        self._owns_db = db is None
        self.db = db or Database(database_url)
        self._topology = topology
        self._max_payload_bytes = max_payload_bytes
        # The caller's (None: blobs disabled, BlobService answers BLOBS_DISABLED).
        self.blobs = blobs
        # LISTEN needs a session of its own: past PgBouncer (ADR-0048).
        listen_url = listen_url or database_url
        self.hub = Listener(listen_url, EVENTS_CHANNEL)
        self.keys = KeyStore(engine, cache_seconds=key_cache_seconds)
        # Revocations reach this process's key cache by notification; a
        # reconnect of the listener (notifications lost) drops the cache.
        self.key_events = Listener(listen_url, KEYS_CHANNEL)
        self.key_events.on_notify(self.keys.forget)
        self.key_events.on_reset(self.keys.clear_cache)
        self.limiter = TenantLimiter(limits or TenantLimits())
        self.service = JobService(
            JobStore(engine, self.db, faults=faults),
            self.hub,
            topology,
            max_payload_bytes=max_payload_bytes,
            recheck_seconds=recheck_seconds,
            blobs=blobs,
            max_schedule_seconds=max_schedule_seconds,
        )
        self.event_hub = Listener(listen_url, DOMAIN_EVENTS_CHANNEL)
        self.events = EventService(
            EventStore(engine),
            self.event_hub,
            max_payload_bytes=max_payload_bytes,
            recheck_seconds=recheck_seconds,
        )
        self.workers = _worker_service(
            self, topology, worker_lease_seconds, inline_bytes, max_schedule_seconds
        )
        self.schedules = ScheduleService(
            engine, topology, max_payload_bytes=max_payload_bytes, blobs=blobs
        )
        self.max_receive_bytes = _max_receive_bytes(max_payload_bytes)
        self.service.metrics = self.workers.metrics = metrics
        metrics.add_streams(self.limiter.open_streams)
        metrics.know_topology(topology)
        self.health = HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._serving = False
        self._stopping = False
        self.port: int = 0

    @property
    def address(self) -> str:
        """host:port the server listens on (the real port, once started)."""
        host = self._listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def not_ready(self) -> str | None:
        """Why this server takes no calls now (None: it serves), for ``/readyz``."""
        return None if self._serving else "not serving"

    async def start(self, *, report_serving: bool = True) -> None:
        """Bind, start serving and report SERVING.

        ``report_serving=False``: health stays NOT_SERVING (and ``/readyz`` not
        ready) until :meth:`report_serving` says the process is usable, e.g.
        once the topology exists on the broker: a caller that binds a queue to
        the events exchange the moment health says SERVING must find it.
        """
        await self.db.open()
        self.service.open()
        self.events.open()
        await self.hub.start()
        await self.event_hub.start()
        await self.key_events.start()
        await self._sync_submit_rules()
        await self._install_schedules()
        self.workers.deployment = (await this_deployment(self._engine)).id
        server = grpc.aio.server(
            # Authentication first: a call without a valid key is refused
            # before its body is read, decodable or not. RefuseUndecodable
            # must stay last (it wraps the servicer's handlers once each).
            interceptors=[
                # Only while tracing is on: off, calls pay nothing for it.
                *([ServerTracing()] if tracing.ENABLED else []),
                CallGate(API_SERVICES, self.keys, self.limiter),
                CallGate(WORKER_SERVICE_NAME, self.keys, self.limiter, scope=KeyScope.WORKER),
                RefuseUndecodable("/jobplane.v1."),
            ],
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", self.max_receive_bytes),
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                # gRPC core cancels calls that arrive faster than the process
                # picks them up once 1,000 wait (3,000 at once); thousands of
                # watchers reconnecting after a restart arrive together.
                ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
                ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
            ],
        )
        self._add_servicers(server)
        if self._tls is None:
            self.port = server.add_insecure_port(self._listen)
        else:
            self.port = server.add_secure_port(self._listen, self._tls.credentials())
        if self.port == 0:
            raise OSError(f"cannot listen on {self._listen}")
        # grpc's health servicer says SERVING for "" until told otherwise.
        for service in ("", *API_SERVICES, WORKER_SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        log.info(
            "server.started",
            address=self.address,
            transport=self._tls.mode if self._tls else "plaintext",
        )
        if report_serving:
            await self.report_serving()

    async def report_serving(self) -> None:
        """Report SERVING (health and ``/readyz``); nothing once :meth:`stop` began."""
        if self._server is None or self._stopping:
            return
        for service in ("", *API_SERVICES, WORKER_SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._serving = True

    def _add_servicers(self, server: grpc.aio.Server) -> None:
        """Every service this server answers, with health and reflection."""
        jobs_pb2_grpc.add_JobServiceServicer_to_server(
            JobServiceServicer(self.service, self.limiter), server
        )
        events_pb2_grpc.add_EventServiceServicer_to_server(
            EventServiceServicer(self.events), server
        )
        workers_pb2_grpc.add_WorkerServiceServicer_to_server(
            WorkerServiceServicer(self.workers), server
        )
        blobs_pb2_grpc.add_BlobServiceServicer_to_server(BlobServiceServicer(self.blobs), server)
        schedules_pb2_grpc.add_ScheduleServiceServicer_to_server(
            ScheduleServiceServicer(self.schedules, self.service), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                *API_SERVICES,
                WORKER_SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )

    async def _install_schedules(self) -> None:
        """The built-in retention schedules (ADR-0041); a failure is a warning only."""
        try:
            done = await sync_retention_schedules(self._engine, self._topology)
        except DBAPIError as exc:
            log.warning("server.schedules.not_installed", error=describe_error(exc))
            return
        if done.created or done.removed:
            log.info("server.schedules.installed", created=done.created, removed=done.removed)

    async def _sync_submit_rules(self) -> None:
        """Give ``jobplane.submit_job`` this server's routes and payload limit.

        A role that may not write them (granted table by table before they
        existed) leaves them as ``jobplane migrate`` wrote them: a warning,
        not a server that does not start.
        """
        try:
            changed = await sync_submit_rules(
                self._engine,
                self._topology,
                max_payload_bytes=self._max_payload_bytes,
                # As this process's transitions do: `jobplane.submit_job` then
                # writes job.queued exactly when SubmitJob does.
                lifecycle_events=MACHINE.lifecycle_events,
                max_schedule_seconds=self.service.max_schedule_seconds,
            )
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) != _INSUFFICIENT_PRIVILEGE:
                raise
            log.warning(
                "routes.sync.refused",
                reason="this database role may not write job_routes and submit_settings; "
                "jobplane.submit_job routes by what `jobplane migrate` wrote",
            )
            return
        if changed:
            log.info("routes.synced", queues=[q.name for q in self._topology.queues])

    async def stop(self, grace: float = 5.0) -> None:
        """Report NOT_SERVING, end watch streams (clients resume elsewhere), stop."""
        self._serving = False
        self._stopping = True
        for service in ("", *API_SERVICES, WORKER_SERVICE_NAME):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.service.close_streams()
        self.events.close_streams()
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        await self.service.feeds.stop()
        await self.hub.stop()
        await self.event_hub.stop()
        await self.key_events.stop()
        await self.keys.close()
        await self.service.close()
        if self._owns_db:
            await self.db.close()
        log.info("server.stopped")

    async def wait(self) -> None:
        """Until the server terminates."""
        if self._server is not None:
            await self._server.wait_for_termination()
        else:  # pragma: no cover - only before start
            await asyncio.Event().wait()
