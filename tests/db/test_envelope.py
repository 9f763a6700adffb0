"""The envelope against real PostgreSQL: idempotency, claims, fencing, life cycle, bad input."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

from appliance.bus.core import Bus, BusConfig
from appliance.db import message_store
from appliance.db.database import Database, Endpoints
from appliance.db.message_rows import message_rows, row_to_message
from appliance.db.message_store import PgMessageStore, enqueue_params
from appliance.db.queries import q
from appliance.domain.envelope import (
    LEGAL_TRANSITIONS,
    EnqueueRequest,
    Lane,
    LeaseRef,
    MessageStatus,
)
from appliance.domain.errors import InvalidInput, UnknownTenant
from appliance.domain.ports import AckOutcome, Completion, FailOutcome, Redrive
from appliance.domain.retry import RetryPolicy

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def req(bus: Bus, sid: str, *, tenant: str = "acme", stage: str = "intake", **kw: object):
    fields = {
        "tenant": tenant,
        "pipeline": "demo",
        "stage": stage,
        "source": "test",
        "source_id": sid,
        "directive": f"do {sid}",
        **kw,
    }
    return bus.request(**fields)


async def test_enum_and_transitions_match_python(db: Database) -> None:
    async with db.system_conn() as conn:
        rows = await (
            await conn.execute("SELECT unnest(enum_range(NULL::message_status))::text AS v")
        ).fetchall()
        assert [r["v"] for r in rows] == [s.value for s in MessageStatus]
        rows = await (
            await conn.execute("SELECT unnest(enum_range(NULL::lane))::text AS v")
        ).fetchall()
        assert [r["v"] for r in rows] == [lane.value for lane in Lane]
        rows = await (
            await conn.execute(
                "SELECT from_status::text AS f, to_status::text AS t"
                " FROM message_status_transitions"
            )
        ).fetchall()
    assert {(r["f"], r["t"]) for r in rows} == {(a.value, b.value) for a, b in LEGAL_TRANSITIONS}


async def test_submit_twice_is_new_then_duplicate(bus: Bus) -> None:
    first = await bus.enqueue(**vars_of(req(bus, "1")))
    again = await bus.enqueue(**vars_of(req(bus, "1")))
    assert first.new and not again.new and first.id == again.id
    other_stage = await bus.enqueue(**vars_of(req(bus, "1", stage="review")))
    assert other_stage.new and other_stage.id != first.id


def vars_of(request) -> dict[str, Any]:
    """Turn a built request back into enqueue keyword arguments."""
    return {
        "tenant": request.tenant,
        "pipeline": request.pipeline,
        "stage": request.stage,
        "source": request.source,
        "source_id": request.source_id,
        "directive": request.directive,
        "context": json.loads(request.context_json),
        "lane": request.lane,
    }


async def test_same_key_64_concurrent_enqueues(fresh_db: Endpoints, tenants_ready) -> None:
    database = Database(fresh_db, min_size=64, max_size=64)
    await database.open()
    try:
        bus = Bus(PgMessageStore(database))
        for round_ in range(5):
            barrier = asyncio.Barrier(64)

            async def one(round_: int = round_, barrier: asyncio.Barrier = barrier):
                request = req(bus, f"race-{round_}")
                await barrier.wait()
                (result,) = await bus.enqueue_many([request])
                return result

            results = await asyncio.gather(*(one() for _ in range(64)))
            assert len({r.id for r in results}) == 1
            assert sum(r.new for r in results) == 1
            async with database.system_conn() as conn:
                row = await (
                    await conn.execute(
                        "SELECT count(*) AS n FROM agent_messages WHERE source_id = %s",
                        (f"race-{round_}",),
                    )
                ).fetchone()
                assert row is not None and row["n"] == 1
                hits = await (
                    await conn.execute(
                        "SELECT hits FROM idempotency_keys WHERE message_id = %s", (results[0].id,)
                    )
                ).fetchone()
                assert hits is not None and hits["hits"] == 63
    finally:
        await database.close()


@pytest.fixture
async def tenants_ready(tenants) -> None:
    for name in ("acme", "globex"):
        await tenants.add(name)


async def test_same_key_in_two_tenants_gives_two_rows(bus: Bus) -> None:
    a = await bus.enqueue_many([req(bus, "k", tenant="acme")])
    b = await bus.enqueue_many([req(bus, "k", tenant="globex")])
    assert a[0].new and b[0].new and a[0].id != b[0].id


async def test_first_inserter_rolls_back_next_is_new(bus: Bus, db: Database) -> None:
    request = req(bus, "rollback")
    params = enqueue_params([request], timedelta(days=90), None)
    async with db.app_pool.connection() as conn:
        await conn.set_autocommit(False)
        await conn.execute(q("tenant_set"), {"tenant": "acme"})
        await (
            await conn.execute(q("message_enqueue_tenant"), {**params, "scope": "acme"})
        ).fetchall()
        # A second enqueue of the same key now waits on the uncommitted key row.
        second = asyncio.create_task(bus.enqueue_many([request]))
        await asyncio.sleep(0.3)
        assert not second.done()
        await conn.rollback()
        await conn.set_autocommit(True)
    (result,) = await asyncio.wait_for(second, 10)
    assert result.new
    assert (await bus.get("acme", result.id)) is not None


async def test_duplicates_inside_one_batch(bus: Bus) -> None:
    results = await bus.enqueue_many([req(bus, "x"), req(bus, "y"), req(bus, "x")])
    assert [r.new for r in results] == [True, True, False]
    assert results[0].id == results[2].id


@pytest.mark.parametrize("size", [2, 8, 1500])
async def test_a_batch_is_claimed_in_the_order_it_was_submitted(bus: Bus, size: int) -> None:
    """Its messages share their not-before, so the claim takes them by id: the ids follow the
    requests. They were drawn in a hash join's order, reversed, and the last request ran first
    (also for a batch sent in more than one statement, and with a duplicate among them)."""
    requests = [req(bus, f"n{i}") for i in range(size)]
    results = await bus.enqueue_many([*requests, req(bus, "n0")], now=T0)
    ids = [r.id for r in results[:-1]]
    assert ids == sorted(ids) and results[-1].id == ids[0]
    claimed = await bus.claim("w", limit=size, now=T0 + timedelta(seconds=1))
    assert [m.source_id for m in claimed] == [f"n{i}" for i in range(size)]


async def test_key_reused_after_retention_once_its_message_left(bus: Bus, db: Database) -> None:
    short = Bus(bus.store, BusConfig(idempotency_retention=timedelta(days=1)))
    first = await short.enqueue(now=T0, **vars_of(req(bus, "old")))
    dup = await short.enqueue(now=T0 + timedelta(hours=23), **vars_of(req(bus, "old")))
    assert first.new and not dup.new and dup.id == first.id
    async with db.system_conn() as conn:  # a hit on a live key does not slide its expiry
        row = await (await conn.execute("SELECT expires_at FROM idempotency_keys")).fetchone()
    assert row is not None and row["expires_at"] == T0 + timedelta(days=1)
    # Past the retention, but its message is still in the envelope (pending): a duplicate. It
    # was taken over, and the same work enqueued twice (migration 0024).
    kept = await short.enqueue(now=T0 + timedelta(days=2), **vars_of(req(bus, "old")))
    assert not kept.new and kept.id == first.id
    # Done and archived: the key (renewed by that hit until T0 + 3 days) then serves new work.
    (m,) = await bus.claim("w", now=T0 + timedelta(days=2))
    await bus.complete(m.lease, None, now=T0 + timedelta(days=2))
    async with db.system_conn() as conn:
        await conn.execute(
            "SELECT archive_messages(%s, 100, %s)", (T0 + timedelta(days=3), T0 + timedelta(days=3))
        )
    assert await short.enqueue(now=T0 + timedelta(days=2.5), **vars_of(req(bus, "old"))) == dup
    later = await short.enqueue(now=T0 + timedelta(days=4), **vars_of(req(bus, "old")))
    assert later.new and later.id != first.id


async def test_four_claimers_claim_everything_once_in_lane_order(bus: Bus, db: Database) -> None:
    lanes = [Lane.BATCH, Lane.INTERACTIVE, Lane.SYSTEM]
    requests = [req(bus, str(i), lane=lanes[i % 3]) for i in range(10_000)]
    for start in range(0, len(requests), 1000):
        await bus.enqueue_many(requests[start : start + 1000], now=T0)
    claimed: list[tuple[int, int, Lane]] = []

    async def claimer(name: str) -> None:
        while True:
            batch = await bus.claim(name, limit=10, now=T0 + timedelta(seconds=1))
            if not batch:
                return
            claimed.extend((m.id, m.lease_token or 0, m.lane) for m in batch)

    await asyncio.gather(*(claimer(f"w{i}") for i in range(4)))
    ids = [c[0] for c in claimed]
    assert len(ids) == 10_000 and len(set(ids)) == 10_000
    # Strict lane order: a lower lane starts only when the higher one is drained, give or take
    # the batches other claimers held at that instant (4 claimers x 10).
    first_token = {lane: min(t for _, t, ln in claimed if ln is lane) for lane in Lane}
    late_interactive = sum(
        1 for _, t, ln in claimed if ln is Lane.INTERACTIVE and t > first_token[Lane.SYSTEM]
    )
    late_system = sum(
        1 for _, t, ln in claimed if ln is Lane.SYSTEM and t > first_token[Lane.BATCH]
    )
    assert late_interactive <= 40 and late_system <= 40
    async with db.system_conn() as conn:
        row = await (
            await conn.execute(
                "SELECT count(*) AS n FROM message_transitions WHERE to_status = 'running'"
            )
        ).fetchone()
    assert row is not None and row["n"] == 10_000


async def test_stale_worker_cannot_write(bus: Bus) -> None:
    await bus.enqueue(now=T0, **vars_of(req(bus, "s")))
    (old,) = await bus.claim("old", lease=timedelta(seconds=30), now=T0)
    assert await bus.reclaim(now=T0 + timedelta(seconds=31)) == [old.id]
    due = T0 + timedelta(seconds=34)  # its backoff after one attempt: at most 2 s
    assert await bus.promote_due(now=due) == 1
    (new,) = await bus.claim("new", lease=timedelta(seconds=30), now=due)
    assert new.id == old.id and new.lease_token != old.lease_token and new.attempts == 2
    at = T0 + timedelta(seconds=35)
    assert (await bus.heartbeat(old.lease, now=at)).outcome is AckOutcome.STALE
    assert await bus.complete(old.lease, {"by": "old"}, now=at) is AckOutcome.STALE
    assert await bus.fail(old, "late", now=at) is FailOutcome.STALE
    current = await bus.get("acme", new.id)
    assert current is not None and current.status is MessageStatus.RUNNING
    assert current.lease_token == new.lease_token and current.error != "late"
    assert await bus.complete(new.lease, {"by": "new"}, now=at) is AckOutcome.APPLIED
    done = await bus.get("acme", new.id)
    assert done is not None and done.status is MessageStatus.DONE and done.result == {"by": "new"}
    log = await bus.store.transitions("acme", new.id)  # type: ignore[attr-defined]
    assert [(r["from_status"], r["to_status"], r["reason"]) for r in log] == [
        (None, "pending", "enqueued"),
        ("pending", "running", "claimed"),
        ("running", "pending", "lease_expired"),
        ("pending", "running", "claimed"),
        ("running", "done", "completed"),
    ]


async def test_a_completion_the_database_cannot_hold_is_an_input_error(bus: Bus) -> None:
    # Data, not a lost connection: the caller must not send it again as it is.
    await bus.enqueue(now=T0, **vars_of(req(bus, "nul")))
    (m,) = await bus.claim("w", now=T0)
    with pytest.raises(InvalidInput, match="completion: rejected by the database"):
        await bus.store.complete([Completion(m.lease, outcome="x\x00")], actor="w", now=T0)
    assert await bus.complete(m.lease, now=T0) is AckOutcome.APPLIED  # nothing was written


@pytest.mark.parametrize("write", ["complete", "fail"])
async def test_a_write_that_waited_behind_a_cancel_is_told_cancelled(
    bus: Bus, db: Database, write: str
) -> None:
    """The write waits on the cancel's row lock and changes nothing; its own snapshot still
    shows the lease running, so the answer comes from a fresh read: cancelled, not stale."""
    await bus.enqueue(**vars_of(req(bus, f"race-{write}")))
    (m,) = await bus.claim("w")
    async with db.tenant_tx("acme") as conn:
        params = {"id": m.id, "reason": "operator", "actor": "op", "now": None}
        assert await (await conn.execute(q("message_cancel"), params)).fetchone() is not None
        pending = asyncio.ensure_future(
            bus.complete(m.lease) if write == "complete" else bus.fail(m, "boom")
        )
        await asyncio.sleep(0.3)  # the write is waiting for this transaction's row lock
        assert not pending.done()
    outcome = await pending
    assert outcome in (AckOutcome.CANCELLED, FailOutcome.CANCELLED)
    got = await bus.get("acme", m.id)
    assert got is not None and got.status is MessageStatus.CANCELLED


async def test_two_attempts_of_one_message_acknowledged_together(bus: Bus) -> None:
    # The older attempt's lease was reclaimed and the message claimed again; both results go
    # in one batch: only the current lease applies, and the other is told so.
    await bus.enqueue(now=T0, **vars_of(req(bus, "twice")))
    (old,) = await bus.claim("w", lease=timedelta(seconds=30), now=T0)
    assert await bus.reclaim(now=T0 + timedelta(seconds=31)) == [old.id]
    assert await bus.promote_due(now=T0 + timedelta(seconds=34)) == 1
    (new,) = await bus.claim("w", lease=timedelta(seconds=30), now=T0 + timedelta(seconds=34))
    at = T0 + timedelta(seconds=35)
    outcomes = await bus.store.complete(
        [Completion(old.lease, {"by": "old"}), Completion(new.lease, {"by": "new"})],
        actor="w",
        now=at,
    )
    assert outcomes == [AckOutcome.STALE, AckOutcome.APPLIED]
    done = await bus.get("acme", new.id)
    assert done is not None and done.result == {"by": "new"}


async def test_a_reclaimed_message_backs_off_like_a_failed_attempt(bus: Bus) -> None:
    # A handler that takes its worker down (a native crash, memory) must not take the next
    # runner down at once, and the one after: a lapsed lease waits a retry's backoff, doubled
    # per attempt (half-jittered: base 2 s, so 1-2 s after one attempt, 2-4 s after two), out
    # of the claim's index until due; the last attempt's goes dead, not deferred.
    await bus.enqueue(now=T0, max_attempts=3, **vars_of(req(bus, "crash")))
    at = T0
    for attempt, (low, high) in enumerate([(1, 2), (2, 4)], start=1):
        (m,) = await bus.claim("w", lease=timedelta(seconds=30), now=at)
        assert m.attempts == attempt
        at += timedelta(seconds=31)
        assert await bus.reclaim(now=at) == [m.id]
        got = await bus.get("acme", m.id)
        assert got is not None and got.status is MessageStatus.PENDING
        wait = (got.not_before - at).total_seconds()
        assert low <= wait <= high, wait
        # Not claimable before it is due (a claim that finds too little promotes what is).
        assert await bus.claim("w", now=got.not_before - timedelta(microseconds=1)) == []
        assert await bus.promote_due(now=got.not_before - timedelta(microseconds=1)) == 0
        at = got.not_before
        assert await bus.promote_due(now=at) == 1
    (m,) = await bus.claim("w", lease=timedelta(seconds=30), now=at)
    at += timedelta(seconds=31)
    assert await bus.reclaim(now=at) == [m.id]
    got = await bus.get("acme", m.id)
    assert got is not None and got.status is MessageStatus.DEAD and got.not_before == at


async def test_reclaim_jitter_spreads_a_batch_and_its_seed_reproduces_it(bus: Bus) -> None:
    # Leases that lapse together (a runner died) must not come back as one herd; yet the
    # jitter is a hash of the row under the caller's seed, not the server's random(), so a
    # seeded caller (a test, a replay) gets the same delays again. Each message's jitter
    # fraction is read back from its delay over the attempt's ceiling.
    ids = [
        (await bus.enqueue(now=T0, max_attempts=5, **vars_of(req(bus, f"j{i}")))).id
        for i in range(8)
    ]
    at = T0
    rounds: list[dict[int, float]] = []
    for attempt, seed in [(1, 7), (2, 7), (3, 8)]:
        got = await bus.claim("w", limit=len(ids), lease=timedelta(seconds=30), now=at)
        assert sorted(m.id for m in got) == ids and {m.attempts for m in got} == {attempt}
        at += timedelta(seconds=31)
        due = await bus.store.reclaim_due(
            batch=100, now=at, backoff=bus.config.retry, jitter_seed=seed
        )
        ceiling = bus.config.retry.base.total_seconds() * 2 ** (attempt - 1)
        rounds.append({mid: 2 * wait / ceiling - 1 for mid, wait in due if wait is not None})
        assert sorted(rounds[-1]) == ids
        assert all(0 <= f < 1 for f in rounds[-1].values()), rounds[-1]
        at += timedelta(seconds=ceiling)
        assert await bus.promote_due(now=at) == len(ids)
    same, other = rounds[0], rounds[2]
    assert all(abs(same[i] - rounds[1][i]) < 1e-4 for i in ids), "one seed, other delays"
    assert len({round(f, 3) for f in same.values()}) == len(ids), "a batch came back as a herd"
    assert any(abs(same[i] - other[i]) > 1e-3 for i in ids), "another seed, the same delays"


async def test_a_worker_of_the_bus_api_alone_gets_its_retries_back(bus: Bus) -> None:
    """Promotion was a runner's maintenance alone: with no runner anywhere, a failed attempt's
    message (and work enqueued for later) stayed out of every claim after its backoff."""
    await bus.enqueue(now=T0, **vars_of(req(bus, "retry")))
    later = await bus.enqueue(
        now=T0, not_before=T0 + timedelta(minutes=5), **vars_of(req(bus, "later"))
    )
    (m,) = await bus.claim("w", now=T0)
    assert await bus.fail(m, "flaky", now=T0) is FailOutcome.RETRY
    got = await bus.get("acme", m.id)
    assert got is not None and got.not_before > T0
    assert await bus.claim("w", now=got.not_before - timedelta(microseconds=1)) == []
    (again,) = await bus.claim("w", limit=5, now=got.not_before)
    assert again.id == m.id and again.attempts == 2
    (due,) = await bus.claim("w", limit=5, now=T0 + timedelta(minutes=5))
    assert due.id == later.id


async def test_a_due_retry_is_not_held_behind_work_of_lower_lanes(bus: Bus) -> None:
    """Due work was promoted only when a claim came back short: while batch work kept every
    claim full, an interactive retry whose backoff had ended waited behind all of it."""
    await bus.enqueue(now=T0, **vars_of(req(bus, "urgent")))
    for i in range(5):
        await bus.enqueue(now=T0, **vars_of(req(bus, f"bulk-{i}", lane=Lane.BATCH)))
    (m,) = await bus.claim("w", now=T0)
    assert m.lane is Lane.INTERACTIVE
    assert await bus.fail(m, "flaky", now=T0) is FailOutcome.RETRY
    got = await bus.get("acme", m.id)
    assert got is not None
    # Still deferred when this claim looks: it takes batch work, and promotes the retry...
    (first,) = await bus.claim("w", now=got.not_before)
    assert first.lane is Lane.BATCH
    # ...which the next claim takes ahead of the batch work still there.
    (second,) = await bus.claim("w", now=got.not_before)
    assert second.id == m.id and second.attempts == 2


async def test_one_lease_acknowledged_twice_with_different_answers_is_refused(bus: Bus) -> None:
    """One statement stores one answer per lease: the other was reported applied and lost."""
    await bus.enqueue(now=T0, **vars_of(req(bus, "dup")))
    (m,) = await bus.claim("w", now=T0)
    for second in (Completion(m.lease, {"v": 2}), Completion(m.lease, {"v": 1}, "other")):
        with pytest.raises(InvalidInput, match=f"completions: message {m.id} is acknowledged"):
            await bus.complete_many([Completion(m.lease, {"v": 1}), second], now=T0)
    held = await bus.get("acme", m.id)
    assert held is not None and held.status is MessageStatus.RUNNING  # nothing written
    # The same answer twice (a retried acknowledgement in one batch) is one answer.
    same = [Completion(m.lease, {"v": 1}), Completion(m.lease, {"v": 1})]
    assert await bus.complete_many(same, now=T0) == [AckOutcome.APPLIED, AckOutcome.APPLIED]
    done = await bus.get("acme", m.id)
    assert done is not None and done.result == {"v": 1}


async def test_bus_arguments_are_checked_before_the_database(bus: Bus) -> None:
    """Callers of the Python API met the database's own refusals (integer out of range, NUL
    in text, no function for a numeric id) or, with a clock without a time zone, a
    TypeError, or a moment silently read in the session's zone."""
    await bus.enqueue(now=T0, **vars_of(req(bus, "args")))
    naive = datetime(2026, 11, 1, 12, 0)
    calls: list[tuple[str, Any]] = [
        ("limit: 2147483648 is not from 1 to 10000", lambda: bus.claim("w", limit=2**31, now=T0)),
        ("limit: 0 is not from 1 to 10000", lambda: bus.claim("w", limit=0, now=T0)),
        ("worker: contains a NUL", lambda: bus.claim("w\x00", now=T0)),
        ("now: must carry a time zone", lambda: bus.claim("w", now=naive)),
        ("now: must carry a time zone", lambda: bus.expire(now=naive)),
        ("now: must carry a time zone", lambda: bus.reclaim(now=naive)),
        ("now: must carry a time zone", lambda: bus.status(now=naive)),
        ("now: must carry a time zone", lambda: bus.enqueue(now=naive, **vars_of(req(bus, "n")))),
        ("message_id: 9223372036854775808 is not an id", lambda: bus.cancel("acme", 2**63)),
        ("message_id: 0 is not an id", lambda: bus.get("acme", 0)),
        ("message_id: 9223372036854775808", lambda: bus.redrive("acme", [2**63])),
        ("before: 9223372036854775808", lambda: bus.list_messages("acme", before=2**63)),
        ("tenant: 'No Such' is not a valid name", lambda: bus.get("No Such", 1)),
        ("lease_token: 0 is not an id", lambda: bus.heartbeat(LeaseRef(1, 0), now=T0)),
        ("actor: contains a NUL", lambda: bus.complete(LeaseRef(1, 1), actor="a\x00", now=T0)),
        ("outcome: 'not a name' is not a valid name", lambda: bus.complete_many(
            [Completion(LeaseRef(1, 1), outcome="not a name")], now=T0)),
    ]  # fmt: skip
    for expected, call in calls:
        with pytest.raises(InvalidInput, match=re.escape(expected)):
            await call()
    # Nothing was touched: the message is there to claim.
    (m,) = await bus.claim("w", now=T0)
    assert m.source_id == "args" and m.attempts == 1


