"""Work that is not due yet (a retry's backoff, a deferral, an enqueue for later) stays out of
the claim's index until the promoter makes it claimable, and rings its lane then."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from appliance.bus.core import Bus
from appliance.db.database import Database
from appliance.db.listener import PgDoorbell
from appliance.db.runner_store import PgRunnerStore
from appliance.domain.envelope import Lane, MessageStatus
from appliance.scheduler import Maintenance
from tests.db.plans import PENDING_INDEX, read_by

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
LANES = (Lane.INTERACTIVE, Lane.SYSTEM, Lane.BATCH)  # claim order


async def enqueue(bus: Bus, prefix: str, n: int, **kw: Any) -> None:
    for first in range(0, n, 1000):
        await bus.enqueue_many(
            [
                bus.request(tenant="acme", pipeline="demo", stage="intake", source="t",
                            source_id=f"{prefix}{i}", directive="work", **kw)
                for i in range(first, min(n, first + 1000))
            ],
            now=T0,
        )  # fmt: skip


async def test_a_claim_reads_none_of_the_work_deferred_ahead_of_it(
    bus: Bus, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5,000 messages of a higher priority wait for tomorrow ahead of 20 due ones: a claim of
    10 takes due ones and reads no more of the pending index than with nothing deferred."""
    store = PgRunnerStore(db)

    async def pages_read() -> tuple[int, set[str]]:
        found, pages = await read_by(
            db,
            lambda: store.claim_lane(
                worker="w", lane=Lane.INTERACTIVE, limit=10, lease=timedelta(seconds=30),
                tenant_limit=1000, now=T0,
            ),
            stat="blocks_fetched", relation=PENDING_INDEX, monkeypatch=monkeypatch,
        )  # fmt: skip
        return pages, {m.source_id for m in found.messages}

    await enqueue(bus, "due", 20)
    alone, first = await pages_read()
    assert len(first) == 10 and all(sid.startswith("due") for sid in first)
    await enqueue(bus, "later", 5000, priority=5, not_before=T0 + timedelta(days=1))
    behind, taken = await pages_read()
    assert taken == first
    assert behind <= alone, (alone, behind)


async def test_due_work_is_promoted_in_batches_and_rings_its_lane(bus: Bus, db: Database) -> None:
    store = PgRunnerStore(db)
    await enqueue(bus, "later", 5, lane=Lane.BATCH, not_before=T0 + timedelta(minutes=5))
    doorbell = PgDoorbell(db.endpoints.system)
    await doorbell.start()
    try:
        await doorbell.wait(5)  # a connect rings every lane (work may have come meanwhile)
        await enqueue(bus, "later-too", 1, lane=Lane.BATCH, not_before=T0 + timedelta(hours=1))
        # An enqueue for later rings nothing: there is nothing to claim.
        assert await doorbell.wait(0.3) == frozenset()
        claim: dict[str, Any] = {"worker": "w", "lane": Lane.BATCH, "limit": 10,
                                 "lease": timedelta(seconds=30), "tenant_limit": 1000}  # fmt: skip
        due = T0 + timedelta(minutes=5)
        assert (await store.claim_lane(**claim, now=due)).messages == []  # not promoted yet
        assert await store.promote_due(lanes=LANES, batch=2, now=due - timedelta(seconds=1)) == 0
        assert await store.promote_due(lanes=LANES, batch=2, now=due) == 2
        assert await doorbell.wait(5) == frozenset({Lane.BATCH})
        assert await store.promote_due(lanes=LANES, batch=2, now=due) == 2
        assert await store.promote_due(lanes=LANES, batch=2, now=due) == 1
        assert (
            await store.promote_due(lanes=LANES, batch=2, now=due) == 0
        )  # the hour-later one waits
        lane = (await store.status(now=due)).lanes[Lane.BATCH]
        assert (lane.counts[MessageStatus.PENDING], lane.deferred) == (6, 1)
        # The oldest pending age counts from when work came due: the five, due at `due`;
        # before that nothing waited.
        assert lane.oldest_pending_age_s == 0
        later = (await store.status(now=due + timedelta(seconds=10))).lanes[Lane.BATCH]
        assert later.oldest_pending_age_s == 10
        early = (await store.status(now=due - timedelta(seconds=1))).lanes[Lane.BATCH]
        assert early.oldest_pending_age_s is None
        await asyncio.sleep(0)
        taken = (await store.claim_lane(**claim, now=due)).messages
        assert sorted(m.source_id for m in taken) == [f"later{i}" for i in range(5)]
    finally:
        await doorbell.close()


async def test_the_maintenance_tick_that_reclaims_also_promotes(bus: Bus, db: Database) -> None:
    await enqueue(bus, "later", 3, not_before=T0 + timedelta(minutes=5))  # due by the real clock
    maintenance = Maintenance(bus, PgRunnerStore(db))
    await maintenance.reclaim()
    assert maintenance.promoted == 3
    taken = await bus.claim("w", limit=10)
    assert len(taken) == 3


async def test_interactive_work_due_is_promoted_ahead_of_a_burst_of_batch_work(
    bus: Bus, db: Database
) -> None:
    """3,000 batch messages come due first, one interactive message a second later: the first
    promotion of 500 takes the interactive one (claim order), not only the oldest due."""
    store = PgRunnerStore(db)
    await enqueue(bus, "nightly", 3000, lane=Lane.BATCH, not_before=T0 + timedelta(minutes=1))
    await enqueue(bus, "urgent", 1, not_before=T0 + timedelta(minutes=1, seconds=1))
    now = T0 + timedelta(minutes=2)
    assert await store.promote_due(lanes=LANES, batch=500, now=now) == 500
    claim: dict[str, Any] = {"worker": "w", "limit": 10, "lease": timedelta(seconds=30),
                             "tenant_limit": 10_000, "now": now}  # fmt: skip
    taken = (await store.claim_lane(lane=Lane.INTERACTIVE, **claim)).messages
    assert [m.source_id for m in taken] == ["urgent0"]
    assert len((await store.claim_lane(lane=Lane.BATCH, **claim)).messages) == 10
