"""Upkeep statements read what they touch, whatever the statistics their kept plans were made on
(migration 0014): releasing holds whose lease is gone, resuming work that waited for a tier or
for budget, expiring waits, and keeping run_budgets' statistics current; and the update
trigger's joins stay linear in a statement's size, whatever size its plans were made for
(migration 0015); and a purge of expired idempotency keys reads a bounded window of the table
(migration 0016); and the promoter reads only deferred work that has come due (migration 0020).

Each test builds the situation in which the old statement read the whole table (or the whole
history) and counts the rows the statement reads now."""

from __future__ import annotations

from datetime import UTC, datetime

import psycopg
from psycopg.rows import dict_row

from appliance.bus.core import Bus
from appliance.db.database import Database
from appliance.db.message_store import complete_params
from appliance.db.queries import q
from appliance.db.runner_store import PgRunnerStore
from appliance.domain.envelope import LeaseRef
from appliance.domain.inference import Tier
from appliance.domain.ports import Completion
from tests.db.plans import (
    admin_sql,
    backlog,
    claim_values,
    explain,
    explained_session,
    hot_reads,
    plan_nodes,
    plans_of,
    prepare,
    rows_written,
    take,
)

TYPES = {
    "now": "timestamptz",
    "actor": "text",
    "reason": "text",
    "batch": "integer",
    "tiers": "text[]",
    "earlier_months_only": "boolean",
    "tenant": "text",
    "lanes": "lane[]",
}


async def test_release_of_holds_whose_lease_is_gone_reads_the_reserved_holds_only(
    quiet_db: Database,
) -> None:
    # The reclaimer runs this every second. With a long spend history and a few calls in
    # flight, it walked the ledger's primary key through the history (on current statistics).
    await backlog(quiet_db, 20000)
    await take(PgRunnerStore(quiet_db), 100)
    await admin_sql(
        quiet_db,
        "INSERT INTO appliance.spend_ledger (month, tenant, status, amount, created_at,"
        " settled_at) SELECT date '2026-11-01', 'acme', 'settled', 0.001, now(), now()"
        " FROM generate_series(1, 40000)",
        # Holds of calls in flight: their leases are current, so nothing is released.
        "INSERT INTO appliance.spend_ledger (month, tenant, message_id, lease_token, status,"
        " reserved, created_at) SELECT date '2026-11-01', tenant, id, lease_token, 'reserved',"
        " 0.01, now() FROM appliance.agent_messages WHERE status = 'running'",
        "ANALYZE appliance.spend_ledger",
    )
    async with explained_session(quiet_db.endpoints.admin) as (conn, plans):
        for _ in range(2):  # the second call runs the plan the session keeps
            row = await (await conn.execute("SELECT spend_release_dead(500, NULL)")).fetchone()
            assert row == (0,)
    plan = plans_of(plans, "FROM spend_ledger l")[-1]
    assert hot_reads(plan, "spend_ledger") <= 110, hot_reads(plan, "spend_ledger")


async def test_resuming_work_that_waited_for_a_tier_reads_only_that_work(
    quiet_db: Database,
) -> None:
    # Statistics taken during an outage (most work waiting for a tier); by the time the tier is
    # back up, nothing waits any more. Resumption runs after every model call.
    rstore = PgRunnerStore(quiet_db)
    await backlog(quiet_db, 4000)
    await admin_sql(
        quiet_db,
        "UPDATE appliance.agent_messages SET status = 'waiting_capability',"
        " waiting_for = 'mechanical', status_reason = 'test', status_actor = 'test'"
        " WHERE id IN (SELECT id FROM appliance.agent_messages ORDER BY id LIMIT 3000)",
        "ANALYZE appliance.agent_messages",
    )
    async with quiet_db.system_pool.connection() as aconn:
        cur = psycopg.AsyncClientCursor(aconn, row_factory=dict_row)
        call = await prepare(aconn, "message_resume_capability", TYPES)
        args = {"tiers": ["reasoning"], "batch": 500, "now": None, "actor": "test"}
        await cur.execute(call, args)  # the kept plan, made on those statistics
        assert await rstore.resume_capability([Tier.MECHANICAL]) == 3000
        plan = await explain(cur, call, {**args, "tiers": ["mechanical"]})
    assert rows_written(plan) == 0
    assert hot_reads(plan) <= 10, hot_reads(plan)


