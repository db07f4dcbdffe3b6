"""Checks of request fields the servicers make before anything is written, at
their bounds: a SubmitJob's concurrency key, limit and mode, and ListJobs'
page tokens (INVALID_ARGUMENT naming the field, with the message callers see).
"""

from __future__ import annotations

import base64
import uuid
from datetime import UTC, datetime, timedelta, timezone

import pytest

from jobplane.errors import InvalidArgument
from jobplane.server.key_requests import MAX_KEY_CHARS, MAX_LIMIT, check_concurrency
from jobplane.server.page_tokens import (
    MAX_PAGE_TOKEN_LENGTH,
    decode_token,
    encode_token,
    extra_filters,
    filter_key,
)
from jobplane.store.jobs import ListCursor
from jobplane.types import ConcurrencyMode, JobState


def _refused(call: object, *args: object) -> tuple[str | None, str]:
    with pytest.raises(InvalidArgument) as refused:
        call(*args)  # type: ignore[operator]
    return refused.value.field, refused.value.message


def test_a_concurrency_key_up_to_its_bounds_is_taken() -> None:
    assert check_concurrency("", 0, 0) == (None, 0, ConcurrencyMode.QUEUE)
    assert check_concurrency("k", 0, 0) == ("k", 1, ConcurrencyMode.QUEUE)  # 0 means 1
    assert check_concurrency("k", 1, 1) == ("k", 1, ConcurrencyMode.QUEUE)
    assert check_concurrency("k", MAX_LIMIT, 2) == ("k", MAX_LIMIT, ConcurrencyMode.REJECT)
    longest = "k" * MAX_KEY_CHARS
    assert check_concurrency(longest, 3, 0) == (longest, 3, ConcurrencyMode.QUEUE)
    # Spaces inside, and characters past the C1 controls, are a key's own.
    assert check_concurrency(" a b ", 0, 0)[0] == " a b "
    assert check_concurrency("\xa1k", 0, 0)[0] == "\xa1k"


def test_a_concurrency_key_past_its_bounds_is_refused_on_its_field() -> None:
    key_field, limit_field, mode_field = "concurrency_key", "concurrency_limit", "concurrency_mode"
    assert _refused(check_concurrency, "k", 0, 3) == (mode_field, "unknown concurrency_mode 3")
    assert _refused(check_concurrency, "", 0, -1) == (mode_field, "unknown concurrency_mode -1")
    assert _refused(check_concurrency, "", 5, 0) == (
        limit_field,
        "concurrency_limit needs a concurrency_key",
    )
    for mode in (1, 2):
        assert _refused(check_concurrency, "", 0, mode) == (
            mode_field,
            "concurrency_mode needs a concurrency_key",
        )
    assert _refused(check_concurrency, "k" * (MAX_KEY_CHARS + 1), 0, 0) == (
        key_field,
        f"concurrency_key is longer than {MAX_KEY_CHARS} characters",
    )
    for control in ("\x00", "\x1f", "\x7f", "\x9f"):
        assert _refused(check_concurrency, f"a{control}b", 0, 0) == (
            key_field,
            "concurrency_key has control characters",
        )
    for blank in (" ", "\u3000"):
        assert _refused(check_concurrency, blank, 0, 0) == (key_field, "concurrency_key is blank")
    for limit in (-1, MAX_LIMIT + 1):
        assert _refused(check_concurrency, "k", limit, 0) == (
            limit_field,
            f"concurrency_limit must be 1 to {MAX_LIMIT} (0 means 1)",
        )


NOT_OURS = ("page_token", "page_token is not a token this server created")


def test_a_page_token_holds_its_cursor_and_its_filters() -> None:
    cursor = ListCursor(datetime(2026, 5, 1, 12, 0, 0, 123456, tzinfo=UTC), uuid.uuid4())
    filters = filter_key(JobState.QUEUED, "demo.echo")
    token = encode_token(cursor, filters)
    assert "=" not in token
    assert decode_token(token, filters) == cursor
    # A time in another zone is the same instant, read back in UTC.
    east = timezone(timedelta(hours=5))
    shifted = decode_token(
        encode_token(ListCursor(cursor.create_time.astimezone(east), cursor.job_id), filters),
        filters,
    )
    assert shifted == cursor and shifted.create_time.tzinfo is UTC
    assert _refused(decode_token, token, filter_key(None, "demo.echo")) == (
        "page_token",
        "page_token was created for other filters; keep state and type the same",
    )


def test_a_filter_key_tells_each_filter_apart() -> None:
    keys = {
        filter_key(None, ""),
        filter_key(JobState.QUEUED, ""),
        filter_key(None, "demo.echo"),
        filter_key(None, "", "x"),
        filter_key(None, "", extra_filters({"a": "1"}, None, None)),
        filter_key(None, "", extra_filters(None, None, None, waiting_code="UNROUTABLE")),
        filter_key(None, "", extra_filters(None, None, None, parent="jobs/p")),
    }
    assert len(keys) == 7 and all(len(k) == 16 for k in keys)
    # Lists without the later filters keep the tokens they had.
    assert extra_filters(None, None, None) == ""
    assert filter_key(None, "", "") == filter_key(None, "")
    moment = datetime(2026, 1, 1, tzinfo=UTC)
    assert extra_filters({"b": "2", "a": "1"}, moment, None) == (
        '[[["a", "1"], ["b", "2"]], "2026-01-01T00:00:00+00:00", ""]'
    )
    assert extra_filters(None, None, moment, parent="jobs/p") == (
        '[[], "", "2026-01-01T00:00:00+00:00", "", "jobs/p"]'
    )


def test_a_token_of_the_longest_length_is_read_and_one_longer_refused() -> None:
    cursor = ListCursor(datetime(2026, 5, 1, tzinfo=UTC), uuid.uuid4())
    # The filter text is the token's only free length: grow it to the bound.
    filters = ""
    while len(encode_token(cursor, filters)) < MAX_PAGE_TOKEN_LENGTH:
        filters += "f"
    token = encode_token(cursor, filters)
    assert len(token) == MAX_PAGE_TOKEN_LENGTH
    assert decode_token(token, filters) == cursor
    longer = encode_token(cursor, filters + "ff")
    assert len(longer) > MAX_PAGE_TOKEN_LENGTH
    assert _refused(decode_token, longer, filters + "ff") == NOT_OURS


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        b'{"t": "2026-05-01T00:00:00+00:00", "i": "x", "f": ""}',
        b'{"t": "2026-05-01T00:00:00", "i": "00000000-0000-0000-0000-000000000001", "f": ""}',
        b'{"t": 1, "i": "00000000-0000-0000-0000-000000000001", "f": ""}',
        b'{"t": "2026-05-01T00:00:00+00:00", "i": "00000000-0000-0000-0000-000000000001"}',
        b'{"t": "0001-01-01T00:00:00+01:00", "i": "00000000-0000-0000-0000-000000000001", "f": ""}',
    ],
    ids=[
        "not-json",
        "not-an-object",
        "bad-id",
        "no-zone",
        "time-not-text",
        "no-filters",
        "before-year-1",
    ],
)
def test_anything_else_is_not_a_token(raw: bytes) -> None:
    token = base64.urlsafe_b64encode(raw).decode().rstrip("=")
    assert _refused(decode_token, token, "") == NOT_OURS
