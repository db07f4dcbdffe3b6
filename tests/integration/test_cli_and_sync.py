"""The `jobplane` command and the synchronous SDK, against a running stack."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

from jobplane.client import Client, JobNotFound, JobState
from jobplane.types import EventType
from tests.support.stack import Stack


async def jobplane(
    stack: Stack,
    *args: str,
    key: str | None = None,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
) -> tuple[int, str, str]:
    env = {
        **os.environ,
        "JOBPLANE_DATABASE_URL": stack.database_url,
        "JOBPLANE_ADDRESS": stack.server.address,
        "JOBPLANE_API_KEY": key or stack.key,
        **(env or {}),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "jobplane",
        *args,
        env=env,
        stdin=asyncio.subprocess.PIPE if stdin is not None else None,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(stdin), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_keys_create_prints_only_the_key(stack: Stack) -> None:
    code, out, _err = await jobplane(stack, "keys", "create", "--tenant", "initech")
    assert code == 0
    key = out.strip()
    assert out == key + "\n"
    assert key.startswith("jp_") and len(key) >= 40
    # The key works, for a new tenant that sees none of acme's jobs.
    await stack.client().submit("demo.echo", {})
    assert (await stack.client(key).list()).jobs == []
    raw = await stack.scalar("SELECT count(*) FROM api_keys WHERE prefix = :p", p=key[:8])
    assert raw == 1
    # Stored as a hash only: the key's bytes are nowhere in the table.
    stored = await stack.scalar(
        "SELECT bool_and(position(convert_to(:k, 'UTF8') in key_hash) = 0) FROM api_keys", k=key
    )
    assert stored is True


async def test_submit_watch_and_json_output(stack: Stack) -> None:
    code, out, _err = await jobplane(
        stack, "submit", "demo.progress", "--payload", '{"steps": 3, "interval_ms": 10}', "--watch"
    )
    assert code == 0, out
    assert "succeeded" in out

    code, out, _err = await jobplane(stack, "submit", "demo.fail", "--watch")
    assert code == 1

    code, out, _err = await jobplane(stack, "list", "--json")
    assert code == 0
    listed = json.loads(out)
    assert sorted(j["type"] for j in listed["jobs"]) == ["demo.fail", "demo.progress"]

    name = (await stack.client().list(type="demo.progress")).jobs[0].name
    code, out, _err = await jobplane(stack, "watch", name, "--json")
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    seqs = [line["seq"] for line in lines if "seq" in line]
    assert seqs == list(range(1, len(seqs) + 1))


async def test_cli_errors_are_clear(stack: Stack) -> None:
    code, _out, err = await jobplane(stack, "submit", "Not A Type")
    assert code == 1
    assert "INVALID_ARGUMENT" in err
    code, _out, err = await jobplane(stack, "submit", "demo.echo", "--payload", "[1, 2]")
    assert code == 2
    code, _out, err = await jobplane(stack, "get", "jobs/x", key="jp_wrong")
    assert code == 1
    assert "UNAUTHENTICATED" in err
    assert (await stack.counts())["jobs"] == 0


async def test_key_with_a_trailing_newline_works(stack: Stack, tmp_path: Path) -> None:
    job = await stack.client(stack.key + "\n").submit("demo.echo", {"n": 1})
    assert (await stack.client(stack.key + "\r\n").get(job.name)).name == job.name
    code, out, err = await jobplane(stack, "get", job.name, key=stack.key + "\n")
    assert code == 0, err
    assert job.name in out
    key_file = tmp_path / "key"
    key_file.write_text(stack.key + "\n")
    code, out, err = await jobplane(
        stack, "get", job.name, "--api-key-file", str(key_file), env={"JOBPLANE_API_KEY": ""}
    )
    assert code == 0, err
    assert job.name in out


async def test_malformed_key_is_one_line_and_exit_2(stack: Stack, tmp_path: Path) -> None:
    bad = stack.key[:10] + "\x07" + stack.key[10:]
    key_file = tmp_path / "key"
    key_file.write_bytes(stack.key.encode() + b"\xff\n")
    for args, key in (
        (("get", "jobs/x"), bad),
        (("get", "jobs/x", "--api-key", bad), None),
        (("list", "--api-key-file", str(key_file)), None),
    ):
        code, out, err = await jobplane(stack, *args, key=key)
        assert code == 2, err
        assert out == ""
        assert len(err.splitlines()) == 1, err
        assert err.startswith("error: the API key is malformed"), err
        assert stack.key not in err
    empty = tmp_path / "empty"
    empty.write_text("\n")
    code, _out, err = await jobplane(stack, "list", "--api-key-file", str(empty))
    assert (code, err) == (2, f"error: no API key in {empty}\n")


async def test_sync_client(stack: Stack) -> None:
    def use() -> None:
        with Client(stack.server.address, stack.key) as client:
            job = client.submit("demo.progress", {"steps": 3, "interval_ms": 10})
            events = list(client.watch(job.name))
            assert [e.seq for e in events] == list(range(1, len(events) + 1))
            assert events[-1].type is EventType.SUCCEEDED
            done = client.wait(job.name, timeout=20)
            assert done.state is JobState.SUCCEEDED
            assert client.get(job.name).result == {"steps": 3}
            try:
                client.get("jobs/0d2b1b7e-9c1f-4c39-8f3a-1ad1e5f1c111")
            except JobNotFound:
                pass
            else:
                raise AssertionError("expected JobNotFound")

    await asyncio.to_thread(use)


async def test_sweep_and_dlq_commands(stack: Stack, tmp_path: Path) -> None:
    from jobplane.envelope import Envelope
    from tests.faults.cluster import topology_toml
    from tests.support.queues import dead_letter

    path = tmp_path / "topology.toml"
    path.write_text(topology_toml(stack.topology))
    env = {"JOBPLANE_AMQP_URL": stack.amqp_url, "JOBPLANE_TOPOLOGY": str(path)}

    code, _out, err = await jobplane(stack, "sweep", "--once", env=env)
    assert code == 0
    assert "leases: 0 requeued, 0 failed" in err

    stray = Envelope(uuid.uuid4(), uuid.uuid4(), stack.tenant_id, "demo.echo")
    await dead_letter(stack.amqp_url, stack.topology, stray)
    code, out, _err = await jobplane(stack, "dlq", "list", "--json", env=env)
    assert code == 0
    listed = [json.loads(line) for line in out.splitlines()]
    assert [m["job"] for m in listed] == [f"jobs/{stray.job_id}"]
    code, _out, _err = await jobplane(stack, "dlq", "purge", env=env)
    assert code == 2  # refuses without --yes
    code, _out, err = await jobplane(stack, "dlq", "purge", "--yes", env=env)
    assert code == 0 and "purged 1" in err
