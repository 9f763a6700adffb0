"""The runner's store against real PostgreSQL: fair claims, tenant limits, hand-off, archive,
schedules and the claim's cost with a large history. Time is injected, nothing sleeps."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg.rows import dict_row

from appliance.bus.core import Bus, BusConfig
from appliance.db.database import Database, Endpoints
from appliance.db.message_store import complete_params
from appliance.db.migrate import migrate
from appliance.db.queries import q
from appliance.db.runner_store import PgRunnerStore
from appliance.db.spend_store import PgSpendStore
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.envelope import Lane, LeaseRef, MessageStatus, idempotency_key
from appliance.domain.pipeline import Pipeline, Stage, StageContext, StageResult
from appliance.domain.ports import AckOutcome, Completion, FailOutcome
from appliance.domain.schedule import Schedule
from appliance.scheduler import Maintenance, fire, latest_fire_time
from tests.db.plans import (
    CLAIM_TYPES,
    check_bounded_plan,
    explain,
    hot_reads,
    positional,
    prepare,
)

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
LEASE = timedelta(seconds=30)


async def noop(ctx: StageContext) -> StageResult:
    return ctx.finish()


CHAIN = Pipeline(
    "chain",
    (
        Stage("a", noop, next={"ok": "b", "skip": "c"}),
        Stage("b", noop, lane=Lane.BATCH, next={"ok": "c"}),
        Stage("c", noop, max_runtime=timedelta(seconds=5)),
    ),
)


@pytest.fixture
async def rstore(db: Database, tenants: PgTenantStore) -> PgRunnerStore:
    for name in ("acme", "globex", "small"):
        await tenants.add(name)
    store = PgRunnerStore(db)
    await store.sync_pipelines([CHAIN])
    return store


def req(bus: Bus, sid: str, **kw: Any):
    fields: dict[str, Any] = {
        "tenant": "acme",
        "pipeline": "chain",
        "stage": "a",
        "source": "t",
        "source_id": sid,
        "directive": "go",
    }
    fields.update(kw)
    return bus.request(**fields)


async def claim(store: PgRunnerStore, lane: Lane = Lane.INTERACTIVE, limit: int = 10, **kw):
    found = await store.claim_lane(
        worker="w",
        lane=lane,
        limit=limit,
        lease=LEASE,
        tenant_limit=kw.pop("tenant_limit", 100),
        now=kw.pop("now", T0),
        **kw,
    )
    return found.messages


async def test_sql_and_python_idempotency_keys_agree(db: Database) -> None:
    samples = [("mail", "1", "intake"), ("s|1:", "x|2:y", "z"), ("ü", "日本", "ok"), ("a", "", "b")]
    async with db.system_conn() as conn:
        for source, sid, stage in samples:
            row = await (
                await conn.execute("SELECT idempotency_key(%s, %s, %s) AS k", (source, sid, stage))
            ).fetchone()
            assert row is not None and row["k"] == idempotency_key(source, sid, stage)


@settings(max_examples=30, deadline=None)
@given(st.text(max_size=8), st.text(max_size=8), st.text(max_size=8))
def test_sql_key_equals_python_key_for_any_text(pg_server, a: str, b: str, c: str) -> None:
    # NUL cannot be stored in PostgreSQL text; everything else must agree.
    if "\x00" in a + b + c:
        return
    with psycopg.connect(pg_server.endpoints("appliance_template").system) as conn:
        row = conn.execute("SELECT appliance.idempotency_key(%s, %s, %s)", (a, b, c)).fetchone()
    assert row is not None and row[0] == idempotency_key(a, b, c)


async def test_unset_lane_and_attempts_come_from_the_declared_stage(
    rstore: PgRunnerStore,
) -> None:
    bus = Bus(rstore)
    await bus.enqueue_many(
        [
            req(bus, "1", stage="b"),
            req(bus, "2", stage="b", lane="system", max_attempts=2),
            req(bus, "3", pipeline="undeclared", stage="x"),
        ],
        now=T0,
    )
    got = {
        m.source_id: (m.lane, m.max_attempts)
        for lane in Lane
        for m in await claim(rstore, lane, limit=10)
    }
    assert got == {
        "1": (Lane.BATCH, 5),
        "2": (Lane.SYSTEM, 2),
        "3": (Lane.INTERACTIVE, 5),
    }


async def test_completion_hands_off_to_the_next_stage_exactly_once(rstore: PgRunnerStore) -> None:
    bus = Bus(rstore)
    first = await bus.enqueue_many([req(bus, "s1")], now=T0)
    (m,) = await claim(rstore)
    assert m.id == first[0].id
    result = {"answer": 42}
    assert await rstore.complete([Completion(m.lease, result)], actor="w", now=T0) == [
        AckOutcome.APPLIED
    ]
    # A retried completion (same lease, same result) changes nothing and enqueues nothing; it
    # answers applied (by the first), as its first answer would have, had it not been lost.
    assert await rstore.complete([Completion(m.lease, result)], actor="w", now=T0) == [
        AckOutcome.APPLIED
    ]
    # Another result under it changes nothing either, and is not told it was recorded.
    assert await rstore.complete([Completion(m.lease, {"other": 1})], actor="w", now=T0) == [
        AckOutcome.STALE
    ]
    (nxt,) = await claim(rstore, Lane.BATCH)
    assert (nxt.stage, nxt.source_id, nxt.context, nxt.extra["hops"]) == ("b", "s1", result, 1)
    assert nxt.idempotency_key == idempotency_key("t", "s1", "b")
    assert nxt.directive == "chain: b"
    # The outcome chooses the route: "skip" goes straight to c.
    await bus.enqueue_many([req(bus, "s2")], now=T0)
    (m2,) = await claim(rstore)
    await rstore.complete([Completion(m2.lease, None, "skip")], actor="w", now=T0)
    (c,) = await claim(rstore)
    assert (c.stage, c.source_id, c.context) == ("c", "s2", None)
    # c claims carry the stage's hard run deadline (5 s), which caps the lease.
    assert c.extra["run_deadline"] == T0 + timedelta(seconds=5)
    assert c.lease_expires_at == T0 + timedelta(seconds=5)


async def test_two_stages_of_a_run_finished_together_hand_off_to_their_next_stage_once(
    rstore: PgRunnerStore,
) -> None:
    # A fan-in: a (outcome skip) and b (outcome ok) of one run both lead to c, the same key.
    # Acknowledged in one statement, the trigger asked for that key twice and the statement
    # failed ("ON CONFLICT DO UPDATE command cannot affect row a second time"): both results,
    # and every other in the runner's batch, were retried until their leases lapsed.
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, "s3"), req(bus, "s3", stage="b")], now=T0)
    (a,) = await claim(rstore)
    (b,) = await claim(rstore, Lane.BATCH)
    outcomes = await rstore.complete(
        [Completion(b.lease, {"from": "b"}), Completion(a.lease, {"from": "a"}, "skip")],
        actor="w",
        now=T0,
    )
    assert outcomes == [AckOutcome.APPLIED, AckOutcome.APPLIED]
    (c,) = await claim(rstore)
    assert (c.stage, c.source_id) == ("c", "s3")
    assert c.context == {"from": "a"}  # the first finished message by id hands off
    assert await claim(rstore) == []


async def test_hand_off_keys_keep_the_retention_their_run_was_given(
    rstore: PgRunnerStore, db: Database
) -> None:
    """Each stage's key lives as long as the run's first key, whatever the retention (shorter
    or longer than the 90-day default), also when one acknowledgement finishes runs that were
    given different retentions."""
    short = Bus(rstore, BusConfig(idempotency_retention=timedelta(days=3)))
    long = Bus(rstore, BusConfig(idempotency_retention=timedelta(days=200)))
    await short.enqueue_many([req(short, "short")], now=T0)
    await long.enqueue_many([req(long, "long")], now=T0)
    done_at = T0 + timedelta(hours=1)
    taken = await claim(rstore, limit=2)
    assert (
        await rstore.complete([Completion(m.lease) for m in taken], actor="w", now=done_at)
        == [AckOutcome.APPLIED] * 2
    )
    (b_short, b_long) = sorted(await claim(rstore, Lane.BATCH, now=done_at), key=lambda m: m.id)
    later = done_at + timedelta(hours=1)
    await rstore.complete(
        [Completion(b_short.lease), Completion(b_long.lease)], actor="w", now=later
    )
    keys = await _keys(db)
    for sid, days in (("short", 3), ("long", 200)):
        assert keys[idempotency_key("t", sid, "a")] == T0 + timedelta(days=days)
        assert keys[idempotency_key("t", sid, "b")] == done_at + timedelta(days=days)
        assert keys[idempotency_key("t", sid, "c")] == later + timedelta(days=days)


async def test_a_key_kept_for_its_message_keeps_its_own_retention_down_the_run(
    rstore: PgRunnerStore, db: Database
) -> None:
    """A key past its expiry is kept while its message is still in the envelope (dead here),
    and a duplicate then extends it: by the key's own retention, not the duplicate's, and the
    hand-offs after the redrive keep that retention (they read it as expires_at - created_at,
    which each extension lengthened, until keys outlived their messages' history)."""
    short = Bus(rstore, BusConfig(idempotency_retention=timedelta(days=3)))
    long = Bus(rstore, BusConfig(idempotency_retention=timedelta(days=200)))
    (first,) = await short.enqueue_many([req(short, "kept")], now=T0)
    outcome = None
    while outcome is not FailOutcome.DEAD:  # every attempt the stage allows fails
        (m,) = await claim(rstore)
        outcome = await rstore.fail(m.lease, error="x", retry_delay=timedelta(0), actor="w", now=T0)
    dup_at = T0 + timedelta(days=5)  # the key expired on day 3; its message is still dead here
    (dup,) = await long.enqueue_many([req(long, "kept")], now=dup_at)
    assert dup.id == first.id and not dup.new
    key_a = idempotency_key("t", "kept", "a")
    assert (await _keys(db))[key_a] == dup_at + timedelta(days=3)
    assert (await short.redrive("acme", now=dup_at)).moved == [first.id]
    (m,) = await claim(rstore, now=dup_at)
    assert await rstore.complete([Completion(m.lease)], actor="w", now=dup_at) == [
        AckOutcome.APPLIED
    ]
    assert (await _keys(db))[idempotency_key("t", "kept", "b")] == dup_at + timedelta(days=3)


async def test_concurrent_duplicate_completions_hand_off_once(
    fresh_db: Endpoints, rstore: PgRunnerStore
) -> None:
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, str(i)) for i in range(20)], now=T0)
    claimed = await claim(rstore, limit=20)
    other = Database(fresh_db, max_size=4)
    await other.open()
    try:
        twin = PgRunnerStore(other)
        done = [Completion(m.lease) for m in claimed]
        a, b = await asyncio.gather(
            rstore.complete(done, actor="x", now=T0), twin.complete(done, actor="y", now=T0)
        )
    finally:
        await other.close()
    # Each answered applied (one by its own write, the other by the first's: both sent the
    # same lease's completion), and each message was finished once: one done in its log.
    assert all(o is AckOutcome.APPLIED for o in a + b)
    async with rstore.db.system_conn() as conn:
        rows = await (
            await conn.execute(
                "SELECT count(*) AS n FROM message_transitions WHERE to_status = 'done'"
            )
        ).fetchall()
    assert rows == [{"n": 20}]
    nxt = await claim(rstore, Lane.BATCH, limit=100)
    assert len(nxt) == 20 and len({m.source_id for m in nxt}) == 20


