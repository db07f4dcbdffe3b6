"""Configuration: one frozen object, built once from the environment."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

from jobplane.store.dsn import connect_options

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/jobplane"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_LISTEN = "127.0.0.1:50051"
# The largest JOBPLANE_MAX_PAYLOAD_BYTES (which bounds results too). A job
# carries a payload and a result, each up to 5.5 times its JSON size as a
# protobuf Struct: at this bound one Job message stays under 45 MiB, which
# the SDK accepts (jobplane.client.aio.MAX_RECEIVE_BYTES). Large data goes
# by reference to object storage, not in a payload.
MAX_PAYLOAD_BYTES_LIMIT = 4 * 1024 * 1024


#: What ``JOBPLANE_LOG_LEVEL`` and ``JOBPLANE_LOG_FORMAT`` accept.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("console", "json")
#: What ``JOBPLANE_LOG_JOB_PREFIX`` (and a queue's ``log_prefix``) accepts: dot-separated
#: lower-case words ending in a dot, e.g. ``ingestion.`` (``job.completed`` becomes
#: ``ingestion.job.completed``).
LOG_PREFIX = re.compile(r"(?:[a-z][a-z0-9_-]*\.)+")
LOG_PREFIX_HINT = "dot-separated lower-case words ending in a dot (e.g. 'ingestion.')"


#: ``JOBPLANE_MAX_BLOB_BYTES`` by default (5 GiB) and at most (5 TiB, S3's own limit).
DEFAULT_MAX_BLOB_BYTES = 5 * 1024**3
MAX_BLOB_BYTES_LIMIT = 5 * 1024**4
#: ``JOBPLANE_INLINE_BYTES`` by default: larger payloads and results go by reference.
DEFAULT_INLINE_BYTES = 64 * 1024
#: The largest payload or result a blob may hold in place of the inline JSON:
#: the worker (or the SDK) reads it whole into memory to hand it over.
MAX_OFFLOADED_JSON_BYTES = 64 * 1024 * 1024
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")

#: Where ``jobplane dev`` and ``jobplane ui`` serve the dashboard unless told otherwise.
DEFAULT_UI_LISTEN = "127.0.0.1:8080"
#: The shortest JOBPLANE_UI_SECRET accepted.
MIN_UI_SECRET = 32

#: Per-tenant limits of one server process, by default (docs/security.md). The
#: submit rate is well above what one server takes, so a tenant alone never
#: meets it: the limit keeps one tenant from taking a process from the others,
#: it is no quota.
DEFAULT_TENANT_MAX_STREAMS = 1000
DEFAULT_TENANT_SUBMITS_PER_SECOND = 10_000.0
DEFAULT_TENANT_SUBMIT_BURST = 10_000

#: The longest lease of a WorkerService attempt: a dead worker's job waits this long.
MAX_WORKER_LEASE = 3600.0


#: An address or network (of a trusted proxy).
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class ConfigError(ValueError):
    """A JOBPLANE_* setting has a value that cannot be used."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything a jobplane process reads from its environment."""

    database_url: str = DEFAULT_DATABASE_URL
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
    db_pool_size: int = 6
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
        max_payload = _positive_int(env, "JOBPLANE_MAX_PAYLOAD_BYTES", base.max_payload_bytes)
        if max_payload > MAX_PAYLOAD_BYTES_LIMIT:
            raise ConfigError(
                f"JOBPLANE_MAX_PAYLOAD_BYTES must be at most {MAX_PAYLOAD_BYTES_LIMIT} "
                "(4 MiB); pass larger data by reference"
            )
        pool = _positive_int(env, "JOBPLANE_DB_POOL_SIZE", base.db_pool_size)
        engine_pool = _positive_int(env, "JOBPLANE_DB_ENGINE_POOL_SIZE", base.db_engine_pool_size)
        lease = _seconds(
            env, "JOBPLANE_WORKER_LEASE_SECONDS", base.worker_lease_seconds, 1.0, MAX_WORKER_LEASE
        )
        faults = frozenset(p for p in env.get("JOBPLANE_FAULTS", "").split(",") if p.strip())
        tls_cert, tls_key = _path(env, "JOBPLANE_TLS_CERT"), _path(env, "JOBPLANE_TLS_KEY")
        tls_client_ca = _path(env, "JOBPLANE_TLS_CLIENT_CA")
        if (tls_cert is None) != (tls_key is None):
            raise ConfigError("JOBPLANE_TLS_CERT and JOBPLANE_TLS_KEY go together")
        if tls_client_ca is not None and tls_cert is None:
            raise ConfigError("JOBPLANE_TLS_CLIENT_CA needs JOBPLANE_TLS_CERT and JOBPLANE_TLS_KEY")
        settings = replace(
            base,
            database_url=_database_url(env, base.database_url),
            amqp_url=env.get("JOBPLANE_AMQP_URL", base.amqp_url),
            listen=env.get("JOBPLANE_LISTEN", base.listen),
            address=env.get("JOBPLANE_ADDRESS", base.address),
            api_key=env.get("JOBPLANE_API_KEY") or None,
            topology_path=Path(topology) if topology else None,
            max_payload_bytes=max_payload,
            db_pool_size=pool,
            db_engine_pool_size=engine_pool,
            log_level=_choice(env, "JOBPLANE_LOG_LEVEL", LOG_LEVELS),
            log_format=_choice(env, "JOBPLANE_LOG_FORMAT", LOG_FORMATS) or base.log_format,
            faults=frozenset(f.strip() for f in faults),
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_client_ca=tls_client_ca,
            tenant_max_streams=_non_negative_int(
                env, "JOBPLANE_TENANT_MAX_STREAMS", base.tenant_max_streams
            ),
            tenant_submits_per_second=_non_negative(
                env, "JOBPLANE_TENANT_SUBMITS_PER_SECOND", base.tenant_submits_per_second
            ),
            tenant_submit_burst=_non_negative_int(
                env, "JOBPLANE_TENANT_SUBMIT_BURST", base.tenant_submit_burst
            ),
            worker_lease_seconds=lease,
            # Anything but an explicit no leaves them on, their default.
            lifecycle_events=env.get("JOBPLANE_LIFECYCLE_EVENTS", "").strip().lower()
            not in {"0", "false", "no", "off"},
            sync_threads=(
                _positive_int(env, "JOBPLANE_SYNC_THREADS", 1)
                if env.get("JOBPLANE_SYNC_THREADS", "").strip()
                else None
            ),
        )
        return _with_dashboard(
            env, _with_metrics(env, _with_tracing(env, _with_ingest(env, _with_s3(env, settings))))
        )


