"""jobplane: a gRPC job control plane on Postgres and RabbitMQ.

The package is one import name over several folders of the repository, each
the home of one part (ADR-0038):

- ``core/jobplane/`` — this package: the shared core every process uses
  (``config``, ``errors``, ``types``, ``names``, ``topology``, ``broker``,
  ``store`` with all SQL, ``events``, ``blobs``, ``observe``, ``testing``, the
  generated ``v1`` stubs) and the ``jobplane`` command's entry point.
- ``server/jobplane/server/`` — ``jobplane.server``: the gRPC services and
  their adapters, the dashboard.
- ``workers/jobplane/workers/`` — ``jobplane.workers``: the handler API, the
  worker runtime, the relay, the sweeper.
- ``client/jobplane/client/`` — ``jobplane.client``: the SDK.
- ``migrations/jobplane/migrations/`` — ``jobplane.migrations``: Alembic.
- ``contrib/jobplane/contrib/`` — ``jobplane.contrib``: applications built on
  the handler API (ingestion).

An installed wheel holds them all in one folder. A source checkout (an
editable install, ``PYTHONPATH=core``, a copy for mutation testing) finds the
other parts beside this one, below.
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

# The folders of a source checkout that hold the other parts of this package,
# relative to the checkout's root (two levels above this package's folder).
_PARTS = ("server", "workers", "client", "migrations", "contrib")


def _source_parts() -> list[str]:
    """The other parts' folders when this package runs from a source checkout."""
    root = Path(__file__).resolve().parent.parent.parent
    found = []
    for name in _PARTS:
        portion = root / name / "jobplane"
        if (portion / name / "__init__.py").is_file():
            found.append(str(portion))
    return found


__path__ += [p for p in _source_parts() if p not in __path__]
