"""A tenant the maintenance store does not find: each of its tenant calls refuses
with TenantNotFound naming the tenant and its field, with the database faked to
find no row (the SQL itself is pinned by tests/integration/test_tenants_command.py)."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

import grpc
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from jobplane.errors import TenantNotFound
from jobplane.store.maintenance import MaintenanceStore, Tenant

_ID = uuid.UUID(int=7)


class _Nothing:
    """A result without rows."""

    def first(self) -> None:
        return None


class _Connection:
    async def __aenter__(self) -> _Connection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def execute(self, statement: Any, params: Any = None) -> _Nothing:
        return _Nothing()


class _Engine:
    """An engine (and its autocommit twin) whose every statement finds no row."""

    def execution_options(self, **options: Any) -> _Engine:
        return self

    def connect(self) -> _Connection:
        return _Connection()


_CALLS: list[tuple[str, Callable[[MaintenanceStore], Awaitable[Tenant]]]] = [
    (str(_ID), lambda store: store.tenant(_ID)),
    ("acme", lambda store: store.tenant_named("acme")),
    ("acme", lambda store: store.set_retention("acme", 30)),
    ("acme", lambda store: store.set_weight("acme", 5)),
]


@pytest.mark.parametrize(
    ("named", "call"), _CALLS, ids=["tenant", "tenant_named", "set_retention", "set_weight"]
)
async def test_a_missing_tenant_is_not_found_naming_it_and_the_tenant_field(
    named: str, call: Callable[[MaintenanceStore], Awaitable[Tenant]]
) -> None:
    store = MaintenanceStore(cast(AsyncEngine, _Engine()))
    with pytest.raises(TenantNotFound) as missing:
        await call(store)
    error = missing.value
    assert (error.message, error.field) == (f"no tenant {named!r}", "tenant")
    assert (error.code, error.reason) == (grpc.StatusCode.NOT_FOUND, "TENANT_NOT_FOUND")
