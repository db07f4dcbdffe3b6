"""The Qdrant side of ingestion: one module owns the client.

``open_index(settings)`` gives an :class:`Index`: a Qdrant server when
``JOBPLANE_QDRANT_URL`` is set, else Qdrant's embedded local mode in
``JOBPLANE_QDRANT_PATH`` (``<JOBPLANE_DATA_DIR>/qdrant``). Local mode keeps
its collections in SQLite files under a lock that one process at a time may
hold, so:

- every :class:`Index` of one process and one location shares one client,
  opened at its first call (not when the index is made: a worker that never
  runs an index stage never takes the lock) and closed with the last index;
- the local client's calls run on one thread of their own, one at a time
  (they are blocking SQLite writes; the event loop, and with it the
  handlers' heartbeats, goes on meanwhile);
- a second process on the same path gets :class:`IndexUnavailable`, which a
  handler treats as retryable: run the index stage's queue in one worker
  process (docs/ingestion.md).

Every point's payload carries ``tenant_id`` and every read and delete here
filters on it: no call of this module reaches another tenant's points.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from jobplane.config import Settings

if TYPE_CHECKING:
    from qdrant_client.http import models

log = structlog.get_logger("jobplane.ingest.index")

#: The collection points go to when the job names none.
DEFAULT_COLLECTION = "jobplane_ingest"
#: Metadata of the collections ingestion made: ``delete_tenant`` looks only at these.
COLLECTION_MARK = {"jobplane": "ingest"}
_COLLECTION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
# Points per upsert call: a request stays well under the server's 32 MiB limit
# with 4096-dimensional vectors, and a local-mode call holds its thread briefly.
UPSERT_BATCH = 128

#: The namespace of point ids (uuid5): fixed forever, or every id changes.
POINT_NAMESPACE = uuid.UUID("5b0f3a4e-8f1c-5d2a-9a57-2f6f0c1e7d93")


def point_id(tenant_id: str, file: str, chunk_index: int, pipeline_version: str) -> uuid.UUID:
    """The id of a file's chunk: uuid5 of (tenant, file, chunk index, pipeline version).

    The same chunk of the same file always has the same id, whatever the
    file's content: a new upload of a file overwrites its points in place, so
    a file never has two points for one chunk, whatever crashed when.
    """
    key = json.dumps([tenant_id, file, chunk_index, pipeline_version], ensure_ascii=False)
    return uuid.uuid5(POINT_NAMESPACE, key)


def check_collection(name: str) -> str:
    """``name`` when it can name a collection, else ValueError."""
    if not isinstance(name, str) or not _COLLECTION.match(name):
        raise ValueError(
            "collection must be 1..63 letters, digits, '_' or '-', starting with a letter or digit"
        )
    return name


class IndexUnavailable(Exception):
    """Qdrant cannot be reached (or its local path is held by another process); try later."""


def _ingestions(name: str, info: Any) -> bool:
    """Whether collection ``name`` (its ``get_collection`` info) is one ingestion made:
    marked so, or the default collection, ingestion's even on a server too old to
    keep collection metadata."""
    metadata = getattr(info.config, "metadata", None) or {}
    return bool(
        metadata.get("jobplane") == COLLECTION_MARK["jobplane"] or name == DEFAULT_COLLECTION
    )


class CollectionMismatch(ValueError):
    """The collection exists with vectors of another size (another embedder)."""


@dataclass(frozen=True, slots=True)
class Point:
    """One point to upsert: its id, vector and payload (which must hold ``tenant_id``)."""

    id: uuid.UUID
    vector: Sequence[float]
    payload: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Hit:
    """One search result."""

    id: str
    score: float
    payload: dict[str, Any] = field(default_factory=dict)


class _Client:
    """One Qdrant client of this process for one location, shared by its indexes."""

    def __init__(self, key: str, settings: Settings) -> None:
        self.key = key
        self.users = 0
        self._settings = settings
        self._client: Any = None
        self._local = settings.qdrant_url is None
        # Local mode: one thread runs every call, in order (SQLite, one lock).
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._opening = asyncio.Lock()

    @property
    def local(self) -> bool:
        return self._local

    async def call(self, method: str, /, **kwargs: Any) -> Any:
        client = await self._open()
        try:
            if self._thread is not None:
                loop = asyncio.get_running_loop()
                bound = functools.partial(getattr(client, method), **kwargs)
                return await loop.run_in_executor(self._thread, bound)
            return await getattr(client, method)(**kwargs)
        except Exception as exc:
            if _down(exc):
                raise IndexUnavailable(f"Qdrant {method} failed: {_describe(exc)}") from exc
            raise

    async def _open(self) -> Any:
        if self._client is not None:
            return self._client
        async with self._opening:
            if self._client is None:
                # qdrant-client's first import takes a second (its models): not
                # on the event loop, where it would hold up the heartbeats.
                await asyncio.to_thread(importlib.import_module, "qdrant_client")
                self._client = await self._connect()
        return self._client

    async def _connect(self) -> Any:
        settings = self._settings
        if settings.qdrant_url is not None:
            from qdrant_client import AsyncQdrantClient

            log.info("ingest.index.opened", url=settings.qdrant_url)
            return AsyncQdrantClient(
                url=settings.qdrant_url,
                api_key=settings.qdrant_api_key,
                timeout=30,
                check_compatibility=False,
            )
        path = settings.qdrant_location
        thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="qdrant-local")
        loop = asyncio.get_running_loop()
        try:
            client = await loop.run_in_executor(thread, functools.partial(_local, path))
        except RuntimeError as exc:  # "already accessed by another instance"
            thread.shutdown(wait=False)
            raise IndexUnavailable(
                f"the local Qdrant at {path} is open in another process ({exc}); run the "
                "index stage in one worker process, or set JOBPLANE_QDRANT_URL"
            ) from exc
        self._thread = thread
        log.info("ingest.index.opened", path=str(path))
        return client

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        if self._thread is not None:
            thread, self._thread = self._thread, None
            await asyncio.get_running_loop().run_in_executor(thread, client.close)
            thread.shutdown(wait=True)
        else:
            await client.close()


def _local(path: Path) -> Any:
    from qdrant_client import QdrantClient

    path.mkdir(parents=True, exist_ok=True)
    _check_unlocked(path / ".lock")
    return QdrantClient(path=str(path))


def _check_unlocked(lock: Path) -> None:
    """Raise RuntimeError when another process holds local Qdrant's lock on ``lock``.

    Qdrant's client finds this out too, but leaks the lock file's handle
    when it does; this look closes its own.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: Qdrant's client checks alone
        return
    try:
        handle = lock.open("a")
    except OSError:
        return  # Qdrant's client says what is wrong with the path
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"{lock} is locked") from None
        fcntl.flock(handle, fcntl.LOCK_UN)


