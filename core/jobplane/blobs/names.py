"""Blob names: ``blobs/{sha256}``, the one way a blob is named anywhere."""

from __future__ import annotations

import re

PREFIX = "blobs/"
#: A blob name as a regular expression (use ``fullmatch``).
BLOB_NAME_PATTERN = re.compile(r"blobs/[0-9a-f]{64}")
_DIGEST = re.compile(r"[0-9a-f]{64}")


def parse_blob_name(name: str) -> str:
    """The sha256 (64 lowercase hex characters) of ``blobs/{sha256}``; ValueError otherwise."""
    if not isinstance(name, str) or not name.startswith(PREFIX):
        raise ValueError(f"a blob name looks like blobs/<sha256>, not {str(name)[:80]!r}")
    digest = name[len(PREFIX) :]
    if not _DIGEST.fullmatch(digest):
        raise ValueError(
            "a blob name is blobs/ and the sha256 of its bytes in 64 lowercase hex characters, "
            f"not {name[:80]!r}"
        )
    return digest


def blob_name(digest: str) -> str:
    """``blobs/{digest}`` (the digest checked)."""
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ValueError(f"a sha256 is 64 lowercase hex characters, not {str(digest)[:80]!r}")
    return PREFIX + digest


def parse_digest(value: str) -> str:
    """A declared sha256 (hex, any case) in canonical form; ValueError otherwise."""
    lowered = value.strip().lower() if isinstance(value, str) else ""
    if not _DIGEST.fullmatch(lowered):
        raise ValueError("sha256 must be 64 hex characters")
    return lowered


def is_blob_name(value: object) -> bool:
    """True when ``value`` is a string naming a blob."""
    return isinstance(value, str) and BLOB_NAME_PATTERN.fullmatch(value) is not None


def referenced_digests(value: object) -> set[str]:
    """The digests of every string in a JSON value that is a blob name."""
    found: set[str] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if BLOB_NAME_PATTERN.fullmatch(item):
                found.add(item[len(PREFIX) :])
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return found