async def test_heartbeat_extends_and_reports_cancel(bus: Bus) -> None:
    await bus.enqueue(now=T0, **vars_of(req(bus, "hb")))
    (m,) = await bus.claim("w", lease=timedelta(seconds=10), now=T0)
    beat = await bus.heartbeat(m.lease, extend=timedelta(seconds=10), now=T0 + timedelta(seconds=8))
    assert beat.keep_going and beat.lease_expires_at == T0 + timedelta(seconds=18)
    assert await bus.reclaim(now=T0 + timedelta(seconds=12)) == []
    assert await bus.cancel("acme", m.id, reason="operator said stop")
    assert (
        await bus.heartbeat(m.lease, now=T0 + timedelta(seconds=13))
    ).outcome is AckOutcome.CANCELLED
    assert await bus.complete(m.lease, None) is AckOutcome.CANCELLED
    assert await bus.fail(m, "x") is FailOutcome.CANCELLED
    assert not await bus.cancel("acme", m.id)


async def test_a_running_message_is_not_run_past_its_deadline(bus: Bus) -> None:
    deadline = T0 + timedelta(seconds=20)
    await bus.enqueue(now=T0, deadline=deadline, **vars_of(req(bus, "late")))
    # Neither the claim's lease (30 s asked) nor a heartbeat's runs past the deadline...
    (m,) = await bus.claim("w", lease=timedelta(seconds=30), now=T0)
    assert m.lease_expires_at == deadline
    beat = await bus.heartbeat(
        m.lease, extend=timedelta(seconds=10), now=T0 + timedelta(seconds=15)
    )
    assert beat.keep_going and beat.lease_expires_at == deadline
    # ...and at it, tells the worker to stop.
    beat = await bus.heartbeat(m.lease, now=deadline)
    assert beat.outcome is AckOutcome.OVERRUN and not beat.keep_going
    # Its lease lapsed past the deadline: expired, not retried (it had attempts left) and not
    # dead (a redrive would need --clear-deadline to send it back).
    assert await bus.reclaim(now=deadline + timedelta(seconds=1)) == [m.id]
    got = await bus.get("acme", m.id)
    assert got is not None and got.status is MessageStatus.EXPIRED and not got.extra["deferred"]
    assert got.extra["finished_at"] == deadline + timedelta(seconds=1)
    assert got.error is not None and "deadline" in got.error


