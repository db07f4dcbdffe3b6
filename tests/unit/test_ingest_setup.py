"""The ingest pipeline's setup: its shipped topology, settings, payload checks and lifespans."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from jobplane.config import ConfigError, Settings
from jobplane.contrib.ingest import STAGE_TYPES, Ingest, content_version, registry
from jobplane.contrib.ingest.stages import request_of
from jobplane.topology import TopologyError, load_topology
from jobplane.workers.handlers import PermanentError, Registry, load_registry

BLOB = "blobs/" + "ab" * 32


def test_the_shipped_topology_gives_each_stage_its_own_queue() -> None:
    topology = load_topology(Path("builtin:ingest"))
    pipeline = topology.pipeline("ingest.file")
    assert pipeline is not None and pipeline.version == "ingest-2"
    assert [s.type for s in pipeline.stages] == list(STAGE_TYPES)
    assert [s.queue for s in pipeline.stages] == list(STAGE_TYPES)
    # No queue catches everything: each stage's dispatch reaches one queue only.
    assert all("#" not in q.bindings for q in topology.queues)
    for job_type in (*STAGE_TYPES, "demo.echo", "maintenance.retention"):
        matching = [q.name for q in topology.queues if q.takes(job_type)]
        assert len(matching) == 1, (job_type, matching)


def test_an_unknown_builtin_topology_names_the_known_ones() -> None:
    with pytest.raises(TopologyError, match="ships default, dev, ingest"):
        load_topology(Path("builtin:nope"))


def test_settings() -> None:
    settings = Settings.from_env({})
    assert settings.qdrant_url is None and settings.embedder == "hash"
    assert settings.qdrant_location == Path(".jobplane/qdrant")
    settings = Settings.from_env({"JOBPLANE_DATA_DIR": "/data", "JOBPLANE_QDRANT_API_KEY": "s"})
    assert settings.qdrant_location == Path("/data/qdrant")
    assert "qdrant_api_key" not in repr(settings)
    settings = Settings.from_env({"JOBPLANE_QDRANT_PATH": "/q", "JOBPLANE_EMBEDDER": "fastembed:m"})
    assert settings.qdrant_location == Path("/q") and settings.embedder == "fastembed:m"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"JOBPLANE_QDRANT_URL": "qdrant:6333"}, "http:// or https://"),
        ({"JOBPLANE_EMBEDDER": "openai"}, "JOBPLANE_EMBEDDER must be"),
        ({"JOBPLANE_EMBEDDER": "fastembed:"}, "JOBPLANE_EMBEDDER must be"),
    ],
)
def test_bad_settings(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Settings.from_env(env)


def test_a_payload_with_defaults() -> None:
    request = request_of({"blob": BLOB, "file": "a.txt"})
    assert (request.chunk_size, request.chunk_overlap) == (1000, 200)
    assert request.collection == "jobplane_ingest" and request.digest == "ab" * 32
    small = request_of({"blob": BLOB, "file": "a.txt", "chunk_size": 100})
    assert small.chunk_overlap == 50  # the default overlap, within half a small size


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"file": "a"}, "blob must be"),
        ({"blob": "blobs/xyz", "file": "a"}, "blob: "),
        ({"blob": BLOB}, "file must be"),
        ({"blob": BLOB, "file": "  "}, "file must be"),
        ({"blob": BLOB, "file": "a", "collection": "a/b"}, "collection: "),
        ({"blob": BLOB, "file": "a", "chunk_size": 8}, "chunk_size must be"),
        ({"blob": BLOB, "file": "a", "chunk_overlap": 900}, "chunk_overlap must be"),
        ({"blob": BLOB, "file": "a", "chunk_size": "big"}, "chunk_size must be an integer"),
        ({"blob": BLOB, "file": "a", "content_type": 7}, "content_type must be"),
        ({"blob": BLOB, "file": "a", "path": "/etc"}, "unknown payload keys"),
    ],
)
def test_a_bad_payload_fails_permanently(payload: dict[str, Any], message: str) -> None:
    with pytest.raises(PermanentError, match=message) as caught:
        request_of(payload)
    assert caught.value.code == "BAD_PAYLOAD"


def test_the_content_version_changes_with_what_makes_the_points() -> None:
    base: dict[str, Any] = {
        "digest": "d",
        "pipeline_version": "ingest-1",
        "chunk_size": 1000,
        "chunk_overlap": 200,
        "embedder": "hash:v1:384",
    }
    version = content_version(**base)
    assert version == content_version(**base) and len(version) == 32
    for key, other in [
        ("digest", "e"),
        ("pipeline_version", "ingest-2"),
        ("chunk_size", 999),
        ("chunk_overlap", 0),
        ("embedder", "fastembed:x"),
    ]:
        assert content_version(**{**base, key: other}) != version


def test_the_registry_loads_as_handlers_spec() -> None:
    loaded = load_registry("jobplane.contrib.ingest:registry")
    assert loaded is registry and list(loaded) == sorted(STAGE_TYPES)
    assert len(loaded.lifespans) == 1


async def test_lifespans_survive_a_merge_and_close_what_was_opened(tmp_path: Path) -> None:
    entered: list[str] = []

    @contextlib.asynccontextmanager
    async def life() -> AsyncIterator[None]:
        entered.append("in")
        yield
        entered.append("out")

    mine = Registry()
    mine.lifespan(life)
    ingest = Ingest(Settings(qdrant_path=tmp_path / "q"))
    merged = mine.merge(ingest.registry)
    assert merged.lifespans == (life, ingest.running)
    async with contextlib.AsyncExitStack() as stack:
        for factory in merged.lifespans:
            await stack.enter_async_context(factory())
        index = await ingest.index()
        await index.ensure_collection(8)
        assert entered == ["in"]
    assert entered == ["in", "out"]
    assert ingest._index is None  # closed with the lifespan; opened again on next use


@pytest.mark.parametrize("queue", ["ingest.parse", "ingest.chunk", "ingest.embed", "ingest.index"])
def test_every_stage_rides_out_minutes_of_outage(queue: str) -> None:
    """A retryable error (object store or Qdrant down) keeps a stage going for at
    least two minutes of backoff, at the least jitter, before its attempts are spent."""
    from jobplane.workers.retry import retry_delay

    topology = load_topology(Path("builtin:ingest"))
    spec = topology.queue(queue)
    least = sum(retry_delay(topology, queue, a) for a in range(1, spec.max_attempts))
    assert least >= 120, (queue, least)