_clients: dict[str, _Client] = {}


def _location(settings: Settings) -> str:
    if settings.qdrant_url is not None:
        return settings.qdrant_url
    return str(settings.qdrant_location.resolve())


def open_index(settings: Settings, *, collection: str = DEFAULT_COLLECTION) -> Index:
    """An index on the Qdrant ``settings`` name; close it (or use ``async with``) when done.

    Indexes of one process on one location share one client (see the module's docstring).
    """
    key = _location(settings)
    client = _clients.get(key)
    if client is None:
        client = _clients[key] = _Client(key, settings)
    client.users += 1
    return Index(client, check_collection(collection))


class Index:
    """Points of files, by tenant, in Qdrant collections (see :func:`open_index`)."""

    def __init__(self, client: _Client, collection: str) -> None:
        self._client = client
        self.collection = collection
        self._closed = False
        self._known: dict[str, int] = {}

    @property
    def local(self) -> bool:
        """True in Qdrant's embedded local mode."""
        return self._client.local

    async def __aenter__(self) -> Index:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Give this index up; the last index of a location closes its client."""
        if self._closed:
            return
        self._closed = True
        client = self._client
        client.users -= 1
        if client.users <= 0 and _clients.get(client.key) is client:
            del _clients[client.key]
            await client.close()

    async def ensure_collection(self, dim: int, *, collection: str | None = None) -> str:
        """Create the collection for vectors of ``dim`` unless it exists; returns its name.

        Raises :class:`CollectionMismatch` when it exists with another size.
        """
        name = check_collection(collection or self.collection)
        if self._known.get(name) == dim:
            return name
        from qdrant_client.http import models

        if not await self._client.call("collection_exists", collection_name=name):
            try:
                await self._client.call(
                    "create_collection",
                    collection_name=name,
                    vectors_config=models.VectorParams(size=dim, distance=models.Distance.COSINE),
                    metadata=dict(COLLECTION_MARK),
                )
            except IndexUnavailable:
                raise
            except Exception:
                # Another worker made it meanwhile; anything else raises again below.
                if not await self._client.call("collection_exists", collection_name=name):
                    raise
            else:
                log.info("ingest.collection.created", collection=name, dim=dim)
            if not self._client.local:
                # Local mode has no payload indexes (it scans); a server needs
                # them for tenant-filtered search at scale.
                await self._payload_index(name, "tenant_id", tenant=True)
                await self._payload_index(name, "file", tenant=False)
                await self._payload_index(name, "version", tenant=False)
        info = await self._client.call("get_collection", collection_name=name)
        if not _ingestions(name, info):
            # Another application's collection on a shared server: a tenant's
            # payload must not write into it (nor would erasure look there).
            raise CollectionMismatch(
                f"collection {name!r} was not made by ingestion; name another collection"
            )
        size = int(info.config.params.vectors.size)
        if size != dim:
            raise CollectionMismatch(
                f"collection {name!r} holds vectors of {size} dimensions, the embedder makes {dim}"
            )
        self._known[name] = dim
        return name

    async def _payload_index(self, name: str, field_name: str, *, tenant: bool) -> None:
        from qdrant_client.http import models

        await self._client.call(
            "create_payload_index",
            collection_name=name,
            field_name=field_name,
            field_schema=models.KeywordIndexParams(
                type=models.KeywordIndexType.KEYWORD, is_tenant=tenant or None
            ),
            wait=True,
        )

    async def upsert(self, points: Sequence[Point], *, collection: str | None = None) -> int:
        """Write ``points`` (each overwrites the point of its id), waiting until applied."""
        from qdrant_client.http import models

        name = check_collection(collection or self.collection)
        for point in points:
            if not isinstance(point.payload.get("tenant_id"), str):
                raise TypeError("every point's payload needs its tenant_id")
        for at in range(0, len(points), UPSERT_BATCH):
            batch = [
                models.PointStruct(id=str(p.id), vector=list(p.vector), payload=dict(p.payload))
                for p in points[at : at + UPSERT_BATCH]
            ]
            await self._client.call("upsert", collection_name=name, points=batch, wait=True)
        return len(points)

    async def delete_file_points(
        self,
        tenant_id: str,
        file: str,
        keep_version: str | None = None,
        *,
        collection: str | None = None,
    ) -> None:
        """Delete the tenant's points of ``file``, but those of version ``keep_version``."""
        from qdrant_client.http import models

        name = check_collection(collection or self.collection)
        if not await self._exists(name):
            return
        keep: list[models.Condition] | None = None
        if keep_version is not None:
            keep = [
                models.FieldCondition(key="version", match=models.MatchValue(value=keep_version))
            ]
        selector = models.FilterSelector(
            filter=models.Filter(must=_of(tenant_id, file), must_not=keep)
        )
        await self._client.call("delete", collection_name=name, points_selector=selector, wait=True)

    async def delete_tenant(self, tenant_id: str) -> int:
        """Delete every point of the tenant in every collection ingestion made; returns how many."""
        from qdrant_client.http import models

        found = await self._client.call("get_collections")
        deleted = 0
        for description in found.collections:
            name = description.name
            info = await self._client.call("get_collection", collection_name=name)
            if not _ingestions(name, info):
                continue
            deleted += await self._count(name, _of(tenant_id))
            await self._client.call(
                "delete",
                collection_name=name,
                points_selector=models.FilterSelector(filter=models.Filter(must=_of(tenant_id))),
                wait=True,
            )
        log.info("ingest.tenant.deleted", tenant=tenant_id, points=deleted)
        return deleted

    async def count(
        self, tenant_id: str, file: str | None = None, *, collection: str | None = None
    ) -> int:
        """Points of the tenant (of one file when ``file`` is given); exact."""
        name = check_collection(collection or self.collection)
        if not await self._exists(name):
            return 0
        return await self._count(name, _of(tenant_id, file))

    async def _count(self, name: str, must: list[models.Condition]) -> int:
        from qdrant_client.http import models

        found = await self._client.call(
            "count", collection_name=name, count_filter=models.Filter(must=must), exact=True
        )
        return int(found.count)

    async def search(
        self,
        tenant_id: str,
        vector: Sequence[float],
        limit: int = 10,
        *,
        collection: str | None = None,
    ) -> list[Hit]:
        """The tenant's points nearest to ``vector``, best first."""
        from qdrant_client.http import models

        name = check_collection(collection or self.collection)
        if not await self._exists(name):
            return []
        found = await self._client.call(
            "query_points",
            collection_name=name,
            query=list(vector),
            query_filter=models.Filter(must=_of(tenant_id)),
            limit=limit,
            with_payload=True,
        )
        return [Hit(str(p.id), float(p.score), dict(p.payload or {})) for p in found.points]

    async def points(
        self, tenant_id: str, file: str | None = None, *, collection: str | None = None
    ) -> list[Hit]:
        """Every point of the tenant (of one file), by id, with payloads (score 0)."""
        from qdrant_client.http import models

        name = check_collection(collection or self.collection)
        if not await self._exists(name):
            return []
        hits: list[Hit] = []
        offset: Any = None
        while True:
            records, offset = await self._client.call(
                "scroll",
                collection_name=name,
                scroll_filter=models.Filter(must=_of(tenant_id, file)),
                limit=256,
                offset=offset,
                with_payload=True,
            )
            hits += [Hit(str(r.id), 0.0, dict(r.payload or {})) for r in records]
            if offset is None:
                return sorted(hits, key=lambda h: h.id)

    async def _exists(self, name: str) -> bool:
        return name in self._known or bool(
            await self._client.call("collection_exists", collection_name=name)
        )


def _of(tenant_id: str, file: str | None = None) -> list[models.Condition]:
    from qdrant_client.http import models

    must: list[models.Condition] = [
        models.FieldCondition(key="tenant_id", match=models.MatchValue(value=tenant_id))
    ]
    if file is not None:
        must.append(models.FieldCondition(key="file", match=models.MatchValue(value=file)))
    return must


def _down(exc: BaseException) -> bool:
    """True when ``exc`` says Qdrant is out of reach, not that the request was wrong."""
    from qdrant_client.http.exceptions import ResponseHandlingException, UnexpectedResponse

    if isinstance(exc, ResponseHandlingException | ConnectionError | TimeoutError):
        return True
    if isinstance(exc, UnexpectedResponse):
        return exc.status_code in (429, 500, 502, 503, 504)
    try:
        import httpx
    except ImportError:  # pragma: no cover - a dependency of qdrant-client
        return False
    return isinstance(exc, httpx.TransportError)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