async def test_resuming_work_held_in_earlier_months_reads_no_hold_of_this_month(
    quiet_db: Database,
) -> None:
    # Statistics taken when nothing was held; then this month's cap holds 3,000 messages. The
    # month-rollover check (every 30 s) must not read this month's holds to find none.
    await backlog(quiet_db, 4000)
    async with quiet_db.system_pool.connection() as aconn:
        cur = psycopg.AsyncClientCursor(aconn, row_factory=dict_row)
        call = await prepare(aconn, "message_resume_budget", TYPES)
        stale = {
            "reason": "test",
            "actor": "test",
            "batch": 500,
            "now": datetime(2031, 3, 15, tzinfo=UTC),  # the holds' month (fixed: no rollover)
            "earlier_months_only": True,
            "tenant": None,
        }
        await cur.execute(call, stale)  # the kept plan, made while nothing is held
        await admin_sql(
            quiet_db,
            "UPDATE appliance.agent_messages SET status = 'held_budget',"
            " updated_at = '2031-03-10 12:00+00',"
            " status_reason = 'test', status_actor = 'test'"
            " WHERE id IN (SELECT id FROM appliance.agent_messages ORDER BY id LIMIT 3000)",
        )
        none_stale = await explain(cur, call, stale)
        # Raising the cap resumes them all, a batch at a time, each batch reading its own.
        first_batch = await explain(cur, call, {**stale, "earlier_months_only": False})
    assert rows_written(none_stale) == 0
    assert hot_reads(none_stale) <= 10, hot_reads(none_stale)
    assert rows_written(first_batch) == 500
    # Each hold of the batch found in the index of holds, probed by key, and written (1,500
    # here), with room for another plan shape; never the 3,000 holds.
    assert hot_reads(first_batch) <= 4 * 500, hot_reads(first_batch)


async def test_expiring_waits_does_not_reread_waits_that_ended(quiet_db: Database) -> None:
    # 3,000 approvals waited past their expiry and were expired; the expirer (every 5 s) must not
    # read them again on every round afterwards.
    await backlog(quiet_db, 3000)
    await admin_sql(
        quiet_db,
        "UPDATE appliance.agent_messages SET status = 'awaiting_approval',"
        " wait_expires_at = now() - interval '1 hour', status_reason = 'test',"
        " status_actor = 'test'",
    )
    bus = Bus(PgRunnerStore(quiet_db))
    expired = 0
    while n := await bus.expire():
        expired += n
    assert expired == 3000
    async with quiet_db.system_pool.connection() as aconn:
        cur = psycopg.AsyncClientCursor(aconn, row_factory=dict_row)
        call = await prepare(aconn, "message_expire_deadline", TYPES)
        plan = await explain(cur, call, {"now": None, "batch": 500, "actor": "test"})
    assert rows_written(plan) == 0
    assert hot_reads(plan) <= 10, hot_reads(plan)


async def test_promoting_due_work_reads_only_what_has_come_due(quiet_db: Database) -> None:
    # The promoter runs every second. Its plan is kept from a quiet time (nothing deferred);
    # then 20,000 messages wait to run and 3,000 retries back off for an hour: a round with
    # nothing due must read none of them, and a round with 500 due only those.
    await backlog(quiet_db, 20000)
    async with quiet_db.system_pool.connection() as aconn:
        cur = psycopg.AsyncClientCursor(aconn, row_factory=dict_row)
        call = await prepare(aconn, "message_promote_due", TYPES)
        promote = {"now": None, "batch": 500, "lanes": ["interactive", "system", "batch"]}
        await cur.execute(call, promote)  # the kept plan
        await admin_sql(
            quiet_db,
            "UPDATE appliance.agent_messages SET deferred = true,"
            " not_before = now() + interval '1 hour'"
            " WHERE id IN (SELECT id FROM appliance.agent_messages ORDER BY id LIMIT 3000)",
        )
        none_due = await explain(cur, call, promote)
        await admin_sql(
            quiet_db,
            "UPDATE appliance.agent_messages SET not_before = now() - interval '1 second'"
            " WHERE id IN (SELECT id FROM appliance.agent_messages ORDER BY id LIMIT 500)",
        )
        some_due = await explain(cur, call, promote)
    assert rows_written(none_due) == 0
    assert hot_reads(none_due) <= 10, hot_reads(none_due)
    assert rows_written(some_due) == 500
    assert hot_reads(some_due) <= 4 * 500, hot_reads(some_due)