def _database_url(env: Mapping[str, str], default: str) -> str:
    """JOBPLANE_DATABASE_URL, in libpq's URL form (docs/operations.md), checked."""
    url = env.get("JOBPLANE_DATABASE_URL", default)
    try:
        connect_options(url)
    except ValueError as exc:  # the reason never quotes the URL (it may hold a password)
        raise ConfigError(f"JOBPLANE_DATABASE_URL: {exc}") from None
    return url


def _with_s3(env: Mapping[str, str], base: Settings) -> Settings:
    """``base`` with the object-storage settings, checked."""
    max_payload = base.max_payload_bytes
    url = env.get("JOBPLANE_S3_URL", "").strip() or None
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"JOBPLANE_S3_URL must be an http:// or https:// URL of an S3 endpoint, not {url!r}"
            )
        try:
            parts.port  # noqa: B018 - a bad port raises here
        except ValueError as exc:
            raise ConfigError(f"JOBPLANE_S3_URL has a bad port: {url!r}") from exc
    bucket = env.get("JOBPLANE_S3_BUCKET", "").strip() or base.s3_bucket
    if not _BUCKET_NAME.match(bucket) or ".." in bucket:
        raise ConfigError(
            f"JOBPLANE_S3_BUCKET must be an S3 bucket name (3-63 characters: a-z, 0-9, '.', "
            f"'-'), not {bucket!r}"
        )
    key_id = env.get("JOBPLANE_S3_ACCESS_KEY_ID", "").strip() or None
    secret = env.get("JOBPLANE_S3_SECRET_ACCESS_KEY", "").strip() or None
    if (key_id is None) != (secret is None):
        raise ConfigError("JOBPLANE_S3_ACCESS_KEY_ID and JOBPLANE_S3_SECRET_ACCESS_KEY go together")
    region = env.get("JOBPLANE_S3_REGION", "").strip() or base.s3_region
    prefix = env.get("JOBPLANE_S3_PREFIX", base.s3_prefix).strip()
    if prefix.startswith("/") or "//" in prefix or len(prefix) > 512:
        raise ConfigError(
            f"JOBPLANE_S3_PREFIX must be a relative key prefix (e.g. 'jobplane/'), not {prefix!r}"
        )
    max_blob = _positive_int(env, "JOBPLANE_MAX_BLOB_BYTES", base.max_blob_bytes)
    if max_blob > MAX_BLOB_BYTES_LIMIT:
        raise ConfigError("JOBPLANE_MAX_BLOB_BYTES must be at most 5 TiB (S3's object limit)")
    # Unset, it follows a smaller payload limit down.
    inline = _positive_int(env, "JOBPLANE_INLINE_BYTES", min(base.inline_bytes, max_payload))
    if inline > max_payload:
        raise ConfigError(
            f"JOBPLANE_INLINE_BYTES ({inline}) must be at most JOBPLANE_MAX_PAYLOAD_BYTES "
            f"({max_payload}): a payload between the two could go neither way"
        )
    return replace(
        base,
        s3_url=url,
        s3_bucket=bucket,
        s3_access_key_id=key_id,
        s3_secret_access_key=secret,
        s3_region=region,
        s3_prefix=prefix,
        max_blob_bytes=max_blob,
        inline_bytes=inline,
    )


