"""The ingest handlers of ``--only ingest-fanout``: the hashing embedder, slowed down.

The hashing embedder costs next to nothing; a real one is either a model (CPU
or GPU bound) or a remote API (latency bound). This one stands for the API:
``BENCH_EMBED_MS_PER_CHUNK`` milliseconds of waiting per chunk (default 10,
about 0.6 s for a request of 64 chunks), then the hashing embedder's vectors,
so the points are those of ``JOBPLANE_EMBEDDER=hash``. Waiting is what more
embed workers (or a worker's ``--concurrency``) overlap; a CPU-bound model
on a machine of two cores would gain at most its cores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from jobplane.contrib.ingest import HashingEmbedder, Ingest


class LatencyEmbedder:
    """:class:`HashingEmbedder` behind a remote embedding API's latency per chunk."""

    def __init__(self, seconds_per_chunk: float) -> None:
        self.seconds_per_chunk = seconds_per_chunk
        self._inner = HashingEmbedder()

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def dim(self) -> int:
        return self._inner.dim

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        time.sleep(self.seconds_per_chunk * len(texts))  # runs in a thread of the worker
        return self._inner.embed(texts)


def _seconds_per_chunk() -> float:
    return float(os.environ.get("BENCH_EMBED_MS_PER_CHUNK", "10")) / 1000


registry = Ingest(embedder=LatencyEmbedder(_seconds_per_chunk())).registry
