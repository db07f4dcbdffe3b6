"""The chunker: stable, exact spans, every character covered, overlaps as configured."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jobplane.contrib.ingest.chunker import (
    DEFAULT_CHUNK_OVERLAP,
    DEFAULT_CHUNK_SIZE,
    check_params,
    chunk_text,
)
from tests.support.documents import generated_text


def test_empty_text_has_no_chunks() -> None:
    assert chunk_text("") == []


def test_short_text_is_one_chunk() -> None:
    (chunk,) = chunk_text("a short text")
    assert (chunk.index, chunk.start, chunk.end, chunk.text) == (0, 0, 12, "a short text")


def test_chunks_end_at_a_paragraph_break_when_one_is_near() -> None:
    text = "a" * 80 + "\n\n" + "b" * 60
    first, second = chunk_text(text, size=100, overlap=10)
    assert first.text == "a" * 80 + "\n\n"
    assert second.start == first.end - 10


def test_the_same_text_gives_the_same_chunks() -> None:
    text = generated_text(7, 3000)
    assert chunk_text(text) == chunk_text(text)
    assert len(chunk_text(text)) > 10


def test_defaults() -> None:
    text = generated_text(1, 2000)
    assert chunk_text(text) == chunk_text(text, DEFAULT_CHUNK_SIZE, DEFAULT_CHUNK_OVERLAP)


@pytest.mark.parametrize(
    ("size", "overlap", "message"),
    [
        (15, 0, "chunk_size must be 16"),
        (100_001, 0, "chunk_size must be"),
        (100, 51, "chunk_overlap must be 0..chunk_size/2"),
        (100, -1, "chunk_overlap must be"),
    ],
)
def test_bad_parameters(size: int, overlap: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_params(size, overlap)


@pytest.mark.parametrize(("size", "overlap"), [(100.0, 10), (True, 0), (100, "10")])
def test_parameters_must_be_integers(size: object, overlap: object) -> None:
    with pytest.raises(TypeError):
        check_params(size, overlap)  # type: ignore[arg-type]


_texts = st.text(alphabet=st.sampled_from("ab \n.é"), max_size=3000) | st.builds(
    generated_text, st.integers(0, 1000), st.integers(0, 600)
)


@st.composite
def _params(draw: st.DrawFn) -> tuple[int, int]:
    size = draw(st.integers(16, 400))
    return size, draw(st.integers(0, size // 2))


@given(text=_texts, params=_params())
def test_chunking_properties(text: str, params: tuple[int, int]) -> None:
    size, overlap = params
    chunks = chunk_text(text, size, overlap)
    # Deterministic.
    assert chunks == chunk_text(text, size, overlap)
    if not text:
        assert chunks == []
        return
    # Exact spans, in order, at most size long, indexes 0..n-1.
    for i, chunk in enumerate(chunks):
        assert chunk.index == i
        assert chunk.text == text[chunk.start : chunk.end]
        assert 0 < chunk.end - chunk.start <= size
    # Every character covered: from 0 to the end with no gap.
    assert chunks[0].start == 0 and chunks[-1].end == len(text)
    for before, after in itertools.pairwise(chunks):
        # Neighbours share exactly `overlap` characters, and each moves on.
        assert after.start == before.end - overlap
        assert after.start > before.start and after.end > before.end
    # The last chunk is not inside the one before it.
    if len(chunks) > 1:
        assert chunks[-1].end > chunks[-2].end
