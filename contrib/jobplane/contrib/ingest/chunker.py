"""Text into overlapping chunks with exact character spans.

A chunk is ``text[start:end]``: the spans index the parsed text itself, so
a hit can be shown in its context. Chunks follow each other by a fixed
rule — a window of ``size`` characters whose end moves back to the nearest
paragraph break, else line break, else space, within the last quarter of
the window, and the next window starts ``overlap`` characters before that
end — so the same text always gives the same chunks, every character is in
one chunk at least, and two neighbours share exactly ``overlap`` characters.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

DEFAULT_CHUNK_SIZE = 1000
DEFAULT_CHUNK_OVERLAP = 200
MIN_CHUNK_SIZE = 16
MAX_CHUNK_SIZE = 100_000

# Where a chunk prefers to end, best first.
_BREAKS = ("\n\n", "\n", ". ", " ")


@dataclass(frozen=True, slots=True)
class Chunk:
    """One chunk: its index in the file, its span ``[start, end)`` and its text."""

    index: int
    start: int
    end: int
    text: str


def check_params(size: int, overlap: int) -> None:
    """Raise TypeError or ValueError unless ``size`` and ``overlap`` make a valid chunking."""
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError("chunk_size must be an integer")
    if isinstance(overlap, bool) or not isinstance(overlap, int):
        raise TypeError("chunk_overlap must be an integer")
    if not MIN_CHUNK_SIZE <= size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be {MIN_CHUNK_SIZE}..{MAX_CHUNK_SIZE}, not {size}")
    if not 0 <= overlap <= size // 2:
        raise ValueError(f"chunk_overlap must be 0..chunk_size/2 ({size // 2}), not {overlap}")


def chunk_text(
    text: str, size: int = DEFAULT_CHUNK_SIZE, overlap: int = DEFAULT_CHUNK_OVERLAP
) -> list[Chunk]:
    """The chunks of ``text`` (none for an empty text); see the module's docstring."""
    return list(iter_chunks(text, size, overlap))


def iter_chunks(text: str, size: int, overlap: int) -> Iterator[Chunk]:
    """:func:`chunk_text`, one chunk at a time."""
    check_params(size, overlap)
    start, index, length = 0, 0, len(text)
    while start < length:
        end = min(start + size, length)
        if end < length:
            end = _break_before(text, start, end, size, overlap)
        yield Chunk(index, start, end, text[start:end])
        if end >= length:
            return
        # end > start + overlap (see _break_before), so every step moves on.
        start, index = end - overlap, index + 1


def _break_before(text: str, start: int, end: int, size: int, overlap: int) -> int:
    """The end of a chunk that may end at ``end``: just after a break in its last quarter.

    Never at or before ``start + overlap``: the next chunk must start after this one.
    """
    lowest = max(start + overlap + 1, end - size // 4)
    for mark in _BREAKS:
        at = text.rfind(mark, lowest, end)
        if at >= 0 and at + len(mark) > lowest:
            return at + len(mark)
    return end