async def test_small_tenant_served_before_busy_one_drains_a_quarter(
    rstore: PgRunnerStore,
) -> None:
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, f"big{i}") for i in range(400)], now=T0)
    served: list[str] = []
    # Busy tenant has been served for a while when the small tenant's first message arrives.
    for _ in range(5):
        batch = await claim(rstore, limit=4)
        served.extend(m.tenant for m in batch)
    await bus.enqueue_many([req(bus, "small1", tenant="small")], now=T0)
    while "small" not in served:
        batch = await claim(rstore, limit=4)
        assert batch
        served.extend(m.tenant for m in batch)
    big_before = served.index("small")
    assert big_before < 100, big_before
    assert big_before <= 20 + 4  # in fact within one claim of its arrival


async def test_a_tenant_whose_work_is_all_late_takes_no_share_of_a_claim(
    rstore: PgRunnerStore,
) -> None:
    """Late work waits for the expirer and is never claimed; its tenant must not take the
    claim's place meanwhile (never served, it would come first in every claim)."""
    bus = Bus(rstore)
    soon = T0 + timedelta(seconds=1)
    late = [req(bus, f"late{i}", deadline=soon, now=T0) for i in range(3)]
    await bus.enqueue_many(late, now=T0)
    await bus.enqueue_many([req(bus, "due", tenant="globex")], now=T0)
    later = T0 + timedelta(seconds=5)
    found = await rstore.claim_lane(
        worker="w", lane=Lane.INTERACTIVE, limit=1, lease=LEASE, tenant_limit=100, now=later
    )
    assert [m.tenant for m in found.messages] == ["globex"]
    assert not found.left_behind  # nothing claimable was left: the late work is not


async def test_tenants_share_a_claim_round_robin(rstore: PgRunnerStore) -> None:
    bus = Bus(rstore)
    for tenant in ("acme", "globex", "small"):
        await bus.enqueue_many([req(bus, str(i), tenant=tenant) for i in range(30)], now=T0)
    batch = await claim(rstore, limit=9)
    assert sorted(m.tenant for m in batch) == ["acme"] * 3 + ["globex"] * 3 + ["small"] * 3


