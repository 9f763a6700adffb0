"""The runtime pools: the connection returned last is handed out first (appliance/db/pool.py);
a statement is cancelled past the statement timeout; TCP connections keep alive."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from appliance.bus.core import Bus
from appliance.db.database import Database, Endpoints
from appliance.db.message_store import PgMessageStore
from appliance.db.pool import LifoConnectionPool
from appliance.db.tenant_store import PgTenantStore


async def _pid(db: Database) -> int:
    async with db.system_conn() as conn:
        row = await (await conn.execute("SELECT pg_backend_pid() AS pid")).fetchone()
    assert row is not None
    return int(row["pid"])


async def test_a_sequential_caller_keeps_one_server_process(fresh_db: Endpoints) -> None:
    db = Database(fresh_db, min_size=4, max_size=4)
    await db.open()
    try:
        assert isinstance(db.system_pool, LifoConnectionPool)
        # Four connections exist and are idle; one statement after another uses one of them.
        assert len({await _pid(db) for _ in range(12)}) == 1
    finally:
        await db.close()


async def test_idle_connections_are_taken_last_returned_first(fresh_db: Endpoints) -> None:
    db = Database(fresh_db, min_size=3, max_size=3)
    await db.open()
    try:
        pool = db.system_pool
        conns = [await pool.getconn() for _ in range(3)]
        for conn in conns:  # returned in order: the last one back is on top
            await pool.putconn(conn)
        taken = [await pool.getconn() for _ in range(3)]
        assert taken == conns[::-1]
        for conn in taken:
            await pool.putconn(conn)
        # Concurrent callers still each get a connection of their own.
        async with asyncio.TaskGroup() as group:
            pids = [group.create_task(_pid_held(db)) for _ in range(3)]
        assert len({task.result() for task in pids}) == 3
    finally:
        await db.close()


async def _pid_held(db: Database) -> int:
    async with db.system_conn() as conn:
        row = await (await conn.execute("SELECT pg_backend_pid() AS pid")).fetchone()
        await asyncio.sleep(0.2)  # held while the others take theirs
    assert row is not None
    return int(row["pid"])


async def test_a_claim_behind_a_forgotten_lock_is_cancelled_not_waited_on_for_ever(
    fresh_db: Endpoints,
) -> None:
    # An operator's psql session left a transaction open holding the tenant's claim counter:
    # the claim waited for it with no end, and its runner with it. Past the statement timeout
    # the server cancels it, and the runner's loop sees an error it logs and retries.
    db = Database(fresh_db, statement_timeout=timedelta(seconds=2))
    await db.open()
    try:
        await PgTenantStore(db).add("acme")
        bus = Bus(PgMessageStore(db))
        await bus.enqueue(tenant="acme", pipeline="p", stage="s", source="t", source_id="1",
                          directive="d")  # fmt: skip
        async with await psycopg.AsyncConnection.connect(fresh_db.admin) as forgotten:
            await forgotten.execute(
                "SELECT 1 FROM appliance.tenant_runtime WHERE tenant = 'acme' FOR UPDATE"
            )
            began = time.monotonic()
            with pytest.raises(psycopg.errors.QueryCanceled, match="statement timeout"):
                await bus.claim("w", limit=1)
            assert time.monotonic() - began < 10
            await forgotten.rollback()
        (claimed,) = await bus.claim("w", limit=1)  # the lock gone, the claim goes through
        assert claimed.source_id == "1"
        for pool in (db.app_pool, db.system_pool):
            async with pool.connection() as conn:
                row = await (await conn.execute("SHOW statement_timeout")).fetchone()
                assert row is not None and row["statement_timeout"] == "2s"
    finally:
        await db.close()


async def test_runtime_connections_ask_for_tcp_keepalives(fresh_db: Endpoints) -> None:
    # Ignored on the Unix socket the tests use; over TCP they notice a vanished server. One
    # the connection string sets itself is the operator's: kept, not overridden.
    app = make_conninfo(fresh_db.app, keepalives_idle=7)
    db = Database(Endpoints(fresh_db.admin, app, fresh_db.system))
    await db.open()
    try:
        async with db.system_conn() as conn:
            system = conn.info.get_parameters()
            row = await (await conn.execute("SHOW statement_timeout")).fetchone()
        async with db.app_pool.connection() as conn:
            tenant = conn.info.get_parameters()
        assert row is not None and row["statement_timeout"] == "5min"
    finally:
        await db.close()
    assert system.get("keepalives") == "1"
    assert system.get("keepalives_idle") == "30"
    assert system.get("tcp_user_timeout") == "60000"
    assert tenant.get("keepalives_idle") == "7" and tenant.get("keepalives") == "1"


def test_a_statement_timeout_below_a_millisecond_is_refused(fresh_db: Endpoints) -> None:
    with pytest.raises(ValueError, match="statement_timeout"):
        Database(fresh_db, statement_timeout=timedelta(0))


async def test_connections_idle_a_while_are_checked_before_they_are_handed_out(
    fresh_db: Endpoints,
) -> None:
    """After a server restart (here: every backend of the pool ended by an operator), each
    idle connection was handed out dead and failed one caller."""
    db = Database(fresh_db, min_size=4, max_size=4)
    await db.open()
    try:
        barrier = asyncio.Barrier(4)

        async def hold() -> int:
            async with db.system_conn() as conn:
                row = await (await conn.execute("SELECT pg_backend_pid() AS pid")).fetchone()
                await barrier.wait()  # all four connections out at once: each is used
            assert row is not None
            return int(row["pid"])

        pids = await asyncio.gather(*(hold() for _ in range(4)))
        assert len(set(pids)) == 4
        async with await psycopg.AsyncConnection.connect(fresh_db.admin, autocommit=True) as adm:
            await adm.execute("SELECT pg_terminate_backend(p) FROM unnest(%s::int[]) AS p", [pids])
        # Idle "a while" without waiting for it: every idle connection counts as idle long.
        assert isinstance(db.system_pool, LifoConnectionPool)
        db.system_pool.idle_check_s = 0.0
        fresh = [await _pid(db) for _ in range(6)]
        assert not set(fresh) & set(pids)
    finally:
        await db.close()


async def test_a_runtime_roles_own_defaults_cannot_stop_writes_row_security_or_durability(
    fresh_db: Endpoints,
) -> None:
    # An ordinary role may ALTER ROLE its own defaults, and every tenant's SQL runs as one
    # role: read-only transactions, row security off (every tenant's statement fails) or
    # commits that may be lost would have applied to every connection opened after.
    with psycopg.connect(fresh_db.admin, autocommit=True) as adm:
        dbname = adm.info.dbname
        for role in ("appliance_app", "appliance_system"):
            for setting in (
                "default_transaction_read_only = on",
                "row_security = off",
                "synchronous_commit = off",
            ):
                adm.execute(f'ALTER ROLE {role} IN DATABASE "{dbname}" SET {setting}')
    db = Database(fresh_db)
    await db.open()
    try:
        await PgTenantStore(db).add("acme")
        bus = Bus(PgMessageStore(db))
        done = await bus.enqueue(
            tenant="acme", pipeline="p", stage="s", source="t", source_id="1", directive="d"
        )
        assert done.new and await bus.get("acme", done.id) is not None
        for conn_of in (db.system_conn(), db.tenant_tx("acme")):
            async with conn_of as conn:
                row = await (
                    await conn.execute(
                        "SELECT current_setting('synchronous_commit') AS sc,"
                        " current_setting('row_security') AS rs,"
                        " current_setting('default_transaction_read_only') AS ro"
                    )
                ).fetchone()
            assert row == {"sc": "on", "rs": "on", "ro": "off"}
    finally:
        await db.close()