async def test_a_completion_sent_again_under_its_lease_is_applied_not_lost(bus: Bus) -> None:
    # Its first commit's answer was lost with the connection: the worker sends it again, and
    # must not read "stale" (its lease lost, its work perhaps redone elsewhere).
    await bus.enqueue(now=T0, **vars_of(req(bus, "twice")))
    (m,) = await bus.claim("w", now=T0)
    assert await bus.complete(m.lease, {"n": 1}, now=T0) is AckOutcome.APPLIED
    assert await bus.complete(m.lease, {"n": 1}, now=T0) is AckOutcome.APPLIED
    # Another result under the same lease changes nothing, and is told so rather than that
    # it was recorded.
    assert await bus.complete(m.lease, {"n": 2}, now=T0) is AckOutcome.STALE
    assert (await bus.complete_many([Completion(m.lease, {"n": 1}, "other")], now=T0)) == [
        AckOutcome.STALE
    ]
    got = await bus.get("acme", m.id)
    assert got is not None and got.result == {"n": 1}  # the first one's, unchanged
    log = await bus.store.transitions("acme", m.id)  # type: ignore[attr-defined]
    assert [r["to_status"] for r in log] == ["pending", "running", "done"]


async def test_lanes_are_claimed_in_lane_order_whatever_order_the_caller_names(bus: Bus) -> None:
    await bus.enqueue(now=T0, **vars_of(req(bus, "b", lane=Lane.BATCH)))
    await bus.enqueue(now=T0 + timedelta(seconds=1), **vars_of(req(bus, "i")))
    (m,) = await bus.claim("w", lanes=[Lane.BATCH, Lane.INTERACTIVE], now=T0 + timedelta(seconds=2))
    assert m.lane is Lane.INTERACTIVE