async def test_tenant_limit_is_never_exceeded_under_concurrent_claimers(
    fresh_db: Endpoints, rstore: PgRunnerStore
) -> None:
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, str(i)) for i in range(200)], now=T0)
    dbs = [Database(fresh_db, max_size=2) for _ in range(6)]
    for d in dbs:
        await d.open()
    try:
        stores = [PgRunnerStore(d) for d in dbs]
        for _ in range(10):
            results = await asyncio.gather(*(claim(s, limit=3, tenant_limit=4) for s in stores))
            running = [m for r in results for m in r]
            assert len(running) <= 4
            async with dbs[0].system_conn() as conn:
                row = await (
                    await conn.execute(
                        "SELECT count(*) AS n FROM agent_messages WHERE status = 'running'"
                    )
                ).fetchone()
                counter = await (
                    await conn.execute("SELECT running FROM tenant_running WHERE tenant = 'acme'")
                ).fetchone()
            assert row is not None and counter is not None
            assert row["n"] == counter["running"] <= 4
            await rstore.complete([Completion(m.lease) for m in running], actor="w", now=T0)
    finally:
        for d in dbs:
            await d.close()


async def test_counters_stay_exact_while_claims_and_acks_of_two_tenants_interleave(
    fresh_db: Endpoints, rstore: PgRunnerStore, db: Database
) -> None:
    # Six connections claim (3 at most, 4 running per tenant) and acknowledge at once, two
    # tenants' work: claims and acknowledgements of one tenant (the counters by key, 0045) and
    # of both (the general statements), acknowledgements counted in whichever released shard
    # is free (0043). In every snapshot a tenant's counter equals its running messages and
    # never exceeds the limit; at the end both are 0.
    await PgTenantStore(db).add("beta")
    bus = Bus(rstore)
    await bus.enqueue_many(
        [req(bus, str(i), tenant=("acme", "beta")[i % 2]) for i in range(600)], now=T0
    )
    dbs = [Database(fresh_db, max_size=2) for _ in range(6)]
    for d in dbs:
        await d.open()
    done = 0
    finished = asyncio.Event()
    seen: list[dict[str, Any]] = []
    tenants_per_claim: set[int] = set()

    async def worker(store: PgRunnerStore) -> None:
        nonlocal done
        while True:
            taken = await claim(store, limit=3, tenant_limit=4, now=T0)
            if not taken:
                if done == 600:
                    return
                await asyncio.sleep(0.001)  # others hold the limit's room: theirs end soon
                continue
            tenants_per_claim.add(len({m.tenant for m in taken}))
            await asyncio.sleep(0)  # let another claim or acknowledgement run in between
            outcomes = await store.complete([Completion(m.lease) for m in taken], now=T0)
            assert outcomes == [AckOutcome.APPLIED] * len(taken)
            done += len(taken)

    async def observer() -> None:
        while True:
            last_round = finished.is_set()  # then this read sees every acknowledgement
            async with db.system_conn() as conn:
                cur = await conn.execute(
                    "SELECT r.tenant, r.running,"
                    " (SELECT count(*) FROM agent_messages m"
                    "  WHERE m.tenant = r.tenant AND m.status = 'running') AS actual"
                    " FROM tenant_running r ORDER BY r.tenant"
                )
                seen.extend(await cur.fetchall())
            if last_round:
                return
            await asyncio.sleep(0)

    watching = asyncio.create_task(observer())
    try:
        await asyncio.wait_for(
            asyncio.gather(*(worker(PgRunnerStore(d)) for d in dbs)), timeout=120
        )
    finally:
        finished.set()
        await watching
        for d in dbs:
            await d.close()
    assert done == 600
    assert tenants_per_claim == {1, 2}, "both kinds of statement must have run"
    assert len(seen) > 20, "the observer saw too little to prove anything"
    assert any(row["running"] > 0 for row in seen)
    assert all(row["running"] == row["actual"] <= 4 for row in seen), [
        row for row in seen if not row["running"] == row["actual"] <= 4
    ]
    last = {row["tenant"]: (row["running"], row["actual"]) for row in seen}  # the latest
    assert last["acme"] == last["beta"] == (0, 0)


async def test_claims_and_acks_of_one_tenant_never_wait_for_each_other(
    fresh_db: Endpoints, rstore: PgRunnerStore, db: Database
) -> None:
    # An acknowledgement not yet committed (as when its WAL flush is in progress) must not hold
    # up a claim of its tenant, and is not counted as released until it commits: the limit
    # holds exactly (migration 0008).
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, str(i)) for i in range(3)], now=T0)
    (first,) = await claim(rstore, limit=1, tenant_limit=2)
    other = Database(fresh_db, max_size=1)
    await other.open()
    try:
        async with other.system_pool.connection() as ack_conn:
            async with ack_conn.transaction():
                cur = await ack_conn.execute(
                    q("message_complete"),
                    complete_params([Completion(first.lease)], actor="w", now=T0),
                )
                assert [r["applied"] for r in await cur.fetchall()] == [True]
                # A claim now does not wait for that transaction (it would wait until the
                # commit below, and time out) and still counts the uncommitted one as
                # running: one more fits under 2.
                second = await asyncio.wait_for(claim(rstore, limit=3, tenant_limit=2), 10)
                assert len(second) == 1
        # Committed: released; the last message fits now, and nothing more.
        third = await claim(rstore, limit=3, tenant_limit=2)
        assert len(third) == 1
        assert await claim(rstore, limit=3, tenant_limit=2) == []
        async with db.system_conn() as conn:
            row = await (
                await conn.execute("SELECT running FROM tenant_running WHERE tenant = 'acme'")
            ).fetchone()
        assert row is not None and row["running"] == 2
    finally:
        await other.close()


