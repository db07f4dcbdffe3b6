"""The hashing embedder: deterministic, unit length, near for shared words; embedder loading."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobplane.contrib.ingest.embedders import (
    Embedder,
    EmbedderUnavailable,
    HashingEmbedder,
    check_embedder,
    load_embedder,
)


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def test_same_text_same_vector_and_a_fixed_reference() -> None:
    one, two = HashingEmbedder(), HashingEmbedder()
    vector = one.embed_one("Queues deliver jobs to workers")
    assert vector == two.embed_one("Queues deliver jobs to workers")
    assert len(vector) == one.dim == 384
    # Pinned: a change of the hashing must come with a new name (and so new
    # point versions), never silently.
    assert one.name == "hash:v1:384"
    nonzero = [(i, round(v, 6)) for i, v in enumerate(vector) if v]
    assert len(nonzero) == 31
    assert nonzero[:4] == [(23, 0.147442), (25, -0.147442), (32, 0.147442), (33, -0.147442)]


@given(st.text(max_size=500))
def test_vectors_have_unit_length(text: str) -> None:
    vector = HashingEmbedder(64).embed_one(text)
    assert math.isclose(math.fsum(v * v for v in vector), 1.0, rel_tol=1e-9)


def test_shared_words_are_nearer_than_none() -> None:
    e = HashingEmbedder()
    query = e.embed_one("tenant filtered vector search")
    near = e.embed_one("a search over vectors, filtered by tenant")
    far = e.embed_one("postgres leases and outbox relays")
    assert _cos(query, near) > _cos(query, far) + 0.2


def test_case_does_not_matter() -> None:
    e = HashingEmbedder()
    assert e.embed_one("Qdrant Points") == e.embed_one("qdrant points")


def test_a_text_without_words_still_has_a_unit_vector() -> None:
    vector = HashingEmbedder(16).embed_one("  ... !!")
    assert vector == [1.0] + [0.0] * 15


def test_the_protocol() -> None:
    assert isinstance(HashingEmbedder(), Embedder)
    assert isinstance(load_embedder("hash"), HashingEmbedder)


def test_a_model_whose_library_is_missing_is_refused_before_loading() -> None:
    try:
        import fastembed  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        with pytest.raises(EmbedderUnavailable, match="pip install fastembed"):
            check_embedder("fastembed:BAAI/bge-small-en-v1.5")
    else:  # pragma: no cover - fastembed is not a test dependency
        check_embedder("fastembed:BAAI/bge-small-en-v1.5")


@pytest.mark.parametrize("dim", [7, 65537])
def test_dimensions_are_bounded(dim: int) -> None:
    with pytest.raises(ValueError, match="dim"):
        HashingEmbedder(dim)
