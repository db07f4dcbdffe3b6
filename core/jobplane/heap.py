"""The garbage collector of a long-running jobplane process (ADR-0032).

CPython's cyclic collector runs its youngest generation every 700 net
allocations and, now and then, a full collection that walks every object
the process holds: the imported modules, SQLAlchemy's and gRPC's tables,
compiled statements. Measured in the benchmark's processes (a callback on
``gc.callbacks`` timing each collection), that was 8 to 17 % of a server's,
worker's and relay's CPU. Most of what a full collection walks was made
at start and lives as long as the process.

:func:`settle`, called once a process is up (every long-running command
calls it as it starts waiting for its stop signal), moves what the process
holds then into the permanent generation (``gc.freeze``), where no
collection walks it, and collects the youngest generation less often.
Objects made later are collected as before; the frozen ones are never
freed (they lived for the process's life anyway).
"""

from __future__ import annotations

import gc

#: Net allocations between collections of the youngest generation (CPython: 700).
YOUNG_THRESHOLD = 10_000


def settle() -> None:
    """Freeze what the process holds now and collect the young less often (see the module)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