async def test_acknowledgements_of_one_tenant_do_not_wait_for_each_others_commit(
    fresh_db: Endpoints, rstore: PgRunnerStore, db: Database
) -> None:
    # Each acknowledgement counts its tenant's ended leases up in one of the tenant's 8 shards,
    # one no other transaction holds (migration 0043): 8 uncommitted acknowledgements of one
    # tenant (as while their WAL flushes are in progress) all go through at once; a 9th waits
    # for its own shard, and only for that one; every count lands.
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, str(i)) for i in range(9)], now=T0)
    taken = await claim(rstore, limit=9)
    assert len(taken) == 9
    other = Database(fresh_db, min_size=9, max_size=9)
    await other.open()
    try:
        async with contextlib.AsyncExitStack() as stack:
            conns = [
                await stack.enter_async_context(other.system_pool.connection()) for _ in range(9)
            ]
            for conn in conns:
                await conn.execute("BEGIN")

            async def ack(conn: Any, message: Any) -> list[bool]:
                cur = await conn.execute(
                    q("message_complete"),
                    complete_params([Completion(message.lease)], actor="w", now=T0),
                )
                return [r["applied"] for r in await cur.fetchall()]

            for conn, message in zip(conns[:8], taken[:8], strict=True):
                # With one counter row per tenant, the second of these waited for the first
                # one's commit (and gave up after the acknowledgement's lock timeout).
                assert await asyncio.wait_for(ack(conn, message), 10) == [True]
            last = asyncio.create_task(ack(conns[8], taken[8]))
            waiter = conns[8].info.backend_pid
            holder = None
            async with db.system_conn() as watch:
                for _ in range(200):
                    row = await (
                        await watch.execute(
                            "SELECT pg_blocking_pids(%s) AS pids", (waiter,), prepare=False
                        )
                    ).fetchone()
                    if row is not None and row["pids"]:
                        (holder,) = row["pids"]
                        break
                    await asyncio.sleep(0.05)
            assert holder is not None, "the 9th acknowledgement found a free shard"
            assert not last.done()
            (blocking,) = [c for c in conns[:8] if c.info.backend_pid == holder]
            await blocking.execute("COMMIT")
            assert await asyncio.wait_for(last, 10) == [True]
            for conn in conns:
                if conn is not blocking:
                    await conn.execute("COMMIT")
        async with db.system_conn() as conn:
            running = await (
                await conn.execute("SELECT running FROM tenant_running WHERE tenant = 'acme'")
            ).fetchone()
            shards = await (
                await conn.execute(
                    "SELECT count(*) FILTER (WHERE released > 0) AS used, sum(released) AS total"
                    " FROM tenant_released_shards WHERE tenant = 'acme'"
                )
            ).fetchone()
        assert running is not None and running["running"] == 0
        assert shards is not None and (shards["used"], shards["total"]) == (8, 9)
    finally:
        await other.close()


async def test_a_callers_finished_attempts_do_not_count_against_the_limit(
    rstore: PgRunnerStore,
) -> None:
    # Handlers done, acknowledgements not committed: the caller's own such attempts do not
    # hold back its claim, exactly once (never again after their acknowledgement commits), and
    # only under the lease the caller held.
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, str(i)) for i in range(5)], now=T0)
    first, second = await claim(rstore, limit=2, tenant_limit=2)
    assert await claim(rstore, limit=3, tenant_limit=2) == []
    (third,) = await claim(rstore, limit=3, tenant_limit=2, finished=[first.lease])
    # Running in the database: first (finished), second, third. A lease that is not the
    # caller's (wrong token) is no discount.
    forged = LeaseRef(second.id, second.lease.lease_token + 1000)
    assert await claim(rstore, limit=3, tenant_limit=2, finished=[first.lease, forged]) == []
    await rstore.complete([Completion(first.lease)], actor="w", now=T0)
    # Its end is counted now: naming it again frees nothing more.
    assert await claim(rstore, limit=3, tenant_limit=2, finished=[first.lease]) == []
    await rstore.complete([Completion(second.lease), Completion(third.lease)], actor="w", now=T0)
    assert len(await claim(rstore, limit=3, tenant_limit=2)) == 2


async def test_tenant_own_limit_overrides_default(rstore: PgRunnerStore, db: Database) -> None:
    async with db.system_conn() as conn:
        await conn.execute("UPDATE tenants SET max_running = 1 WHERE name = 'acme'")
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, str(i)) for i in range(5)], now=T0)
    assert len(await claim(rstore, limit=5, tenant_limit=10)) == 1
    assert await claim(rstore, limit=5, tenant_limit=10) == []


async def test_claim_says_when_it_left_work_behind(rstore: PgRunnerStore) -> None:
    bus = Bus(rstore)
    found = await rstore.claim_lane(
        worker="w", lane=Lane.INTERACTIVE, limit=4, lease=LEASE, tenant_limit=2, now=T0
    )
    assert found.messages == [] and not found.left_behind  # an empty lane
    await bus.enqueue_many([req(bus, str(i)) for i in range(3)], now=T0)
    found = await rstore.claim_lane(
        worker="w", lane=Lane.INTERACTIVE, limit=4, lease=LEASE, tenant_limit=2, now=T0
    )
    assert len(found.messages) == 2 and found.left_behind  # the tenant's limit kept one back
    found = await rstore.claim_lane(
        worker="w", lane=Lane.INTERACTIVE, limit=4, lease=LEASE, tenant_limit=2, now=T0
    )
    assert found.messages == [] and found.left_behind  # still there, still at the limit
    found = await rstore.claim_lane(
        worker="w", lane=Lane.INTERACTIVE, limit=4, lease=LEASE, tenant_limit=3, now=T0
    )
    assert len(found.messages) == 1 and not found.left_behind  # took the last one
    await bus.enqueue_many([req(bus, f"b{i}", lane=Lane.BATCH) for i in range(2)], now=T0)
    found = await rstore.claim_lane(
        worker="w", lane=Lane.BATCH, limit=2, lease=LEASE, tenant_limit=10, now=T0
    )
    assert len(found.messages) == 2 and not found.left_behind  # exactly what was there


async def test_claims_and_heartbeats_leave_the_connection_durable(
    fresh_db: Endpoints, rstore: PgRunnerStore
) -> None:
    """They commit without waiting for the WAL flush by a setting local to their own statement:
    the pooled connection's next statement (an acknowledgement) is durable again."""
    one = Database(fresh_db, min_size=1, max_size=1)
    await one.open()
    try:
        store = PgRunnerStore(one)
        async with one.system_conn() as conn:
            await conn.execute("SET synchronous_commit = on")  # as in production
        await Bus(rstore).enqueue_many([req(Bus(rstore), "d")], now=T0)
        (m,) = (
            await store.claim_lane(
                worker="w", lane=Lane.INTERACTIVE, limit=1, lease=LEASE, tenant_limit=8, now=None
            )
        ).messages
        await store.heartbeat_many([m.lease], extend=LEASE, now=None)
        async with one.system_conn() as conn:
            row = await (await conn.execute("SHOW synchronous_commit")).fetchone()
        assert row is not None and row["synchronous_commit"] == "on"
    finally:
        await one.close()


async def test_heartbeat_never_extends_past_run_deadline(rstore: PgRunnerStore) -> None:
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, "x", stage="c")], now=T0)
    (m,) = await claim(rstore)
    beat = await rstore.heartbeat_many([m.lease], extend=LEASE, now=T0 + timedelta(seconds=2))
    assert beat[0].outcome is AckOutcome.APPLIED
    assert beat[0].lease_expires_at == T0 + timedelta(seconds=5)
    late = await rstore.heartbeat_many([m.lease], extend=LEASE, now=T0 + timedelta(seconds=6))
    assert late[0].outcome is AckOutcome.OVERRUN
    assert await rstore.reclaim(batch=10, now=T0 + timedelta(seconds=6)) == [m.id]


