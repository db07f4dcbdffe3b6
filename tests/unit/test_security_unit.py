"""Without services: log redaction, the limiter, settings, the rich error contract."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
from sqlalchemy.exc import DBAPIError

from jobplane.client._errors import error_from_rpc
from jobplane.config import ConfigError, Settings
from jobplane.errors import TenantLimitExceeded, Unauthenticated
from jobplane.logs import describe_error, format_exception, scrub, stdlib_formatter
from jobplane.server import limits
from jobplane.server.auth import bearer_token
from jobplane.server.limits import TenantLimiter, TenantLimits
from jobplane.server.status import to_grpc_status

MARKER = "payload-marker-93ab"
KEY = "jp_" + "x" * 43


def _insert() -> None:
    raise asyncpg.exceptions.RaiseError(f"refused {MARKER}")


def _execute() -> None:
    try:
        _insert()
    except asyncpg.PostgresError as exc:
        raise DBAPIError("INSERT INTO jobs VALUES ($1)", (MARKER,), exc) from exc


def _submit() -> None:
    try:
        _execute()
    except DBAPIError as exc:
        raise RuntimeError("while submitting") from exc


def _database_failure() -> BaseException:
    """RuntimeError <- SQLAlchemy error with parameters <- Postgres RAISE echoing the payload."""
    with pytest.raises(RuntimeError) as info:
        _submit()
    return info.value


def test_tracebacks_withhold_database_messages_but_keep_the_rest() -> None:
    exc = _database_failure()
    text = format_exception((type(exc), exc, exc.__traceback__))
    assert MARKER not in text
    assert "asyncpg.exceptions.RaiseError: [message withheld: sqlstate=P0001]" in text
    assert "sqlalchemy.exc.DBAPIError: [message withheld" in text
    # Everything else of a traceback is there: frames, chain, other messages.
    assert "RuntimeError: while submitting" in text
    assert "The above exception was the direct cause" in text
    assert "in _insert" in text
    assert text.index("RaiseError") < text.index("DBAPIError") < text.index("RuntimeError")


def test_one_line_descriptions_withhold_database_messages() -> None:
    exc = _database_failure().__cause__
    assert isinstance(exc, DBAPIError)
    line = describe_error(exc)
    assert MARKER not in line
    assert line == (
        "sqlalchemy.exc.DBAPIError from asyncpg.exceptions.RaiseError: "
        "[message withheld: sqlstate=P0001]"
    )
    # Connection failures say what happened: they hold no values.
    closed = asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed")
    assert describe_error(closed).endswith("connection was closed")
    assert describe_error(ValueError(f"bad {KEY}\nmore")) == "ValueError: bad jp_[REDACTED]"


def test_keys_and_bearer_tokens_are_scrubbed() -> None:
    line = f"metadata=(('authorization', 'Bearer {KEY}'),) key={KEY} prefix=jp_abcde"
    cleaned = scrub(line)
    assert KEY not in cleaned and KEY[3:] not in cleaned
    # A non-secret prefix stays readable.
    assert "prefix=jp_abcde" in cleaned
    assert scrub("authorization: bearer abc.def") == "authorization: bearer [REDACTED]"


def test_stdlib_records_follow_the_same_rules() -> None:
    exc = _database_failure()
    record = logging.LogRecord(
        "grpc", logging.ERROR, __file__, 1, "call with %s", (KEY,), (type(exc), exc, None)
    )
    text = stdlib_formatter().format(record)
    assert KEY not in text and MARKER not in text
    assert "RuntimeError: while submitting" in text


def test_token_bucket() -> None:
    now = [100.0]
    tenant, other = uuid.uuid4(), uuid.uuid4()
    limiter = TenantLimiter(
        TenantLimits(submits_per_second=2, submit_burst=3), clock=lambda: now[0]
    )
    for _ in range(3):
        limiter.take_submit(tenant)
    with pytest.raises(TenantLimitExceeded) as info:
        limiter.take_submit(tenant)
    assert info.value.retry_delay == pytest.approx(0.5)
    assert info.value.metadata == {"limit": "submits_per_second", "max": "2", "burst": "3"}
    limiter.take_submit(other)  # a bucket of its own
    now[0] += 0.5
    limiter.take_submit(tenant)  # refilled one
    with pytest.raises(TenantLimitExceeded):
        limiter.take_submit(tenant)
    now[0] += 60
    for _ in range(3):  # never more than the burst
        limiter.take_submit(tenant)
    with pytest.raises(TenantLimitExceeded):
        limiter.take_submit(tenant)


def test_a_batch_takes_its_submits_all_or_none() -> None:
    now = [0.0]
    tenant = uuid.uuid4()
    limiter = TenantLimiter(
        TenantLimits(submits_per_second=4, submit_burst=5), clock=lambda: now[0]
    )
    limiter.take_submit(tenant, 0)  # nothing to take, nothing taken
    limiter.take_submit(tenant, 3)
    with pytest.raises(TenantLimitExceeded) as short:
        limiter.take_submit(tenant, 3)  # 2 left: none of the 3 is taken
    # The batch's first token went at the gate (taken=1): its retry spends it again,
    # so the delay counts it too.
    with pytest.raises(TenantLimitExceeded) as short_taken:
        limiter.take_submit(tenant, 3, taken=1)
    assert short.value.retry_delay == pytest.approx((3 - 2) / 4)
    assert short_taken.value.retry_delay == pytest.approx((3 + 1 - 2) / 4)
    assert short.value.message == (
        "more than 4 submits and publishes per second (burst 5) from this tenant; slow down"
    )
    limiter.take_submit(tenant, 2)
    with pytest.raises(TenantLimitExceeded):
        limiter.take_submit(tenant)


def test_a_call_of_more_submits_than_the_burst_is_refused_without_a_delay() -> None:
    tenant = uuid.uuid4()
    limiter = TenantLimiter(TenantLimits(submits_per_second=4, submit_burst=5))
    limiter.take_submit(tenant, 5)  # the burst itself passes
    for count, taken in ((6, 0), (5, 1)):
        with pytest.raises(TenantLimitExceeded) as refused:
            limiter.take_submit(tenant, count, taken=taken)
        assert refused.value.retry_delay is None
        assert refused.value.message == (
            "6 submits at once are more than this tenant's burst of 5; send at most 5 a call"
        )
        assert refused.value.metadata == {"limit": "submits_per_second", "max": "4", "burst": "5"}
    # A burst set to 0 is a burst of one.
    zero = TenantLimiter(TenantLimits(submits_per_second=1, submit_burst=0))
    zero.take_submit(tenant)
    with pytest.raises(TenantLimitExceeded) as one:
        zero.take_submit(tenant)
    assert one.value.metadata["burst"] == "1"


def test_past_many_tenants_full_buckets_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "_PRUNE_AT", 3)
    now = [100.0]
    limiter = TenantLimiter(
        TenantLimits(submits_per_second=2, submit_burst=2), clock=lambda: now[0]
    )
    spent, refilled, idle, new = (uuid.uuid4() for _ in range(4))
    limiter.take_submit(spent, 2)
    limiter.take_submit(refilled)
    limiter.take_submit(idle)
    now[0] += 0.5  # refilled and idle are full again; spent has one token of two
    limiter.take_submit(new)  # the fourth tenant: the full buckets go
    assert sorted(limiter._buckets, key=str) == sorted([spent, new], key=str)
    # The bucket kept still holds what the tenant spent: one token, not a fresh burst.
    limiter.take_submit(spent)
    with pytest.raises(TenantLimitExceeded):
        limiter.take_submit(spent)


def test_a_tenant_alone_meets_no_submit_limit_on_the_defaults() -> None:
    # One server takes a few thousand submits a second at most
    # (docs/performance.md); a tenant alone on the defaults is never refused,
    # whether its submits come at once or steadily.
    limits = TenantLimits.from_settings(Settings.from_env({}))
    assert limits == TenantLimits()  # a server started without settings has the same
    now = [0.0]
    tenant = uuid.uuid4()
    limiter = TenantLimiter(limits, clock=lambda: now[0])
    limiter.take_submit(tenant, 5000)
    for _ in range(10_000):  # then 5,000 a second for 10 s
        now[0] += 0.001
        limiter.take_submit(tenant, 5)


async def test_the_dashboard_alone_takes_the_limits_the_server_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `jobplane ui` builds its limiter from every limit setting, as `serve` does.
    from jobplane import process
    from jobplane.cli import build_parser
    from jobplane.server import cli
    from jobplane.server.dashboard import app

    class Built(Exception):
        """The backend's arguments, seen: stop before any service is needed."""

    seen: list[TenantLimiter] = []

    async def standalone_backend(*_args: object, limiter: TenantLimiter, **_kw: object) -> None:
        seen.append(limiter)
        raise Built

    monkeypatch.setattr(app, "standalone_backend", standalone_backend)
    monkeypatch.setattr(process, "configure", lambda *args, **kwargs: None)
    monkeypatch.setenv("JOBPLANE_TENANT_MAX_STREAMS", "7")
    monkeypatch.setenv("JOBPLANE_TENANT_SUBMITS_PER_SECOND", "2.5")
    monkeypatch.setenv("JOBPLANE_TENANT_SUBMIT_BURST", "3")
    with pytest.raises(Built):
        await cli._ui(build_parser().parse_args(["ui", "--listen", "127.0.0.1:0"]))
    assert [limiter.limits for limiter in seen] == [
        TenantLimits(max_streams=7, submits_per_second=2.5, submit_burst=3)
    ]


