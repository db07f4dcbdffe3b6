"""Configuration: one frozen object, built once from the environment.

:class:`Settings` and its defaults are here; reading a variable's value
(and the error a wrong one raises) is :mod:`jobplane.config_parse`, and the
groups of settings checked beside the core ones :mod:`jobplane.config_checks`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from jobplane.config_checks import (
    OTLP_GRPC_MODULE,
    amqp_url,
    database_direct_url,
    database_url,
    with_dashboard,
    with_ingest,
    with_metrics,
    with_s3,
    with_tracing,
)
from jobplane.config_parse import (
    LOG_FORMATS,
    LOG_LEVELS,
    ConfigError,
    ListenAddress,
    Network,
    check_log_prefix,
    env_choice,
    env_non_negative,
    env_non_negative_int,
    env_path,
    env_positive_int,
    env_seconds,
    parse_listen,
    parse_networks,
    parse_origin,
    requested_log_format,
)
from jobplane.scheduling import DEFAULT_MAX_SCHEDULE_SECONDS, MAX_SCHEDULE_SECONDS_LIMIT

# Named here by the processes and tests that read settings, wherever defined.
__all__ = [
    "DEFAULT_AMQP_URL",
    "DEFAULT_DATABASE_URL",
    "DEFAULT_INLINE_BYTES",
    "DEFAULT_LISTEN",
    "DEFAULT_MAX_BLOB_BYTES",
    "DEFAULT_TENANT_MAX_STREAMS",
    "DEFAULT_TENANT_SUBMITS_PER_SECOND",
    "DEFAULT_TENANT_SUBMIT_BURST",
    "DEFAULT_UI_LISTEN",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "MAX_OFFLOADED_JSON_BYTES",
    "MAX_PAYLOAD_BYTES_LIMIT",
    "MAX_WORKER_LEASE",
    "OTLP_GRPC_MODULE",
    "ConfigError",
    "ListenAddress",
    "Network",
    "Settings",
    "check_log_prefix",
    "parse_listen",
    "parse_networks",
    "parse_origin",
    "requested_log_format",
]

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/jobplane"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_LISTEN = "127.0.0.1:50051"
# The largest JOBPLANE_MAX_PAYLOAD_BYTES (which bounds results too). A job
# carries a payload and a result, each up to 5.5 times its JSON size as a
# protobuf Struct: at this bound one Job message stays under 45 MiB, which
# the SDK accepts (jobplane.client.aio.MAX_RECEIVE_BYTES). Large data goes
# by reference to object storage, not in a payload.
MAX_PAYLOAD_BYTES_LIMIT = 4 * 1024 * 1024
#: ``JOBPLANE_MAX_BLOB_BYTES`` by default (5 GiB; at most config_checks.MAX_BLOB_BYTES_LIMIT).
DEFAULT_MAX_BLOB_BYTES = 5 * 1024**3
#: A worker's handler slots (``--concurrency``) by default: handlers run at
#: once, and the unacked messages it holds (ADR-0057).
DEFAULT_WORKER_CONCURRENCY = 64
#: ``JOBPLANE_INLINE_BYTES`` by default: larger payloads and results go by reference.
DEFAULT_INLINE_BYTES = 64 * 1024
#: The largest payload or result a blob may hold in place of the inline JSON:
#: the worker (or the SDK) reads it whole into memory to hand it over.
MAX_OFFLOADED_JSON_BYTES = 64 * 1024 * 1024

#: Where ``jobplane dev`` and ``jobplane ui`` serve the dashboard unless told otherwise.
DEFAULT_UI_LISTEN = "127.0.0.1:8080"

#: Per-tenant limits of one server process, by default (docs/security.md). The
#: submit rate is well above what one server takes, so a tenant alone never
#: meets it: the limit keeps one tenant from taking a process from the others,
#: it is no quota.
DEFAULT_TENANT_MAX_STREAMS = 1000
DEFAULT_TENANT_SUBMITS_PER_SECOND = 10_000.0
DEFAULT_TENANT_SUBMIT_BURST = 10_000

#: The longest lease of a WorkerService attempt: a dead worker's job waits this long.
MAX_WORKER_LEASE = 3600.0


#: The default of Settings.db_pool_size: a process's asyncpg pool at most.
DEFAULT_DB_POOL_SIZE = 6


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything a jobplane process reads from its environment."""

    database_url: str = DEFAULT_DATABASE_URL
    # What needs a session of its own goes straight to Postgres, past a
    # PgBouncer in transaction pooling: LISTEN, migrations, advisory locks held
    # across statements (JOBPLANE_DATABASE_DIRECT_URL; None: database_url).
    database_direct_url: str | None = None
    amqp_url: str = DEFAULT_AMQP_URL
    listen: str = DEFAULT_LISTEN
    address: str = DEFAULT_LISTEN
    api_key: str | None = None
    topology_path: Path | None = None
    max_payload_bytes: int = 256 * 1024
    # Postgres connections a process's pools hold at most (docs/operations.md,
    # "Connections per process"): fixed pools, since opening and closing
    # connections under load costs Postgres a process each time. The hot
    # statements' asyncpg pool (ADR-0030; a worker's at most its concurrency)…
    db_pool_size: int = DEFAULT_DB_POOL_SIZE
    # …and the SQLAlchemy engine's, for the rest (keys, listings, cancels,
    # sweeps, metrics): small, since the hot paths do not use it.
    db_engine_pool_size: int = 2
    # None: the process decides (info; warning for `jobplane dev`, whose
    # terminal shows the demo's progress bar).
    log_level: str | None = None
    log_format: str = "console"
    # Put before the job.* log event names (job.completed: ingestion.job.completed).
    log_job_prefix: str = ""
    # Named fault points (see jobplane.faults); empty in production.
    faults: frozenset[str] = field(default_factory=frozenset)
    # `jobplane serve` speaks TLS with this certificate chain and key (PEM
    # files); with a client CA, every client must present a certificate it signed.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    # Per tenant and per server process; 0 turns a limit off.
    tenant_max_streams: int = DEFAULT_TENANT_MAX_STREAMS
    tenant_submits_per_second: float = DEFAULT_TENANT_SUBMITS_PER_SECOND
    tenant_submit_burst: int = DEFAULT_TENANT_SUBMIT_BURST
    # The lease a WorkerService claim or heartbeat gives (docs/workers.md).
    worker_lease_seconds: float = 30.0
    # Whether job transitions publish their lifecycle events (docs/events.md).
    lifecycle_events: bool = True
    # Threads a worker runs plain ``def`` handlers in; None: its concurrency.
    sync_threads: int | None = None
    # Object storage (S3-compatible; docs/adr/0020-blobs.md). No URL: blobs are disabled.
    s3_url: str | None = None
    s3_bucket: str = "jobplane"
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = field(default=None, repr=False)
    s3_region: str = "us-east-1"
    s3_prefix: str = ""
    max_blob_bytes: int = DEFAULT_MAX_BLOB_BYTES
    # Payloads and results larger than this (compact JSON) go to a blob.
    inline_bytes: int = DEFAULT_INLINE_BYTES
    # Delayed jobs (docs/scheduling.md): how far ahead a job may be scheduled.
    max_schedule_seconds: float = DEFAULT_MAX_SCHEDULE_SECONDS

    @property
    def direct_url(self) -> str:
        """The URL of what must reach Postgres itself (LISTEN, migrations, session locks)."""
        return self.database_direct_url or self.database_url

    @property
    def blobs_enabled(self) -> bool:
        """True when an object store is configured (``JOBPLANE_S3_URL``)."""
        return self.s3_url is not None

    # Ingestion (jobplane.contrib.ingest): a Qdrant server, else Qdrant's
    # embedded local mode in a directory one process at a time may open.
    data_dir: Path = Path(".jobplane")
    qdrant_url: str | None = None
    qdrant_api_key: str | None = field(default=None, repr=False)
    qdrant_path: Path | None = None
    #: ``hash`` (offline, deterministic) or ``fastembed:<model>`` (docs/ingestion.md).
    embedder: str = "hash"
    #: Chunks per ``ingest.embed`` child job: the chunk stage's batch (docs/ingestion.md).
    ingest_batch: int = 64

    # Tracing.
    #: Span exporters the OTEL_* variables ask for ("otlp", "console"); empty: tracing is off.
    trace_exporters: tuple[str, ...] = ()
    #: OTEL_SERVICE_NAME, which wins over each command's own service name.
    trace_service_name: str | None = None
    #: The OTLP exporter's protocol: ``http/protobuf``, or ``grpc`` when its
    #: package is installed (OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL).
    trace_protocol: str = "http/protobuf"
    #: OTEL_PROPAGATORS: what reads a caller's trace context from a call's
    #: metadata (docs/tracing.md); empty: none is read.
    trace_propagators: tuple[str, ...] = ("tracecontext",)

    # Metrics and health.
    #: The ops listener (/metrics, /livez, /readyz): host:port, or None when
    #: JOBPLANE_METRICS_LISTEN=off. Unset: each command's own default port.
    metrics_listen: ListenAddress | None = None
    metrics_listen_set: bool = False

    # Dashboard.
    #: ``host:port`` of the dashboard, ``off``, or None when unset (``jobplane
    #: serve``: off; ``jobplane dev`` and ``jobplane ui``: DEFAULT_UI_LISTEN).
    ui_listen: str | None = None
    #: Signs session cookies; None: a random one per process (sessions end on restart).
    ui_secret: bytes | None = field(default=None, repr=False)
    ui_session_seconds: float = 8 * 3600.0
    #: Mark the session cookie Secure (the dashboard is reached over HTTPS).
    ui_secure_cookie: bool = False
    #: The dashboard's public origin (``https://jobs.example``) behind a proxy;
    #: when set, a form's ``Origin`` must be exactly it.
    ui_origin: str | None = None
    #: Proxies (addresses or CIDR networks) whose X-Forwarded-For names the client.
    ui_trusted_proxies: tuple[Network, ...] = ()

    def ui_address(self, default: str | None) -> str | None:
        """Where the dashboard listens: the setting, else ``default``; None when off."""
        chosen = self.ui_listen if self.ui_listen is not None else default
        return None if chosen is None or chosen.strip().lower() == "off" else chosen

    @property
    def qdrant_location(self) -> Path:
        """Where local-mode Qdrant keeps its collections (unused with ``qdrant_url``)."""
        return self.qdrant_path if self.qdrant_path is not None else self.data_dir / "qdrant"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read the JOBPLANE_* variables; unset ones keep their defaults."""
        env = os.environ if env is None else env
        base = cls()
        topology = env.get("JOBPLANE_TOPOLOGY")
        max_payload = env_positive_int(env, "JOBPLANE_MAX_PAYLOAD_BYTES", base.max_payload_bytes)
        if max_payload > MAX_PAYLOAD_BYTES_LIMIT:
            raise ConfigError(
                f"JOBPLANE_MAX_PAYLOAD_BYTES must be at most {MAX_PAYLOAD_BYTES_LIMIT} "
                "(4 MiB); pass larger data by reference"
            )
        pool = env_positive_int(env, "JOBPLANE_DB_POOL_SIZE", base.db_pool_size)
        engine_pool = env_positive_int(
            env, "JOBPLANE_DB_ENGINE_POOL_SIZE", base.db_engine_pool_size
        )
        lease = env_seconds(
            env, "JOBPLANE_WORKER_LEASE_SECONDS", base.worker_lease_seconds, 1.0, MAX_WORKER_LEASE
        )
        faults = frozenset(p for p in env.get("JOBPLANE_FAULTS", "").split(",") if p.strip())
        tls_cert, tls_key = env_path(env, "JOBPLANE_TLS_CERT"), env_path(env, "JOBPLANE_TLS_KEY")
        tls_client_ca = env_path(env, "JOBPLANE_TLS_CLIENT_CA")
        if (tls_cert is None) != (tls_key is None):
            raise ConfigError("JOBPLANE_TLS_CERT and JOBPLANE_TLS_KEY go together")
        if tls_client_ca is not None and tls_cert is None:
            raise ConfigError("JOBPLANE_TLS_CLIENT_CA needs JOBPLANE_TLS_CERT and JOBPLANE_TLS_KEY")
        settings = replace(
            base,
            database_url=database_url(env, base.database_url),
            database_direct_url=database_direct_url(env, base.database_direct_url),
            amqp_url=amqp_url(env, base.amqp_url),
            listen=env.get("JOBPLANE_LISTEN", base.listen),
            address=env.get("JOBPLANE_ADDRESS", base.address),
            api_key=env.get("JOBPLANE_API_KEY") or None,
            topology_path=Path(topology) if topology else None,
            max_payload_bytes=max_payload,
            db_pool_size=pool,
            db_engine_pool_size=engine_pool,
            log_level=env_choice(env, "JOBPLANE_LOG_LEVEL", LOG_LEVELS),
            log_format=env_choice(env, "JOBPLANE_LOG_FORMAT", LOG_FORMATS) or base.log_format,
            faults=frozenset(f.strip() for f in faults),
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_client_ca=tls_client_ca,
            tenant_max_streams=env_non_negative_int(
                env, "JOBPLANE_TENANT_MAX_STREAMS", base.tenant_max_streams
            ),
            tenant_submits_per_second=env_non_negative(
                env, "JOBPLANE_TENANT_SUBMITS_PER_SECOND", base.tenant_submits_per_second
            ),
            tenant_submit_burst=env_non_negative_int(
                env, "JOBPLANE_TENANT_SUBMIT_BURST", base.tenant_submit_burst
            ),
            worker_lease_seconds=lease,
            # Anything but an explicit no leaves them on, their default.
            lifecycle_events=env.get("JOBPLANE_LIFECYCLE_EVENTS", "").strip().lower()
            not in {"0", "false", "no", "off"},
            sync_threads=(
                env_positive_int(env, "JOBPLANE_SYNC_THREADS", 1)
                if env.get("JOBPLANE_SYNC_THREADS", "").strip()
                else None
            ),
            max_schedule_seconds=env_seconds(
                env,
                "JOBPLANE_MAX_SCHEDULE_SECONDS",
                base.max_schedule_seconds,
                1.0,
                MAX_SCHEDULE_SECONDS_LIMIT,
            ),
        )
        return with_dashboard(
            env, with_metrics(env, with_tracing(env, with_ingest(env, with_s3(env, settings))))
        )
