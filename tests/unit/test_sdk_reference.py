"""docs/sdk.md names every field, state and exception the SDK hands its callers."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import jobplane.client
from jobplane.client import (
    EventType,
    Job,
    JobError,
    JobEvent,
    JobplaneError,
    JobState,
    Stage,
    StageState,
)

REFERENCE = Path(__file__).parents[2] / "docs" / "sdk.md"


def _section(title: str) -> str:
    """The text of ``## title`` or ``### title``, up to the next heading of any level."""
    text = REFERENCE.read_text()
    match = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#)", text + "\n#", re.S | re.M)
    assert match, f"docs/sdk.md has no section {title!r}"
    return match.group(1)


@pytest.mark.parametrize(
    ("cls", "title"),
    [(Job, "`Job`"), (JobEvent, "`JobEvent`"), (Stage, "`Stage` and `StageState`")],
)
def test_every_field_is_described(cls: type, title: str) -> None:
    section = _section(title)
    missing = [f.name for f in dataclasses.fields(cls) if f"`{f.name}`" not in section]
    assert missing == [], f"{title} does not describe {missing}"


def test_every_enum_member_and_the_error_fields_are_named() -> None:
    assert all(f"`{s.name}`" in _section("`JobState`") for s in JobState)
    assert all(f"`{s.name}`" in _section("`Stage` and `StageState`") for s in StageState)
    assert all(f"`{t.name}`" in _section("`JobEvent`") for t in EventType)
    assert all(f"`{f.name}`" in _section("`JobError`") for f in dataclasses.fields(JobError))


def test_every_exported_exception_has_a_row_with_its_reason() -> None:
    exported = [
        value
        for name in jobplane.client.__all__
        if isinstance(value := getattr(jobplane.client, name), type)
        and issubclass(value, JobplaneError)
        and value is not JobplaneError
    ]
    assert len(exported) > 20
    rows = {
        cells[0].strip("` "): cells
        for line in _section("Exceptions").splitlines()
        if line.startswith("| `")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    for cls in exported:
        assert cls.__name__ in rows, f"no row for {cls.__name__}"
        _name, parent, code, reason, _when = rows[cls.__name__]
        assert parent == f"`{cls.__mro__[1].__name__}`", cls
        assert code == cls.code.name, cls
        assert reason == f"`{cls.reason}`", cls
