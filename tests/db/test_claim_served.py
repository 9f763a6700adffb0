"""Runners that serve different pipelines on one bus: a claim skips the stages other live
runners serve (not taken, not counted as backlog, and a tenant that has only such work takes
no share), the runners say what they serve, and work parked for want of a runner of its stage
resumes when one serves it. Time is injected where the statements take it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from appliance.bus.core import Bus
from appliance.db.runner_store import PgRunnerStore
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.envelope import Lane, MessageStatus
from appliance.domain.ports import RUNNER_ALIVE

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
OTHERS = frozenset({("other", "a"), ("chain", "b")})


async def _store(db: Any, tenants: PgTenantStore) -> tuple[Bus, PgRunnerStore]:
    for name in ("acme", "globex"):
        await tenants.add(name)
    store = PgRunnerStore(db)
    return Bus(store), store


async def _enqueue(bus: Bus, tenant: str, pipeline: str, stage: str, n: int, at: datetime) -> None:
    await bus.enqueue_many(
        [
            bus.request(
                tenant=tenant,
                pipeline=pipeline,
                stage=stage,
                source="t",
                source_id=f"{tenant}-{pipeline}-{stage}-{i}",
                directive="go",
            )
            for i in range(n)
        ],
        now=at,
    )


async def _claim(store: PgRunnerStore, limit: int, skip: Any) -> Any:
    return await store.claim_lane(
        worker="w",
        lane=Lane.INTERACTIVE,
        limit=limit,
        lease=timedelta(seconds=30),
        tenant_limit=100,
        now=T0,
        skip=skip,
    )


async def test_skipped_stages_are_not_claimed_and_not_backlog(
    db: Any, tenants: PgTenantStore
) -> None:
    bus, store = await _store(db, tenants)
    # Older, so ahead in the pending index: read past, never taken.
    await _enqueue(bus, "acme", "other", "a", 5, T0 - timedelta(minutes=2))
    await _enqueue(bus, "acme", "chain", "b", 5, T0 - timedelta(minutes=2))
    await _enqueue(bus, "acme", "chain", "a", 3, T0 - timedelta(minutes=1))

    found = await _claim(store, 10, OTHERS)
    assert {(m.pipeline, m.stage) for m in found.messages} == {("chain", "a")}
    assert len(found.messages) == 3
    # Only skipped work is left: nothing for this runner to ask again for.
    assert not found.left_behind
    again = await _claim(store, 10, OTHERS)
    assert again.messages == [] and not again.left_behind

    # Untouched: no attempt used, no lease.
    left = await bus.status(now=T0)
    assert left.lanes[Lane.INTERACTIVE].counts[MessageStatus.PENDING] == 10
    # Nothing skipped (the Bus's own claim, a runner alone): taken.
    rest = await _claim(store, 20, None)
    assert len(rest.messages) == 10
    assert all(m.attempts == 1 for m in rest.messages)


async def test_a_tenant_with_only_skipped_work_takes_no_share(
    db: Any, tenants: PgTenantStore
) -> None:
    bus, store = await _store(db, tenants)
    # globex has only another runner's work; never served, it would come first and halve
    # acme's share if it were eligible.
    await _enqueue(bus, "globex", "other", "a", 10, T0 - timedelta(minutes=1))
    await _enqueue(bus, "acme", "chain", "a", 10, T0 - timedelta(minutes=1))
    found = await _claim(store, 10, OTHERS)
    assert [m.tenant for m in found.messages] == ["acme"] * 10


async def test_names_are_matched_whole(db: Any, tenants: PgTenantStore) -> None:
    bus, store = await _store(db, tenants)
    # 'a.b' + 'c' and 'a' + 'b.c' read alike when joined with a dot; the pairs do not.
    await _enqueue(bus, "acme", "a.b", "c", 1, T0 - timedelta(minutes=1))
    await _enqueue(bus, "acme", "a", "b.c", 1, T0 - timedelta(minutes=1))
    found = await _claim(store, 10, frozenset({("a.b", "c")}))
    assert [(m.pipeline, m.stage) for m in found.messages] == [("a", "b.c")]


def _runner(rid: str, serves: Any, seen: datetime) -> dict[str, Any]:
    return {
        "id": rid, "host": "h", "pid": 1, "started_at": seen, "seen_at": seen,
        "listener_connected": True, "serves": serves,
    }  # fmt: skip


async def test_the_stages_served_elsewhere_are_those_of_live_runners(
    db: Any, tenants: PgTenantStore
) -> None:
    _, store = await _store(db, tenants)
    await store.register_runner(_runner("me", {("chain", "a")}, T0))
    await store.register_runner(_runner("b", {("other", "a"), ("chain", "a")}, T0))
    await store.register_runner(_runner("c", None, T0))  # says nothing: skips nothing
    await store.register_runner(_runner("old", {("gone", "x")}, T0 - RUNNER_ALIVE * 2))
    stopped = _runner("stopped", {("stopped", "x")}, T0)
    await store.register_runner(stopped)
    await store.report_runner({**stopped, "stopped_at": T0, "last_missed_wakeup_at": None,
                               "missed_wakeups": 0, "claimed": 0, "completed": 0,
                               "failed": 0, "stats": {}})  # fmt: skip
    assert await store.stages_elsewhere("me", now=T0) == {("other", "a"), ("chain", "a")}
    assert await store.stages_elsewhere("b", now=T0) == {("chain", "a")}


async def test_parked_work_of_a_stage_resumes_when_a_runner_serves_it(
    db: Any, tenants: PgTenantStore
) -> None:
    bus, store = await _store(db, tenants)
    await _enqueue(bus, "acme", "other", "a", 2, T0 - timedelta(minutes=1))
    await _enqueue(bus, "acme", "chain", "a", 1, T0 - timedelta(minutes=1))
    taken = (await _claim(store, 10, None)).messages
    for m in taken:
        took = await store.wait_stage(
            m.lease, pipeline=m.pipeline, stage=m.stage, wait=timedelta(hours=1),
            reason="no runner", actor="w", now=T0,
        )  # fmt: skip
        assert took == "waiting_capability"
    parked = await bus.get("acme", taken[0].id)
    assert parked is not None and parked.status is MessageStatus.WAITING_CAPABILITY
    assert parked.attempts == 0  # the attempt is not counted
    assert parked.extra["waiting_for"] == f"stage:{parked.pipeline}/{parked.stage}"
    assert parked.extra["wait_expires_at"] == T0 + timedelta(hours=1)
    # Another stage's runner resumes only its own.
    assert await store.resume_stages({("other", "a")}, actor="b", now=T0) == 2
    assert await store.resume_stages({("other", "a")}, actor="b", now=T0) == 0
    states = {(m.pipeline, (await bus.get("acme", m.id)).status) for m in taken}  # type: ignore[union-attr]
    assert states == {("other", MessageStatus.PENDING), ("chain", MessageStatus.WAITING_CAPABILITY)}


async def test_work_claimed_before_its_runner_started_goes_back_to_it_not_parked(
    db: Any, tenants: PgTenantStore
) -> None:
    bus, store = await _store(db, tenants)
    await _enqueue(bus, "acme", "other", "a", 1, T0 - timedelta(minutes=1))
    (m,) = (await _claim(store, 10, None)).messages
    # The runner of other/a registers after this claim (its start-up resume found nothing
    # parked), before the claimer parks it: given back for that runner, not parked.
    await store.register_runner(_runner("b", {("other", "a")}, T0))
    took = await store.wait_stage(
        m.lease, pipeline="other", stage="a", wait=timedelta(hours=1), reason="no runner",
        actor="w", now=T0,
    )  # fmt: skip
    assert took == "pending"
    got = await bus.get("acme", m.id)
    assert got is not None and got.status is MessageStatus.PENDING and got.attempts == 0
    assert got.not_before == T0 - timedelta(minutes=1)  # its place in line kept
    # The claimer's own registration does not count as another runner serving it.
    (m,) = (await _claim(store, 10, None)).messages
    await store.register_runner(_runner("w", {("other", "a")}, T0))
    await store.register_runner(_runner("b", None, T0))
    took = await store.wait_stage(
        m.lease, pipeline="other", stage="a", wait=timedelta(hours=1), reason="no runner",
        actor="w", now=T0,
    )  # fmt: skip
    assert took == "waiting_capability"
