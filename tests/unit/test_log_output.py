"""Logs go to the stderr of the moment a line is written, not of the moment
logging was configured: a program that swaps (and closes) stderr keeps its logs."""

from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator

import pytest
import structlog

from jobplane.logs import configure


@pytest.fixture
def restored() -> Iterator[None]:
    saved = sys.stderr
    yield
    sys.stderr = saved
    configure("warning")


@pytest.mark.usefixtures("restored")
def test_lines_follow_a_replaced_stderr() -> None:
    first = io.StringIO()
    sys.stderr = first
    configure("info")
    structlog.get_logger("t").warning("first.line")
    first.close()  # as a test runner's capture of one test is
    second = io.StringIO()
    sys.stderr = second
    structlog.get_logger("t").warning("second.line", n=2)
    logging.getLogger("aio_pika").warning("from the stdlib")
    assert "second.line" in second.getvalue()
    assert "n=2" in second.getvalue()
