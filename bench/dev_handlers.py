"""The handlers of the ``jobplane dev`` arm of ``--only peers``: what ``make dev``
loads (``examples.reports:registry``; dev adds its demos and maintenance jobs)
and the benchmark's no-op types beside them."""

from __future__ import annotations

from bench.handlers import registry as bench_registry
from examples.reports import registry as reports_registry

registry = reports_registry.merge(bench_registry)
