"""Workers: the handler API, the worker runtime and the outbox relay.

The package exports the handler API, :mod:`jobplane.workers.handlers`: the
same names (its ``__all__``, kept in one place).
"""

from __future__ import annotations

from jobplane.workers.handlers import *  # noqa: F403
from jobplane.workers.handlers import __all__ as __all__