def _with_ingest(env: Mapping[str, str], base: Settings) -> Settings:
    """The ingestion settings (JOBPLANE_DATA_DIR, JOBPLANE_QDRANT_*, JOBPLANE_EMBEDDER)."""
    url = env.get("JOBPLANE_QDRANT_URL", "").strip() or None
    if url is not None and not url.startswith(("http://", "https://")):
        raise ConfigError(f"JOBPLANE_QDRANT_URL must be an http:// or https:// URL, not {url!r}")
    embedder = env.get("JOBPLANE_EMBEDDER", "").strip() or base.embedder
    kind, _, model = embedder.partition(":")
    if not (embedder == "hash" or (kind in ("fastembed", "sentence-transformers") and model)):
        raise ConfigError(
            "JOBPLANE_EMBEDDER must be hash, fastembed:<model> or sentence-transformers:<model>, "
            f"not {embedder!r}"
        )
    return replace(
        base,
        data_dir=_path(env, "JOBPLANE_DATA_DIR") or base.data_dir,
        qdrant_url=url,
        qdrant_api_key=env.get("JOBPLANE_QDRANT_API_KEY") or None,
        qdrant_path=_path(env, "JOBPLANE_QDRANT_PATH"),
        embedder=embedder,
    )


#: What ``OTEL_TRACES_EXPORTER`` may name (the SDK installed: OTLP over HTTP, the console).
TRACE_EXPORTERS = ("otlp", "console", "none")
#: ``OTEL_TRACES_SAMPLER``'s values, as the OpenTelemetry SDK reads them.
TRACE_SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
_TRUE = ("true", "1", "yes", "on")
#: The OTLP/gRPC exporter: its module, and the package that brings it.
OTLP_GRPC_MODULE = "opentelemetry.exporter.otlp.proto.grpc"
OTLP_GRPC_PACKAGE = "opentelemetry-exporter-otlp-proto-grpc"
#: The packages of OpenTelemetry's propagators that are not installed with
#: jobplane, by their OTEL_PROPAGATORS name.
PROPAGATOR_PACKAGES = {
    "b3": "opentelemetry-propagator-b3",
    "b3multi": "opentelemetry-propagator-b3",
    "jaeger": "opentelemetry-propagator-jaeger",
    "xray": "opentelemetry-propagator-aws-xray",
    "ottrace": "opentelemetry-propagator-ot-trace",
}