async def test_lease_lengths_and_lanes_are_checked_before_the_database(bus: Bus) -> None:
    await bus.enqueue(now=T0, **vars_of(req(bus, "lease")))
    (m,) = await bus.claim("w", now=T0)
    # A zero or negative extension was taken as "the default" or written as a lease already
    # expired, which the reclaimer would take from a live worker.
    for extend in (timedelta(0), timedelta(seconds=-5)):
        with pytest.raises(InvalidInput, match=r"lease: .* is outside 1 s \.\. 1 day"):
            await bus.heartbeat(m.lease, extend=extend, now=T0)
    with pytest.raises(InvalidInput, match="lease: "):
        await bus.claim("w", lease=timedelta(0), now=T0)
    with pytest.raises(InvalidInput, match="unknown lane 'bogus'"):
        await bus.claim("w", lanes=["bogus"], now=T0)  # type: ignore[list-item]
    held = await bus.get("acme", m.id)
    assert held is not None and held.lease_expires_at == m.lease_expires_at


async def test_a_deadline_already_past_is_refused_without_an_injected_now(bus: Bus) -> None:
    # The production call passes no `now`: the deadline is checked against this machine's
    # clock (it was accepted, then expired unseen), and the row is stamped by the database's.
    past = datetime.now(UTC) - timedelta(hours=1)
    fields = vars_of(req(bus, "late"))
    with pytest.raises(InvalidInput, match=r"deadline: .* is not in the future"):
        await bus.enqueue(deadline=past, **fields)
    with pytest.raises(InvalidInput, match=r"deadline: .* is not in the future"):
        bus.request(deadline=past, **fields)
    result = await bus.enqueue(deadline=datetime.now(UTC) + timedelta(hours=1), **fields)
    assert result.new