async def test_run_budgets_are_reanalyzed_when_they_outgrow_their_statistics(
    quiet_db: Database,
) -> None:
    # Every reservation against a run's budget reads its row by key; a plan kept from when the
    # table was small scans it.
    await admin_sql(
        quiet_db,
        "INSERT INTO appliance.run_budgets (tenant, source, source_id, pipeline, limits,"
        " verification_reserve, started_at, used_at) SELECT 'acme', 'test', g::text, 'p', '{}',"
        " 0.1, now(), now() FROM generate_series(1, 6000) AS g",
    )
    rstore = PgRunnerStore(quiet_db)
    assert "run_budgets" in await rstore.refresh_planner_stats()
    assert "run_budgets" not in await rstore.refresh_planner_stats()  # current now


async def test_the_update_trigger_joins_a_large_statement_in_linear_time(
    quiet_db: Database,
) -> None:
    # The trigger's joins of old_rows with new_rows are planned once per session, for the first
    # statement's row count. A session whose first update wrote one row must not compare every
    # row with every row in a later update of 2,000; and the tenants' counter rows are still
    # found by key, however many tenants there are: by the statements for any number of
    # tenants (the 2,000 are of two tenants) and by those for one tenant (migration 0045).
    rstore = PgRunnerStore(quiet_db)
    await admin_sql(
        quiet_db,
        "INSERT INTO appliance.tenants (name) SELECT 't' || g FROM generate_series(1, 5000) g",
        "ANALYZE appliance.tenants, appliance.tenant_runtime, appliance.tenant_released_shards",
    )
    await backlog(quiet_db, 1100)
    await backlog(quiet_db, 1100, tenant="t1")
    (first,) = await take(rstore, 1)
    async with explained_session(quiet_db.endpoints.admin) as (conn, plans):
        ack = q("message_complete")
        one = complete_params([Completion(first)], actor="test", now=None)
        await conn.execute(ack, one)  # the trigger's plans, made for one row
        many = await take(rstore, 2000)
        plans.clear()
        await conn.execute(ack, complete_params([Completion(x) for x in many], actor="t", now=None))
        await conn.execute(q("message_claim_lane"), claim_values())
        general = list(plans)
        plans.clear()
        # One tenant's claim and acknowledgement.
        claimed = conn.cursor(row_factory=dict_row)
        await claimed.execute(q("message_claim_lane"), claim_values(tenant="acme"))
        rows = [r for r in await claimed.fetchall() if r["id"] is not None]
        assert {r["tenant"] for r in rows} == {"acme"}
        mine = [Completion(LeaseRef(r["id"], r["lease_token"])) for r in rows]
        await conn.execute(ack, complete_params(mine, actor="t", now=None))
        single = list(plans)
    joins = plans_of(general, "JOIN old_rows o ON o.id = n.id")
    assert len(joins) >= 7  # the counts, the log, leases ended, the hand-off; the claim's
    # Leases taken and ended: several tenants' by the general statements, one tenant's by key.
    assert len(plans_of(general, "FROM delta JOIN took")) == 1
    assert len(plans_of(general, "waited AS")) == 1
    assert not plans_of(general, "seen.first_tenant")
    assert len(plans_of(single, "seen.first_tenant")) == 2
    assert not plans_of(single, "FROM delta JOIN took") + plans_of(single, "waited AS")
    for plan in joins:
        loops = [n for n in plan_nodes(plan["Plan"]) if n["Node Type"] == "Nested Loop"]
        assert loops == [], plan["Query Text"]
    mine_counted = plans_of(single, "seen.first_tenant") + plans_of(single, "JOIN old_rows")
    for tenants, plan in [(2, p) for p in joins] + [(1, p) for p in mine_counted]:
        # By key: a tenant's counter row; its 8 shards of leases ended, read by tenant (to
        # pick a free one, to count it up): never the other tenants' rows.
        for counters, bound in (("tenant_runtime", 4), ("tenant_released_shards", 2 * 8)):
            assert hot_reads(plan, counters) <= tenants * bound, (counters, plan["Query Text"])
    # Counted right by either kind: each tenant's running leases are its running messages.
    async with await psycopg.AsyncConnection.connect(quiet_db.endpoints.admin) as conn:
        cur = await conn.execute(
            "SELECT r.tenant, r.running, (SELECT count(*) FROM appliance.agent_messages m"
            " WHERE m.tenant = r.tenant AND m.status = 'running')"
            " FROM appliance.tenant_running r WHERE r.tenant IN ('acme', 't1') ORDER BY 1"
        )
        counted = await cur.fetchall()
    assert [(t, running) for t, running, _ in counted] == [(t, n) for t, _, n in counted]
    assert all(n > 0 for _, _, n in counted)


