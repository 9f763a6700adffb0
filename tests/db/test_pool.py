"""The runtime pools hand out the connection returned last (appliance/db/pool.py)."""

from __future__ import annotations

import asyncio

from appliance.db.database import Database, Endpoints
from appliance.db.pool import LifoConnectionPool


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
