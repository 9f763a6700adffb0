"""Writes under a lease read the row they write, whatever the statistics.

Runtime connections keep one generic plan per statement (migration 0009). A plan made while
few messages ran, on statistics that say none do, takes the partial index of running messages
for empty; a statement that found its message through that index read every running message.
Every statement fenced by (id, lease token) must find its row by primary key instead
(migration 0013)."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from appliance.db.database import Database
from appliance.db.runner_store import PgRunnerStore
from appliance.domain.envelope import LeaseRef
from tests.db.plans import (
    backlog,
    explain,
    explained_session,
    hot_reads,
    plan_nodes,
    plans_of,
    prepare,
    reads_index,
    rows_written,
    take,
)

RUNNING_INDEX = "agent_messages_lease_expires_at_idx"
RUNNING = 1500  # messages running when the kept plans are used

# Parameter types of the statements fenced by lease (PREPARE needs them).
SCALAR = {
    "now": "timestamptz",
    "actor": "text",
    "reason": "text",
    "error": "text",
    "id": "bigint",
    "token": "bigint",
    "retry_delay": "interval",
    "delay": "interval",
    "status": "text",
    "waiting_for": "text",
    "expires_at": "timestamptz",
    "stage": "text",
    "wait": "interval",
    "alive": "interval",
}
ARRAYS = {
    **SCALAR,
    "id": "bigint[]",
    "token": "bigint[]",
    "extend": "interval",
    "acks": "jsonb",
    "lock_timeout": "text",
}
FENCED = {
    "message_complete": ARRAYS,
    "message_heartbeat_many": ARRAYS,
    "message_release": ARRAYS,
    "message_fail": SCALAR,
    "message_expire_running": SCALAR,
    "message_park": SCALAR,
    "message_park_stage": SCALAR,
    "message_terminate": SCALAR,
    "message_defer": SCALAR,
}
# The hazard itself: the same probe written with the status.
CONTROL = (
    "PREPARE control (bigint, bigint) AS SELECT m.id FROM appliance.agent_messages m"
    " WHERE m.id = $1 AND m.lease_token = $2 AND m.status = 'running'"
)


def values(name: str, leases: list[LeaseRef]) -> dict[str, Any]:
    """Arguments of `name` for these leases (a statement of one lease takes the first)."""
    return {
        "acks": json.dumps([[x.message_id, x.lease_token, None, None] for x in leases]),
        "id": [x.message_id for x in leases] if FENCED[name] is ARRAYS else leases[0].message_id,
        "token": (
            [x.lease_token for x in leases] if FENCED[name] is ARRAYS else leases[0].lease_token
        ),
        "now": None,
        "actor": "w",
        "reason": "test",
        "error": "boom",
        "retry_delay": "1 second",
        "delay": "1 second",
        "extend": "30 seconds",
        "status": "waiting_capability",
        "waiting_for": "small",
        "expires_at": "infinity",
        "stage": "p/s",
        "wait": "1 hour",
        "alive": "30 seconds",
        "lock_timeout": "5s",
    }


async def test_writes_under_a_lease_probe_by_key_with_plans_kept_from_before(
    quiet_db: Database,
) -> None:
    rstore = PgRunnerStore(quiet_db)
    await backlog(quiet_db, 4000)
    async with quiet_db.system_pool.connection() as aconn:
        setting = await (await aconn.execute("SHOW plan_cache_mode")).fetchone()
        assert setting is not None and setting["plan_cache_mode"] == "force_generic_plan"
        cur = psycopg.AsyncClientCursor(aconn, row_factory=dict_row)
        calls = {name: await prepare(aconn, name, types) for name, types in FENCED.items()}
        await aconn.execute(CONTROL)
        # The generic plans, made while nothing runs (a lease no message holds: no change).
        nobody = [LeaseRef(message_id=0, lease_token=0)]
        for name, call in calls.items():
            await cur.execute(call, values(name, nobody))
        await cur.execute("EXECUTE control(0, 0)")

        leases = await take(rstore, RUNNING)
        # Autocommit: each EXPLAIN ANALYZE runs its statement for real (a rollback would make
        # the driver deallocate the prepared statements).
        first = {"id": leases[0].message_id, "token": leases[0].lease_token}
        control = await explain(cur, "EXECUTE control(%(id)s::bigint, %(token)s::bigint)", first)
        plans = {
            name: await explain(cur, call, values(name, leases[1 + 10 * i : 11 + 10 * i]))
            for i, (name, call) in enumerate(calls.items())
        }
    # Precondition, or this test proves nothing: the kept plan of the status probe reads every
    # running message to find one.
    assert reads_index(control, RUNNING_INDEX) and hot_reads(control) >= RUNNING - 1
    for name, plan in plans.items():
        assert not reads_index(plan, RUNNING_INDEX), name
        # Each of its (at most 10) leases' rows read a few times: found, locked, written,
        # reported. Never the running set.
        assert hot_reads(plan) <= 60, (name, hot_reads(plan))
        # And it did its work: the update wrote (and returned) its rows.
        assert rows_written(plan) >= 1, name


async def test_spend_reserve_checks_its_lease_by_key_with_a_plan_kept_from_before(
    quiet_db: Database,
) -> None:
    # The lease check inside spend_reserve() (every model call runs it) is a PL/pgSQL query:
    # its plan is kept per session like a prepared statement's. auto_explain shows it.
    rstore = PgRunnerStore(quiet_db)
    await backlog(quiet_db, 3000)
    async with explained_session(quiet_db.endpoints.admin) as (conn, plans):
        reserve = (
            "SELECT * FROM spend_reserve('acme', 'interactive', 0.01, %s, %s, 'p', 's',"
            " 'generate', 'm', 'small', NULL)"
        )
        # The plan, made while nothing runs: a lease no message holds is refused.
        with pytest.raises(psycopg.errors.LockNotAvailable):
            await conn.execute(reserve, (0, 0))
        leases = await take(rstore, RUNNING)
        plans.clear()
        await conn.execute(reserve, (leases[0].message_id, leases[0].lease_token))
    (plan,) = plans_of(plans, "agent_messages am")
    assert not reads_index(plan, RUNNING_INDEX)
    assert hot_reads(plan) <= 2


async def test_batched_writes_under_leases_read_their_own_results_once(
    quiet_db: Database,
) -> None:
    # A batch's statement joined its own UPDATE's results (a data-modifying CTE, estimated at
    # one row) by a nested loop: every lease of the batch read all of them again, quadratic in
    # the batch (a third of a 100-acknowledgement statement's time). Each is read once now.
    rstore = PgRunnerStore(quiet_db)
    await backlog(quiet_db, 20_000)  # large enough for index probes and nested loops
    batched = ("message_complete", "message_heartbeat_many")
    async with quiet_db.system_pool.connection() as aconn:
        cur = psycopg.AsyncClientCursor(aconn, row_factory=dict_row)
        calls = {name: await prepare(aconn, name, FENCED[name]) for name in batched}
        leases = await take(rstore, 200)
        plans = {
            name: await explain(cur, call, values(name, leases[100 * i : 100 * (i + 1)]))
            for i, (name, call) in enumerate(calls.items())
        }
    for name, plan in plans.items():
        assert rows_written(plan) == 100, name  # the whole batch was written
        rescanned = [
            (n.get("CTE Name"), n["Actual Loops"])
            for n in plan_nodes(plan["Plan"])
            if n["Node Type"] == "CTE Scan" and int(n["Actual Loops"]) > 1
        ]
        assert rescanned == [], (name, rescanned)