async def test_a_heartbeat_of_two_attempts_of_one_message_answers_each_by_its_lease(
    rstore: PgRunnerStore,
) -> None:
    # The first attempt's lease was given back and the message claimed again: beaten together,
    # the current lease is extended and the lost one told so (answers were kept by message id,
    # so both got the same one).
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, "twice")], now=T0)
    (first,) = await claim(rstore)
    assert await rstore.release([first.lease], actor="w", now=T0) == 1
    (second,) = await claim(rstore)
    assert second.id == first.id and second.lease != first.lease
    at = T0 + timedelta(seconds=1)
    for leases in ([first.lease, second.lease], [second.lease, first.lease]):
        answers = await rstore.heartbeat_many(leases, extend=LEASE, now=at)
        beats = dict(zip(leases, answers, strict=True))
        assert beats[first.lease].outcome is AckOutcome.STALE
        assert beats[second.lease].outcome is AckOutcome.APPLIED
        assert beats[second.lease].lease_expires_at == at + LEASE


async def test_a_source_items_later_stages_held_by_a_run_are_found_for_a_new_first_message(
    rstore: PgRunnerStore,
) -> None:
    # A run of item t/i1 went a -> b; a new first message of the item under a key of its own
    # would hand off to b and c as duplicates of that run's (the submit says so). Only stages
    # ahead of the one submitted, only that tenant's, only keys still kept.
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, "i1")], now=T0)
    (m,) = await claim(rstore)
    assert await bus.complete(m.lease) is AckOutcome.APPLIED  # hands off to b
    b = await rstore.item_stage_holders(
        "acme", pipeline="chain", stage="a", source="t", source_id="i1"
    )
    assert [stage for stage, _ in b] == ["b"]
    got = await rstore.get("acme", b[0][1])
    assert got is not None and got.stage == "b" and got.source_id == "i1"
    for tenant, stage, sid in (("globex", "a", "i1"), ("acme", "b", "i1"), ("acme", "a", "i2")):
        found = await rstore.item_stage_holders(
            tenant, pipeline="chain", stage=stage, source="t", source_id=sid
        )
        assert found == [], (tenant, stage, sid)


async def test_release_gives_back_without_counting_an_attempt(rstore: PgRunnerStore) -> None:
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, "r")], now=T0)
    (m,) = await claim(rstore)
    assert m.attempts == 1
    assert await rstore.release([m.lease], actor="w", now=T0) == 1
    assert await rstore.release([m.lease], actor="w", now=T0) == 0
    got = await rstore.get("acme", m.id)
    assert got is not None and got.status is MessageStatus.PENDING and got.attempts == 0


async def test_released_work_keeps_its_place_in_line(rstore: PgRunnerStore) -> None:
    # Given back unstarted (claimed ahead, or at shutdown), it is next again: not sent behind
    # work enqueued after it.
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, "first")], now=T0)
    await bus.enqueue_many([req(bus, "second")], now=T0 + timedelta(seconds=1))
    (m,) = await claim(rstore, limit=1, now=T0 + timedelta(seconds=2))
    assert m.source_id == "first"
    later = T0 + timedelta(seconds=5)
    assert await rstore.release([m.lease], actor="w", now=later) == 1
    (again,) = await claim(rstore, limit=1, now=later)
    assert again.id == m.id and again.attempts == 1


async def test_archive_keeps_log_and_idempotency_reachable(
    rstore: PgRunnerStore, db: Database
) -> None:
    bus = Bus(rstore, BusConfig())
    first = await bus.enqueue_many([req(bus, "old", stage="c")], now=T0)
    (m,) = await claim(rstore)
    await rstore.complete([Completion(m.lease, {"v": 1})], actor="w", now=T0)
    moved = await rstore.archive(retention=timedelta(days=7), now=T0 + timedelta(days=8))
    assert moved == 1
    async with db.system_conn() as conn:
        hot = await (await conn.execute("SELECT count(*) AS n FROM agent_messages")).fetchone()
        part = await (
            await conn.execute(
                "SELECT tableoid::regclass::text AS p FROM agent_messages_archive WHERE id = %s",
                (m.id,),
            )
        ).fetchone()
    assert hot is not None and hot["n"] == 0
    assert part is not None and part["p"] == "agent_messages_archive_y2026m11"
    got = await rstore.get("acme", m.id)
    assert got is not None and got.status is MessageStatus.DONE and got.result == {"v": 1}
    assert [t["to_status"] for t in await rstore.transitions("acme", m.id)][-1] == "done"
    again = await bus.enqueue_many([req(bus, "old", stage="c")], now=T0 + timedelta(days=9))
    assert again[0].id == first[0].id and not again[0].new
    assert await rstore.get("globex", m.id) is None


async def _keys(db: Database) -> dict[str, datetime]:
    async with db.system_conn() as conn:
        rows = await (await conn.execute("SELECT key, expires_at FROM idempotency_keys")).fetchall()
    return {r["key"]: r["expires_at"] for r in rows}


async def _finish_and_archive(store: PgRunnerStore, at: datetime) -> None:
    """Run everything pending to done at `at` and move it to the archive: out of the hot
    table, where a key may expire (migration 0024)."""
    while done := await claim(store, limit=100, now=at):
        await store.complete([Completion(m.lease) for m in done], actor="w", now=at)
    while await store.archive(retention=timedelta(0), now=at + timedelta(seconds=1)):
        pass


async def test_expired_idempotency_keys_are_purged_in_batches(
    rstore: PgRunnerStore, db: Database
) -> None:
    """Keys past their retention whose messages have left the hot table are deleted a bounded
    batch at a time; live keys, a key renewed by a new request, and the key of a message still
    in the envelope stay; a purged key's next request is new."""
    day = timedelta(days=1)
    bus = Bus(rstore, BusConfig(idempotency_retention=day))
    old = await bus.enqueue_many([req(bus, f"old-{i}", stage="c") for i in range(3)], now=T0)
    await bus.enqueue_many([req(bus, "renewed", stage="c")], now=T0)
    await _finish_and_archive(rstore, T0)
    # Dead, so kept in the envelope (re-drivable): its key must outlive its retention.
    (dead,) = await bus.enqueue_many([req(bus, "dead", stage="c", max_attempts=1)], now=T0)
    (m,) = await claim(rstore, now=T0)
    failed = await rstore.fail(m.lease, error="x", retry_delay=timedelta(0), actor="w", now=T0)
    assert failed is FailOutcome.DEAD
    live = await bus.enqueue_many([req(bus, "live", stage="c")], now=T0 + 2 * day)
    # Renewed: expired at T0 + 1 day, its message archived: taken over by a new request.
    renewed = await bus.enqueue_many([req(bus, "renewed", stage="c")], now=T0 + 1.5 * day)
    assert renewed[0].new
    at = T0 + 1.6 * day
    assert await rstore.purge_keys(batch=2, now=at) == 2
    assert await rstore.purge_keys(batch=2, now=at) == 1
    assert await rstore.purge_keys(batch=2, now=at) == 0
    left = await _keys(db)
    assert len(left) == 3  # live, renewed, and dead's (expired, but its message is hot)
    again = await bus.enqueue_many([req(bus, "old-0", stage="c")], now=at)
    assert again[0].new and again[0].id != old[0].id
    dup = await bus.enqueue_many([req(bus, "live", stage="c")], now=at)
    assert not dup[0].new and dup[0].id == live[0].id
    # Past its retention, its message still in the envelope: a duplicate, not new work.
    dup_dead = await bus.enqueue_many([req(bus, "dead", stage="c")], now=at)
    assert not dup_dead[0].new and dup_dead[0].id == dead.id

    # One purger at a time: while another holds the lock, a purge does nothing.
    expired_at = T0 + 10 * day
    await _finish_and_archive(rstore, expired_at)
    with psycopg.connect(db.endpoints.admin) as other:
        other.execute("SELECT pg_advisory_xact_lock(hashtext('appliance.purge_keys'))")
        assert await rstore.purge_keys(now=expired_at) == 0
    assert await rstore.purge_keys(now=expired_at) == 3  # live, renewed, old-0 again
    assert len(await _keys(db)) == 1  # the dead message's, as long as it stays


