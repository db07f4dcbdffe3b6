"""The groups of settings read and checked beside the core ones: the database URL,
object storage, ingestion, tracing, metrics and the dashboard.

:meth:`jobplane.config.Settings.from_env` passes its settings through each;
each returns them with its group's values, or raises a ConfigError saying
what a variable must be.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from jobplane.broker_addresses import split_addresses
from jobplane.config_parse import (
    ConfigError,
    check_log_prefix,
    env_choice,
    env_float,
    env_path,
    env_positive_int,
    parse_listen,
    parse_networks,
    parse_origin,
)
from jobplane.store.dsn import connect_options

if TYPE_CHECKING:
    from jobplane.config import Settings

#: ``JOBPLANE_MAX_BLOB_BYTES`` at most (5 TiB, S3's own limit).
MAX_BLOB_BYTES_LIMIT = 5 * 1024**4
_BUCKET_NAME = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: The shortest JOBPLANE_UI_SECRET accepted.
MIN_UI_SECRET = 32

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


def database_url(env: Mapping[str, str], default: str) -> str:
    """JOBPLANE_DATABASE_URL, in libpq's URL form (docs/operations.md), checked."""
    url = env.get("JOBPLANE_DATABASE_URL", default)
    try:
        connect_options(url)
    except ValueError as exc:  # the reason never quotes the URL (it may hold a password)
        raise ConfigError(f"JOBPLANE_DATABASE_URL: {exc}") from None
    return url


def database_direct_url(env: Mapping[str, str], default: str | None) -> str | None:
    """JOBPLANE_DATABASE_DIRECT_URL: Postgres itself, never PgBouncer; checked.

    Unset, while JOBPLANE_DATABASE_URL leads to PgBouncer (``pgbouncer=true``),
    is refused: LISTEN and the locks held across statements need a session of
    their own, which transaction pooling does not keep (ADR-0048).
    """
    url = env.get("JOBPLANE_DATABASE_DIRECT_URL", "").strip() or default
    if url is not None:
        try:
            pooled = connect_options(url).pgbouncer
        except ValueError as exc:
            raise ConfigError(f"JOBPLANE_DATABASE_DIRECT_URL: {exc}") from None
        if pooled:
            raise ConfigError(
                "JOBPLANE_DATABASE_DIRECT_URL: leads to Postgres itself, "
                "not through PgBouncer (drop pgbouncer=true)"
            )
        return url
    main = env.get("JOBPLANE_DATABASE_URL")
    if main is not None and connect_options(main).pgbouncer:
        raise ConfigError(
            "JOBPLANE_DATABASE_DIRECT_URL is needed when JOBPLANE_DATABASE_URL has "
            "pgbouncer=true: LISTEN, migrations and session locks go straight to Postgres"
        )
    return None


def amqp_url(env: Mapping[str, str], default: str) -> str:
    """JOBPLANE_AMQP_URL: one AMQP URL, or several nodes' separated by commas, checked."""
    url = env.get("JOBPLANE_AMQP_URL", default)
    try:
        split_addresses(url)
    except ValueError as exc:  # the reason never quotes the URL (it may hold a password)
        raise ConfigError(f"JOBPLANE_AMQP_URL: {exc}") from None
    return url


def with_s3(env: Mapping[str, str], base: Settings) -> Settings:
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
    max_blob = env_positive_int(env, "JOBPLANE_MAX_BLOB_BYTES", base.max_blob_bytes)
    if max_blob > MAX_BLOB_BYTES_LIMIT:
        raise ConfigError("JOBPLANE_MAX_BLOB_BYTES must be at most 5 TiB (S3's object limit)")
    # Unset, it follows a smaller payload limit down.
    inline = env_positive_int(env, "JOBPLANE_INLINE_BYTES", min(base.inline_bytes, max_payload))
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


def with_ingest(env: Mapping[str, str], base: Settings) -> Settings:
    """The ingestion settings (JOBPLANE_DATA_DIR, JOBPLANE_QDRANT_*, JOBPLANE_EMBEDDER,
    JOBPLANE_INGEST_BATCH)."""
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
        data_dir=env_path(env, "JOBPLANE_DATA_DIR") or base.data_dir,
        qdrant_url=url,
        qdrant_api_key=env.get("JOBPLANE_QDRANT_API_KEY") or None,
        qdrant_path=env_path(env, "JOBPLANE_QDRANT_PATH"),
        embedder=embedder,
        ingest_batch=env_positive_int(env, "JOBPLANE_INGEST_BATCH", base.ingest_batch),
    )


def with_tracing(env: Mapping[str, str], base: Settings) -> Settings:
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
        ratio = env_float(env, "OTEL_TRACES_SAMPLER_ARG", 1.0, "a ratio from 0 to 1")
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


def with_metrics(env: Mapping[str, str], base: Settings) -> Settings:
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


def with_dashboard(env: Mapping[str, str], base: Settings) -> Settings:
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
    hours = env_float(env, "JOBPLANE_UI_SESSION_HOURS", base.ui_session_seconds / 3600, "a number")
    if not 0.01 <= hours <= 720:  # NaN too
        raise ConfigError("JOBPLANE_UI_SESSION_HOURS must be 0.01..720 hours")
    secure = env_choice(env, "JOBPLANE_UI_SECURE_COOKIE", ("true", "false", "1", "0"))
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
