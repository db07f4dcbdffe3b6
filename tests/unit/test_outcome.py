"""What a handler hands back, checked and described before anything is written."""

from __future__ import annotations

import asyncio
import gc
import math
from typing import Any

import pytest

from jobplane.workers.handlers import JobContext, PermanentError, RetryableError
from jobplane.workers.outcome import (
    MAX_RETRY_DELAY,
    MAX_TRACEBACK,
    Escaped,
    check_result,
    describe,
    invoke,
)
from jobplane.workers.values import MAX_JSON_DEPTH, clean_text, json_problem
from tests.support.attempts import ProgressSink, progress_context


def nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"d": value}
    return value


@pytest.mark.parametrize(
    "value",
    [
        {},
        {"a": [1, 2.5, None, True, "x", {"b": ()}]},
        {"big": 2**63, "neg": -1e300, "unicode": "héllo ☃ 😀"},
        nested(MAX_JSON_DEPTH),
    ],
)
def test_storable_json_passes(value: Any) -> None:
    assert json_problem(value, max_bytes=10_000) is None


def _cyclic() -> dict[str, Any]:
    value: dict[str, Any] = {}
    value["again"] = value
    return value


def _shared() -> list[Any]:
    # Small in memory, 10^9 nodes when walked: the budget stops the walk.
    row = [0] * 1000
    table = [row] * 1000
    return [table] * 1000


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"x": math.nan}, "$.x: nan is not a finite number"),
        ({"x": [math.inf]}, "$.x[0]: inf is not a finite number"),
        ({"x": "a\x00"}, "$.x: a NUL character"),
        ({"a\x00": 1}, "$: a key has a NUL character"),
        ({"x": "\udc80"}, "$.x: a lone surrogate (not UTF-8)"),
        ({1: 2}, "$: key 1 is not a string"),
        ({"s": {1}}, "$.s: a set is not JSON"),
        ({"b": b""}, "$.b: a bytes is not JSON"),
        ({"n": 10**400}, "$.n: the integer is too large for a JSON number"),
        (nested(MAX_JSON_DEPTH + 1), f"nested deeper than {MAX_JSON_DEPTH} levels"),
        (_cyclic(), f"nested deeper than {MAX_JSON_DEPTH} levels"),
        ({"x": "a" * 20_000}, "larger than 10000 bytes"),
        ({"rows": _shared()}, "larger than 10000 bytes"),
    ],
)
def test_unstorable_json_is_named_with_its_path(value: Any, problem: str) -> None:
    found = json_problem(value, max_bytes=10_000)
    assert found is not None and problem in found


def test_clean_text_escapes_what_postgres_refuses_and_bounds_it() -> None:
    assert clean_text("a\x00b\ud800c", 100) == "a\\x00b\\ud800c"
    assert clean_text("abcdef", 4) == "abc…"
    assert clean_text("abcdef", 4, keep_end=True) == "…def"
    assert clean_text("abc", 3) == "abc"


def test_a_result_is_checked_and_none_is_empty() -> None:
    assert check_result(None, max_bytes=100) == {}
    assert check_result({"a": 1}, max_bytes=100) == {"a": 1}
    too_big = check_result({"a": "x" * 200}, max_bytes=100)
    assert isinstance(too_big, PermanentError) and too_big.code == "RESULT_TOO_LARGE"
    exact = check_result({"a": "é" * 60}, max_bytes=100)  # 60 chars, 120 bytes as stored
    assert isinstance(exact, PermanentError) and exact.code == "RESULT_TOO_LARGE"
    wrong = check_result([1], max_bytes=100)
    assert isinstance(wrong, PermanentError) and wrong.code == "BAD_RESULT"


async def test_a_returned_coroutine_is_closed_not_left_to_warn() -> None:
    async def inner() -> dict[str, Any]:
        return {}

    error = check_result(inner(), max_bytes=100)
    assert isinstance(error, PermanentError) and "await is missing" in str(error)
    gc.collect()  # an unclosed coroutine would warn "never awaited" here (an error in tests)


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


def _throw(error: BaseException) -> None:
    raise error


def _raised(error: BaseException) -> BaseException:
    try:
        _throw(error)
    except BaseException as exc:
        return exc
    raise AssertionError("not raised")


def test_errors_are_described_with_clean_codes_messages_and_delays() -> None:
    plain = describe(_raised(ValueError("bad\x00")))
    assert (plain.code, plain.retryable) == ("HANDLER_ERROR", True)
    assert plain.message == "ValueError: bad\\x00"
    assert plain.traceback.startswith("Traceback") and "ValueError: bad" in plain.traceback
    assert describe(_raised(KeyError())).message == "KeyError"
    assert "str() raised RuntimeError" in describe(_raised(Unprintable())).message

    assert describe(PermanentError("x", code="MY_CODE")).code == "MY_CODE"
    assert describe(PermanentError("x", code="lower")).code == "HANDLER_FAILED"
    assert describe(PermanentError("x", code="A" * 65)).code == "HANDLER_FAILED"
    assert describe(PermanentError("x")).retryable is False
    for delay, expected in [
        (5, 5.0),
        (None, None),
        (math.nan, None),
        (-1, None),
        ("soon", None),
        (True, None),
        (1e300, MAX_RETRY_DELAY),
    ]:
        assert describe(RetryableError("x", delay=delay)).delay == expected  # type: ignore[arg-type]

    escaped = describe(Escaped(_raised(SystemExit(3))))
    assert escaped.message == "SystemExit: 3" and escaped.code == "HANDLER_ERROR"
    assert "SystemExit: 3" in escaped.traceback


