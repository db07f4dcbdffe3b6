"""`jobplane schedules ...` and the blocking client's schedule calls, against a stack."""

from __future__ import annotations

import asyncio
import json

import pytest

from jobplane.client import Client, ScheduleNotFound
from jobplane.schedule_types import SCHEDULE_LABEL
from tests.integration.test_cli_and_sync import jobplane
from tests.support.stack import Stack

pytestmark = pytest.mark.stack(worker=False, relay=False)


async def test_the_schedules_commands(stack: Stack) -> None:
    code, out, err = await jobplane(
        stack,
        "schedules",
        "create",
        "demo.echo",
        "--id",
        "hourly",
        "--cron",
        "@hourly",
        "--time-zone",
        "America/New_York",
        "--payload",
        '{"a": 1}',
        "--label",
        "team=bi",
        "--json",
    )
    assert code == 0, err
    made = json.loads(out)
    assert made["name"] == "schedules/hourly"
    assert made["spec"]["cron"] == "@hourly"
    assert made["template"]["labels"] == {"team": "bi"}
    # A cron schedule given an interval too: refused on the field, nothing changed.
    code, _, err = await jobplane(stack, "schedules", "update", "hourly", "--interval", "30")
    assert code == 1 and "cron" in err
    code, out, _ = await jobplane(stack, "schedules", "update", "hourly", "--payload", '{"a": 2}')
    assert code == 0 and "schedules/hourly" in out
    code, out, _ = await jobplane(stack, "schedules", "pause", "hourly")
    assert code == 0 and "paused" in out
    code, out, _ = await jobplane(stack, "schedules", "trigger", "hourly", "--json")
    assert code == 0
    job = json.loads(out)
    assert job["labels"][SCHEDULE_LABEL] == "schedules/hourly"
    code, out, _ = await jobplane(stack, "schedules", "resume", "hourly")
    assert code == 0 and "next " in out
    code, out, _ = await jobplane(stack, "schedules", "get", "hourly")
    assert code == 0 and job["name"] in out
    code, out, _ = await jobplane(stack, "schedules", "list")
    assert code == 0 and out.count("schedules/") == 1
    code, _, _ = await jobplane(stack, "schedules", "delete", "hourly")
    assert code == 0
    code, _, err = await jobplane(stack, "schedules", "get", "hourly")
    assert code == 1 and "not found" in err


async def test_the_blocking_client_schedule_calls(stack: Stack) -> None:
    def use() -> None:
        with Client(stack.server.address, stack.key) as client:
            made = client.create_schedule("demo.echo", {"b": 1}, interval=3600)
            assert client.get_schedule(made).template.payload == {"b": 1}
            assert [s.name for s in client.iter_schedules()] == [made.name]
            assert client.update_schedule(made, jitter=5).spec.jitter_seconds == 5
            assert client.pause_schedule(made).paused
            job = client.trigger_schedule(made)
            assert job.labels[SCHEDULE_LABEL] == made.name
            assert not client.resume_schedule(made).paused
            client.delete_schedule(made)
            with pytest.raises(ScheduleNotFound):
                client.get_schedule(made)

    await asyncio.to_thread(use)


async def test_setting_a_horizon_installs_the_retention_schedule(stack: Stack) -> None:
    code, _, err = await jobplane(stack, "tenants", "set-retention", "acme", "30")
    assert code == 0, err
    assert "schedules/jobplane-retention" in err
    schedule = await stack.client().get_schedule("jobplane-retention")
    assert schedule.template.type == "maintenance.retention"
    code, _, err = await jobplane(stack, "tenants", "set-retention", "acme", "none")
    assert code == 0, err
    with pytest.raises(ScheduleNotFound):
        await stack.client().get_schedule("jobplane-retention")