async def test_a_time_with_an_offset_postgresql_refuses_is_stored_as_its_instant(
    bus: Bus,
) -> None:
    # +20:00 and a fractional-second offset pass Python but not PostgreSQL: sent as UTC, and
    # (grouped with other callers' enqueues) failing none of them.
    odd = timezone(timedelta(hours=20, microseconds=5))
    deadline = datetime.now(odd) + timedelta(hours=2)
    sent = [vars_of(req(bus, f"tz{i}")) for i in range(8)]
    results = await asyncio.gather(
        *(bus.enqueue(**f, **({"deadline": deadline} if i == 3 else {})) for i, f in
          enumerate(sent))
    )  # fmt: skip
    assert all(r.new for r in results)
    got = await bus.get("acme", results[3].id)
    assert got is not None and got.deadline == deadline


async def test_retry_backoff_then_dead_then_redrive(store: PgMessageStore, tenants) -> None:
    await tenants.add("acme")
    bus = Bus(store, BusConfig(max_attempts=3, retry=RetryPolicy(base=timedelta(seconds=10))))
    await bus.enqueue(now=T0, **vars_of(req(bus, "r")))
    at = T0
    for attempt in (1, 2):
        (m,) = await bus.claim("w", now=at)
        assert m.attempts == attempt
        assert await bus.fail(m, f"boom {attempt}", now=at) is FailOutcome.RETRY
        again = await bus.get("acme", m.id)
        assert again is not None and again.status is MessageStatus.PENDING
        delay = again.not_before - at
        ceiling = timedelta(seconds=10 * 2 ** (attempt - 1))
        assert ceiling / 2 <= delay <= ceiling
        assert await bus.claim("w", now=at) == []  # not before the backoff
        assert again.extra["deferred"] is True  # out of the claim's index until due
        assert await bus.promote_due(now=again.not_before - timedelta(microseconds=1)) == 0
        at = again.not_before
        if attempt == 1:
            # Due: promoted by the maintenance's sweep, then claimed...
            assert await bus.promote_due(now=at) == 1
    # ...or by the claim itself, which found too little.
    (m,) = await bus.claim("w", now=at)
    assert await bus.fail(m, "boom 3", now=at) is FailOutcome.DEAD
    dead = await bus.get("acme", m.id)
    assert dead is not None and dead.status is MessageStatus.DEAD and dead.error == "boom 3"
    assert (await bus.redrive("acme", now=at)).moved == [m.id]
    (m,) = await bus.claim("w", now=at)
    assert m.attempts == 1


