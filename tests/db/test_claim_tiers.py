"""Claims under model backpressure: the work of a blocked tier is neither taken nor read.

A runner whose pool has no room for a tier claims with that tier blocked (a runner without a
pool blocks every tier). Each message carries its stage's tier, and the claim scans work without
model calls and each open tier's work in their own index order, then merges them by priority
(migration 0017): a backlog of a blocked tier ahead of other work costs the claim nothing."""

from __future__ import annotations

import asyncio
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
from tests.db.plans import (
    CLAIM_TYPES,
    admin_sql,
    claim_values,
    explain,
    hot_reads,
    prepare,
    rows_written,
)

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


async def admin_row(db: Database, sql: str, *params: Any) -> tuple[Any, ...] | None:
    """One row of a query as the superuser, autocommit."""
    async with await psycopg.AsyncConnection.connect(db.endpoints.admin, autocommit=True) as conn:
        return await (await conn.execute(sql, params)).fetchone()


async def tier_of(db: Database, message_id: int) -> str | None:
    row = await admin_row(db, "SELECT tier FROM appliance.agent_messages WHERE id = %s", message_id)
    assert row is not None
    tier: str | None = row[0]
    return tier


async def watch(db: Database, sql: str, want: tuple[Any, ...], task: asyncio.Task[None]) -> Any:
    """The row `sql` gives once it is `want` (or `task` ended first; at most ~5 s)."""
    for _ in range(500):
        row = await admin_row(db, sql)
        if row == want or task.done():
            break
        await asyncio.sleep(0.01)
    return row


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


async def test_claim_reads_none_of_a_blocked_tiers_backlog(quiet_db: Database) -> None:
    rstore = PgRunnerStore(quiet_db)
    await rstore.sync_pipelines([support()])
    bus = Bus(rstore)
    await enqueue(bus, "draft", DRAFTS)
    await enqueue(bus, "classify", 20)
    await enqueue(bus, "plain", 20)
    await admin_sql(quiet_db, "ANALYZE appliance.agent_messages")
    async with quiet_db.system_pool.connection() as aconn:
        cur = psycopg.AsyncClientCursor(aconn, row_factory=dict_row)
        call = await prepare(aconn, "message_claim_lane", CLAIM_TYPES)
        # The reasoning tier blocked (its pool is full): the mechanical and plain work behind
        # the drafts; then a runner without a pool (every tier blocked): plain work only.
        mechanical_open = await explain(cur, call, claim_values(open_tiers='{"",mechanical}'))
        none_open = await explain(cur, call, claim_values())
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
    assert [await tier_of(quiet_db, m.id) for m in (running, dead)] == ["mechanical"] * 2
    # A stage no longer declared: its work has no model tier any more.
    await rstore.sync_pipelines(
        [Pipeline("support", (Stage("draft", noop, task_kind="draft", uses_model=True),))]
    )
    assert await tiers_by_stage(quiet_db) == {
        "plain": {None},
        "draft": {"reasoning"},
        "classify": {None},
    }
    # An unchanged declaration re-stamps nothing (no pass over the messages): a tier set by
    # hand stays as it is.
    await admin_sql(
        quiet_db,
        f"UPDATE appliance.agent_messages SET tier = 'mechanical' WHERE id = {running.id}",
    )
    await rstore.sync_pipelines(
        [Pipeline("support", (Stage("draft", noop, task_kind="draft", uses_model=True),))]
    )
    assert await tier_of(quiet_db, running.id) == "mechanical"


