"""Resource names and identifiers: parsing and validation."""

from __future__ import annotations

import re
import uuid

from jobplane.errors import InvalidArgument, shown

JOB_TYPE_MAX_LENGTH = 128
_JOB_TYPE = re.compile(r"[a-z0-9][a-z0-9_-]*(\.[a-z0-9][a-z0-9_-]*)*")
_NAME_PREFIX = "jobs/"


def job_name(job_id: uuid.UUID | str) -> str:
    """``jobs/{id}`` for a job id."""
    return f"{_NAME_PREFIX}{job_id}"


def parse_job_name(name: str, *, field: str = "name") -> uuid.UUID:
    """The job id in ``jobs/{id}``; INVALID_ARGUMENT when malformed."""
    if not name.startswith(_NAME_PREFIX):
        raise InvalidArgument(f"{field} must look like jobs/{{id}}, got {shown(name)}", field=field)
    raw = name[len(_NAME_PREFIX) :]
    try:
        parsed = uuid.UUID(raw)
    except ValueError:
        raise InvalidArgument(f"{field} has a malformed job id {shown(raw)}", field=field) from None
    if str(parsed) != raw.lower():
        raise InvalidArgument(f"{field} has a malformed job id {shown(raw)}", field=field)
    return parsed


def is_job_type(value: str) -> bool:
    """True when ``value`` follows the job type grammar (see :func:`validate_job_type`)."""
    return len(value) <= JOB_TYPE_MAX_LENGTH and _JOB_TYPE.fullmatch(value) is not None


def validate_job_type(job_type: str, *, field: str = "type") -> str:
    """Check the job type grammar: lowercase dotted, letters, digits, '.', '_', '-'."""
    if not job_type:
        raise InvalidArgument(f"{field} is required", field=field)
    if len(job_type) > JOB_TYPE_MAX_LENGTH:
        raise InvalidArgument(
            f"{field} is longer than {JOB_TYPE_MAX_LENGTH} characters", field=field
        )
    # fullmatch: `$` would also match before a trailing newline.
    if not _JOB_TYPE.fullmatch(job_type):
        raise InvalidArgument(
            f"{field} {shown(job_type)} must be lowercase dotted words of letters, digits, '_' "
            "and '-' (e.g. 'reports.render')",
            field=field,
        )
    return job_type