async def test_maintenance_rounds_drain_in_bounded_batches(rstore: PgRunnerStore) -> None:
    """One maintenance round archives, and purges expired keys, idle run budgets and old
    waiting places, batch after batch until a short batch (or its time is up), and counts
    every row: batches of 2 here, 13 of them, past the ten a round that once capped the rate
    the tables drain at."""
    bus = Bus(rstore, BusConfig(idempotency_retention=timedelta(days=1)))
    await bus.enqueue_many([req(bus, f"r{i}", stage="c") for i in range(25)], now=T0)
    done = await claim(rstore, limit=25)
    await rstore.complete([Completion(m.lease) for m in done], actor="w", now=T0)
    spend = PgSpendStore(rstore.db)
    for i in range(25):
        await spend.run_reserve(
            tenant="acme", source="t", source_id=f"r{i}", pipeline="chain", limits={},
            reserve=Decimal(0), verification=False, ask={"steps": 1}, now=T0,
        )  # fmt: skip
    async with rstore.db.system_conn() as conn:
        # Five places in the cap's waiting line nobody asked for since T0.
        for i in range(5):
            await conn.execute(
                "INSERT INTO spend_waiters (month, scope, message_id, lane, amount, since,"
                " seen_at) VALUES ('2031-01-01', 'appliance', %s, 'batch', 1, %s, %s)",
                (done[i].id, T0, T0),
            )
    maintenance = Maintenance(
        bus, rstore, archive_batch=2, spend=spend, run_budget_idle=timedelta(days=1)
    )
    await maintenance.archive()  # the real clock: T0 is past the 7-day retention
    await maintenance.purge_keys()  # and past the keys' one-day retention
    await maintenance.purge_run_budgets()  # and the runs have been idle for longer than a day
    assert (maintenance.archived, maintenance.keys_purged, maintenance.budgets_purged) == (
        25,
        25,
        25,
    )
    assert maintenance.places_purged == 5  # an hour past their last ask, with the budgets


async def test_claim_cost_does_not_grow_with_history(pg_server, fresh_db: Endpoints) -> None:
    # 1,000,000 finished messages (half archived) and a few pending ones: the claim must use
    # the partial index and read a bounded number of rows.
    with psycopg.connect(fresh_db.admin, autocommit=True) as conn:
        conn.execute("SET search_path = appliance, pg_catalog")
        conn.execute("INSERT INTO tenants (name) VALUES ('acme'), ('globex')")
        conn.execute("SET session_replication_role = replica")  # bulk history: skip triggers
        conn.execute(
            "INSERT INTO agent_messages (id, tenant, pipeline, stage, source, source_id,"
            " idempotency_key, directive, status, attempts, not_before, created_at, updated_at,"
            " finished_at)"
            " SELECT g, CASE WHEN g % 2 = 0 THEN 'acme' ELSE 'globex' END, 'p', 's', 'h',"
            " g::text, 'k' || g, 'd', 'done', 1, t, t, t, t"
            " FROM generate_series(1, 500000) g, LATERAL (SELECT timestamptz '2026-01-01'"
            " + g * interval '1 second' AS t) x"
        )
        conn.execute(
            "INSERT INTO agent_messages_archive (id, tenant, pipeline, stage, source, source_id,"
            " status, finished_at, archived_at, body)"
            " SELECT g, 'acme', 'p', 's', 'h', g::text, 'done', '2026-02-01', now(), '{}'"
            " FROM generate_series(500001, 1000000) g"
        )
        conn.execute("SET session_replication_role = origin")
        conn.execute("SELECT setval('agent_messages_id_seq', 1000001)")
        conn.execute("ANALYZE")
    db = Database(fresh_db, max_size=2)
    await db.open()
    try:
        bus = Bus(PgRunnerStore(db))
        await bus.enqueue_many([req(bus, f"p{i}", pipeline="p", stage="s") for i in range(20)])
        params = {
            "worker": "w",
            "lane": "interactive",
            "limit": 10,
            "lease": LEASE,
            "tenant_limit": 100,
            "tenant": None,
            "backlog_limit": 11,
            "max_runtime": timedelta(minutes=10),
            "open_tiers": [""],
            "now": None,
            "finished_ids": [],
            "finished_tokens": [],
            "skip": None,
        }
        plans = await _claim_plans(db, params)
    finally:
        await db.close()
    assert len(plans) == 2
    for plan in plans:
        check_bounded_plan(plan)


async def test_claim_plan_built_on_an_empty_table_stays_bounded(fresh_db: Endpoints) -> None:
    # A runner that starts on a fresh install builds its generic plans on empty tables, and
    # keeps them until the statistics change (autovacuum's ANALYZE, which a burst may outrun).
    # Those plans must still read a bounded number of rows once thousands wait and run.
    with psycopg.connect(fresh_db.admin, autocommit=True) as conn:
        conn.execute("ALTER TABLE appliance.agent_messages SET (autovacuum_enabled = off)")
    db = Database(fresh_db, max_size=2)
    await db.open()
    try:
        # globex has no work: its probe must not read acme's backlog either.
        await PgTenantStore(db).add("acme")
        await PgTenantStore(db).add("globex")
        rstore = PgRunnerStore(db)
        bus = Bus(rstore)
        params: dict[str, Any] = {
            "worker": "w",
            "lane": "interactive",
            "limit": 10,
            "lease": LEASE,
            "tenant_limit": 100_000,
            "tenant": None,
            "backlog_limit": 11,
            "max_runtime": timedelta(minutes=10),
            "open_tiers": [""],
            "now": None,
            "finished_ids": [],
            "finished_tokens": [],
            "skip": None,
        }

        async def burst() -> None:
            running = await _burst(bus, rstore, claims=30)
            assert len(running) == 300
            params["finished_ids"] = [lease.message_id for lease in running[:20]]
            params["finished_tokens"] = [lease.lease_token for lease in running[:20]]

        plans = await _claim_plans(db, params, before_data=burst)
    finally:
        await db.close()
    assert len(plans) == 2
    for plan in plans:
        check_bounded_plan(plan)