def test_stream_slots() -> None:
    tenant = uuid.uuid4()
    limiter = TenantLimiter(TenantLimits(max_streams=2))
    limiter.acquire_stream(tenant)
    limiter.acquire_stream(tenant)
    with pytest.raises(TenantLimitExceeded) as info:
        limiter.acquire_stream(tenant)
    assert info.value.limit == "watch_streams"
    assert limiter.streams(tenant) == 2
    limiter.release_stream(tenant)
    limiter.acquire_stream(tenant)
    limiter.release_stream(tenant)
    limiter.release_stream(tenant)
    assert limiter.streams(tenant) == 0
    assert info.value.retry_delay == 2.0
    assert info.value.message == (
        "this tenant already has 2 watch and subscribe streams open on this server; "
        "close some first"
    )
    assert info.value.metadata == {"limit": "watch_streams", "max": "2"}
    other = uuid.uuid4()
    limiter.acquire_stream(tenant)
    limiter.acquire_stream(other)
    limiter.acquire_stream(other)
    assert limiter.open_streams() == 3
    limiter.release_stream(other)
    assert (limiter.streams(other), limiter.open_streams()) == (1, 2)


def test_zero_turns_a_limit_off() -> None:
    tenant = uuid.uuid4()
    limiter = TenantLimiter(TenantLimits(max_streams=0, submits_per_second=0))
    for _ in range(5000):
        limiter.take_submit(tenant)
        limiter.acquire_stream(tenant)
    assert limiter.streams(tenant) == 5000


