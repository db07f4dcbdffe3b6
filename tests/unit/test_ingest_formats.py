"""Ingestion's parsers: text, Markdown, HTML and PDF in, normalised text out; junk refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobplane.contrib.ingest.formats import UnsupportedFormat, detect, html_text, parse, tidy
from tests.support.documents import minimal_pdf

CORPUS = Path(__file__).parents[2] / "examples" / "ingest"


def test_plain_text_is_tidied() -> None:
    doc = parse(b"\xef\xbb\xbfOne  line\r\nnext\t\tline  \r\n\r\n\r\n\r\nlast\n", file="a.txt")
    assert (doc.format, doc.pages) == ("text", 1)
    assert doc.text == "One line\nnext line\n\nlast"


def test_markdown_is_kept_as_written() -> None:
    doc = parse(b"# Title\n\n- **bold** item\n", file="notes.md")
    assert doc.format == "markdown"
    assert doc.text == "# Title\n\n- **bold** item"


def test_html_gives_visible_text_only() -> None:
    page = (
        b"<html><head><title>T</title><style>p{}</style><script>var x = 1;</script></head>"
        b"<body><h1>Head</h1><p>One &amp; two<br>three</p><ul><li>a</li><li>b</li></ul>"
        b"<noscript>enable js</noscript></body></html>"
    )
    doc = parse(page, file="page.html")
    assert doc.format == "html"
    assert doc.text == "Head\n\nOne & two\nthree\n\na\n\nb"
    assert "var x" not in doc.text and "enable js" not in doc.text


def test_html_without_body_text_gives_its_title() -> None:
    assert html_text("<html><head><title>Only a title</title></head><body></body></html>") == (
        "Only a title"
    )


def test_broken_markup_still_parses() -> None:
    assert parse(b"<p>open <b>never closed <i>x", content_type="text/html").text == (
        "open never closed x"
    )


def test_pdf_text_of_every_page() -> None:
    doc = parse(minimal_pdf(["first page", "second (page)"]), file="x.pdf")
    assert (doc.format, doc.pages) == ("pdf", 2)
    assert doc.text == "first page\n\nsecond (page)"


@pytest.mark.parametrize(
    ("name", "fmt", "pages", "needle"),
    [
        ("notes.txt", "text", 1, "Postgres is the system of record."),
        ("pipelines.md", "markdown", 1, "# Pipelines"),
        ("qdrant.html", "html", 1, "Every point carries its tenant's id"),
        ("guide.pdf", "pdf", 2, "Chunks and points"),
    ],
)
def test_the_sample_corpus(name: str, fmt: str, pages: int, needle: str) -> None:
    doc = parse((CORPUS / name).read_bytes(), file=name)
    assert (doc.format, doc.pages) == (fmt, pages)
    assert needle in doc.text


@pytest.mark.parametrize(
    ("data", "kwargs", "expected"),
    [
        (b"%PDF-1.4 ...", {}, "pdf"),
        (b"<!DOCTYPE html><html>", {}, "html"),
        (b"plain", {}, "text"),
        (b"plain", {"file": "README.MD"}, "markdown"),
        (b"%PDF-", {"file": "x.txt"}, "text"),  # the name wins over a look at the bytes
        (b"x", {"file": "x.txt", "content_type": "text/html; charset=utf-8"}, "html"),
        (b"%PDF-", {"content_type": "application/octet-stream"}, "pdf"),
    ],
)
def test_detect(data: bytes, kwargs: dict[str, str], expected: str) -> None:
    assert detect(data, **kwargs) == expected


@pytest.mark.parametrize(
    ("data", "kwargs", "reason"),
    [
        (b"%PDF-1.4\nthis is no pdf at all", {}, "PDF cannot be read"),
        (minimal_pdf(["x"])[:120], {"file": "cut.pdf"}, "PDF cannot be read"),
        # Neither named nor declared a type ingestion reads, and not text:
        # refused as a type, not as text that failed to decode.
        (bytes(range(256)) * 8, {"file": "blob.bin"}, "type '.bin' is not one ingestion reads"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", {"file": "photo"}, "no type ingestion reads"),
        (b"\x00\x01\x02\x03" * 100, {"file": "a.dat"}, "type '.dat' is not one ingestion reads"),
        (b"\x00\x01\x02\x03" * 100, {"file": "zeros.txt"}, "binary data"),
        (b"PK\x03\x04", {"content_type": "application/zip"}, "application/zip"),
        (b"x", {"content_type": "image/png"}, "image/png"),
    ],
)
def test_unparsable_files_are_refused(data: bytes, kwargs: dict[str, str], reason: str) -> None:
    with pytest.raises(UnsupportedFormat, match=reason):
        parse(data, **kwargs)


def test_a_declared_charset_is_honoured() -> None:
    latin = "Café crème".encode("latin-1")
    assert parse(latin, content_type="text/plain; charset=ISO-8859-1").text == "Café crème"
    page = b'<html><head><meta charset="windows-1252"></head><body><p>\x93quoted\x94</p>'
    assert parse(page, file="p.html").text == "\u201cquoted\u201d"
    with pytest.raises(UnsupportedFormat, match="not UTF-8"):
        parse(latin, file="a.txt")  # undeclared: UTF-8, and these bytes are not


def test_tidy_is_idempotent() -> None:
    text = " a \t b\r\n\r\n\r\n c\u00a0 d "
    assert tidy(tidy(text)) == tidy(text) == "a b\n\nc d"


@pytest.mark.parametrize("codec", ["zlib", "base64", "hex", "rot13", "no-such-charset"])
def test_a_charset_that_is_no_text_encoding_is_ignored(codec: str) -> None:
    """Codecs that look up but cannot decode text fall back to UTF-8, never crash."""
    assert parse(b"plain words", content_type=f"text/plain; charset={codec}").text == "plain words"
    page = f'<html><head><meta charset="{codec}"></head><body><p>caf\u00e9</p>'.encode()
    assert "café" in parse(page, file="p.html").text
