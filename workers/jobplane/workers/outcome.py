"""What an attempt's end is recorded as: a checked result, or a described failure.

Whatever a handler returns or raises becomes something Postgres accepts: a
result that cannot be stored fails the job with a clear code instead of
failing the write on every retry, and an error's message, code, delay and
traceback are bounded and cleaned here, once.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jobplane.workers.context import JobContext
from jobplane.workers.errors import PermanentError, RetryableError
from jobplane.workers.values import TOO_LARGE, clean_text, json_problem, json_size, safe_str

MAX_ERROR_MESSAGE = 4096
#: The tail of a traceback kept with the failure event.
MAX_TRACEBACK = 8192
#: The longest delay a RetryableError may ask for.
MAX_RETRY_DELAY = 7 * 24 * 3600.0
_CODE = re.compile(r"^[A-Z][A-Z0-9_]{0,63}$")


class Escaped(Exception):
    """A BaseException the handler raised (SystemExit, KeyboardInterrupt,
    GeneratorExit, a CancelledError nobody asked for), carried as an ordinary
    exception: raised in a task, the first two would stop the event loop."""

    def __init__(self, original: BaseException) -> None:
        super().__init__(f"{type(original).__name__}: {safe_str(original)}")
        self.original = original


def raised(error: BaseException | None) -> BaseException | None:
    """What the handler raised, for an interceptor or a log line: an Escaped's original."""
    return error.original if isinstance(error, Escaped) else error


async def invoke(handler: Callable[[JobContext], Any], ctx: JobContext) -> Any:
    """Run ``handler(ctx)`` so that only an Exception or our own cancellation leaves it."""
    try:
        returned = handler(ctx)
        if inspect.isawaitable(returned):
            return await returned
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the runtime stopped the handler
        raise Escaped(exc) from exc
    except Exception:
        raise
    except BaseException as exc:
        raise Escaped(exc) from exc
    raise PermanentError(
        f"the handler returned {type(returned).__name__}, not an awaitable: handlers must be "
        "`async def`",
        code="BAD_HANDLER",
    )


def check_result(result: Any, *, max_bytes: int) -> dict[str, Any] | PermanentError:
    """The result to store, or the error that fails the job instead."""
    if result is None:
        return {}
    if inspect.iscoroutine(result):
        result.close()  # never awaited, and never to be: no "never awaited" warning either
        return PermanentError(
            "the handler returned a coroutine instead of a result (an await is missing)",
            code="BAD_RESULT",
        )
    if not isinstance(result, dict):
        return PermanentError(
            f"the handler returned {type(result).__name__}, not a JSON object", code="BAD_RESULT"
        )
    try:
        problem = json_problem(result, max_bytes=max_bytes)
        size = json_size(result) if problem is None else 0
    except Exception as exc:  # a dict subclass whose methods raise
        problem = f"reading it raised {type(exc).__name__}"
    if problem == TOO_LARGE.format(max_bytes=max_bytes):
        return PermanentError(
            f"the handler's result is {problem} as JSON; at most {max_bytes} are stored",
            code="RESULT_TOO_LARGE",
        )
    if problem is not None:
        return PermanentError(
            clean_text(f"the handler's result cannot be stored as JSON: {problem}", 1024),
            code="BAD_RESULT",
        )
    if size > max_bytes:
        return PermanentError(
            f"the handler's result is {size} bytes as JSON; at most {max_bytes} are stored",
            code="RESULT_TOO_LARGE",
        )
    return result


@dataclass(frozen=True, slots=True)
class Failure:
    """An attempt's error as it is stored."""

    code: str
    message: str
    retryable: bool
    delay: float | None = None  # asked for by a RetryableError; None: the backoff
    traceback: str = ""


def describe(error: BaseException) -> Failure:
    """Code, message, retryability, delay and traceback of a handler's error."""
    original = error.original if isinstance(error, Escaped) else error
    if isinstance(error, PermanentError | RetryableError):
        message = safe_str(error)
        default = type(error).code if _CODE.match(str(type(error).code)) else "HANDLER_FAILED"
        code = _attribute(error, "code")
        code = code if isinstance(code, str) and _CODE.match(code) else default
    else:
        text = safe_str(original)
        message = f"{type(original).__name__}: {text}" if text else type(original).__name__
        code = "HANDLER_ERROR"
    delay = _delay(_attribute(error, "delay")) if isinstance(error, RetryableError) else None
    return Failure(
        code=code,
        message=clean_text(message, MAX_ERROR_MESSAGE),
        retryable=not isinstance(error, PermanentError),
        delay=delay,
        traceback=clean_text(_traceback(original), MAX_TRACEBACK, keep_end=True),
    )


def _attribute(error: BaseException, name: str) -> Any:
    try:
        return getattr(error, name, None)
    except Exception:
        return None


def _delay(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        delay = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if not math.isfinite(delay) or delay < 0:
        return None
    return min(delay, MAX_RETRY_DELAY)


def _traceback(error: BaseException) -> str:
    try:
        return "".join(traceback.format_exception(error))
    except asyncio.CancelledError:
        raise
    except BaseException:
        return ""