def _with_tracing(env: Mapping[str, str], base: Settings) -> Settings:
    """The tracing settings from the standard OTEL_* variables, checked.

    On when ``OTEL_TRACES_EXPORTER`` names an exporter, or, unset, when an
    OTLP endpoint is set; ``OTEL_SDK_DISABLED=true`` turns it off whatever
    the rest says. The SDK reads the other variables itself; those it would
    quietly replace by a default when wrong (sampler, protocol) are refused here.
    """
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE:
        return base
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    wrong = [n for n in names if n not in TRACE_EXPORTERS]
    if wrong:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER must name {', '.join(TRACE_EXPORTERS)}, not {wrong[0]!r}"
        )
    endpoint = any(
        env.get(name, "").strip()
        for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    if not raw and endpoint:
        names = ("otlp",)
    names = tuple(n for n in names if n != "none")
    protocol = "http/protobuf"
    if "otlp" in names:
        for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            found = env.get(name, "").strip()
            if found:
                _check_protocol(name, found)
                protocol = found
                break
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if sampler and sampler not in TRACE_SAMPLERS:
        raise ConfigError(
            f"OTEL_TRACES_SAMPLER must be one of {', '.join(TRACE_SAMPLERS)}, not {sampler!r}"
        )
    if sampler.endswith("traceidratio"):
        ratio = _float(env, "OTEL_TRACES_SAMPLER_ARG", 1.0, "a ratio from 0 to 1")
        if not 0.0 <= ratio <= 1.0:
            raise ConfigError("OTEL_TRACES_SAMPLER_ARG must be a ratio from 0 to 1")
    return replace(
        base,
        trace_exporters=names,
        trace_service_name=env.get("OTEL_SERVICE_NAME", "").strip() or None,
        trace_protocol=protocol,
        trace_propagators=_propagators(env) if names else base.trace_propagators,
    )


def _check_protocol(name: str, protocol: str) -> None:
    """Refuse an OTLP protocol no installed exporter speaks, saying what would."""
    if protocol == "grpc":
        if not _importable(OTLP_GRPC_MODULE):
            raise ConfigError(
                f"{name}=grpc needs OpenTelemetry's OTLP/gRPC exporter: "
                f"pip install {OTLP_GRPC_PACKAGE} (or set {name}=http/protobuf)"
            )
    elif protocol == "http/json":
        raise ConfigError(
            f"{name}=http/json: OpenTelemetry's Python SDK has no OTLP/JSON exporter; "
            "set http/protobuf (or grpc)"
        )
    elif protocol != "http/protobuf":
        raise ConfigError(f"{name} must be http/protobuf or grpc, not {protocol!r}")


def _importable(module: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _propagators(env: Mapping[str, str]) -> tuple[str, ...]:
    """OTEL_PROPAGATORS' names, each one an installed propagator's; unset:
    ``tracecontext``; ``none``: none."""
    names = tuple(
        dict.fromkeys(n.strip() for n in env.get("OTEL_PROPAGATORS", "").split(",") if n.strip())
    )
    if not names:
        return ("tracecontext",)
    if "none" in names:
        return ()
    from importlib.metadata import entry_points

    installed = {e.name for e in entry_points(group="opentelemetry_propagator")}
    for name in names:
        if name not in installed:
            package = PROPAGATOR_PACKAGES.get(name)
            raise ConfigError(
                f"OTEL_PROPAGATORS names {name!r}, which is not installed: "
                + (
                    f"pip install {package}"
                    if package
                    else f"the installed ones are {', '.join(sorted(installed))}"
                )
            )
    return names


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """A parsed ``host:port`` (``[v6]:port`` for IPv6)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_listen(value: str, *, name: str = "JOBPLANE_METRICS_LISTEN") -> ListenAddress | None:
    """``host:port`` (port 0: any free one) as a :class:`ListenAddress`; None for ``off``.

    Anything else is a :class:`ConfigError` naming ``name``.
    """
    raw = value.strip()
    if raw.lower() == "off":
        return None
    host, sep, port_text = raw.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        bad_host = not host or "[" in host or "]" in host
    else:
        bad_host = not host or ":" in host or "[" in host or "]" in host
    if not sep or bad_host or any(c.isspace() or not c.isprintable() for c in host):
        raise ConfigError(f"{name} must be host:port or off, not {value!r}")
    if not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"{name} must be host:port with a port of 0..65535, not {value!r}")
    return ListenAddress(host, int(port_text))


def check_log_prefix(value: str, name: str) -> str:
    """``value`` when it is a valid log prefix (or empty); else a ConfigError naming ``name``."""
    if value and not LOG_PREFIX.fullmatch(value):
        raise ConfigError(f"{name} must be {LOG_PREFIX_HINT}, not {value!r}")
    return value


def _with_metrics(env: Mapping[str, str], base: Settings) -> Settings:
    """The ops listener and log-name settings (JOBPLANE_METRICS_LISTEN, JOBPLANE_LOG_JOB_PREFIX)."""
    raw = env.get("JOBPLANE_METRICS_LISTEN", "").strip()
    prefix = check_log_prefix(
        env.get("JOBPLANE_LOG_JOB_PREFIX", "").strip(), "JOBPLANE_LOG_JOB_PREFIX"
    )
    known = {"JOBPLANE_LOG_LEVEL", "JOBPLANE_LOG_FORMAT", "JOBPLANE_LOG_JOB_PREFIX"}
    for name in sorted(k for k in env if k.startswith("JOBPLANE_LOG_") and k not in known):
        raise ConfigError(
            f"{name} is not a setting; the log settings are {', '.join(sorted(known))}"
        )
    return replace(
        base,
        metrics_listen=parse_listen(raw) if raw else None,
        metrics_listen_set=bool(raw),
        log_job_prefix=prefix,
    )


def _with_dashboard(env: Mapping[str, str], base: Settings) -> Settings:
    """The dashboard's settings (JOBPLANE_UI_*)."""
    listen = env.get("JOBPLANE_UI_LISTEN", "").strip() or None
    if listen is not None:
        parse_listen(listen, name="JOBPLANE_UI_LISTEN")
    secret_text = env.get("JOBPLANE_UI_SECRET", "").strip()
    if secret_text and len(secret_text) < MIN_UI_SECRET:
        raise ConfigError(
            f"JOBPLANE_UI_SECRET must have at least {MIN_UI_SECRET} characters "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)"
        )
    hours = _float(env, "JOBPLANE_UI_SESSION_HOURS", base.ui_session_seconds / 3600, "a number")
    if not 0.01 <= hours <= 720:  # NaN too
        raise ConfigError("JOBPLANE_UI_SESSION_HOURS must be 0.01..720 hours")
    secure = _choice(env, "JOBPLANE_UI_SECURE_COOKIE", ("true", "false", "1", "0"))
    origin = env.get("JOBPLANE_UI_ORIGIN", "").strip() or None
    if origin is not None:
        origin = parse_origin(origin, name="JOBPLANE_UI_ORIGIN")
    proxies = parse_networks(
        env.get("JOBPLANE_UI_TRUSTED_PROXIES", ""), name="JOBPLANE_UI_TRUSTED_PROXIES"
    )
    return replace(
        base,
        ui_trusted_proxies=proxies,
        ui_origin=origin,
        ui_listen=listen,
        ui_secret=secret_text.encode() if secret_text else None,
        ui_session_seconds=hours * 3600,
        ui_secure_cookie=secure in ("true", "1"),
    )


def parse_networks(value: str, *, name: str) -> tuple[Network, ...]:
    """Comma-separated addresses or CIDR networks; a ConfigError naming ``name``."""
    networks = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        try:
            networks.append(ipaddress.ip_network(part, strict=False))
        except ValueError:
            raise ConfigError(
                f"{name} must be addresses or networks (e.g. 10.0.0.0/8,::1), not {part!r}"
            ) from None
    return tuple(networks)


def parse_origin(value: str, *, name: str) -> str:
    """A web origin (``scheme://host[:port]``, http or https, nothing after it), normalised."""
    parts = urlsplit(value.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    if (
        parts.scheme.lower() not in ("http", "https")
        or not parts.hostname
        or port == -1
        or parts.path not in ("", "/")
        or parts.query
        or parts.fragment
        or parts.username is not None
    ):
        raise ConfigError(
            f"{name} must be an origin such as https://jobs.example (scheme, host and "
            f"optional port only), not {value!r}"
        )
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}"


def requested_log_format(env: Mapping[str, str] | None = None) -> str:
    """``JOBPLANE_LOG_FORMAT`` as asked for, "console" when unset or not one of
    :data:`LOG_FORMATS`: the format of a start-up error's line, when the settings
    themselves could not be read."""
    env = os.environ if env is None else env
    found = env.get("JOBPLANE_LOG_FORMAT", "").strip().lower()
    return found if found in LOG_FORMATS else "console"


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str | None:
    """``name``'s value, lower-cased, when it is one of ``choices``; None when unset.

    Anything else is refused at start: a typo would otherwise log at a
    level, or in a format, nobody asked for.
    """
    raw = env.get(name, "").strip().lower()
    if not raw:
        return None
    if raw not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, not {raw!r}")
    return raw


def _positive_int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        value = int(env.get(name, default))
    except ValueError as exc:
        raise ConfigError(f"{name} must be an integer") from exc
    if value <= 0:
        raise ConfigError(f"{name} must be positive")
    return value


def _float(env: Mapping[str, str], name: str, default: float, what: str) -> float:
    """``name`` as a float (``default`` when unset or blank); ``what`` names it in the error."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ConfigError(f"{name} must be {what}") from exc


def _non_negative(env: Mapping[str, str], name: str, default: float) -> float:
    value = _float(env, name, default, "a number")
    if not value >= 0 or value == float("inf"):
        raise ConfigError(f"{name} must be 0 (no limit) or more")
    return value


def _non_negative_int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        value = int(env.get(name) or default)
    except ValueError as exc:
        raise ConfigError(f"{name} must be an integer") from exc
    if value < 0:
        raise ConfigError(f"{name} must be 0 (no limit) or more")
    return value


def _seconds(env: Mapping[str, str], name: str, default: float, low: float, high: float) -> float:
    value = _float(env, name, default, "a number of seconds")
    if not low <= value <= high:  # NaN too
        raise ConfigError(f"{name} must be {low:g}..{high:g} seconds")
    return value


def _path(env: Mapping[str, str], name: str) -> Path | None:
    raw = env.get(name, "").strip()
    return Path(raw) if raw else None