KEYS = 200_000
WINDOW_PAGES = 1024  # purge_idempotency_keys' window


async def test_a_key_purge_reads_one_window_also_where_expired_keys_left_their_space(
    quiet_db: Database,
) -> None:
    # A full retention period: every key expired and was purged, VACUUM freed the space, and
    # the next period's keys filled it. A purge with nothing expired must not read them all
    # (a BRIN index on the expiry kept every reused range's old minimum, and read them all).
    fill = (
        "INSERT INTO appliance.idempotency_keys (tenant, key, message_id, created_at,"
        " expires_at) SELECT 'acme', 'k1:' || encode(sha256(('{0}' || g)::bytea), 'hex'), g,"
        " now() + interval '{1}', now() + interval '{1}' + interval '90 days'"
        f" FROM generate_series(1, {KEYS}) AS g"
    )
    await admin_sql(quiet_db, fill.format("old", "-91 days"))
    rstore = PgRunnerStore(quiet_db)
    purged, calls = 0, 0
    while purged < KEYS and calls < 200:
        purged, calls = purged + await rstore.purge_keys(batch=20_000), calls + 1
    assert purged == KEYS
    await admin_sql(quiet_db, "VACUUM appliance.idempotency_keys", fill.format("new", "0 days"))
    async with explained_session(quiet_db.endpoints.admin) as (conn, plans):
        size = await (
            await conn.execute("SELECT pg_relation_size('idempotency_keys') / 8192")
        ).fetchone()
        assert size is not None and size[0] >= 2 * WINDOW_PAGES  # more than one window
        plans.clear()
        row = await (await conn.execute("SELECT purge_idempotency_keys(NULL, 1000)")).fetchone()
        assert row == (0,)
    (plan,) = plans_of(plans, "FROM idempotency_keys d")
    assert hot_reads(plan, "idempotency_keys") < KEYS / 2, hot_reads(plan, "idempotency_keys")
    assert (
        int(plan["Plan"]["Shared Hit Blocks"]) + int(plan["Plan"].get("Shared Read Blocks", 0))
        <= WINDOW_PAGES + 16
    )


async def test_a_reservation_behind_waiters_reads_the_open_holds_not_the_ledger(
    quiet_db: Database,
) -> None:
    # A refused batch call sums what the more urgent lanes hold in flight, to know whether its
    # room can gather (migration 0028): from the open holds' index, whatever the statistics
    # say, never the month's whole ledger.
    rstore = PgRunnerStore(quiet_db)
    await backlog(quiet_db, 3)
    first, waiter, me = await take(rstore, 3)
    await admin_sql(
        quiet_db,
        "INSERT INTO appliance.spend_caps (scope, monthly_cap) VALUES ('appliance', 1)",
        "INSERT INTO appliance.spend_ledger (month, tenant, lane, status, amount, created_at,"
        " settled_at) SELECT appliance.spend_month(now()), 'acme', 'interactive', 'settled',"
        " 0, now(), now() FROM generate_series(1, 40000)",
        "ANALYZE appliance.spend_ledger",
    )
    reserve = (
        "SELECT hold_id, refusal FROM spend_reserve('acme', %s::lane, %s::numeric,"
        " %s::bigint, %s::bigint, 'p', 's', 'k', 'm', 'mechanical', NULL)"
    )
    async with explained_session(quiet_db.endpoints.admin) as (conn, plans):
        args = ("interactive", "0.3", first.message_id, first.lease_token)
        assert (await (await conn.execute(reserve, args)).fetchone())[0] is not None  # type: ignore[index]
        for lease in (waiter, me, me):  # the waiter joins the line; `me` is behind it, twice
            args = ("batch", "0.6", lease.message_id, lease.lease_token)
            assert (await (await conn.execute(reserve, args)).fetchone())[0] is None  # type: ignore[index]
    plan = plans_of(plans, "FROM spend_ledger o")[-1]
    assert hot_reads(plan, "spend_ledger") <= 10, hot_reads(plan, "spend_ledger")
