"""A handler's progress reports: what ``ctx.progress`` accepts, refuses and queues."""

from __future__ import annotations

import math
from typing import Any

import pytest

from jobplane.testing import run_handler
from jobplane.workers import JobContext, SyncJobContext
from jobplane.workers.context import MAX_PROGRESS_DATA_BYTES
from tests.support.attempts import ProgressSink, progress_context


def context() -> tuple[JobContext, ProgressSink]:
    return progress_context()


async def test_progress_is_queued_clamped_cut_and_with_a_copy_of_its_data() -> None:
    ctx, sink = context()
    data: dict[str, Any] = {"rows": 3}
    await ctx.progress(0.25, "quarter", data)
    data["rows"] = 4  # the report keeps what was passed then
    await ctx.progress(-2, "x" * 5000)
    await ctx.progress(7)
    assert [(u.progress, u.message, u.data) for u in sink.updates] == [
        (0.25, "quarter", {"rows": 3}),
        (0.0, "x" * 4095 + "…", {}),
        (1.0, "", {}),
    ]
    assert all(type(u.progress) is float for u in sink.updates)


async def test_a_message_is_stored_as_text_postgres_takes() -> None:
    ctx, sink = context()
    await ctx.progress(0.5, "a\x00b")
    await ctx.progress(0.5, 42)  # type: ignore[arg-type]
    assert [u.message for u in sink.updates] == ["a\\x00b", "42"]


@pytest.mark.parametrize(
    ("fraction", "data", "error", "message"),
    [
        (math.nan, None, ValueError, "progress fraction must be a finite number, got nan"),
        (math.inf, None, ValueError, "progress fraction must be a finite number, got inf"),
        ("0.5", None, ValueError, "progress fraction must be a finite number, got '0.5'"),
        (0.5, [1], TypeError, "progress data must be a dict, got list"),
        (
            0.5,
            {"x": math.nan},
            ValueError,
            "progress data cannot be stored: $.x: nan is not a finite number",
        ),
        (
            0.5,
            # Few JSON nodes, many bytes: refused for its stored size.
            {"n": [10**9] * (MAX_PROGRESS_DATA_BYTES // 10)},
            ValueError,
            f"progress data cannot be stored: larger than {MAX_PROGRESS_DATA_BYTES} bytes",
        ),
        (
            0.5,
            {"s": "y" * MAX_PROGRESS_DATA_BYTES},
            ValueError,
            f"progress data cannot be stored: larger than {MAX_PROGRESS_DATA_BYTES} bytes",
        ),
    ],
    ids=["nan", "inf", "text", "list-data", "nan-data", "many-numbers", "long-text"],
)
async def test_a_report_that_cannot_be_stored_is_refused_and_not_queued(
    fraction: Any, data: Any, error: type[Exception], message: str
) -> None:
    ctx, sink = context()
    with pytest.raises(error) as refused:
        await ctx.progress(fraction, "m", data)
    assert str(refused.value) == message
    assert sink.updates == []


async def test_data_of_the_limit_exactly_is_kept() -> None:
    ctx, sink = context()
    # {"s":"..."} is 8 bytes around the text: stored, this is the limit exactly.
    data = {"s": "y" * (MAX_PROGRESS_DATA_BYTES - 8)}
    await ctx.progress(0.5, "", data)
    assert [u.data for u in sink.updates] == [data]


async def test_a_plain_handler_reports_progress_with_its_data() -> None:
    def plain(ctx: SyncJobContext) -> dict[str, Any]:
        ctx.progress(0.5, "half", {"rows": 3})
        ctx.progress(0.75)
        return {}

    outcome = await run_handler(plain)
    assert outcome.status == "succeeded", outcome.error
    assert [(p.progress, p.message, p.data) for p in outcome.progress] == [
        (0.5, "half", {"rows": 3}),
        (0.75, "", {}),
    ]
