"""Session cookies, CSRF tokens, the sign-in throttle and the dashboard's forms."""

from __future__ import annotations

import ipaddress

import pytest
from multidict import MultiDict

from jobplane.config import ConfigError, Settings
from jobplane.server.dashboard.forms import BadField, after_seq, job_filters
from jobplane.server.dashboard.session import SessionCodec, SignInThrottle
from jobplane.store.keys import hash_key
from jobplane.types import JobState


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_round_trips_and_any_change_is_refused() -> None:
    clock = Clock()
    codec = SessionCodec(b"s" * 32, max_age=100, clock=clock)
    session = codec.new(hash_key("jp_x"), "key_1")
    cookie = codec.encode(session)
    assert codec.decode(cookie) == session
    assert "jp_x" not in cookie
    body, _, signature = cookie.partition(".")
    # Another last character (base64 "A" ends one signature in 64).
    other = "B" if signature.endswith("A") else "A"
    for forged in (body + "x." + signature, body + "." + signature[:-1] + other, body, ""):
        assert codec.decode(forged) is None
    assert SessionCodec(b"t" * 32, max_age=100, clock=clock).decode(cookie) is None


def test_a_session_expires_and_ends_at_sign_out() -> None:
    clock = Clock()
    codec = SessionCodec(b"s" * 32, max_age=100, clock=clock)
    first, second = (codec.new(hash_key("jp_x"), "key_1") for _ in range(2))
    clock.now += 99
    assert codec.decode(codec.encode(first)) is not None
    codec.end(first)
    assert codec.decode(codec.encode(first)) is None
    assert codec.decode(codec.encode(second)) is not None
    clock.now += 2
    assert codec.decode(codec.encode(second)) is None


def test_csrf_and_sign_in_tokens_belong_to_their_session_and_cookie() -> None:
    clock = Clock()
    codec = SessionCodec(b"s" * 32, max_age=100, clock=clock)
    one, two = (codec.new(hash_key("jp_x"), "key_1") for _ in range(2))
    assert codec.csrf_ok(one, codec.csrf(one))
    assert not codec.csrf_ok(one, codec.csrf(two))
    assert not codec.csrf_ok(one, "")
    nonce, token = codec.signin_nonce()
    assert codec.signin_ok(nonce, token)
    assert codec.signin_nonce(nonce) == (nonce, token)  # kept while fresh
    assert not codec.signin_ok(codec.signin_nonce()[0] + "x", token)
    assert not codec.signin_ok(None, token)
    clock.now += 601
    assert not codec.signin_ok(nonce, token)


def test_the_throttle_refuses_after_the_free_failures_then_forgives() -> None:
    clock = Clock()
    throttle = SignInThrottle(free=3, window=60, clock=clock)
    for _ in range(3):
        assert throttle.retry_after("a") == 0
        throttle.failed("a")
    assert 59 <= throttle.retry_after("a") <= 60
    assert throttle.retry_after("b") == 0
    clock.now += 61
    assert throttle.retry_after("a") == 0
    throttle.failed("a")
    throttle.succeeded("a")
    assert throttle.retry_after("a") == 0


def test_job_filters_are_checked_whole() -> None:
    filters = job_filters(
        MultiDict(
            state="RUNNING", type="demo.progress", label="team=a, env = prod", since="2026-12-01"
        )
    )
    assert filters.state is JobState.RUNNING
    assert filters.labels == {"team": "a", "env": "prod"}
    assert filters.since is not None and filters.since.tzinfo is not None
    for query, field in (
        ({"state": "x"}, "state"),
        ({"size": "1e3"}, "size"),
        ({"size": "٣"}, "size"),
        ({"label": "a=1,a=2"}, "label"),
        ({"until": "2026-13-01"}, "until"),
        ({"type": "x" * 2000}, "type"),
        ({"type": "a\x00"}, "type"),
    ):
        with pytest.raises(BadField) as refused:
            job_filters(MultiDict(query))
        assert refused.value.field == field
    assert after_seq(MultiDict(), "17") == 17
    with pytest.raises(BadField):
        after_seq(MultiDict(after="-1"), None)


def test_dashboard_settings() -> None:
    settings = Settings.from_env({"JOBPLANE_UI_LISTEN": "0.0.0.0:9000"})
    assert settings.ui_address(None) == "0.0.0.0:9000"
    assert Settings.from_env({}).ui_address(None) is None
    assert Settings.from_env({}).ui_address("127.0.0.1:8080") == "127.0.0.1:8080"
    assert Settings.from_env({"JOBPLANE_UI_LISTEN": "off"}).ui_address("x:1") is None
    for env in (
        {"JOBPLANE_UI_LISTEN": "nope"},
        {"JOBPLANE_UI_SECRET": "short"},
        {"JOBPLANE_UI_SESSION_HOURS": "0"},
        {"JOBPLANE_UI_SECURE_COOKIE": "maybe"},
    ):
        with pytest.raises(ConfigError) as refused:
            Settings.from_env(env)
        assert next(iter(env)) in str(refused.value)


def test_the_public_origin_setting_is_checked_and_normalised() -> None:
    settings = Settings.from_env({"JOBPLANE_UI_ORIGIN": "HTTPS://Jobs.Example/"})
    assert settings.ui_origin == "https://jobs.example"
    assert Settings.from_env({}).ui_origin is None
    for bad in ("jobs.example", "ftp://jobs.example", "https://jobs.example/ui", "https://:1"):
        with pytest.raises(ConfigError, match="JOBPLANE_UI_ORIGIN"):
            Settings.from_env({"JOBPLANE_UI_ORIGIN": bad})


def test_the_client_is_the_remote_unless_a_trusted_proxy_forwarded_it() -> None:
    from jobplane.config import parse_networks
    from jobplane.server.dashboard.session import client_address

    proxies = parse_networks("10.0.0.0/8, ::1", name="JOBPLANE_UI_TRUSTED_PROXIES")
    assert client_address("10.1.2.3", ["203.0.113.9"], ()) == "10.1.2.3"
    assert client_address("198.51.100.1", ["203.0.113.9"], proxies) == "198.51.100.1"
    assert client_address("10.1.2.3", ["203.0.113.9"], proxies) == "203.0.113.9"
    # A client's own X-Forwarded-For (left of the proxies' entries) is not believed.
    assert client_address("10.1.2.3", ["1.1.1.1, 203.0.113.9, 10.0.0.2"], proxies) == "203.0.113.9"
    assert client_address("::1", [], proxies) == "::1"
    assert client_address("10.1.2.3", ["nonsense"], proxies) == "10.1.2.3"
    with pytest.raises(ConfigError, match="JOBPLANE_UI_TRUSTED_PROXIES"):
        Settings.from_env({"JOBPLANE_UI_TRUSTED_PROXIES": "10.0.0.0/8,proxy.local"})
    assert Settings.from_env(
        {"JOBPLANE_UI_TRUSTED_PROXIES": " 10.0.0.1 , fd00::/8"}
    ).ui_trusted_proxies == (ipaddress.ip_network("10.0.0.1"), ipaddress.ip_network("fd00::/8"))


def test_an_attempt_is_counted_before_it_is_checked() -> None:
    clock = Clock()
    throttle = SignInThrottle(free=3, window=60, clock=clock)
    assert [throttle.attempt("a") for _ in range(3)] == [0.0] * 3
    assert throttle.attempt("a") > 0
    assert throttle.attempt("b") == 0.0
    throttle.succeeded("b")
    assert throttle.retry_after("b") == 0.0
