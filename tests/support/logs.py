"""Log lines captured at every level, whatever an earlier test configured."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

Lines = list[MutableMapping[str, Any]]


@contextmanager
def capture_every_level() -> Iterator[Lines]:
    """``capture_logs`` with the level filter opened to DEBUG for its span.

    ``jobplane.logs.configure`` (run by any command a test ran in process)
    installs a level-filtering logger class; ``capture_logs`` swaps only the
    processors, so a line below that level would never reach it. The code's
    module logger must also be one not used before (a cached one keeps its
    first configuration): tests patch ``module.log`` with a fresh one.
    """
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with capture_logs() as captured:
            yield captured
    finally:
        structlog.configure(**saved)


@contextmanager
def module_lines(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str) -> Iterator[Lines]:
    """Every line ``module`` writes through its ``log`` in this span, at every level.

    ``module.log`` becomes a logger of ``name`` not used before: one an
    earlier test used is cached (``cache_logger_on_first_use``) and would
    write past the capture.
    """
    monkeypatch.setattr(module, "log", structlog.get_logger(name))
    with capture_every_level() as captured:
        yield captured


#: A command's answer or error as its stderr line says it: the event, the line in
#: text, and the fields of its JSON line (with JOBPLANE_LOG_FORMAT=json).
Answer = tuple[str, str, dict[str, Any]]


#: The answers not said at info.
_ANSWER_LEVELS = {"command.failed": "error", "topology.owner_unrecorded": "warning"}


#: The keys of every JSON line; an answer's own fields are the rest.
_EVERY_LINE = frozenset({"event", "level", "logger", "timestamp"})


def assert_answers(err: str, fmt: str, answers: list[Answer]) -> None:
    """``err`` is the lines of ``answers``: their text with ``fmt`` "console", else
    one JSON object each with its event, a level, a timestamp and its fields, no
    other."""
    if fmt == "console":
        assert err == "".join(f"{text}\n" for _, text, _ in answers)
        return
    lines = [json.loads(line) for line in err.splitlines()]
    assert [line["event"] for line in lines] == [event for event, _, _ in answers]
    for line, (event, _, fields) in zip(lines, answers, strict=True):
        assert line["level"] == _ANSWER_LEVELS.get(event, "info"), event
        assert line["logger"] == "jobplane.cli"
        assert line["timestamp"].endswith("Z")
        given = {k: v for k, v in line.items() if k not in _EVERY_LINE}
        assert given == fields, event