def test_retry_info_survives_the_wire() -> None:
    error = TenantLimitExceeded(
        "slow down", metadata={"limit": "submits_per_second", "max": "5"}, retry_delay=0.25
    )
    status = to_grpc_status(error)
    rpc_error = grpc.aio.AioRpcError(
        status.code,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(*status.trailing_metadata),
        details=status.details,
    )
    back = error_from_rpc(rpc_error)
    assert type(back) is TenantLimitExceeded
    assert back.retry_delay == pytest.approx(0.25)
    assert back.limit == "submits_per_second"
    assert back.code == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize(
    ("metadata", "token"),
    [
        ((("authorization", "Bearer jp_abc"),), "jp_abc"),
        ((("x-other", "1"), ("authorization", "bearer  jp_abc ")), "jp_abc"),
    ],
)
def test_bearer_token(metadata: tuple[tuple[str, str], ...], token: str) -> None:
    assert bearer_token(metadata) == token


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ((), "missing 'authorization: Bearer <key>' metadata"),
        ((("authorization", "Basic abc"),), "the API key is not valid"),
        ((("authorization", "Bearer "),), "the API key is not valid"),
        # Binary metadata (a -bin key's bytes) is no bearer key either.
        ((("authorization", b"Bearer jp_abc"),), "the API key is not valid"),
    ],
    ids=["missing", "basic", "empty", "bytes"],
)
def test_bearer_token_missing_or_malformed(
    metadata: tuple[tuple[str, Any], ...], message: str
) -> None:
    with pytest.raises(Unauthenticated) as refused:
        bearer_token(metadata)
    assert refused.value.message == message


def test_tls_and_limit_settings(tmp_path: Path) -> None:
    cert, key, ca = (tmp_path / n for n in ("cert.pem", "key.pem", "ca.pem"))
    settings = Settings.from_env(
        {
            "JOBPLANE_TLS_CERT": str(cert),
            "JOBPLANE_TLS_KEY": str(key),
            "JOBPLANE_TLS_CLIENT_CA": str(ca),
            "JOBPLANE_TENANT_MAX_STREAMS": "0",
            "JOBPLANE_TENANT_SUBMITS_PER_SECOND": "2.5",
            "JOBPLANE_TENANT_SUBMIT_BURST": "10",
        }
    )
    assert (settings.tls_cert, settings.tls_key, settings.tls_client_ca) == (cert, key, ca)
    assert settings.tenant_max_streams == 0
    assert settings.tenant_submits_per_second == 2.5
    assert settings.tenant_submit_burst == 10
    assert TenantLimits.from_settings(settings) == TenantLimits(0, 2.5, 10)
    defaults = Settings.from_env({})
    assert defaults.tls_cert is None
    assert defaults.tenant_max_streams > 0 and defaults.tenant_submits_per_second > 0


