"""``--handlers module:registry``: importing the user's registry, with one-line errors.

What ``jobplane worker`` and ``jobplane dev`` load; every way it can go
wrong is a :class:`HandlersError` whose message names the spec and the
user's own line, not ours.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any

from jobplane.workers.registry import Registry
from jobplane.workers.values import safe_str


class HandlersError(ValueError):
    """A ``--handlers`` spec that cannot be loaded; the message is one line for people."""


def load_registry(spec: str) -> Registry:
    """Import ``package.module:attribute`` and check it is a :class:`Registry`.

    The current directory comes first on the import path, as with
    ``celery -A``: ``jobplane worker --handlers jobs:registry`` finds
    ``./jobs.py``. Every way this can go wrong raises :class:`HandlersError`
    with a one-line message.
    """
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise HandlersError(
            f"--handlers must look like module:registry (e.g. myapp.jobs:registry), got {spec!r}"
        )
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise HandlersError(
                f"no module named {exc.name!r} (--handlers {spec}; looked in {cwd} "
                "and on the Python path)"
            ) from None
        raise HandlersError(f"importing {module_name!r} failed: {_one_line(exc)}") from None
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # whatever the module raises at import, even SystemExit
        raise HandlersError(f"importing {module_name!r} failed: {_one_line(exc)}") from None
    found: Any = module
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except Exception:
            registries = sorted(n for n, v in vars(module).items() if isinstance(v, Registry))
            hint = f"; its registries: {', '.join(registries)}" if registries else ""
            raise HandlersError(
                f"module {module_name!r} has no attribute {attribute!r}{hint}"
            ) from None
    if not isinstance(found, Registry):
        raise HandlersError(f"{spec} is a {type(found).__name__}, not a jobplane.workers.Registry")
    if not len(found):
        raise HandlersError(f"{spec} has no handlers registered")
    return found


def _one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` and where it was raised."""
    lines = safe_str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{text} ({exc.filename}, line {exc.lineno})"
    # The user's line, not ours or importlib's (e.g. the decorator that
    # refused a plain function).
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(("<frozen", ours))
    ]
    if frames:
        return f"{text} (at {frames[-1].filename}:{frames[-1].lineno})"
    return text
