"""Fixtures of the database tests beyond the shared ones."""

from __future__ import annotations

from collections.abc import AsyncIterator

import psycopg
import pytest

from appliance.db.database import Database, Endpoints
from appliance.db.tenant_store import PgTenantStore


@pytest.fixture
async def quiet_db(fresh_db: Endpoints) -> AsyncIterator[Database]:
    """A database (tenant acme) whose statistics change only when the test says: no
    autovacuum on the tables whose plans the tests read."""
    with psycopg.connect(fresh_db.admin, autocommit=True) as conn:
        for table in ("agent_messages", "spend_ledger", "run_budgets"):
            conn.execute(f"ALTER TABLE appliance.{table} SET (autovacuum_enabled = off)")
    db = Database(fresh_db, max_size=2)
    await db.open()
    try:
        await PgTenantStore(db).add("acme")
        yield db
    finally:
        await db.close()