async def test_a_sync_of_new_pipelines_only_leaves_a_written_graph_alone(
    quiet_db: Database,
) -> None:
    # What `appliance submit` does before the first runner: it writes the graph only if none
    # is written, decided under the sync's lock, so a runner's graph is never replaced by the
    # CLI's (possibly older) declaration.
    rstore = PgRunnerStore(quiet_db)
    await rstore.sync_pipelines([support()], only_new=True)  # none yet: written
    assert await tiers_by_stage(quiet_db) == {}
    bus = Bus(rstore)
    await enqueue(bus, "draft", 1)
    older = Pipeline("support", (Stage("classify", noop, lane=Lane.BATCH),))
    await rstore.sync_pipelines([older], only_new=True)
    assert await tiers_by_stage(quiet_db) == {"draft": {"reasoning"}}
    async with await psycopg.AsyncConnection.connect(quiet_db.endpoints.admin) as conn:
        stages = await (
            await conn.execute(
                "SELECT stage, lane::text FROM appliance.pipeline_stages ORDER BY stage"
            )
        ).fetchall()
    # The first graph, whole: the later declaration (one batch stage) changed nothing.
    assert stages == [("classify", "interactive"), ("draft", "interactive"),
                      ("plain", "interactive")]  # fmt: skip


async def test_stage_hand_off_stamps_the_next_stages_tier(quiet_db: Database) -> None:
    rstore = PgRunnerStore(quiet_db)
    pipeline = Pipeline(
        "support",
        (
            Stage("classify", noop, task_kind="classify", uses_model=True, next={"ok": "draft"}),
            Stage("draft", noop, task_kind="draft", uses_model=True),
        ),
    )
    await rstore.sync_pipelines([pipeline])
    bus = Bus(rstore)
    await enqueue(bus, "classify", 1)
    (ticket,), _ = await claim(rstore, 1, ())
    await bus.complete(ticket.lease)
    assert await tiers_by_stage(quiet_db) == {"draft": {"reasoning"}}


async def test_a_sync_changing_a_tier_waits_for_enqueues_in_flight(quiet_db: Database) -> None:
    # An enqueue that read the old tier and commits after the sync's re-stamping began would
    # keep it for good: the sync waits for it, then re-stamps its message too.
    rstore = PgRunnerStore(quiet_db)
    await rstore.sync_pipelines([support()])
    request = (
        '[["acme", "support", "plain", "t", "late", "k-late", "work", null, null, null, null,'
        " null, null, null, null, null]]"
    )
    async with await psycopg.AsyncConnection.connect(quiet_db.endpoints.admin) as enqueuer:
        await enqueuer.execute(
            "SELECT * FROM appliance.enqueue_requests(now(), '1 day', %s::jsonb)", (request,)
        )
        sync = asyncio.create_task(rstore.sync_pipelines([support(plain_kind="draft")]))
        # The sync waits on the enqueue's transaction (seen in pg_locks, not by timing).
        waiting = await watch(
            quiet_db,
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
            (1,),
            sync,
        )
        assert not sync.done() and waiting == (1,)
        await enqueuer.commit()
    await asyncio.wait_for(sync, 10)
    assert await tiers_by_stage(quiet_db) == {"plain": {"reasoning"}}


async def test_a_sync_re_stamps_rows_an_acknowledgement_held(quiet_db: Database) -> None:
    # The re-stamping never waits for a row another statement holds (an acknowledgement of a
    # batch could hold it while it waits for one the sync holds); it comes back for it.
    rstore = PgRunnerStore(quiet_db)
    await rstore.sync_pipelines([support()])
    await enqueue(Bus(rstore), "plain", 1)
    (held,), _ = await claim(rstore, 1, ())
    async with await psycopg.AsyncConnection.connect(quiet_db.endpoints.admin) as acker:
        await acker.execute(
            "SELECT FROM appliance.agent_messages WHERE id = %s FOR UPDATE", (held.id,)
        )
        sync = asyncio.create_task(rstore.sync_pipelines([support(plain_kind="draft")]))
        declared = await watch(
            quiet_db,
            "SELECT tier FROM appliance.pipeline_stages WHERE stage = 'plain'",
            ("reasoning",),
            sync,
        )
        # The change committed, the held row not re-stamped yet: the sync is still at it.
        tier = await tier_of(quiet_db, held.id)
        assert declared == ("reasoning",) and tier is None and not sync.done()
        await acker.commit()
    await asyncio.wait_for(sync, 10)
    assert await tier_of(quiet_db, held.id) == "reasoning"
