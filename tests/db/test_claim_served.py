"""Claims of the stages a runner serves: work of other pipelines, or of stages its code does not
have, is left to the runners that serve it: not taken, not counted as backlog, and a tenant
that has only such work takes no share of the claim."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from appliance.bus.core import Bus
from appliance.db.runner_store import PgRunnerStore
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.envelope import Lane, MessageStatus

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
CHAIN_A = frozenset({("chain", "a")})


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


async def _claim(store: PgRunnerStore, limit: int, served: Any) -> Any:
    return await store.claim_lane(
        worker="w",
        lane=Lane.INTERACTIVE,
        limit=limit,
        lease=timedelta(seconds=30),
        tenant_limit=100,
        now=T0,
        served=served,
    )


async def test_only_served_stages_are_claimed_and_the_rest_is_not_backlog(
    db: Any, tenants: PgTenantStore
) -> None:
    bus, store = await _store(db, tenants)
    # Older and of a higher rank in the pending index: read past, never taken.
    await _enqueue(bus, "acme", "other", "a", 5, T0 - timedelta(minutes=2))
    await _enqueue(bus, "acme", "chain", "b", 5, T0 - timedelta(minutes=2))
    await _enqueue(bus, "acme", "chain", "a", 3, T0 - timedelta(minutes=1))

    found = await _claim(store, 10, CHAIN_A)
    assert {(m.pipeline, m.stage) for m in found.messages} == {("chain", "a")}
    assert len(found.messages) == 3
    # Only unserved work is left: nothing for this runner to ask again for.
    assert not found.left_behind
    again = await _claim(store, 10, CHAIN_A)
    assert again.messages == [] and not again.left_behind

    # Untouched: no attempt used, no lease, no error.
    left = await bus.status(now=T0)
    assert left.lanes[Lane.INTERACTIVE].counts[MessageStatus.PENDING] == 10
    # A claim that serves anything (None: the Bus's own claim) takes them.
    rest = await _claim(store, 20, None)
    assert len(rest.messages) == 10
    assert all(m.attempts == 1 for m in rest.messages)


async def test_a_tenant_with_only_unserved_work_takes_no_share(
    db: Any, tenants: PgTenantStore
) -> None:
    bus, store = await _store(db, tenants)
    # globex has only another pipeline's work; it has never been served, so it would come
    # first and halve acme's share if it were eligible.
    await _enqueue(bus, "globex", "other", "a", 10, T0 - timedelta(minutes=1))
    await _enqueue(bus, "acme", "chain", "a", 10, T0 - timedelta(minutes=1))
    found = await _claim(store, 10, CHAIN_A)
    assert [m.tenant for m in found.messages] == ["acme"] * 10


async def test_names_are_matched_whole(db: Any, tenants: PgTenantStore) -> None:
    bus, store = await _store(db, tenants)
    # 'a.b' + 'c' and 'a' + 'b.c' read alike when joined with a dot; served pairs do not.
    await _enqueue(bus, "acme", "a.b", "c", 1, T0 - timedelta(minutes=1))
    await _enqueue(bus, "acme", "a", "b.c", 1, T0 - timedelta(minutes=1))
    found = await _claim(store, 10, frozenset({("a", "b.c")}))
    assert [(m.pipeline, m.stage) for m in found.messages] == [("a", "b.c")]
