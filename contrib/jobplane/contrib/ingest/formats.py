"""Text out of an uploaded file: plain text, Markdown, HTML and PDF.

What a file is comes from, in order: the content type the job names, the
content type the blob was uploaded with, the file name's extension, and a
look at the first bytes. Anything that is none of the four, or claims to be
one and is not (a corrupt PDF, binary bytes called text), raises
:class:`UnsupportedFormat`: the job fails at once, because another attempt
would read the same bytes.
"""

from __future__ import annotations

import codecs
import html
import html.parser
import io
import re
import unicodedata
from dataclasses import dataclass

#: The formats :func:`parse` reads.
FORMATS = ("text", "markdown", "html", "pdf")

_BY_TYPE = {
    "text/plain": "text",
    "text/markdown": "markdown",
    "text/x-markdown": "markdown",
    "text/html": "html",
    "application/xhtml+xml": "html",
    "application/pdf": "pdf",
}
_BY_EXTENSION = {
    ".txt": "text",
    ".text": "text",
    ".md": "markdown",
    ".markdown": "markdown",
    ".html": "html",
    ".htm": "html",
    ".xhtml": "html",
    ".pdf": "pdf",
}
# Content types that say nothing about the bytes: look further.
_UNTYPED = frozenset({"", "application/octet-stream", "binary/octet-stream"})
# Share of characters that may be control characters in text before it is
# taken for binary bytes that happen to decode.
_MAX_CONTROL_SHARE = 0.01


class UnsupportedFormat(ValueError):
    """The file is not text, Markdown, HTML or PDF, or cannot be read as the one it claims."""


@dataclass(frozen=True, slots=True)
class Document:
    """A parsed file: its text, in reading order, and how many pages it had (1 unless PDF)."""

    format: str
    text: str
    pages: int


def detect(data: bytes, *, file: str = "", content_type: str | None = None) -> str:
    """The format of ``data`` (one of :data:`FORMATS`), else :class:`UnsupportedFormat`."""
    return _detect(data, file, content_type)[0]


def _detect(data: bytes, file: str, content_type: str | None) -> tuple[str, bool]:
    """The format, and whether it is text only for want of any other (nothing named
    a type, and the bytes look like no other)."""
    declared = (content_type or "").split(";")[0].strip().lower()
    if declared not in _UNTYPED:
        found = _BY_TYPE.get(declared)
        if found is None:
            raise UnsupportedFormat(f"content type {declared!r} is not one ingestion reads")
        return found, False
    if (found := _BY_EXTENSION.get(_extension(file))) is not None:
        return found, False
    head = data[:1024].lstrip()
    if head.startswith(b"%PDF-"):
        return "pdf", False
    lowered = head[:256].lower()
    if lowered.startswith((b"<!doctype html", b"<html")) or b"<body" in lowered:
        return "html", False
    return "text", True


def _extension(file: str) -> str:
    """The file name's extension, lowercase with its dot ("" when it has none)."""
    name = file.rsplit("/", 1)[-1]
    dot = name.rfind(".")
    return name[dot:].lower() if dot >= 0 else ""


def parse(data: bytes, *, file: str = "", content_type: str | None = None) -> Document:
    """Detect the format of ``data`` and extract its text (normalised, see :func:`tidy`)."""
    kind, guessed = _detect(data, file, content_type)
    if kind == "pdf":
        return _pdf(data)
    charset = _charset(content_type)
    if charset is None and kind == "html":
        charset = _meta_charset(data)
    try:
        text = decode_text(data, charset)
    except UnsupportedFormat:
        if not guessed:
            raise  # named text, and it is not: the bytes are at fault
        # Nothing named a type ingestion reads, and the bytes are not text:
        # the file is of some other type (an image, an archive), not broken text.
        extension = _extension(file)
        if extension:
            raise UnsupportedFormat(
                f"type {extension!r} is not one ingestion reads "
                "(text, Markdown, HTML or PDF), and the bytes are not text"
            ) from None
        raise UnsupportedFormat(
            "the file names no type ingestion reads (text, Markdown, HTML or PDF), "
            "and the bytes are not text"
        ) from None
    if kind == "html":
        return Document("html", tidy(html_text(text)), 1)
    return Document(kind, tidy(text), 1)


