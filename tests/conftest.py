"""Shared fixtures: one real PostgreSQL per session, a migrated template, a clone per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from appliance.bus.core import Bus, BusConfig
from appliance.db.database import Database, Endpoints
from appliance.db.message_store import PgMessageStore
from appliance.db.tenant_store import PgTenantStore
from tests.pgserver import PgTestServer, session_server


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgTestServer]:
    with session_server() as server:
        server.create_template()
        yield server


@pytest.fixture
def fresh_db(pg_server: PgTestServer) -> Iterator[Endpoints]:
    """A migrated database of this test's own, dropped afterwards."""
    name = pg_server.clone()
    try:
        yield pg_server.endpoints(name)
    finally:
        pg_server.drop(name)


@pytest.fixture
async def db(fresh_db: Endpoints) -> AsyncIterator[Database]:
    database = Database(fresh_db, min_size=1, max_size=16)
    await database.open()
    try:
        yield database
    finally:
        await database.close()


@pytest.fixture
def store(db: Database) -> PgMessageStore:
    return PgMessageStore(db)


@pytest.fixture
def tenants(db: Database) -> PgTenantStore:
    return PgTenantStore(db)


@pytest.fixture
async def bus(store: PgMessageStore, tenants: PgTenantStore) -> Bus:
    for name in ("acme", "globex"):
        await tenants.add(name)
    return Bus(store, BusConfig())