async def test_redrive_leaves_work_past_its_deadline_unless_told_to_clear_it(
    store: PgMessageStore, tenants
) -> None:
    """Redriven past its deadline, a message would be reported redriven, then expire unrun:
    it stays dead and is named, unless the redrive clears its deadline."""
    await tenants.add("acme")
    bus = Bus(store, BusConfig(max_attempts=1))
    late = await bus.enqueue(
        now=T0, deadline=T0 + timedelta(minutes=1), **vars_of(req(bus, "late"))
    )
    fine = await bus.enqueue(now=T0, **vars_of(req(bus, "fine")))
    ahead = T0 + timedelta(days=1)
    soon = await bus.enqueue(now=T0, deadline=ahead, **vars_of(req(bus, "soon")))
    for m in await bus.claim("w", limit=3, now=T0):
        assert await bus.fail(m, "boom", now=T0) is FailOutcome.DEAD
    after = T0 + timedelta(minutes=2)
    assert await bus.redrive("acme", [late.id, fine.id], now=after) == Redrive([fine.id], [late.id])
    assert await bus.redrive("acme", [late.id], now=after) == Redrive([], [late.id])
    still = await bus.get("acme", late.id)
    assert still is not None and still.status is MessageStatus.DEAD
    # Cleared only where it has passed: a deadline still ahead is kept.
    assert await bus.redrive("acme", now=after, clear_deadline=True) == Redrive(
        sorted([late.id, soon.id]), []
    )
    again = await bus.get("acme", late.id)
    assert again is not None and again.status is MessageStatus.PENDING
    assert again.deadline is None
    kept = await bus.get("acme", soon.id)
    assert kept is not None and kept.deadline == ahead
    assert await bus.expire(now=after) == 0  # nothing left to expire it for


async def test_expire_deadline_and_queue_age(store: PgMessageStore, tenants) -> None:
    await tenants.add("acme")
    bus = Bus(store, BusConfig(max_queue_age={Lane.INTERACTIVE: timedelta(minutes=5)}))
    a = await bus.enqueue(now=T0, deadline=T0 + timedelta(minutes=1), **vars_of(req(bus, "d")))
    b = await bus.enqueue(now=T0, **vars_of(req(bus, "age")))
    c = await bus.enqueue(now=T0, **vars_of(req(bus, "batch", lane=Lane.BATCH)))
    # Past its deadline a message is not run even before the expirer sweeps it.
    claimed = await bus.claim("w", limit=10, now=T0 + timedelta(minutes=2))
    assert {m.id for m in claimed} == {b.id, c.id}
    for m in claimed:
        await bus.fail(m, "again", now=T0 + timedelta(minutes=2))
    assert await bus.expire(now=T0 + timedelta(minutes=10)) == 2
    for mid, status in ((a.id, "expired"), (b.id, "expired"), (c.id, "pending")):
        got = await bus.get("acme", mid)
        assert got is not None and got.status == status
    # The queue age counts from when work came due: scheduled two hours ahead, a message is
    # not expired before it was ever due, and is once it has waited five minutes since.
    later = T0 + timedelta(hours=2)
    d = await bus.enqueue(now=T0, not_before=later, **vars_of(req(bus, "later")))
    assert await bus.expire(now=later - timedelta(minutes=1)) == 0
    assert await bus.expire(now=later + timedelta(minutes=4)) == 0
    assert await bus.expire(now=later + timedelta(minutes=6)) == 1
    got = await bus.get("acme", d.id)
    assert got is not None and got.status == "expired"


async def test_illegal_transition_refused_by_database(bus: Bus, db: Database) -> None:
    r = await bus.enqueue(**vars_of(req(bus, "ill")))
    (m,) = await bus.claim("w")
    await bus.complete(m.lease, None)
    with pytest.raises(psycopg.errors.CheckViolation, match="illegal status change"):
        async with db.system_conn() as conn:
            await conn.execute(
                "UPDATE agent_messages SET status = 'running', lease_expires_at = now()"
                " WHERE id = %s",
                (r.id,),
            )


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"directive": "   "}, "directive"),
        ({"lane": "fast"}, "lane"),
        ({"context": {"blob": "x" * (1024 * 1024)}}, "context"),
        ({"context": {"s": {1, 2}}}, "context"),
        ({"deadline": datetime(2020, 1, 1, tzinfo=UTC)}, "deadline"),
        ({"deadline": datetime(2030, 1, 1)}, "deadline"),
        ({"tenant": "Not A Name"}, "tenant"),
        ({"priority": 5000}, "priority"),
    ],
)
async def test_bad_input_names_the_field_and_writes_nothing(
    bus: Bus, db: Database, fields: dict[str, Any], field: str
) -> None:
    base = vars_of(req(bus, "bad"))
    with pytest.raises(InvalidInput) as info:
        await bus.enqueue(now=datetime.now(UTC), **{**base, **fields})
    assert info.value.field == field
    async with db.system_conn() as conn:
        row = await (await conn.execute("SELECT count(*) AS n FROM agent_messages")).fetchone()
    assert row is not None and row["n"] == 0


async def test_unknown_tenant_in_a_batch_writes_nothing(bus: Bus, db: Database) -> None:
    with pytest.raises(UnknownTenant, match="initech"):
        await bus.enqueue_many([req(bus, "1"), req(bus, "2", tenant="initech")])
    with pytest.raises(UnknownTenant):
        await bus.enqueue_many([req(bus, "3", tenant="initech")])
    async with db.system_conn() as conn:
        row = await (await conn.execute("SELECT count(*) AS n FROM agent_messages")).fetchone()
        keys = await (await conn.execute("SELECT count(*) AS n FROM idempotency_keys")).fetchone()
    assert row is not None and row["n"] == 0 and keys is not None and keys["n"] == 0