_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?([A-Za-z0-9._-]{1,40})""", re.I)


def _charset(content_type: str | None) -> str | None:
    """The ``charset`` parameter of a content type, if it names a codec Python has."""
    for param in (content_type or "").split(";")[1:]:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset":
            return _codec(value.strip().strip('"'))
    return None


def _meta_charset(data: bytes) -> str | None:
    """The charset an HTML page declares in a ``<meta>`` of its first 2 KiB."""
    found = _CHARSET.search(data[:2048])
    return _codec(found.group(1).decode("ascii")) if found else None


def _codec(name: str) -> str | None:
    """The codec a declared charset names; None for an unknown one or for a codec that
    is not a text encoding (``zlib``, ``base64``, ``rot13`` look up but cannot decode)."""
    try:
        info = codecs.lookup(name)
    except LookupError:
        return None
    return info.name if getattr(info, "_is_text_encoding", True) else None


def decode_text(data: bytes, charset: str | None = None) -> str:
    """``data`` as text: UTF-8 (a BOM allowed) unless ``charset`` says otherwise.

    Binary bytes raise :class:`UnsupportedFormat`.
    """
    if charset is not None and charset not in ("utf-8", "utf-8-sig"):
        try:
            return _not_binary(data.decode(charset))
        except UnicodeDecodeError:
            raise UnsupportedFormat(f"the file does not decode as {charset}") from None
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError:
            raise UnsupportedFormat("the file claims UTF-16 but does not decode") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UnsupportedFormat(
            f"the file is not UTF-8 text (undecodable byte at offset {exc.start})"
        ) from None
    return _not_binary(text)


def _not_binary(text: str) -> str:
    control = sum(1 for c in text if unicodedata.category(c) == "Cc" and c not in "\t\n\r\f")
    if text and control / len(text) > _MAX_CONTROL_SHARE:
        raise UnsupportedFormat("the file holds binary data, not text")
    return text


_BLANKS = re.compile(r"[ \t\f\v\u00a0]+")
_MANY_NEWLINES = re.compile(r"\n{3,}")


def tidy(text: str) -> str:
    """One form for the same words: NFC, ``\\n`` line ends, runs of blanks as one
    space, at most one empty line in a row, no blanks at line ends or around the text.

    The chunker's spans index this text, so it is what the index stores too.
    """
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = text.replace("\x00", "")
    lines = [_BLANKS.sub(" ", line).strip() for line in text.split("\n")]
    return _MANY_NEWLINES.sub("\n\n", "\n".join(lines)).strip()


_BLOCK = frozenset(
    {
        "address", "article", "aside", "blockquote", "br", "dd", "div", "dl", "dt",
        "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6",
        "header", "hr", "li", "main", "nav", "ol", "p", "pre", "section", "table",
        "tbody", "td", "th", "thead", "tr", "ul",
    }
)  # fmt: skip
_SKIP = frozenset({"script", "style", "noscript", "template", "head", "svg", "iframe"})


class _TextOfHtml(html.parser.HTMLParser):
    """The visible text of a page: blocks on lines of their own, scripts and styles left out."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skipping = 0
        self.title = ""
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "title":
            self._in_title = True
        if tag in _SKIP:
            self._skipping += 1
        elif tag in _BLOCK:
            self.parts.append("\n")

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in _BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag == "title":
            self._in_title = False
        if tag in _SKIP:
            self._skipping = max(0, self._skipping - 1)
        elif tag in _BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._in_title:
            self.title += data
        if not self._skipping:
            self.parts.append(data)


def html_text(markup: str) -> str:
    """The visible text of an HTML page (stdlib ``html.parser``, which never raises on bad markup).

    A page whose body has no text gives its ``<title>``.
    """
    parser = _TextOfHtml()
    parser.feed(markup)
    parser.close()
    text = html.unescape("".join(parser.parts))
    # Paragraphs stay apart: a block's own line, and an empty line after a
    # run of blocks, so the chunker's paragraph boundaries survive.
    text = re.sub(r"\n[ \t]*\n+", "\n\n", text)
    return text if text.strip() else parser.title


def _pdf(data: bytes) -> Document:
    import pypdf
    from pypdf.errors import PyPdfError

    try:
        reader = pypdf.PdfReader(io.BytesIO(data), strict=False)
        encrypted = reader.is_encrypted
        pages = [] if encrypted else [page.extract_text() or "" for page in reader.pages]
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, IndexError,
            AssertionError, OSError, RecursionError, ZeroDivisionError) as exc:  # fmt: skip
        # pypdf reports a broken file through many exception types, not one.
        raise UnsupportedFormat(f"the PDF cannot be read: {type(exc).__name__}: {exc}") from None
    if encrypted:
        raise UnsupportedFormat("the PDF is encrypted")
    # A page break is a paragraph break.
    return Document("pdf", tidy("\n\n".join(tidy(p) for p in pages)), len(pages))