async def _burst(bus: Bus, rstore: PgRunnerStore, *, claims: int) -> list[LeaseRef]:
    """4,000 messages enqueued at once, then `claims` claims of 10: the leases taken."""
    for start in range(0, 4000, 1000):
        await bus.enqueue_many([req(bus, f"b{i}") for i in range(start, start + 1000)])
    running: list[LeaseRef] = []
    for _ in range(claims):
        claim = await rstore.claim_lane(
            worker="w", lane=Lane.INTERACTIVE, limit=10, lease=LEASE, tenant_limit=10**5
        )
        running.extend(m.lease for m in claim.messages)
    return running


_ACK_PARAM_TYPES = {
    "acks": "jsonb",
    "actor": "text",
    "now": "timestamptz",
    "id": "bigint[]",
    "token": "bigint[]",
    "extend": "interval",
    "lock_timeout": "text",
}


async def test_kept_plans_are_remade_when_the_envelope_outgrows_its_statistics(
    fresh_db: Endpoints,
) -> None:
    # Acknowledgements and heartbeats planned on an empty table (a runner started on a fresh
    # box) would read every running message, or the whole table, once a burst arrived, until
    # autovacuum's ANALYZE (a minute or more). The maintenance job re-analyzes as soon as the
    # heap has doubled, which makes every session replan: then they read what they touch.
    with psycopg.connect(fresh_db.admin, autocommit=True) as conn:
        conn.execute("ALTER TABLE appliance.agent_messages SET (autovacuum_enabled = off)")
    db = Database(fresh_db, max_size=2)
    await db.open()
    try:
        await PgTenantStore(db).add("acme")
        rstore = PgRunnerStore(db)
        bus = Bus(rstore)
        async with db.system_pool.connection() as aconn:
            cur = psycopg.AsyncClientCursor(aconn, row_factory=dict_row)
            calls = {
                name: await prepare(aconn, name, _ACK_PARAM_TYPES)
                for name in ("message_complete", "message_heartbeat_many")
            }
            empty: dict[str, Any] = {
                "acks": "[]",
                "actor": "w",
                "now": None,
                "id": [],
                "token": [],
                "extend": LEASE,
                "lock_timeout": "5s",
            }
            for call in calls.values():  # the generic plans, made on the empty table
                await cur.execute(call, empty)

            # A backlog, and as many leases running as a few runners hold.
            running = await _burst(bus, rstore, claims=4)

            async def ack_plan(name: str, leases: list[LeaseRef]) -> dict[str, Any]:
                # Autocommit: a rollback would make the driver deallocate the prepared
                # statements. The acknowledgements land; the heartbeats extend leases.
                values = {
                    "acks": json.dumps([[x.message_id, x.lease_token, None, None] for x in leases]),
                    "actor": "w",
                    "now": None,
                    "id": [x.message_id for x in leases],
                    "token": [x.lease_token for x in leases],
                    "extend": LEASE,
                    "lock_timeout": "5s",
                }
                return await explain(cur, calls[name], values)

            # Precondition, or this test proves nothing: the plan kept from the empty table
            # reads the whole table to acknowledge ten messages.
            before = await ack_plan("message_complete", running[:10])
            assert hot_reads(before) >= 4000, "the kept plan was bounded already"

            assert "agent_messages" in await rstore.refresh_planner_stats()
            assert await rstore.refresh_planner_stats() == []  # no growth since: nothing to do
            plans = [
                await ack_plan("message_complete", running[10:20]),
                await ack_plan("message_heartbeat_many", running[20:40]),
            ]
    finally:
        await db.close()
    for plan in plans:
        check_bounded_plan(plan)


async def _claim_plans(
    db: Database, params: dict[str, Any], *, before_data: Any = None
) -> list[dict[str, Any]]:
    """EXPLAIN ANALYZE of the claim: the generic plan that runtime connections run
    (plan_cache_mode=force_generic_plan, as a prepared statement), and the plan for these values.

    `before_data`: when given, the generic plan is built first (an EXECUTE on the data as it
    is), then this coroutine function is awaited, then the plans are taken: a generic plan kept
    from a time the data looked different.
    """
    plans = []
    async with db.system_pool.connection() as aconn:
        setting = await (await aconn.execute("SHOW plan_cache_mode")).fetchone()
        assert setting is not None and setting["plan_cache_mode"] == "force_generic_plan"
        numbered, names = positional(q("message_claim_lane"))
        args = ", ".join(f"%({n})s::{CLAIM_TYPES[n]}" for n in names)
        types = ", ".join(CLAIM_TYPES[n] for n in names)
        # Values inlined client-side: EXECUTE's arguments cannot take protocol parameters
        # whose type the server must infer.
        cur = psycopg.AsyncClientCursor(aconn, row_factory=dict_row)
        await aconn.execute(f"PREPARE claim_generic ({types}) AS {numbered}")
        if before_data is not None:
            await cur.execute(f"EXECUTE claim_generic({args})", params)
            await before_data()
        # The generic plan first: the driver deallocates every prepared statement after a
        # rollback.
        for explain in (
            f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE claim_generic({args})",
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + q("message_claim_lane"),
        ):
            async with aconn.transaction(force_rollback=True):
                await cur.execute(explain, params)
                row = await cur.fetchone()
                assert row is not None
                plans.append(row["QUERY PLAN"][0])
    return plans


def test_schedule_slots_are_stable() -> None:
    every = Schedule("tick", "acme", "chain", "a", "tick", every=timedelta(minutes=5))
    at = datetime(2026, 11, 1, 12, 7, 31, tzinfo=UTC)
    assert latest_fire_time(every, at) == datetime(2026, 11, 1, 12, 5, tzinfo=UTC)
    cron = Schedule("nightly", "acme", "chain", "a", "n", cron="30 2 * * *")
    assert latest_fire_time(cron, at) == datetime(2026, 11, 1, 2, 30, tzinfo=UTC)
    assert (
        every.source_id(datetime(2026, 11, 1, 12, 5, tzinfo=UTC))
        == "tick@2026-11-01T12:05:00+00:00"
    )