@pytest.mark.parametrize(
    "env",
    [
        {"JOBPLANE_TLS_CERT": "cert.pem"},
        {"JOBPLANE_TLS_KEY": "key.pem"},
        {"JOBPLANE_TLS_CLIENT_CA": "ca.pem"},
        {"JOBPLANE_TENANT_MAX_STREAMS": "-1"},
        {"JOBPLANE_TENANT_MAX_STREAMS": "1.5"},
        {"JOBPLANE_TENANT_SUBMITS_PER_SECOND": "nan"},
        {"JOBPLANE_TENANT_SUBMITS_PER_SECOND": "fast"},
    ],
)
def test_bad_security_settings(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        Settings.from_env(env)


def test_client_tls_options_are_checked() -> None:
    from jobplane.client import AsyncClient, Client, ClientTLS

    with pytest.raises(ValueError, match="together"):
        ClientTLS(client_cert=b"x")
    tls = ClientTLS(root_certificates=b"x")
    assert AsyncClient("h:1", tls=tls).tls is tls
    assert AsyncClient("h:1", tls=True).tls == ClientTLS()
    assert AsyncClient("h:1", tls=False).tls is None
    assert not AsyncClient("h:1").tls
    assert Client("h:1", tls=tls).tls is tls
    # The client key never shows in a repr.
    assert "secret-key" not in repr(ClientTLS(client_cert=b"c", client_key=b"secret-key"))


def test_client_tls_from_the_environment(tmp_path: Path) -> None:
    from jobplane.client import AsyncClient, Client, ClientTLS

    (tmp_path / "ca.pem").write_bytes(b"ca")
    (tmp_path / "c.pem").write_bytes(b"cert")
    (tmp_path / "c.key").write_bytes(b"key")
    env = {
        "JOBPLANE_ADDRESS": "h:2",
        "JOBPLANE_API_KEY": "k",
        "JOBPLANE_TLS_CA": str(tmp_path / "ca.pem"),
        "JOBPLANE_TLS_CLIENT_CERT": str(tmp_path / "c.pem"),
        "JOBPLANE_TLS_CLIENT_KEY": str(tmp_path / "c.key"),
        "JOBPLANE_TLS_SERVER_NAME": "svc",
    }
    expected = ClientTLS(b"ca", b"cert", b"key", "svc")
    assert ClientTLS.from_env(env) == expected
    for client in (AsyncClient.from_env(env=env), Client.from_env(env=env)):
        assert (client.address, client.api_key, client.tls) == ("h:2", "k", expected)
    # Arguments win over the environment.
    assert AsyncClient.from_env(env=env, tls=False, address="h:3").tls is None
    assert AsyncClient.from_env(env=env, address="h:3").address == "h:3"
    assert ClientTLS.from_env({"JOBPLANE_TLS": "1"}) == ClientTLS()
    assert ClientTLS.from_env({"JOBPLANE_TLS": "0"}) is None
    assert ClientTLS.from_env({}) is None
    with pytest.raises(ValueError, match="TLS off"):
        ClientTLS.from_env({"JOBPLANE_TLS": "no", "JOBPLANE_TLS_SERVER_NAME": "svc"})
    with pytest.raises(ValueError, match="together"):
        ClientTLS.from_env({"JOBPLANE_TLS_CLIENT_CERT": str(tmp_path / "c.pem")})


def test_keys_list_prints_ids_never_keys(capsys: pytest.CaptureFixture[str]) -> None:
    from datetime import UTC, datetime, timedelta

    from jobplane.server.admin import _print_keys
    from jobplane.store.keys import KeyInfo

    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    tenant = uuid.uuid4()
    _print_keys(
        [
            KeyInfo("key_a", "acme", tenant, "jp_abcde", now, None, now, True),
            KeyInfo("key_b", "acme", tenant, "jp_fghij", now, now + timedelta(hours=1), None, True),
        ]
    )
    out, err = capsys.readouterr()
    header, first, second = out.splitlines()
    assert header.split() == ["KEY", "ID", "TENANT", "PREFIX", "CREATED", "REVOKED", "LAST", "USED"]
    assert first.split() == [
        "key_a",
        "acme",
        "jp_abcde",
        now.isoformat(timespec="seconds"),
        "-",
        now.isoformat(timespec="seconds"),
    ]
    assert second.split()[4].endswith("*")  # ends later: rotated with a grace period
    assert "grace" in err