async def test_status_counts_and_ages(bus: Bus) -> None:
    await bus.enqueue(now=T0 + timedelta(seconds=20), **vars_of(req(bus, "0", stage="other")))
    await bus.enqueue(now=T0, **vars_of(req(bus, "1")))
    await bus.enqueue(now=T0 + timedelta(seconds=30), **vars_of(req(bus, "2", lane=Lane.BATCH)))
    await bus.claim("w", lanes=[Lane.BATCH], now=T0 + timedelta(seconds=40))
    st = await bus.status(now=T0 + timedelta(seconds=100))
    # Two stages pending in one lane: counted together, the older one's age is the lane's.
    assert st.lanes[Lane.INTERACTIVE].counts[MessageStatus.PENDING] == 2
    assert st.lanes[Lane.INTERACTIVE].oldest_pending_age_s == pytest.approx(100)
    assert st.stages == {"demo": {"intake": {"pending": 1, "running": 1}, "other": {"pending": 1}}}
    assert st.lanes[Lane.BATCH].counts[MessageStatus.RUNNING] == 1
    assert st.lanes[Lane.BATCH].oldest_running_lease_age_s == pytest.approx(60)
    assert st.tenants == 2


async def test_status_keeps_dotted_pipeline_and_stage_names_apart(bus: Bus) -> None:
    await bus.enqueue_many(
        [req(bus, "1", pipeline="a.b", stage="c"), req(bus, "2", pipeline="a", stage="b.c")]
    )
    st = await bus.status()
    assert st.stages == {"a": {"b.c": {"pending": 1}}, "a.b": {"c": {"pending": 1}}}


async def test_status_names_work_past_an_expiry_that_maintenance_has_not_moved(
    bus: Bus,
) -> None:
    # With no runner's maintenance running, such work showed only as old pending ages.
    await bus.enqueue(now=T0, **vars_of(req(bus, "lease")))
    await bus.claim("w", lease=timedelta(seconds=30), now=T0)
    await bus.enqueue(now=T0, not_before=T0 + timedelta(minutes=5), **vars_of(req(bus, "later")))
    await bus.enqueue(now=T0, deadline=T0 + timedelta(minutes=1), **vars_of(req(bus, "late")))
    at = T0 + timedelta(minutes=10)
    assert (await bus.status(now=T0)).overdue == {
        "leases_expired": 0, "due_not_promoted": 0, "past_deadline": 0, "waits_expired": 0,
    }  # fmt: skip
    assert (await bus.status(now=at)).overdue == {
        "leases_expired": 1, "due_not_promoted": 1, "past_deadline": 1, "waits_expired": 0,
    }  # fmt: skip
    await bus.reclaim(now=at)
    await bus.promote_due(now=at)
    await bus.expire(now=at)
    assert set((await bus.status(now=at)).overdue.values()) == {0}


async def test_batched_completion(bus: Bus) -> None:
    await bus.enqueue_many([req(bus, str(i)) for i in range(20)])
    claimed = await bus.claim("w", limit=20)
    outcomes = await bus.complete_many([Completion(m.lease, {"i": m.id}) for m in claimed])
    assert outcomes == [AckOutcome.APPLIED] * 20
    # Sent again (their answers lost): applied, by the first, and nothing changes; with
    # another result, not applied, and told so.
    assert (
        await bus.complete_many([Completion(m.lease, {"i": m.id}) for m in claimed[:3]])
        == [AckOutcome.APPLIED] * 3
    )
    assert (
        await bus.complete_many([Completion(m.lease) for m in claimed[:3]])
        == [AckOutcome.STALE] * 3
    )
    for m in claimed[:3]:
        got = await bus.get("acme", m.id)
        assert got is not None and got.result == {"i": m.id}


async def test_concurrent_single_enqueues_share_statements(bus: Bus, db: Database) -> None:
    """Group commit through the real database: 120 concurrent calls in two tenants, a third of
    them repeats, land in far fewer transactions, each answered as it would be alone."""
    ids = [f"g{i % 80}" for i in range(120)]  # g0..g39 asked twice
    tenants = ["acme" if i % 2 else "globex" for i in range(80)]
    before = bus._group.statements

    async def one(sid: str) -> tuple[str, Any]:
        tenant = tenants[int(sid[1:])]
        return sid, await bus.enqueue(**vars_of(req(bus, sid, tenant=tenant)))

    results = await asyncio.gather(*(one(sid) for sid in ids))
    by_key: dict[str, set[int]] = {}
    for sid, result in results:
        by_key.setdefault(sid, set()).add(result.id)
    assert all(len(found) == 1 for found in by_key.values())  # a repeat gets the same id
    assert sum(r.new for _, r in results) == 80
    statements = bus._group.statements - before
    assert statements < 60, f"{statements} statements for 120 calls: not grouped"
    async with db.system_conn() as conn:
        rows = await (
            await conn.execute(
                "SELECT count(*) AS n, count(DISTINCT xmin::text) AS txs,"
                " (SELECT sum(hits) FROM idempotency_keys) AS hits FROM agent_messages"
            )
        ).fetchone()
    assert rows is not None
    assert rows["n"] == 80 and rows["txs"] < 60
    assert rows["hits"] == 40  # every repeat counted as a dedup hit, as if sent alone