def test_a_traceback_keeps_its_last_bytes() -> None:
    def down(n: int) -> int:
        return down(n + 1) + 1

    try:
        down(0)
    except RecursionError as exc:
        error = exc
    failure = describe(error)
    assert len(failure.traceback) <= MAX_TRACEBACK
    assert failure.traceback.rstrip().endswith("RecursionError: maximum recursion depth exceeded")

    # A traceback longer than the bound (the one above is folded short): cut at its start.
    long = describe(_raised(ValueError("x" * MAX_TRACEBACK + " the end")))
    assert len(long.traceback) <= MAX_TRACEBACK
    assert long.traceback.startswith("…") and long.traceback.rstrip().endswith("x the end")


def context() -> tuple[JobContext, ProgressSink]:
    return progress_context(max_attempts=1)


async def test_invoke_turns_what_would_stop_the_loop_into_an_error() -> None:
    ctx, _sink = context()
    for raised in (SystemExit(1), KeyboardInterrupt(), GeneratorExit(), asyncio.CancelledError()):

        async def handler(ctx: JobContext, raised: BaseException = raised) -> dict[str, Any]:
            raise raised

        with pytest.raises(Escaped) as caught:
            await asyncio.create_task(invoke(handler, ctx))
        assert caught.value.original is raised

    with pytest.raises(PermanentError, match="not an awaitable") as bad:
        await invoke(lambda ctx: {}, ctx)
    assert bad.value.code == "BAD_HANDLER"


async def test_invoke_lets_the_runtime_cancel_the_handler() -> None:
    ctx, _sink = context()
    started = asyncio.Event()

    async def handler(ctx: JobContext) -> dict[str, Any]:
        started.set()
        await asyncio.sleep(60)
        return {}

    task = asyncio.create_task(invoke(handler, ctx))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_progress_reports_are_checked_and_cleaned() -> None:
    ctx, sink = context()
    await ctx.progress(0.5, "a\x00b", {"k": [1, "v"]})
    await ctx.progress(7, "x" * 10_000)
    assert [u.progress for u in sink.updates] == [0.5, 1.0]
    assert sink.updates[0].message == "a\\x00b"
    assert len(sink.updates[1].message) == 4096
    with pytest.raises(ValueError, match="finite"):
        await ctx.progress(math.nan)
    with pytest.raises(ValueError, match=r"\$\.k: nan is not a finite number"):
        await ctx.progress(0.5, "", {"k": math.nan})
    with pytest.raises(ValueError, match="larger than"):
        await ctx.progress(0.5, "", {"k": "x" * 70_000})
    with pytest.raises(TypeError, match="must be a dict"):
        await ctx.progress(0.5, "", [1])  # type: ignore[arg-type]
    assert len(sink.updates) == 2


class _Raising(dict[str, Any]):
    """A result whose reading raises (a dict subclass with its own methods)."""

    def items(self) -> Any:
        raise RuntimeError("no")

    def keys(self) -> Any:
        raise RuntimeError("no")

    def __iter__(self) -> Any:
        raise RuntimeError("no")


class _Coded(RetryableError):
    """An error whose code and delay cannot even be read."""

    @property
    def code(self) -> str:
        raise RuntimeError("no")

    @code.setter
    def code(self, value: str) -> None:
        pass

    @property
    def delay(self) -> float:
        raise RuntimeError("no")

    @delay.setter
    def delay(self, value: float | None) -> None:
        pass


def test_the_edges_of_a_result_and_an_error() -> None:
    # A result of exactly the limit is stored; one byte more is not.
    exact = {"a": "x" * 92}  # {"a": "x…x"} is 100 bytes
    assert check_result(exact, max_bytes=100) == exact
    over = check_result({"a": "x" * 93}, max_bytes=100)
    assert isinstance(over, PermanentError) and over.code == "RESULT_TOO_LARGE"
    assert str(over) == "the handler's result is 101 bytes as JSON; at most 100 are stored"
    raising = check_result(_Raising(a=1), max_bytes=100)
    assert isinstance(raising, PermanentError) and raising.code == "BAD_RESULT"
    assert (
        str(raising)
        == "the handler's result cannot be stored as JSON: reading it raised RuntimeError"
    )

    assert describe(RetryableError("x", delay=0)).delay == 0.0  # now, not the backoff
    assert describe(RetryableError("x", delay=MAX_RETRY_DELAY)).delay == MAX_RETRY_DELAY
    unreadable = describe(_Coded("x"))
    assert (unreadable.code, unreadable.delay, unreadable.retryable) == (
        "HANDLER_FAILED",
        None,
        True,
    )
