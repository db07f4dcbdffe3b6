"""The Qdrant index in local mode on a temporary path: ids, tenant walls, versions, sharing."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from jobplane.config import Settings
from jobplane.contrib.ingest.embedders import HashingEmbedder
from jobplane.contrib.ingest.index import (
    CollectionMismatch,
    Index,
    IndexUnavailable,
    Point,
    _Client,
    check_collection,
    open_index,
    point_id,
)

EMBED = HashingEmbedder(32)


@pytest.fixture
async def index(tmp_path: Path) -> AsyncIterator[Index]:
    async with open_index(Settings(qdrant_path=tmp_path / "q"), collection="docs") as index:
        yield index


def _points(tenant: str, file: str, texts: list[str], version: str) -> list[Point]:
    return [
        Point(
            point_id(tenant, file, i, "p1"),
            EMBED.embed_one(text),
            {"tenant_id": tenant, "file": file, "chunk_index": i, "text": text, "version": version},
        )
        for i, text in enumerate(texts)
    ]


def test_point_ids_are_uuid5_of_tenant_file_chunk_and_pipeline_version() -> None:
    a = point_id("acme", "notes.txt", 0, "ingest-1")
    assert a == point_id("acme", "notes.txt", 0, "ingest-1")
    assert a.version == 5
    others = {
        point_id("other", "notes.txt", 0, "ingest-1"),
        point_id("acme", "notes.md", 0, "ingest-1"),
        point_id("acme", "notes.txt", 1, "ingest-1"),
        point_id("acme", "notes.txt", 0, "ingest-2"),
        # No separator games: ("a|b", "c") and ("a", "b|c") differ.
        point_id("acme|x", "y", 0, "ingest-1"),
        point_id("acme", "x|y", 0, "ingest-1"),
    }
    assert a not in others and len(others) == 6
    # Pinned: the namespace must never change, or every file's ids would.
    assert a == uuid.UUID(str(a)) and str(point_id("t", "f", 0, "v")) == str(
        uuid.uuid5(uuid.UUID("5b0f3a4e-8f1c-5d2a-9a57-2f6f0c1e7d93"), '["t", "f", 0, "v"]')
    )


async def test_upsert_count_and_tenant_filtered_search(index: Index) -> None:
    await index.ensure_collection(EMBED.dim)
    await index.upsert(_points("acme", "a.txt", ["vector search", "queues"], "v1"))
    await index.upsert(_points("umbrella", "a.txt", ["vector search", "more", "x"], "v1"))
    assert await index.count("acme") == 2
    assert await index.count("umbrella") == 3
    assert await index.count("umbrella", "a.txt") == 3
    assert await index.count("nobody") == 0
    hits = await index.search("acme", EMBED.embed_one("vector search"), 10)
    assert [h.payload["tenant_id"] for h in hits] == ["acme", "acme"]
    assert hits[0].payload["text"] == "vector search"


async def test_upserting_the_same_points_again_changes_nothing(index: Index) -> None:
    await index.ensure_collection(EMBED.dim)
    points = _points("acme", "a.txt", ["one", "two", "three"], "v1")
    await index.upsert(points)
    before = await index.points("acme")
    await index.upsert(points)
    assert await index.points("acme") == before
    assert {h.id for h in before} == {str(p.id) for p in points}


async def test_delete_file_points_keeps_one_version(index: Index) -> None:
    await index.ensure_collection(EMBED.dim)
    await index.upsert(_points("acme", "a.txt", ["1", "2", "3", "4"], "old"))
    await index.upsert(_points("acme", "b.txt", ["1", "2"], "old"))
    # A new version with fewer chunks overwrites chunks 0 and 1 in place ...
    await index.upsert(_points("acme", "a.txt", ["new 1", "new 2"], "new"))
    assert await index.count("acme", "a.txt") == 4
    # ... and then the rest of the old one goes.
    await index.delete_file_points("acme", "a.txt", keep_version="new")
    left = await index.points("acme", "a.txt")
    assert {(h.payload["chunk_index"], h.payload["version"]) for h in left} == {
        (0, "new"),
        (1, "new"),
    }
    assert await index.count("acme", "b.txt") == 2  # another file untouched
    await index.delete_file_points("acme", "a.txt")
    assert await index.count("acme", "a.txt") == 0


async def test_delete_tenant_reaches_every_ingest_collection_only(tmp_path: Path) -> None:
    settings = Settings(qdrant_path=tmp_path / "q")
    async with (
        open_index(settings, collection="one") as one,
        open_index(settings, collection="two") as two,
    ):
        for index in (one, two):
            await index.ensure_collection(EMBED.dim)
            await index.upsert(_points("acme", "a.txt", ["x", "y"], "v"))
            await index.upsert(_points("keep", "a.txt", ["x"], "v"))
        assert await one.delete_tenant("acme") == 4
        assert await one.count("acme") == 0 and await two.count("acme") == 0
        assert await two.count("keep") == 1


async def test_a_collection_of_another_size_is_refused(index: Index) -> None:
    await index.ensure_collection(32)
    with pytest.raises(CollectionMismatch, match="32 dimensions"):
        await index.ensure_collection(64)


async def test_reads_of_a_missing_collection_are_empty(index: Index) -> None:
    assert await index.count("acme") == 0
    assert await index.search("acme", EMBED.embed_one("x"), 3) == []
    await index.delete_file_points("acme", "a.txt")


async def test_indexes_of_one_process_share_the_local_client(tmp_path: Path) -> None:
    settings = Settings(qdrant_path=tmp_path / "q")
    first = open_index(settings, collection="c")
    second = open_index(settings, collection="c")
    await first.ensure_collection(EMBED.dim)
    await first.upsert(_points("acme", "a.txt", ["x"], "v"))
    await first.close()
    assert await second.count("acme") == 1  # still open: the client outlives the first
    await second.close()
    async with open_index(settings, collection="c") as again:
        assert await again.count("acme") == 1  # persisted, and the lock released


async def test_a_local_path_held_elsewhere_is_unavailable(index: Index, tmp_path: Path) -> None:
    await index.ensure_collection(EMBED.dim)
    # Another client of the same path, as another process would have.
    stranger = _Client("elsewhere", Settings(qdrant_path=tmp_path / "q"))
    with pytest.raises(IndexUnavailable, match="open in another process"):
        await stranger.call("get_collections")


async def test_a_server_that_does_not_answer_is_unavailable() -> None:
    settings = Settings(qdrant_url="http://127.0.0.1:9")  # discard port: nothing listens
    async with open_index(settings) as index:
        with pytest.raises(IndexUnavailable):
            await index.count("acme")


@pytest.mark.parametrize("name", ["", "a/b", "-x", "x" * 64, "a b"])
def test_bad_collection_names(name: str) -> None:
    with pytest.raises(ValueError, match="collection"):
        check_collection(name)


async def test_points_need_a_tenant(index: Index) -> None:
    await index.ensure_collection(EMBED.dim)
    with pytest.raises(TypeError, match="tenant_id"):
        await index.upsert([Point(uuid.uuid4(), EMBED.embed_one("x"), {"file": "a"})])


async def test_a_collection_ingestion_did_not_make_is_refused(index: Index) -> None:
    """On a shared Qdrant, a payload's collection cannot name another application's."""
    from qdrant_client.http import models

    await index._client.call(
        "create_collection",
        collection_name="theirs",
        vectors_config=models.VectorParams(size=EMBED.dim, distance=models.Distance.COSINE),
    )
    with pytest.raises(CollectionMismatch, match="not made by ingestion"):
        await index.ensure_collection(EMBED.dim, collection="theirs")
    assert await index.ensure_collection(EMBED.dim, collection="ours") == "ours"
