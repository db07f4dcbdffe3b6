"""`jobplane submit --from-jsonl FILE --at/--in`, and a line's own schedule_time or
schedule_delay: delayed jobs in bulk from the command line (docs/scheduling.md)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from jobplane.types import WaitingCode
from tests.integration.test_cli_and_sync import jobplane
from tests.support.stack import Stack

pytestmark = pytest.mark.stack(worker=False, relay=False)


def _write(tmp_path: Path, *lines: dict[str, object]) -> str:
    path = tmp_path / "jobs.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return str(path)


async def test_in_applies_to_lines_without_a_time_of_their_own(
    stack: Stack, tmp_path: Path
) -> None:
    at = (datetime.now(UTC) + timedelta(days=2)).replace(microsecond=0)
    path = _write(
        tmp_path,
        {"type": "demo.echo", "payload": {"n": 1}},
        {"type": "demo.echo", "payload": {"n": 2}, "schedule_delay": 7200},
        {"type": "demo.echo", "payload": {"n": 3}, "schedule_time": at.isoformat()},
    )
    before = datetime.now(UTC)
    code, out, err = await jobplane(stack, "submit", "--from-jsonl", path, "--in", "1h", "--json")
    assert code == 0, err
    names = [json.loads(line)["name"] for line in out.splitlines()]
    client = stack.client()
    jobs = [await client.get(name) for name in names]
    assert all(job.waiting_code == WaitingCode.SCHEDULED for job in jobs)
    times = [job.schedule_time for job in jobs]
    assert times[0] is not None and times[1] is not None
    assert timedelta(hours=1) <= times[0] - before < timedelta(hours=1, minutes=5)
    assert timedelta(hours=2) <= times[1] - before < timedelta(hours=2, minutes=5)
    assert times[2] == at


async def test_at_applies_to_every_line(stack: Stack, tmp_path: Path) -> None:
    at = (datetime.now(UTC) + timedelta(days=1)).replace(microsecond=0)
    path = _write(tmp_path, {"type": "demo.echo"}, {"type": "demo.echo"})
    code, out, err = await jobplane(
        stack, "submit", "--from-jsonl", path, "--at", at.isoformat(), "--json"
    )
    assert code == 0, err
    client = stack.client()
    for line in out.splitlines():
        assert (await client.get(json.loads(line)["name"])).schedule_time == at


@pytest.mark.parametrize(
    ("line", "flags", "says"),
    [
        ({"type": "demo.echo", "schedule_time": "2030-01-01T09:00:00"}, [], "zone"),
        ({"type": "demo.echo", "schedule_time": "tomorrow"}, [], "RFC 3339"),
        ({"type": "demo.echo", "schedule_delay": "60"}, [], "seconds"),
        ({"type": "demo.echo", "schedule_delay": True}, [], "boolean"),
        (
            {"type": "demo.echo", "schedule_delay": 5, "schedule_time": "2030-01-01T09:00:00Z"},
            [],
            "one of",
        ),
    ],
)
async def test_a_bad_time_sends_nothing(
    stack: Stack, tmp_path: Path, line: dict[str, object], flags: list[str], says: str
) -> None:
    path = _write(tmp_path, {"type": "demo.echo"}, line)
    code, _, err = await jobplane(stack, "submit", "--from-jsonl", path, *flags)
    assert code == 2 and says in err, err
    assert await stack.scalar("SELECT count(*) FROM jobs") == 0
