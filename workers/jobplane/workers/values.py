"""Checks on what handlers hand us, before it reaches Postgres or a client.

A value Postgres refuses (a NUL character, a lone surrogate) or a client
cannot decode (NaN, an integer no double holds, nesting deeper than protobuf
reads) must be refused where it is made: written, it would fail the same way
on every retry and strand the attempt's outcome.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from jobplane.store.rows import dumps

#: What :func:`json_problem` says of a value over its byte budget.
TOO_LARGE = "larger than {max_bytes} bytes"

#: Nesting of objects and arrays in a result or progress data. Protobuf's
#: decoders stop at 100 message levels, and every JSON level costs two.
MAX_JSON_DEPTH = 32


def safe_str(value: object) -> str:
    """``str(value)``, or a placeholder when its ``__str__`` raises."""
    try:
        return str(value)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        return f"<{type(value).__name__} whose str() raised {type(exc).__name__}>"


def qualname(fn: object) -> str:
    """``module.qualname`` of a handler (or of its class), for messages that name it."""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{getattr(fn, '__module__', None) or '?'}.{name}"


def clean_text(text: str, limit: int, *, keep_end: bool = False) -> str:
    """``text`` as Postgres stores it: NUL and lone surrogates escaped, at most ``limit`` chars.

    ``keep_end`` keeps the last ``limit`` characters (a traceback's tail is
    where it failed) instead of the first.
    """
    text = text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) <= limit:
        return text
    return "…" + text[-(limit - 1) :] if keep_end else text[: limit - 1] + "…"


def json_problem(value: Any, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why ``value`` cannot be stored as JSON and read back by every client, or None.

    Walks without recursion and gives up after ``max_bytes`` nodes, so a
    cyclic or maliciously shared structure costs bounded time.
    """
    budget = max_bytes
    stack: list[tuple[Any, str, int]] = [(value, "$", 0)]
    while stack:
        item, path, depth = stack.pop()
        budget -= 1 + (len(item) if isinstance(item, str) else 0)
        if budget < 0:
            return TOO_LARGE.format(max_bytes=max_bytes)
        if item is None or isinstance(item, bool):
            continue
        if isinstance(item, str):
            problem = _text_problem(item)
            if problem:
                return f"{path}: {problem}"
        elif isinstance(item, int):
            try:
                float(item)
            except OverflowError:
                return f"{path}: the integer is too large for a JSON number"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"{path}: {item} is not a finite number"
        elif isinstance(item, dict | list | tuple):
            if depth >= max_depth:
                return f"{path}: nested deeper than {max_depth} levels"
            if isinstance(item, dict):
                for key, child in item.items():
                    if not isinstance(key, str):
                        return f"{path}: key {_short(repr(key))} is not a string"
                    problem = _text_problem(key)
                    if problem:
                        return f"{path}: a key has {problem}"
                    stack.append((child, f"{path}.{_short(key)}", depth + 1))
            else:
                for index, child in enumerate(item):
                    stack.append((child, f"{path}[{index}]", depth + 1))
        else:
            return f"{path}: a {type(item).__name__} is not JSON"
    return None


def json_size(value: Any) -> int:
    """Bytes of ``value`` as stored (after :func:`json_problem` found nothing)."""
    return len(dumps(value).encode())


def _text_problem(text: str) -> str | None:
    if "\x00" in text:
        return "a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "a lone surrogate (not UTF-8)"
    return None


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
