"""A SubmitJob request's ``after`` checked before the store: malformed names, too
many, a name twice, a policy without ``after`` (docs/workflows.md)."""

from __future__ import annotations

import uuid
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jobplane.errors import InvalidArgument
from jobplane.server.after_requests import check_after, with_after
from jobplane.store.dependencies import MAX_AFTER
from jobplane.store.job_submit import NewJob
from jobplane.types import DependencyFailurePolicy


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


def test_each_refusal_says_what_is_wrong() -> None:
    first, second = (f"jobs/{uuid.UUID(int=n)}" for n in (1, 2))
    cases = [
        ((first,), 4, ("after_failure", "unknown after_failure 4")),
        ((), 1, ("after_failure", "after_failure needs after")),
        (_names(MAX_AFTER + 1), 1, ("after", f"after names at most {MAX_AFTER} jobs")),
        ((first, "jobs/x"), 0, ("after[1]", "after[1] has a malformed job id 'x'")),
        (
            (first, second, first),
            2,
            ("after[2]", f"after[2] names {first} again (after[0])"),
        ),
    ]
    for names, policy, refusal in cases:
        with pytest.raises(InvalidArgument) as refused:
            check_after(names, policy)
        assert (refused.value.field, refused.value.message) == refusal


def test_a_job_runs_after_its_names_on_the_policy_asked() -> None:
    new = NewJob(type="t", queue="q", payload={}, request_id="r", max_attempts=1)
    assert with_after(new, (), 0) is new
    first, second = uuid.UUID(int=1), uuid.UUID(int=2)
    names = (f"jobs/{first}", f"jobs/{second}")
    policies = {0: DependencyFailurePolicy.FAIL, 1: DependencyFailurePolicy.FAIL}
    policies |= {2: DependencyFailurePolicy.CANCEL, 3: DependencyFailurePolicy.RUN_ANYWAY}
    for number, policy in policies.items():
        assert with_after(new, names, number) == replace(
            new, after=(first, second), after_failure=policy
        )
