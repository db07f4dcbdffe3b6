"""A SubmitJob request's ``after`` checked before the store: malformed names, too
many, a name twice, a policy without ``after`` (docs/workflows.md)."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobplane.errors import InvalidArgument
from jobplane.server.after_requests import check_after
from jobplane.store.dependencies import MAX_AFTER


def _names(n: int) -> tuple[str, ...]:
    return tuple(f"jobs/{uuid.uuid4()}" for _ in range(n))


def test_good_names_come_back_as_ids_in_order() -> None:
    names = _names(3)
    assert check_after(names, 0) == tuple(uuid.UUID(n[5:]) for n in names)
    assert check_after((), 0) == ()
    assert len(check_after(_names(MAX_AFTER), 3)) == MAX_AFTER


@pytest.mark.parametrize(
    ("names", "policy", "field"),
    [
        (("job/1",), 0, "after[0]"),
        ((f"jobs/{uuid.uuid4()}", "jobs/x"), 0, "after[1]"),
        (("jobs/",), 0, "after[0]"),
        ((), 2, "after_failure"),
        (_names(1), 9, "after_failure"),
        (_names(MAX_AFTER + 1), 0, "after"),
    ],
)
def test_bad_after_is_refused_on_its_field(names: tuple[str, ...], policy: int, field: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        check_after(names, policy)
    assert refused.value.field == field


@settings(max_examples=50, derandomize=True)
@given(st.lists(st.uuids(), min_size=1, max_size=10), st.data())
def test_a_name_twice_is_refused_at_its_second_place(
    ids: list[uuid.UUID], data: st.DataObject
) -> None:
    at = data.draw(st.integers(0, len(ids) - 1))
    names = [f"jobs/{i}" for i in ids]
    names.insert(data.draw(st.integers(at + 1, len(names))), names[at])
    with pytest.raises(InvalidArgument) as refused:
        check_after(tuple(names), 0)
    field = refused.value.field or ""
    assert field.startswith("after[")
    second = int(field[6:-1])
    assert names[second] in names[:second]
