"""Documents made on the spot for the ingestion tests: a minimal PDF, generated text."""

from __future__ import annotations

import random


def minimal_pdf(pages: list[str]) -> bytes:
    """A valid PDF 1.4 of one page per string (Helvetica, one line per line of text).

    Written by hand (pypdf writes PDFs but does not lay out text): a catalog,
    a page tree, per page a content stream of ``Tj`` lines, one font, and a
    cross-reference table with exact byte offsets.
    """
    objects: list[bytes] = []
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(len(pages)))
    font = 3 + 2 * len(pages)
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(f"<< /Type /Pages /Kids [{kids}] /Count {len(pages)} >>".encode())
    for i, text in enumerate(pages):
        lines = ["BT", "/F1 12 Tf", "14 TL", "72 720 Td"]
        for line in text.split("\n"):
            escaped = line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
            lines.append(f"({escaped}) Tj T*")
        lines.append("ET")
        stream = "\n".join(lines).encode("latin-1")
        objects.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            f"/Resources << /Font << /F1 {font} 0 R >> >> /Contents {4 + 2 * i} 0 R >>".encode()
        )
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for offset in offsets:
        out += b"%010d 00000 n \n" % offset
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        xref,
    )
    return bytes(out)


_WORDS = [
    *("queue", "worker", "lease", "fence", "outbox", "relay", "stage", "pipeline", "vector"),
    *("chunk", "tenant", "postgres", "rabbit", "message", "attempt", "retry", "progress"),
    *("event", "blob", "digest", "index", "search", "embed", "parse", "file", "point"),
    *("collection", "version", "upload", "stream", "watch"),
]


def generated_text(seed: int, words: int) -> str:
    """``words`` words of deterministic prose, in paragraphs, from ``seed``."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(words):
        out.append(rng.choice(_WORDS))
        if i % 12 == 11:
            out[-1] += "."
        if i % 90 == 89:
            out[-1] += "\n\n"
    return " ".join(out).replace("\n\n ", "\n\n")