async def test_claim_rows_decode_by_name_in_any_column_order(bus: Bus, db: Database) -> None:
    """The claim path picks a row's values by position (message_rows); the positions come from
    the result's column names, so the order of columns, the columns later migrations add and
    the trailing value all land where the dict path (row_to_message) puts them."""
    enq = await bus.enqueue(**vars_of(req(bus, "rows", context={"k": [1, "two"]})))
    (claimed,) = await bus.claim("w", limit=1)
    assert claimed.id == enq.id and claimed.context == {"k": [1, "two"]}
    assert claimed.lane is Lane.INTERACTIVE and claimed.status is MessageStatus.RUNNING
    assert claimed.extra["run_deadline"] is not None and claimed.hops == 0

    shuffled = (
        "SELECT 7 AS lane_pending, m.hops, m.status, m.context, m.lane, m.*, m.id AS also"
        " FROM appliance.agent_messages m WHERE m.id = %(id)s"
    )
    async with db.system_conn() as conn:
        cur = conn.cursor(row_factory=message_rows("lane_pending"))
        ((message, trailer),) = await (await cur.execute(shuffled, {"id": enq.id})).fetchall()
        plain = await (
            await conn.execute(
                "SELECT * FROM appliance.agent_messages WHERE id = %(id)s", {"id": enq.id}
            )
        ).fetchone()
    assert trailer == 7 and plain is not None
    expected = row_to_message(dict(plain))
    assert message is not None
    assert {**vars(message), "extra": None} == {**vars(expected), "extra": None}
    assert message.extra == {**expected.extra, "also": enq.id}

    # A row of NULLs (a claim that found nothing) carries only the trailer.
    async with db.system_conn() as conn:
        cur = conn.cursor(row_factory=message_rows("lane_pending"))
        empty = "SELECT NULL::bigint AS lane_pending, m.* FROM appliance.agent_messages m"
        rows = await (await cur.execute(empty + " RIGHT JOIN (SELECT) AS one ON false")).fetchall()
    assert rows == [(None, None)]

    # A statement that lacks a field of the read model is refused by name, never half-read.
    async with db.system_conn() as conn:
        cur = conn.cursor(row_factory=message_rows("lane_pending"))
        with pytest.raises(ValueError, match="directive"):
            await cur.execute("SELECT id, tenant FROM appliance.agent_messages")


async def test_failure_text_the_database_cannot_hold_is_escaped_not_lost(
    bus: Bus, store: PgMessageStore, db: Database
) -> None:
    """An exception's message may hold a NUL or a lone surrogate; recording the failure must
    not fail on it (the lease would lapse and the attempt go unrecorded)."""
    await bus.enqueue(**vars_of(req(bus, "odd-error")))
    (m,) = await bus.claim("w", limit=1)
    outcome = await store.fail(
        m.lease, error="boom \x00 \ud800 é", retry_delay=timedelta(seconds=1), actor="w"
    )
    assert outcome is FailOutcome.RETRY
    async with db.system_conn() as conn:
        row = await (
            await conn.execute("SELECT error FROM appliance.agent_messages WHERE id = %s", (m.id,))
        ).fetchone()
    assert row is not None and row["error"] == "boom \\x00 \\ud800 é"


async def test_a_batch_too_large_for_one_statement_goes_in_several_all_or_nothing(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PostgreSQL holds one JSON value to 256 MiB: 280 contexts of 1 MB in one statement failed
    # every request with a driver error. Statements are cut by bytes as well as by count (the
    # limit made small here), in one transaction: all of the batch or none of it.
    monkeypatch.setattr(message_store, "ENQUEUE_STATEMENT_BYTES", 200_000)
    blob = "x" * 20_000  # 80 KB counted each (4 bytes a character at most)
    batch = [req(bus, f"big{i}", context={"blob": blob}) for i in range(7)]
    results = await bus.enqueue_many(batch)
    assert [r.new for r in results] == [True] * 7
    assert len({r.id for r in results}) == 7
    got = await bus.get("acme", results[6].id)
    assert got is not None and got.source_id == "big6" and got.context == {"blob": blob}
    doomed = [req(bus, f"more{i}", context={"blob": blob}) for i in range(6)]
    doomed.append(req(bus, "ghost", tenant="ghost"))  # refused, in the last statement
    with pytest.raises(UnknownTenant):
        await bus.enqueue_many(doomed)
    assert await bus.get("acme", (await bus.enqueue_many([doomed[0]]))[0].id) is not None
    assert (await bus.enqueue_many([doomed[0]]))[0].new is False  # only now written


def test_statements_are_cut_by_count_and_by_bytes(bus: Bus) -> None:
    small = [req(bus, f"s{i}") for i in range(2500)]
    assert [len(c) for c in message_store.enqueue_chunks(small)] == [1000, 1000, 500]
    big = req(bus, "big", context={"blob": "y" * 600_000})  # 2.4 MB counted
    sizes = [len(c) for c in message_store.enqueue_chunks([big] * 60)]
    assert sizes == [27, 27, 6]  # 64 MiB / 2.4 MB
    assert [len(c) for c in message_store.enqueue_chunks([])] == []


async def test_a_request_never_carries_more_context_than_the_bus_allows(db: Database) -> None:
    bus = Bus(PgMessageStore(db), BusConfig(context_max_bytes=2048))
    with pytest.raises(InvalidInput, match="context: is 4008 bytes, over the limit of 2048"):
        bus.request(
            **{**vars_of(req(bus, "c")), "context": {"b": "x" * 4000}}, context_max_bytes=10**9
        )
    # Built with a larger limit elsewhere, then handed to this bus: refused all the same.
    roomy = EnqueueRequest.build(
        tenant="acme", pipeline="demo", stage="intake", source="test", source_id="r",
        directive="d", context={"b": "x" * 4000},
    )  # fmt: skip
    with pytest.raises(InvalidInput, match="context: of request 0 is 4008 bytes"):
        await bus.enqueue_many([roomy])


async def test_a_result_over_the_context_limit_is_refused_before_anything_is_written(
    store: PgMessageStore, tenants
) -> None:
    # A result becomes the next stage's context: held to the same limit through the Bus API
    # as through the runner, not stored and handed off past it.
    await tenants.add("acme")
    bus = Bus(store, BusConfig(context_max_bytes=2048))
    await bus.enqueue_many([req(bus, "1"), req(bus, "2")])
    first, second = await bus.claim("w", limit=2)
    with pytest.raises(InvalidInput, match=f"result: of message {second.id} is 4008 bytes"):
        await bus.complete_many(
            [Completion(first.lease, {"ok": 1}), Completion(second.lease, {"b": "x" * 4000})]
        )
    # Nothing of the batch was written; the first's result alone is taken.
    got = await bus.get("acme", first.id)
    assert got is not None and got.status is MessageStatus.RUNNING
    assert await bus.complete(first.lease, {"ok": 1}) is AckOutcome.APPLIED
    got = await bus.get("acme", first.id)
    assert got is not None and got.result == {"ok": 1}