async def test_schedule_fires_once_per_slot_even_from_two_runners(
    rstore: PgRunnerStore, fresh_db: Endpoints
) -> None:
    every = Schedule("tick", "acme", "chain", "a", "tick", every=timedelta(minutes=5))
    other = Database(fresh_db, max_size=2)
    await other.open()
    try:
        a, b = Bus(rstore), Bus(PgRunnerStore(other))
        now = datetime(2026, 11, 1, 12, 7, tzinfo=UTC)
        results = await asyncio.gather(fire(a, every, now), fire(b, every, now))
        assert sorted(results) == [False, True]  # type: ignore[type-var]
        assert await fire(a, every, now + timedelta(minutes=1)) is False  # same slot (restart)
        assert await fire(a, every, now + timedelta(minutes=4)) is True  # next slot
    finally:
        await other.close()


async def test_maintenance_stop_lets_jobs_in_flight_finish(rstore: PgRunnerStore) -> None:
    # A graceful shutdown lets a maintenance statement in flight (an ANALYZE, an archive batch)
    # finish instead of cancelling it half way; new jobs no longer start.
    maintenance = Maintenance(Bus(rstore), rstore, reclaim_every=timedelta(hours=1))
    started, finished = asyncio.Event(), asyncio.Event()

    async def slow() -> None:
        started.set()
        async with rstore.db.system_conn() as conn:
            await conn.execute("SELECT pg_sleep(0.3)")
        finished.set()

    maintenance.scheduler.add_job(maintenance._tracked(slow, 60), "date")
    maintenance.start()
    await asyncio.wait_for(started.wait(), 5)
    await maintenance.stop(timeout=5)
    assert finished.is_set()
    assert not maintenance.scheduler.running


async def test_a_maintenance_job_that_never_returns_is_stopped_at_its_limit(
    rstore: PgRunnerStore, caplog: pytest.LogCaptureFixture
) -> None:
    # With one instance per job, a statement that never returned held its job for good.
    maintenance = Maintenance(Bus(rstore), rstore)

    async def hangs() -> None:
        async with rstore.db.system_conn() as conn:
            await conn.execute("SELECT pg_sleep(600)")

    began = time.monotonic()
    await maintenance._tracked(hangs, 0.3)()
    assert time.monotonic() - began < 5
    assert "hangs ran past its limit" in caplog.text
    assert maintenance._idle.is_set()  # counted as ended: a stop does not wait for it


async def test_a_wall_clock_set_back_reschedules_maintenance_from_now(
    rstore: PgRunnerStore,
) -> None:
    """Interval jobs wait for wall-clock times: set back by ten minutes, every maintenance job
    waited ten minutes (no reclaim, no expiry, no release of dead spend holds)."""
    maintenance = Maintenance(Bus(rstore), rstore, reclaim_every=timedelta(hours=1))
    maintenance.start()
    try:
        later = datetime.now(UTC) + timedelta(minutes=10)
        for job in maintenance.scheduler.get_jobs():
            job.modify(next_run_time=later)  # as a step back of the clock leaves them
        assert not maintenance.clock_stepped(1.0, 1.0)  # time going on as it should
        assert maintenance.clock_stepped(-600.0, 1.0)
        soon = datetime.now(UTC) + timedelta(seconds=5)
        jobs = {j.name: j.next_run_time for j in maintenance.scheduler.get_jobs()}
        assert jobs and all(t is not None and t <= soon for t in jobs.values()), jobs
        assert maintenance.clock_steps == 1
    finally:
        await maintenance.stop()


async def test_expiry_drains_a_backlog_in_one_tick(rstore: PgRunnerStore) -> None:
    # One batch a tick let the claim hand out over-age work before it was expired.
    bus = Bus(
        rstore,
        BusConfig(maintenance_batch=100, max_queue_age={Lane.INTERACTIVE: timedelta(minutes=5)}),
    )
    old = datetime.now(UTC) - timedelta(hours=1)
    await bus.enqueue_many([req(bus, f"old{i}", now=old) for i in range(350)], now=old)
    maintenance = Maintenance(bus, rstore)
    await maintenance.expire()
    assert maintenance.expired == 350
    assert await claim(rstore, now=None) == []


async def test_runtime_roles_make_no_temporary_objects_and_the_archive_still_runs(
    rstore: PgRunnerStore, db: Database
) -> None:
    """archive_messages (SECURITY DEFINER) keeps rows in a temporary table, which lives in its
    caller's session: the machinery's role could make one of that name first, with a trigger
    of its own, and that trigger ran as the owner. Temporary objects are the owner's alone."""
    migrate(db.endpoints.admin)  # the database's own privileges: a clone starts with defaults
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, "a", stage="c")], now=T0)
    (m,) = await claim(rstore, now=T0)
    await rstore.complete([Completion(m.lease)], actor="w", now=T0)
    refused = (
        "CREATE TEMP TABLE archive_spill (x integer)",
        "CREATE FUNCTION pg_temp.f() RETURNS integer LANGUAGE sql AS 'SELECT 1'",
        # One tenant's SQL (all run as one role) cancelling another's statements.
        "SELECT pg_cancel_backend(pg_backend_pid())",
        "SELECT pg_terminate_backend(pg_backend_pid())",
    )
    for statement in refused:
        async with db.system_conn() as conn:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                await conn.execute(statement)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            async with db.tenant_tx("acme") as conn:
                await conn.execute(statement)
    assert await rstore.archive(retention=timedelta(0), now=T0 + timedelta(seconds=1)) == 1
    # Twice on one connection: the owner's temporary table of the first round is reused.
    await bus.enqueue_many([req(bus, "b", stage="c")], now=T0)
    (m,) = await claim(rstore, now=T0)
    await rstore.complete([Completion(m.lease)], actor="w", now=T0)
    assert await rstore.archive(retention=timedelta(0), now=T0 + timedelta(seconds=1)) == 1


async def test_archiving_behind_a_long_reader_of_the_archive_skips_the_round(
    rstore: PgRunnerStore, db: Database
) -> None:
    # A new month's partition needs the archive to itself. Behind a reader (a backup) the
    # archiver waited without end, and readers of the archive queued behind it (0024).
    bus = Bus(rstore)
    await bus.enqueue_many([req(bus, "a", stage="c")], now=T0)
    (m,) = await claim(rstore, now=T0)
    await rstore.complete([Completion(m.lease)], actor="w", now=T0)
    with psycopg.connect(db.endpoints.admin) as reader:
        reader.execute("LOCK appliance.agent_messages_archive IN ACCESS SHARE MODE")
        began = time.monotonic()
        assert await rstore.archive(retention=timedelta(0), now=T0 + timedelta(seconds=1)) == 0
        assert time.monotonic() - began < 5
    assert await rstore.archive(retention=timedelta(0), now=T0 + timedelta(seconds=1)) == 1
    assert await bus.get("acme", m.id) is not None  # read from the archive
    with psycopg.connect(db.endpoints.admin) as conn:  # its lock_timeout ends with the call
        conn.execute("SELECT appliance.archive_messages(now(), 10, now())")
        assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)
