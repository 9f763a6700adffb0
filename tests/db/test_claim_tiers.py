"""Claims under model backpressure: the work of a blocked tier is neither taken nor read.

A runner whose pool has no room for a tier claims with that tier blocked (a runner without a
pool blocks every tier). Each message carries its stage's tier, and the claim scans work without
model calls and each open tier's work in their own index order, then merges them by priority
(migration 0017): a backlog of a blocked tier ahead of other work costs the claim nothing."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

from appliance.bus.core import Bus
from appliance.db.database import Database
from appliance.db.runner_store import PgRunnerStore
from appliance.domain.envelope import Lane, Message
from appliance.domain.inference import Tier
from appliance.domain.pipeline import Pipeline, Stage, StageContext, StageResult
from tests.db.plans import admin_sql, explain, hot_reads, prepare, rows_written

DRAFTS = 5000  # the reasoning tier's backlog, ahead of everything else


async def noop(ctx: StageContext) -> StageResult:
    return ctx.finish()


def support(plain_kind: str | None = None) -> Pipeline:
    """draft: reasoning work; classify: mechanical work; plain: no model call, unless
    `plain_kind` makes it a model stage of that task kind."""
    plain = (
        Stage("plain", noop)
        if plain_kind is None
        else Stage("plain", noop, task_kind=plain_kind, uses_model=True)
    )
    return Pipeline(
        "support",
        (
            Stage("draft", noop, task_kind="draft", uses_model=True),
            Stage("classify", noop, task_kind="classify", uses_model=True),
            plain,
        ),
    )


async def enqueue(bus: Bus, stage: str, n: int, *, start: int = 0, priority: int = 0) -> None:
    for first in range(start, start + n, 1000):
        await bus.enqueue_many(
            [
                bus.request(
                    tenant="acme",
                    pipeline="support",
                    stage=stage,
                    source="t",
                    source_id=f"{stage}{i}",
                    directive="work",
                    priority=priority,
                )
                for i in range(first, min(start + n, first + 1000))
            ]
        )


async def claim(
    rstore: PgRunnerStore, limit: int, blocked: tuple[Tier, ...]
) -> tuple[list[Message], bool]:
    found = await rstore.claim_lane(
        worker="w",
        lane=Lane.INTERACTIVE,
        limit=limit,
        lease=timedelta(seconds=60),
        tenant_limit=10**6,
        blocked_tiers=blocked,
    )
    return found.messages, found.left_behind


async def tiers_by_stage(db: Database) -> dict[str, set[str | None]]:
    async with await psycopg.AsyncConnection.connect(db.endpoints.admin) as conn:
        rows = await (
            await conn.execute(
                "SELECT DISTINCT stage, tier FROM appliance.agent_messages WHERE status = 'pending'"
            )
        ).fetchall()
    found: dict[str, set[str | None]] = {}
    for stage, tier in rows:
        found.setdefault(stage, set()).add(tier)
    return found


CLAIM_TYPES = {
    "worker": "text",
    "lane": "lane",
    "limit": "integer",
    "lease": "interval",
    "tenant_limit": "integer",
    "tenant": "text",
    "max_runtime": "interval",
    "open_tiers": "text[]",
    "now": "timestamptz",
    "finished_ids": "bigint[]",
    "finished_tokens": "bigint[]",
}


async def test_claim_reads_none_of_a_blocked_tiers_backlog(quiet_db: Database) -> None:
    rstore = PgRunnerStore(quiet_db)
    await rstore.sync_pipelines([support()])
    bus = Bus(rstore)
    await enqueue(bus, "draft", DRAFTS)
    await enqueue(bus, "classify", 20)
    await enqueue(bus, "plain", 20)
    await admin_sql(quiet_db, "ANALYZE appliance.agent_messages")
    values: dict[str, Any] = {
        "worker": "w",
        "lane": "interactive",
        "limit": 10,
        "lease": "60 seconds",
        "tenant_limit": 10**6,
        "tenant": None,
        "max_runtime": "10 minutes",
        "now": None,
        "finished_ids": "{}",
        "finished_tokens": "{}",
    }
    async with quiet_db.system_pool.connection() as aconn:
        cur = psycopg.AsyncClientCursor(aconn, row_factory=dict_row)
        call = await prepare(aconn, "message_claim_lane", CLAIM_TYPES)
        # The reasoning tier blocked (its pool is full): the mechanical and plain work behind
        # the drafts; then a runner without a pool (every tier blocked): plain work only.
        mechanical_open = await explain(cur, call, {**values, "open_tiers": '{"",mechanical}'})
        none_open = await explain(cur, call, {**values, "open_tiers": '{""}'})
    for plan in (mechanical_open, none_open):
        assert rows_written(plan) == 10
        # The rows taken, the probes, and at most limit + 1 per scan for the backlog: never
        # the drafts (the old claim read all 5,000, twice).
        assert hot_reads(plan) <= 120, hot_reads(plan)


async def test_claim_merges_open_tiers_by_priority_and_leaves_blocked_work(
    quiet_db: Database,
) -> None:
    rstore = PgRunnerStore(quiet_db)
    await rstore.sync_pipelines([support()])
    bus = Bus(rstore)
    await enqueue(bus, "draft", 30, priority=9)
    await enqueue(bus, "plain", 3)
    await enqueue(bus, "classify", 3, priority=5)

    # Reasoning blocked: the classify messages first (priority 5), then plain ones.
    taken, left = await claim(rstore, 4, (Tier.REASONING,))
    assert [m.stage for m in taken] == ["classify"] * 3 + ["plain"]
    assert left  # two plain messages open to this claim remain
    # Everything blocked (no pool): plain work only, and nothing else is left for this caller.
    taken, left = await claim(rstore, 10, tuple(Tier))
    assert [m.stage for m in taken] == ["plain", "plain"]
    assert not left
    # Nothing blocked: the drafts, highest priority.
    taken, left = await claim(rstore, 10, ())
    assert {m.stage for m in taken} == {"draft"} and left
    # Work of a blocked tier alone is no backlog for this caller: it waits for the doorbell.
    taken, left = await claim(rstore, 10, (Tier.REASONING,))
    assert taken == [] and not left


async def test_messages_carry_their_stages_tier_through_redeclaration(quiet_db: Database) -> None:
    rstore = PgRunnerStore(quiet_db)
    bus = Bus(rstore)
    # Submitted before any runner declared the pipeline: no tier known yet.
    await enqueue(bus, "plain", 2)
    await enqueue(bus, "draft", 2)
    assert await tiers_by_stage(quiet_db) == {"plain": {None}, "draft": {None}}
    # First declaration: the waiting drafts become reasoning work.
    await rstore.sync_pipelines([support()])
    assert await tiers_by_stage(quiet_db) == {"plain": {None}, "draft": {"reasoning"}}
    taken, _ = await claim(rstore, 10, (Tier.REASONING,))
    assert [m.stage for m in taken] == ["plain", "plain"]
    # New work is stamped at enqueue, stage hand-offs included (enqueue_requests).
    await enqueue(bus, "plain", 3, start=2)
    await enqueue(bus, "classify", 1)
    assert await tiers_by_stage(quiet_db) == {
        "plain": {None},
        "draft": {"reasoning"},
        "classify": {"mechanical"},
    }
    # A redeclared stage's unfinished messages take its new tier: running ones, and dead ones
    # (a redrive sends them back to pending); finished ones keep theirs.
    running, dead = (await claim(rstore, 2, (Tier.MECHANICAL, Tier.REASONING)))[0]
    assert running.stage == dead.stage == "plain"
    assert await rstore.terminate(dead.lease, reason="test")
    await rstore.sync_pipelines([support(plain_kind="extract")])
    assert await tiers_by_stage(quiet_db) == {
        "plain": {"mechanical"},
        "draft": {"reasoning"},
        "classify": {"mechanical"},
    }
    async with await psycopg.AsyncConnection.connect(
        quiet_db.endpoints.admin, autocommit=True
    ) as conn:
        rows = await (
            await conn.execute(
                "SELECT tier FROM appliance.agent_messages WHERE id = ANY(%s) ORDER BY id",
                ([running.id, dead.id],),
            )
        ).fetchall()
    assert rows == [("mechanical",), ("mechanical",)]
    # A stage no longer declared: its work has no model tier any more.
    await rstore.sync_pipelines(
        [Pipeline("support", (Stage("draft", noop, task_kind="draft", uses_model=True),))]
    )
    assert await tiers_by_stage(quiet_db) == {
        "plain": {None},
        "draft": {"reasoning"},
        "classify": {None},
    }
    # Unchanged declarations touch no message (nothing to re-stamp).
    async with await psycopg.AsyncConnection.connect(
        quiet_db.endpoints.admin, autocommit=True
    ) as conn:
        before = await (
            await conn.execute("SELECT sum(xmin::text::bigint) FROM appliance.agent_messages")
        ).fetchone()
        await rstore.sync_pipelines(
            [Pipeline("support", (Stage("draft", noop, task_kind="draft", uses_model=True),))]
        )
        after = await (
            await conn.execute("SELECT sum(xmin::text::bigint) FROM appliance.agent_messages")
        ).fetchone()
    assert before == after
