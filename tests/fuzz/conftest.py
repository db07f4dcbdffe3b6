"""Hypothesis profiles of the fuzz suite, chosen by HYPOTHESIS_PROFILE.

``quick`` (the default, part of `make test`): a fixed set of examples per
test, the same on every run, so the default suite stays fast and stable.
``deep`` (`make fuzz`): ten times as many, random on every run, and failing
examples kept in a git-ignored database (.hypothesis/) to replay first next
time.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

# The examples run against a real server: slow draws and large strings are
# the point, not a problem with the strategies.
_SLOW_IS_FINE = (HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example)
_DATABASE = Path(__file__).resolve().parents[2] / ".hypothesis" / "examples"

settings.register_profile(
    "quick",
    max_examples=100,
    derandomize=True,
    deadline=None,
    suppress_health_check=_SLOW_IS_FINE,
    print_blob=True,
)
settings.register_profile(
    "deep",
    max_examples=1000,
    deadline=None,
    suppress_health_check=_SLOW_IS_FINE,
    database=DirectoryBasedExampleDatabase(_DATABASE),
    print_blob=True,
)

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "quick")
settings.load_profile(PROFILE)
