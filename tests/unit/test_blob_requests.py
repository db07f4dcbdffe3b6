"""A submit request's blobs, checked before anything is written: the payload's
blob names and ``blob_references`` must be the tenant's, a payload by reference
must exist and fit what a worker reads whole; each refusal on its field."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any, cast

import pytest

from jobplane.blobs.reader import BlobInfo
from jobplane.blobs.store import BlobStore
from jobplane.config import MAX_OFFLOADED_JSON_BYTES
from jobplane.errors import (
    BlobNotFound,
    BlobReferenceNotFound,
    BlobsDisabled,
    InvalidArgument,
    JobplaneError,
    PayloadTooLarge,
)
from jobplane.server.job_requests import MAX_BLOB_REFERENCES, SubmitRequest, check_blobs
from jobplane.types import BlobRef

_TENANT = uuid.UUID(int=1)
A, B, C, GONE = ("a" * 64, "b" * 64, "c" * 64, "d" * 64)


def _name(digest: str) -> str:
    return f"blobs/{digest}"


class _Blobs:
    """The tenant has blobs of ``have``, each of ``size`` bytes."""

    def __init__(self, have: Iterable[str] = (A, B, C), size: int = 10) -> None:
        self.have = set(have)
        self.size = size
        self.asked: list[set[str]] = []

    async def owned(self, tenant: uuid.UUID, digests: Iterable[str]) -> set[str]:
        assert tenant == _TENANT
        wanted = set(digests)
        self.asked.append(wanted)
        return wanted & self.have

    async def stat(self, tenant: uuid.UUID, name: str) -> BlobInfo:
        assert tenant == _TENANT
        digest = name.removeprefix("blobs/")
        if digest not in self.have:
            raise BlobNotFound(f"no blob named {name}", field="name")
        return BlobInfo(name=name, digest=digest, size=self.size, content_type="x")


async def _checked(request: SubmitRequest, blobs: _Blobs | None) -> tuple[Any, ...]:
    return await check_blobs(cast(BlobStore | None, blobs), _TENANT, request)


async def _refused(request: SubmitRequest, blobs: _Blobs | None) -> JobplaneError:
    with pytest.raises(JobplaneError) as refused:
        await _checked(request, blobs)
    return refused.value


async def test_a_request_without_blobs_needs_no_object_store() -> None:
    request = SubmitRequest("t", {"a": "blobs/short", "b": ["x"]})
    assert await _checked(request, None) == (None, ())
    blobs = _Blobs()
    assert await _checked(request, blobs) == (None, ())
    assert blobs.asked == []


async def test_the_references_are_those_the_payload_does_not_name_sorted() -> None:
    blobs = _Blobs()
    request = SubmitRequest(
        "t",
        {"x": [_name(B)], "y": {"z": _name(A)}},
        blob_references=(_name(C), _name(A), _name(C)),
    )
    assert await _checked(request, blobs) == (None, (C,))
    assert blobs.asked == [{A, B, C}]
    request = SubmitRequest("t", {}, blob_references=(_name(C), _name(B)))
    assert await _checked(request, blobs) == (None, (B, C))


async def test_a_payload_by_reference_is_its_blob() -> None:
    blobs = _Blobs(size=MAX_OFFLOADED_JSON_BYTES)
    request = SubmitRequest("t", {}, payload_blob=_name(A), blob_references=(_name(B),))
    assert await _checked(request, blobs) == (
        BlobRef(_name(A), A, MAX_OFFLOADED_JSON_BYTES),
        (B,),
    )
    assert blobs.asked == [{B}]


async def test_a_payload_blob_too_large_for_a_worker_is_refused() -> None:
    size = MAX_OFFLOADED_JSON_BYTES + 1
    refused = await _refused(SubmitRequest("t", {}, payload_blob=_name(A)), _Blobs(size=size))
    assert isinstance(refused, PayloadTooLarge)
    assert (refused.field, refused.message) == (
        "payload_blob",
        f"a payload by reference may have at most {MAX_OFFLOADED_JSON_BYTES} bytes "
        f"(the worker reads it whole), not {size}",
    )


async def test_a_payload_blob_that_is_no_blob_of_the_tenant_is_refused() -> None:
    gone = await _refused(SubmitRequest("t", {}, payload_blob=_name(GONE)), _Blobs())
    assert isinstance(gone, BlobReferenceNotFound)
    assert (gone.field, gone.message) == (
        "payload_blob",
        f"payload_blob 'blobs/{GONE[:56]}…(70 characters) does not exist",
    )
    malformed = await _refused(SubmitRequest("t", {}, payload_blob="blobs/ABC"), _Blobs())
    assert isinstance(malformed, BlobReferenceNotFound)
    assert (malformed.field, malformed.message) == (
        "payload_blob",
        "payload_blob: a blob name is blobs/ and the sha256 of its bytes in 64 lowercase "
        "hex characters, not 'blobs/ABC'",
    )
    both = await _refused(SubmitRequest("t", {"a": 1}, payload_blob=_name(A)), _Blobs())
    assert type(both) is InvalidArgument
    assert (both.field, both.message) == (
        "payload_blob",
        "payload_blob replaces payload: send one of them",
    )


async def test_a_missing_blob_is_refused_on_the_field_that_names_it() -> None:
    in_payload = await _refused(
        SubmitRequest("t", {"x": [_name(GONE), _name(A)]}, blob_references=(_name(B),)),
        _Blobs(),
    )
    assert isinstance(in_payload, BlobReferenceNotFound)
    assert (in_payload.field, in_payload.message) == (
        "payload",
        f"the job references blobs/{GONE}, which does not exist",
    )
    # Of several missing, the least digest is the one shown.
    referenced = await _refused(
        SubmitRequest("t", {"x": _name(A)}, blob_references=(_name(GONE), _name(C))),
        _Blobs(have=[A]),
    )
    assert (referenced.field, referenced.message) == (
        "blob_references",
        f"the job references blobs/{C}, which does not exist",
    )


async def test_blobs_on_a_server_without_an_object_store_are_refused() -> None:
    cases = [
        (SubmitRequest("t", {"x": _name(A)}), "payload"),
        (SubmitRequest("t", {}, blob_references=(_name(A),)), "payload"),
        (SubmitRequest("t", {}, payload_blob=_name(A)), "payload_blob"),
    ]
    for request, field in cases:
        refused = await _refused(request, None)
        assert isinstance(refused, BlobsDisabled)
        assert (refused.field, refused.message) == (
            field,
            "this server has no object store: a payload cannot reference blobs",
        )


async def test_blob_references_are_names_and_at_most_ten_thousand() -> None:
    names = tuple(_name(f"{n:064x}") for n in range(MAX_BLOB_REFERENCES))
    blobs = _Blobs(have=[n.removeprefix("blobs/") for n in names])
    _, references = await _checked(SubmitRequest("t", {}, blob_references=names), blobs)
    assert len(references) == MAX_BLOB_REFERENCES
    too_many = await _refused(SubmitRequest("t", {}, blob_references=(*names, _name(A))), _Blobs())
    assert (type(too_many), too_many.field, too_many.message) == (
        InvalidArgument,
        "blob_references",
        "at most 10000 blob_references",
    )
    malformed = await _refused(SubmitRequest("t", {}, blob_references=("b/x",)), _Blobs())
    assert (type(malformed), malformed.field, malformed.message) == (
        InvalidArgument,
        "blob_references",
        "a blob name looks like blobs/<sha256>, not 'b/x'",
    )
