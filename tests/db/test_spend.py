"""The monthly cap and run budgets in real PostgreSQL: the reservation race, settlement and
alerts, month rollover with holds in flight, the interactive share, tenant caps, released holds of
dead leases, and every run-budget dimension with its verification reserve."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from appliance.db.database import Database
from appliance.db.spend_store import PgSpendStore
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.budget import Refusal, RunBudget
from appliance.domain.envelope import Lane, MessageStatus
from appliance.domain.inference import Tier

A = Decimal("0.000123457")  # one call's worst case: not a round number on purpose


async def reserve(spend: PgSpendStore, now: datetime, **kw: object) -> int | Refusal:
    fields: dict[str, object] = {
        "tenant": "acme", "lane": Lane.INTERACTIVE, "amount": A, "lease": None,
        "pipeline": "p", "stage": "s", "kind": "classify", "model": "m", "tier": "mechanical",
    }  # fmt: skip
    fields.update(kw)
    return await spend.reserve(now=now, **fields)  # type: ignore[arg-type]


def asker(
    spend: PgSpendStore, taken: dict[str, Any]
) -> Callable[[str, str, datetime], Awaitable[int | Refusal]]:
    """ask(source id, amount, at): that running message's call reserves `amount` at `at`."""

    async def ask(sid: str, amount: str, at: datetime) -> int | Refusal:
        m = taken[sid]
        return await reserve(spend, at, tenant=m.tenant, lease=m.lease, lane=m.lane,
                             amount=Decimal(amount))  # fmt: skip

    return ask


@pytest.fixture
async def spend(db: Database) -> PgSpendStore:
    tenants = PgTenantStore(db)
    for name in ("acme", "globex"):
        await tenants.add(name)
    return PgSpendStore(db)


async def month_row(db: Database, month: str, scope: str = "appliance") -> dict[str, object]:
    async with db.system_conn() as conn:
        row = await (
            await conn.execute(
                "SELECT spent, reserved FROM spend_months WHERE month = %s AND scope = %s",
                (month, scope),
            )
        ).fetchone()
    return dict(row) if row else {}


async def test_the_cap_race_admits_exactly_k_and_never_overshoots(
    spend: PgSpendStore, db: Database
) -> None:
    k, n = 7, 50
    await spend.set_cap("appliance", A * k)
    pool = Database(db.endpoints, min_size=n, max_size=n)
    await pool.open()
    racing = PgSpendStore(pool)
    try:
        for run in range(100):
            # Each run is its own month (injected database time): a fresh ledger row.
            now = datetime(2031, 1, 1, tzinfo=UTC) + timedelta(days=32 * run)
            month = now.date().replace(day=1).isoformat()
            barrier = asyncio.Barrier(n + 1)
            samples: list[Decimal] = []
            done = asyncio.Event()

            async def one(now: datetime = now, barrier: asyncio.Barrier = barrier) -> bool:
                await barrier.wait()
                return isinstance(await reserve(racing, now), int)

            async def sample(
                month: str = month, done: asyncio.Event = done, samples: list[Decimal] = samples
            ) -> None:
                while not done.is_set():
                    row = await month_row(db, month)
                    if row:
                        samples.append(Decimal(row["spent"]) + Decimal(row["reserved"]))  # type: ignore[arg-type]
                    await asyncio.sleep(0)

            sampler = asyncio.create_task(sample())
            tasks = [asyncio.create_task(one()) for _ in range(n)]
            await barrier.wait()
            admitted = sum(await asyncio.gather(*tasks))
            done.set()
            await sampler
            row = await month_row(db, month)
            assert admitted == k, f"run {run}: {admitted} admitted"
            assert Decimal(row["reserved"]) == A * k  # type: ignore[arg-type]
            assert all(s <= A * k for s in samples), f"run {run}: overshoot {max(samples)}"
    finally:
        await pool.close()


async def test_settle_release_and_alerts(spend: PgSpendStore, db: Database) -> None:
    now = datetime(2031, 3, 10, tzinfo=UTC)
    await spend.set_cap("appliance", Decimal("1.0"))
    holds = [await reserve(spend, now, amount=Decimal("0.3")) for _ in range(3)]
    assert all(isinstance(h, int) for h in holds)
    refused = await reserve(spend, now, amount=Decimal("0.2"))
    assert isinstance(refused, Refusal)
    assert refused.dimension.startswith("money: appliance monthly cap 1.0")
    assert refused.reason() == (
        "held_budget: money: appliance monthly cap 1.0 EUR; limit 1, spent 0, reserved 0.9, "
        "this call needs 0.2"
    )
    # Settled below the hold: the rest is free again; settling twice changes nothing.
    assert await spend.settle(holds[0], amount=Decimal("0.1"), energy_joules=1200.0,  # type: ignore[arg-type]
                              provenance="estimated", now=now) == Decimal("0.1")  # fmt: skip
    assert await spend.settle(holds[0], amount=Decimal("0.1"), energy_joules=1.0,  # type: ignore[arg-type]
                              provenance="estimated", now=now) is None  # fmt: skip
    assert await spend.settle(holds[1], amount=Decimal(0), energy_joules=None,  # type: ignore[arg-type]
                              provenance=None, released=True, now=now) == 0  # fmt: skip
    row = await month_row(db, "2031-03-01")
    assert (row["spent"], row["reserved"]) == (Decimal("0.1"), Decimal("0.3"))
    assert isinstance(await reserve(spend, now, amount=Decimal("0.6")), int)
    for hold in (holds[2],):
        await spend.settle(hold, amount=Decimal("0.45"), energy_joules=5.0,  # type: ignore[arg-type]
                           provenance="estimated", now=now)  # fmt: skip
    alerts = await spend.alerts(now=now)
    # 0.55 spent of 1.0: the 50 % alert, once, for the appliance scope.
    assert [(a["scope"], a["fraction"]) for a in alerts] == [("appliance", Decimal("0.5"))]
    status = {r["scope"]: r for r in await spend.status(now=now)}
    assert status["appliance"]["provenance"] == {"estimated": 2}


async def test_month_rollover_with_holds_in_flight(spend: PgSpendStore, db: Database) -> None:
    await spend.configure(
        time_zone="Europe/Berlin", currency="EUR", interactive_share=Decimal("0.2"),
        alert_fractions=[Decimal("0.5")], amortisation_monthly=Decimal("0.05"),
    )  # fmt: skip
    await spend.set_cap("appliance", Decimal("1.0"))
    # 23:30 UTC on 31 January is already 1 February in Berlin (UTC+1 in winter).
    late_jan = datetime(2031, 1, 31, 23, 30, tzinfo=UTC)
    assert str(await spend.month(now=late_jan)) == "2031-02-01"
    in_jan = datetime(2031, 1, 31, 22, 30, tzinfo=UTC)
    assert str(await spend.month(now=in_jan)) == "2031-01-01"
    hold = await reserve(spend, in_jan, amount=Decimal("0.4"))
    assert isinstance(hold, int)
    # The month turns while the call runs; many first reservations of February race.
    results = await asyncio.gather(*(reserve(spend, late_jan, amount=A) for _ in range(20)))
    assert all(isinstance(r, int) for r in results)
    await spend.settle(hold, amount=Decimal("0.3"), energy_joules=9.0,
                       provenance="estimated", now=late_jan)  # fmt: skip
    jan, feb = await month_row(db, "2031-01-01"), await month_row(db, "2031-02-01")
    # Each month's amortisation (0.05) was charged by its first reservation, before the hold.
    assert (jan["spent"], jan["reserved"]) == (Decimal("0.35"), 0)
    assert (feb["spent"], feb["reserved"]) == (Decimal("0.05"), A * 20)
    async with db.system_conn() as conn:
        rows = await (
            await conn.execute("SELECT count(*) AS n FROM spend_months WHERE month = '2031-02-01'")
        ).fetchone()
    assert rows is not None and rows["n"] == 2  # appliance and tenant:acme, each once
    # Amortisation is charged once per month, as a platform cost: the scheduler's tick finds
    # it charged already.
    assert await spend.platform_month(now=late_jan) == 0
    assert (await month_row(db, "2031-02-01"))["spent"] == Decimal("0.05")


async def test_the_months_amortisation_comes_before_its_first_hold(
    spend: PgSpendStore, db: Database
) -> None:
    """Charged at the scheduler's first tick of the month, it came after holds that could
    already fill the cap: spent + reserved passed it."""
    await spend.configure(
        time_zone="UTC", currency="EUR", interactive_share=Decimal("0.2"),
        alert_fractions=[], amortisation_monthly=Decimal("0.3"),
    )  # fmt: skip
    await spend.set_cap("appliance", Decimal("1.0"))
    start = datetime(2031, 3, 1, 0, 0, 5, tzinfo=UTC)
    assert isinstance(await reserve(spend, start, amount=Decimal("0.45")), int)
    refused = await reserve(spend, start, amount=Decimal("0.45"))
    assert isinstance(refused, Refusal)  # 0.3 + 0.45 + 0.45 would pass 1.0
    row = await month_row(db, "2031-03-01")
    assert (row["spent"], row["reserved"]) == (Decimal("0.3"), Decimal("0.45"))  # sum <= 1.0
    assert await spend.platform_month(now=start) == 0


async def test_the_months_amortisation_alerts_like_any_charge(
    spend: PgSpendStore, db: Database
) -> None:
    """Charged without the alert check, an amortisation that alone passed the cap (no work
    could run all month) recorded no alert (migration 0039)."""
    await spend.configure(
        time_zone="UTC", currency="EUR", interactive_share=Decimal("0.2"),
        alert_fractions=[Decimal("0.5")], amortisation_monthly=Decimal("5"),
    )  # fmt: skip
    await spend.set_cap("appliance", Decimal("1.0"))
    start = datetime(2031, 4, 1, 0, 0, 5, tzinfo=UTC)
    assert await spend.platform_month(now=start) == Decimal("5")
    async with db.system_conn() as conn:
        rows = await (
            await conn.execute(
                "SELECT scope, fraction FROM spend_alerts WHERE month = '2031-04-01'"
                " ORDER BY fraction"
            )
        ).fetchall()
    assert [(r["scope"], r["fraction"]) for r in rows] == [
        ("appliance", Decimal("0.5")),
        ("appliance", Decimal("1.0")),
    ]


async def test_interactive_keeps_its_share_and_tenants_their_caps(spend: PgSpendStore) -> None:
    now = datetime(2031, 5, 5, tzinfo=UTC)
    await spend.set_cap("appliance", Decimal("1.0"))
    assert isinstance(await reserve(spend, now, amount=Decimal("0.75"), lane=Lane.BATCH), int)
    batch = await reserve(spend, now, amount=Decimal("0.1"), lane=Lane.BATCH)
    assert isinstance(batch, Refusal) and "batch work may use 0.8" in batch.dimension
    assert isinstance(await reserve(spend, now, amount=Decimal("0.2")), int)  # interactive
    await spend.set_cap("tenant:globex", Decimal("0.01"))
    refused = await reserve(spend, now, tenant="globex", amount=Decimal("0.02"))
    assert isinstance(refused, Refusal) and "tenant:globex monthly cap" in refused.dimension


async def test_no_cap_means_no_admission(spend: PgSpendStore) -> None:
    refused = await reserve(spend, datetime(2031, 6, 1, tzinfo=UTC))
    assert isinstance(refused, Refusal) and "no monthly cap is set" in refused.dimension
    with pytest.raises(Exception, match="amount must be > 0"):
        await reserve(spend, datetime(2031, 6, 1, tzinfo=UTC), amount=Decimal(0))


async def test_a_hold_whose_lease_is_gone_keeps_its_room_until_its_call_settles(
    spend: PgSpendStore, db: Database
) -> None:
    """The reclaimer charges a lost lease's hold in full (its call may still run); the re-run
    cannot take that room, and the call's late settlement replaces the charge (migration
    0023). Released at 0, the room went to the re-run and both calls were charged: spent 1.2
    against a cap of 1."""
    from appliance.bus.core import Bus
    from appliance.db.runner_store import PgRunnerStore

    await spend.set_cap("appliance", Decimal("1.0"))
    bus = Bus(PgRunnerStore(db))
    now = datetime.now(UTC)
    await bus.enqueue(tenant="acme", pipeline="p", stage="s", source="t", source_id="1",
                      directive="d")  # fmt: skip
    (first,) = await bus.claim("w", limit=1)
    hold = await reserve(spend, now, lease=first.lease, amount=Decimal("0.6"))
    assert isinstance(hold, int)
    assert await spend.release_dead(now=None) == 0  # its lease is alive
    later = now + timedelta(hours=1)
    await bus.reclaim(now=later)
    assert await spend.release_dead(now=None) == 1
    status = {r["scope"]: r for r in await spend.status(now=None)}
    assert (status["appliance"]["spent"], status["appliance"]["reserved"]) == (Decimal("0.6"), 0)
    # The re-run of the same work does not fit beside the old call's charge.
    rerun = later + timedelta(seconds=2)  # its backoff after one attempt
    assert await bus.promote_due(now=rerun) == 1
    (again,) = await bus.claim("w", limit=1, now=rerun)
    refused = await reserve(spend, now, lease=again.lease, amount=Decimal("0.6"))
    assert isinstance(refused, Refusal)
    # Refused for spend alone, it is held for budget (as the runner parks it).
    assert await spend.hold_budget(again.lease, reason="held_budget: test",
                                   expires_at=now + timedelta(days=30), now=rerun)  # fmt: skip
    # The old call ends: its measured cost replaces the upper bound, and room comes back; the
    # work held meanwhile is woken for it (nothing else would before the month's end).
    assert await spend.settle(hold, amount=Decimal("0.25"), energy_joules=900.0,
                              provenance="estimated", now=now) == Decimal("0.25")  # fmt: skip
    woken = await bus.get("acme", again.id)
    assert woken is not None and woken.status is MessageStatus.PENDING
    log = await bus.store.transitions("acme", again.id)  # type: ignore[attr-defined]
    assert log[-1]["reason"].startswith("spend_lowered: hold"), log[-1]
    (again,) = await bus.claim("w", limit=1)
    assert await spend.settle(hold, amount=Decimal("0.25"), energy_joules=900.0,
                              provenance="estimated", now=now) is None  # fmt: skip
    second = await reserve(spend, now, lease=again.lease, amount=Decimal("0.6"))
    assert isinstance(second, int)
    await spend.settle(second, amount=Decimal("0.6"), energy_joules=1.0,
                       provenance="estimated", now=now)  # fmt: skip
    status = {r["scope"]: r for r in await spend.status(now=None)}
    assert status["appliance"]["spent"] == Decimal("0.85") <= Decimal("1.0")
    async with db.system_conn() as conn:
        rows = await (
            await conn.execute("SELECT amount, note FROM spend_ledger WHERE id = %s", (hold,))
        ).fetchone()
    assert rows is not None and rows["amount"] == Decimal("0.25")
    assert rows["note"].startswith("late: the call ended after its lease was lost")


async def test_reaching_the_cap_is_always_an_alert(spend: PgSpendStore, db: Database) -> None:
    # A measured cost above its reservation is charged as measured; spent past the cap must
    # not pass unseen whatever fractions are configured (here only 50 %).
    now = datetime(2031, 4, 10, tzinfo=UTC)
    await spend.configure(
        time_zone="UTC", currency="EUR", interactive_share=Decimal("0.2"),
        alert_fractions=[Decimal("0.5")], amortisation_monthly=Decimal(0),
    )  # fmt: skip
    await spend.set_cap("appliance", Decimal("1.0"))
    hold = await reserve(spend, now, amount=Decimal("0.9"))
    assert isinstance(hold, int)
    assert await spend.settle(hold, amount=Decimal("1.4"), energy_joules=9.0,
                              provenance="measured", now=now) == Decimal("1.4")  # fmt: skip
    alerts = sorted((a["scope"], a["fraction"]) for a in await spend.alerts(now=now))
    assert alerts == [("appliance", Decimal("0.5")), ("appliance", Decimal("1.0"))]
    assert isinstance(await reserve(spend, now, amount=Decimal("0.01")), Refusal)


async def test_a_park_that_races_a_cap_change_is_resumed_at_once(
    spend: PgSpendStore, db: Database
) -> None:
    # `cap set` resumes what is parked when it runs: a refusal taken before it, parked after
    # it, would otherwise wait for the next month.
    from appliance.bus.core import Bus
    from appliance.db.runner_store import PgRunnerStore

    await spend.set_cap("appliance", Decimal("1.0"))
    bus = Bus(PgRunnerStore(db))
    for sid in ("raced", "plain"):
        await bus.enqueue(tenant="acme", pipeline="p", stage="s", source="t", source_id=sid,
                          directive="d")  # fmt: skip
    await asyncio.sleep(0.3)  # the cap's time lies clear of the claims (its 0.1 s margin)
    raced, plain = await bus.claim("w", limit=2)
    assert isinstance(await reserve(spend, datetime.now(UTC), amount=Decimal(5)), Refusal)
    # Not raced: the cap did not change since the claim; it stays held.
    expires = datetime.now(UTC) + timedelta(days=1)
    assert await spend.hold_budget(plain.lease, reason="held_budget: x", expires_at=expires)
    await spend.set_cap("appliance", Decimal("100"))
    assert await spend.resume_budget(reason="cap_set") == 1  # finds `plain` only
    assert await spend.hold_budget(raced.lease, reason="held_budget: x", expires_at=expires)
    got = await bus.get("acme", raced.id)
    assert got is not None and got.status.value == "pending"
    assert str(got.extra.get("status_reason")).startswith("budget_recheck")


BUDGET = RunBudget(steps=10, tokens=1000, calls=5, writes=2, money=Decimal("0.5"),
                   wall_time=timedelta(minutes=5), verification_reserve=Decimal("0.2"))  # fmt: skip


async def run_reserve(
    spend: PgSpendStore, ask: dict[str, object], *, verification: bool = False,
    now: datetime | None = None, source_id: str = "r1", predict: bool = True,
) -> str | None:  # fmt: skip
    """Reserve, after checking that the read-only check (which the governor asks before a
    wait for the cap's room) writes nothing and, unless the row changes in between (`predict`
    off), predicts the answer."""
    at = now or datetime(2031, 1, 1, tzinfo=UTC)
    before = await spend.run_budget("acme", "t", source_id)
    predicted = await spend.run_check(
        tenant="acme", source="t", source_id=source_id, limits=BUDGET.limits(),
        reserve=BUDGET.verification_reserve, verification=verification, ask=ask, now=at,
    )  # fmt: skip
    assert await spend.run_budget("acme", "t", source_id) == before
    got = await spend.run_reserve(
        tenant="acme", source="t", source_id=source_id, pipeline="p", limits=BUDGET.limits(),
        reserve=BUDGET.verification_reserve, verification=verification, ask=ask, now=at,
    )  # fmt: skip
    assert predicted == got or not predict, (ask, verification, predicted, got)
    return got


@pytest.mark.parametrize(
    ("dimension", "ordinary", "verification"),
    [
        ("steps", 8, 2),
        ("tokens", 800, 200),
        ("calls", 4, 1),
        ("writes", 1, 1),  # 2 * 0.8 = 1.6: one ordinary write, the second needs verification
        ("money", Decimal("0.4"), Decimal("0.1")),
    ],
)
async def test_every_dimension_exhausts_by_name_and_keeps_its_reserve(
    spend: PgSpendStore, dimension: str, ordinary: object, verification: object
) -> None:
    assert await run_reserve(spend, {dimension: ordinary}) is None
    # Ordinary work cannot take the verification reserve...
    assert await run_reserve(spend, {dimension: verification}) == dimension
    # ...a verification stage can, up to the limit and not beyond.
    assert await run_reserve(spend, {dimension: verification}, verification=True) is None
    assert await run_reserve(spend, {dimension: 1}, verification=True) == dimension
    budget = await spend.run_budget("acme", "t", "r1")
    assert budget is not None and budget["exhausted"] == dimension


async def test_wall_time_and_giving_back_unused_reservations(spend: PgSpendStore) -> None:
    start = datetime(2031, 1, 1, tzinfo=UTC)
    assert await run_reserve(spend, {"tokens": 700}, now=start) is None
    await spend.run_adjust(tenant="acme", source="t", source_id="r1", delta={"tokens": -600})
    assert await run_reserve(spend, {"tokens": 700}, now=start) is None  # 100 + 700 <= 800
    assert await run_reserve(spend, {"steps": 1}, now=start + timedelta(minutes=6)) == "wall_time"


async def test_a_call_that_used_more_than_it_reserved_exhausts_the_run_at_once(
    spend: PgSpendStore,
) -> None:
    assert await run_reserve(spend, {"tokens": 700}) is None
    # Booked at its real use: 950 of 1,000 is over the ordinary share, not over the limit
    # (a verification stage may still use the reserve).
    await spend.run_adjust(tenant="acme", source="t", source_id="r1", delta={"tokens": 250})
    budget = await spend.run_budget("acme", "t", "r1")
    assert budget is not None and budget["exhausted"] is None
    # Past the limit: exhausted now, not at the run's next reservation (it may have none).
    await spend.run_adjust(tenant="acme", source="t", source_id="r1", delta={"tokens": 100})
    budget = await spend.run_budget("acme", "t", "r1")
    assert budget is not None and budget["exhausted"] == "tokens"
    assert budget["used"]["tokens"] == 1050
    # Sticky, as a refused reservation's mark is: use given back later does not clear it.
    await spend.run_adjust(tenant="acme", source="t", source_id="r1", delta={"tokens": -1000})
    budget = await spend.run_budget("acme", "t", "r1")
    assert budget is not None and budget["exhausted"] == "tokens"


async def test_a_refusal_found_by_the_check_is_recorded_without_reserving(
    spend: PgSpendStore,
) -> None:
    at = datetime(2031, 1, 1, tzinfo=UTC)

    async def refused(source_id: str, dimension: str) -> None:
        await spend.run_refused(
            tenant="acme", source="t", source_id=source_id, pipeline="p",
            limits=BUDGET.limits(), reserve=BUDGET.verification_reserve, exhausted=dimension,
            now=at,
        )  # fmt: skip

    await refused("new", "tokens")  # a run's first refusal starts its budget
    fresh = await spend.run_budget("acme", "t", "new")
    assert fresh is not None and fresh["exhausted"] == "tokens" and fresh["used"] == {}
    assert fresh["started_at"] == fresh["used_at"] == at
    assert await run_reserve(spend, {"steps": 1}, source_id="old", now=at) is None
    await refused("old", "calls")
    await refused("old", "money")  # the first dimension to run out stays the one named
    old = await spend.run_budget("acme", "t", "old")
    assert old is not None and old["exhausted"] == "calls" and old["used"] == {"steps": 1}


async def test_waiting_places_unasked_for_an_hour_are_purged_in_batches(
    spend: PgSpendStore, db: Database
) -> None:
    # Refusals delete such places too, but only while calls are refused: upkeep does it anyway.
    at = datetime(2031, 1, 1, 12, tzinfo=UTC)
    async with db.system_conn() as conn:
        for mid, minutes in [(1, 180), (2, 120), (3, 61), (4, 59)]:
            seen = at - timedelta(minutes=minutes)
            await conn.execute(
                "INSERT INTO spend_waiters (month, scope, message_id, lane, amount, since, seen_at)"
                " VALUES ('2031-01-01', 'appliance', %s, 'batch', 1, %s, %s)",
                (mid, seen, seen),
            )
    assert await spend.purge_waiters(batch=2, now=at) == 2
    assert await spend.purge_waiters(batch=2, now=at) == 1
    assert await spend.purge_waiters(batch=2, now=at) == 0
    async with db.system_conn() as conn:
        left = await (await conn.execute("SELECT message_id FROM spend_waiters")).fetchall()
    assert [r["message_id"] for r in left] == [4]  # asked for within the hour: kept


async def test_budgets_of_runs_idle_past_the_horizon_are_purged_in_batches(
    spend: PgSpendStore, db: Database
) -> None:
    """A run's last reservation, refused ones included, keeps its budget; a budget idle past
    the horizon is deleted a bounded batch at a time, one being reserved right now is skipped,
    and a run that comes back after its budget went starts a fresh one."""
    t0, day = datetime(2031, 1, 1, tzinfo=UTC), timedelta(days=1)
    for i in range(3):
        assert await run_reserve(spend, {"steps": 1}, source_id=f"old-{i}", now=t0) is None
    assert await run_reserve(spend, {"steps": 1}, source_id="refused", now=t0) is None
    later = t0 + 5 * day  # past the run's five minutes of wall time: refused, yet alive
    assert await run_reserve(spend, {"steps": 1}, source_id="refused", now=later) == "wall_time"
    assert await run_reserve(spend, {"steps": 1}, source_id="live", now=t0 + 9 * day) is None
    at = t0 + 10 * day
    idle = 6 * day
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="idle horizon"):
        await spend.purge_run_budgets(idle=timedelta(0), now=at)
    async with await psycopg.AsyncConnection.connect(db.endpoints.admin) as other:
        await other.execute(
            "SELECT 1 FROM appliance.run_budgets WHERE source_id = 'old-0' FOR UPDATE"
        )
        assert await spend.purge_run_budgets(idle=idle, batch=1, now=at) == 1
        assert await spend.purge_run_budgets(idle=idle, batch=1, now=at) == 1
        assert await spend.purge_run_budgets(idle=idle, batch=1, now=at) == 0  # old-0 held
    assert await spend.purge_run_budgets(idle=idle, now=at) == 1  # old-0, released
    assert await spend.purge_run_budgets(idle=idle, now=at) == 0
    async with db.system_conn() as conn:
        left = await (
            await conn.execute("SELECT source_id, used_at FROM run_budgets ORDER BY source_id")
        ).fetchall()
    assert [(r["source_id"], r["used_at"]) for r in left] == [
        ("live", t0 + 9 * day),
        ("refused", later),
    ]
    # old-1 comes back: a fresh budget, its steps counted from zero and its clock from now.
    assert await run_reserve(spend, {"steps": 2}, source_id="old-1", now=at) is None
    budget = await spend.run_budget("acme", "t", "old-1")
    assert budget is not None
    assert (budget["used"], budget["started_at"]) == ({"steps": 2}, at)


async def test_a_reservation_racing_the_purge_of_its_budget_is_still_counted(
    spend: PgSpendStore, db: Database
) -> None:
    """The purge deletes the budget between the reservation's insert (a no-op: the row is
    there) and its lock: the reservation takes a fresh budget instead of going uncounted."""
    t0 = datetime(2031, 1, 1, tzinfo=UTC)
    assert await run_reserve(spend, {"steps": 1}, source_id="r", now=t0) is None
    later = t0 + timedelta(days=10)
    async with await psycopg.AsyncConnection.connect(db.endpoints.admin) as purger:
        # The purger's transaction holds the row while the reservation's insert finds it there
        # (and does nothing) and its lock waits; then the purge deletes it and commits.
        await purger.execute("SELECT 1 FROM appliance.run_budgets WHERE source_id = 'r' FOR UPDATE")
        # (Checked before the purge: the check's answer is out of date by the reservation.)
        reserving = asyncio.create_task(
            run_reserve(spend, {"steps": 3}, source_id="r", now=later, predict=False)
        )
        await asyncio.sleep(0.3)
        assert not reserving.done()  # waiting for the row
        await purger.execute(
            "SELECT appliance.purge_run_budgets(%s, interval '1 day', 100)", (later,)
        )
        await purger.execute("COMMIT")
        assert await reserving is None
    budget = await spend.run_budget("acme", "t", "r")
    assert budget is not None and budget["used"] == {"steps": 3}


async def test_a_wait_expires_by_its_own_expiry_and_resumes_clear_it(
    spend: PgSpendStore, db: Database
) -> None:
    from appliance.bus.core import Bus
    from appliance.db.runner_store import PgRunnerStore

    store = PgRunnerStore(db)
    bus = Bus(store)
    now = datetime.now(UTC)
    for i in range(2):
        await bus.enqueue(tenant="acme", pipeline="p", stage="s", source="t", source_id=f"w{i}",
                          directive="d", deadline=now + timedelta(days=30))  # fmt: skip
    first, second = await bus.claim("w", limit=2)
    assert await spend.hold_budget(first.lease, reason="held_budget: test",
                                   expires_at=now + timedelta(minutes=5), now=None)  # fmt: skip
    assert await store.wait_capability(second.lease, tier=Tier.REASONING,
                                       expires_at=now + timedelta(hours=2), reason="waiting",
                                       actor="w", now=None)  # fmt: skip
    # The message's deadline (30 days) is untouched; the wait's own expiry ends the first.
    assert await bus.expire(now=now + timedelta(minutes=10)) == 1
    got = await bus.get("acme", first.id)
    assert got is not None and got.status.value == "expired"
    assert got.deadline == first.deadline
    log = await store.transitions("acme", first.id)
    assert log[-1]["reason"] == "wait_expired: budget"
    # Resuming clears the wait's expiry: the second runs with its whole deadline.
    assert await store.resume_capability([Tier.REASONING], now=None) == 1
    async with db.system_conn() as conn:
        row = await (await conn.execute(
            "SELECT status::text AS s, wait_expires_at, deadline FROM agent_messages WHERE id = %s",
            (second.id,),
        )).fetchone()  # fmt: skip
    assert row is not None and row["s"] == "pending" and row["wait_expires_at"] is None
    assert row["deadline"] == second.deadline


async def test_held_work_of_an_earlier_month_resumes_whenever_it_is_seen(
    spend: PgSpendStore, db: Database
) -> None:
    from appliance.bus.core import Bus
    from appliance.db.runner_store import PgRunnerStore

    bus = Bus(PgRunnerStore(db))
    await bus.enqueue(tenant="acme", pipeline="p", stage="s", source="t", source_id="m1",
                      directive="d")  # fmt: skip
    held_at = datetime(2031, 1, 20, tzinfo=UTC)
    (message,) = await bus.claim("w", limit=1, now=held_at)
    expires = held_at + timedelta(days=32)
    assert await spend.hold_budget(
        message.lease, reason="held_budget: test", expires_at=expires, now=held_at
    )
    assert await spend.resume_stale(now=datetime(2031, 1, 31, tzinfo=UTC)) == 0
    assert await spend.resume_stale(now=datetime(2031, 2, 3, tzinfo=UTC)) == 1
    got = await bus.get("acme", message.id)
    assert got is not None and got.status.value == "pending"


async def test_held_work_resumes_by_the_local_month_of_its_hold(
    spend: PgSpendStore, db: Database
) -> None:
    # The month of a hold is the spend time zone's; a resume of earlier months' holds reads the
    # holds up to local midnight starting this month, and checks the month exactly.
    from appliance.bus.core import Bus
    from appliance.db.runner_store import PgRunnerStore

    bus = Bus(PgRunnerStore(db))

    async def held(source_id: str, at: datetime) -> int:
        # Enqueued and claimed at the hold's time, as a runner parks seconds after its claim.
        await bus.enqueue(tenant="acme", pipeline="p", stage="s", source="t",
                          source_id=source_id, directive="d", now=at)  # fmt: skip
        (message,) = await bus.claim("w", limit=1, now=at)
        assert await spend.hold_budget(
            message.lease, reason="held_budget: test", expires_at=at + timedelta(days=60), now=at
        )
        return message.id

    async def configure(time_zone: str) -> None:
        await spend.configure(
            time_zone=time_zone, currency="EUR", interactive_share=Decimal("0.2"),
            alert_fractions=[Decimal("0.5")], amortisation_monthly=Decimal(0),
        )  # fmt: skip

    async def status(message_id: int) -> str:
        got = await bus.get("acme", message_id)
        assert got is not None
        return got.status.value

    await configure("Europe/Berlin")
    january = await held("jan", datetime(2031, 1, 31, 22, 30, tzinfo=UTC))  # 23:30 in Berlin
    february = await held("feb", datetime(2031, 1, 31, 23, 30, tzinfo=UTC))  # 00:30, 1 Feb
    assert await spend.resume_stale(now=datetime(2031, 2, 3, tzinfo=UTC)) == 1
    assert (await status(january), await status(february)) == ("pending", "held_budget")

    # Havana's clocks fall back at 01:00 on 1 November 2026: local midnight happens twice.
    # 04:30 UTC is 00:30 local the first time, November already.
    await configure("America/Havana")
    november = await held("nov", datetime(2026, 11, 1, 4, 30, tzinfo=UTC))
    assert await spend.resume_stale(now=datetime(2026, 11, 3, tzinfo=UTC)) == 0
    assert await status(november) == "held_budget"


async def test_a_tenants_cap_raised_resumes_that_tenants_held_work_only(
    spend: PgSpendStore, db: Database
) -> None:
    from appliance.bus.core import Bus
    from appliance.db.runner_store import PgRunnerStore

    bus = Bus(PgRunnerStore(db))
    at = datetime(2031, 5, 10, tzinfo=UTC)
    for tenant in ("acme", "globex"):
        await bus.enqueue(tenant=tenant, pipeline="p", stage="s", source="t", source_id="h",
                          directive="d", now=at)  # fmt: skip
    for message in await bus.claim("w", limit=2, now=at):
        assert await spend.hold_budget(
            message.lease, reason="held_budget: x", expires_at=at + timedelta(days=9), now=at
        )
    assert await spend.resume_budget(reason="cap_set: tenant:acme", tenant="acme", now=at) == 1
    held = {t: await bus.claim("w", tenant=t, limit=5, now=at) for t in ("acme", "globex")}
    assert (len(held["acme"]), len(held["globex"])) == (1, 0)


async def test_a_calibration_prices_only_the_file_it_measured(db: Database) -> None:
    from appliance import runtime
    from appliance.db.spend_store import PgCalibrationStore
    from appliance.domain.inference import Tier
    from appliance.settings import Settings
    from tests.inference.models import entry

    small = entry(Tier.MECHANICAL)
    store = PgCalibrationStore(db)
    # Another file under the same name (say a smaller quantisation, since re-pinned).
    common: dict[str, Any] = {
        "idle_watts": Decimal(5), "tokens": 100, "provenance": "estimated", "source": "test",
    }  # fmt: skip
    await store.save(model=small.name, sha256="0" * 64, joules_per_token=Decimal("0.01"), **common)
    priced = await runtime.pricing(Settings(), db)
    assert small.name not in priced.joules_per_token
    await store.save(
        model=small.name, sha256=small.sha256, joules_per_token=Decimal("0.5"), **common
    )
    priced = await runtime.pricing(Settings(), db)
    assert priced.joules_per_token[small.name] == Decimal("0.5")


async def test_a_call_deferred_for_room_in_flight_keeps_its_place_in_line(
    spend: PgSpendStore, db: Database
) -> None:
    """Migration 0026. A large call refused because the room is held by calls in flight was
    deferred, and smaller calls that asked after it took the room each time some was freed:
    it could wait until the month's end. Now later calls of its lane (or a less urgent one)
    leave it the room; a more urgent lane never waits for it; a waiter that stops asking
    stops holding room after a minute, and a refusal by spend alone ends its wait."""
    from appliance.bus.core import Bus
    from appliance.db.runner_store import PgRunnerStore

    await spend.set_cap("appliance", Decimal("1.0"))
    bus = Bus(PgRunnerStore(db))
    for sid in ("first", "big", "small", "urgent"):
        lane = Lane.BATCH if sid != "urgent" else Lane.INTERACTIVE
        await bus.enqueue(tenant="acme", pipeline="p", stage="s", source="t", source_id=sid,
                          directive="d", lane=lane)  # fmt: skip
    taken = {m.source_id: m for m in await bus.claim("w", limit=4)}
    t0 = datetime(2031, 7, 10, 12, 0, tzinfo=UTC)

    ask = asker(spend, taken)

    held = await ask("first", "0.3", t0)
    assert isinstance(held, int)
    # Batch work may use 0.8: 0.3 in flight leaves 0.5, the big call needs 0.6.
    refused = await ask("big", "0.6", t0)
    assert isinstance(refused, Refusal) and not refused.exhausted
    # 0.3 + 0.2 fits beside the call in flight, but the room is the big call's first.
    behind = await ask("small", "0.2", t0 + timedelta(seconds=1))
    assert isinstance(behind, Refusal) and not behind.exhausted
    assert "room kept for an earlier call asking 0.6" in behind.dimension
    # Interactive work never waits for batch work.
    fast = await ask("urgent", "0.2", t0 + timedelta(seconds=1))
    assert isinstance(fast, int)
    await spend.settle(fast, amount=Decimal("0.1"), energy_joules=1.0, provenance="estimated",
                       now=t0)  # fmt: skip
    # The call in flight settles: the big call, back from its deferral, now fits.
    await spend.settle(held, amount=Decimal("0.1"), energy_joules=1.0, provenance="estimated",
                       now=t0)  # fmt: skip
    again = await ask("big", "0.6", t0 + timedelta(seconds=2))
    assert isinstance(again, int)
    async with db.system_conn() as conn:
        rows = await (
            await conn.execute(
                "SELECT message_id FROM spend_waiters WHERE seen_at > %s",
                (t0 + timedelta(seconds=2) - timedelta(seconds=15),),
            )
        ).fetchall()
    # The big call's wait is over (its place is kept, out of the line); the small one, kept
    # back only for the big one's room (not by calls in flight), never joined the line.
    assert [r["message_id"] for r in rows] == []

    # A refusal by spend alone ends the wait of the call it refused.
    await spend.settle(again, amount=Decimal("0.6"), energy_joules=1.0, provenance="estimated",
                       now=t0)  # fmt: skip
    # Spent 0.8 of batch's 0.8: the small call can never fit; its wait ends, named as spend.
    final = await ask("small", "0.2", t0 + timedelta(seconds=3))
    assert isinstance(final, Refusal) and final.exhausted
    async with db.system_conn() as conn:
        left = await (
            await conn.execute(
                "SELECT count(*) AS n FROM spend_waiters WHERE message_id = %s",
                (taken["small"].id,),
            )
        ).fetchone()
    assert left is not None and left["n"] == 0


async def _running(db: Database, spec: dict[str, tuple[str, Lane]]) -> dict[str, Any]:
    """One running message per source id (tenant, lane), leased by worker w."""
    from appliance.bus.core import Bus
    from appliance.db.runner_store import PgRunnerStore

    bus = Bus(PgRunnerStore(db))
    for sid, (tenant, lane) in spec.items():
        await bus.enqueue(tenant=tenant, pipeline="p", stage="s", source="t", source_id=sid,
                          directive="d", lane=lane)  # fmt: skip
    taken: dict[str, Any] = {}
    while len(taken) < len(spec):
        claimed = await bus.claim("w", limit=len(spec))
        assert claimed, f"claimed {sorted(taken)} of {sorted(spec)}"
        taken.update((m.source_id, m) for m in claimed)
    return taken


async def test_a_waiter_whose_message_ended_stops_holding_room(
    spend: PgSpendStore, db: Database
) -> None:
    # A waiter counts only while its message is pending or running (migration 0028): one that
    # was cancelled kept later calls out until its wait lapsed.
    from appliance.bus.core import Bus
    from appliance.db.runner_store import PgRunnerStore

    await spend.set_cap("appliance", Decimal("1.0"))
    lane = ("acme", Lane.INTERACTIVE)
    taken = await _running(db, {"first": lane, "gone": lane, "later": lane})
    t0 = datetime(2031, 8, 10, 12, 0, tzinfo=UTC)

    ask = asker(spend, taken)

    assert isinstance(await ask("first", "0.5", t0), int)
    assert isinstance(await ask("gone", "0.6", t0), Refusal)  # in line for 0.6
    kept_back = await ask("later", "0.1", t0 + timedelta(seconds=5))
    assert isinstance(kept_back, Refusal) and "room kept for an earlier call" in kept_back.dimension
    await Bus(PgRunnerStore(db)).cancel("acme", taken["gone"].id)
    assert isinstance(await ask("later", "0.1", t0 + timedelta(seconds=6)), int)


async def test_a_waiter_more_urgent_work_keeps_from_fitting_holds_up_no_one(
    spend: PgSpendStore, db: Database
) -> None:
    # Batch may use 0.8 of 1.0. While interactive work keeps 0.3 in flight, a 0.6 batch call
    # cannot fit, and its room cannot gather: later batch calls that fit go ahead (under 0026
    # every one of them was refused). Once the interactive work settles, its room can gather,
    # and they leave it that room.
    await spend.set_cap("appliance", Decimal("1.0"))
    taken = await _running(
        db,
        {
            "live": ("acme", Lane.INTERACTIVE),
            "big": ("acme", Lane.BATCH),
            "small": ("acme", Lane.BATCH),
            "next": ("acme", Lane.BATCH),
        },
    )
    t0 = datetime(2031, 9, 10, 12, 0, tzinfo=UTC)

    ask = asker(spend, taken)

    live = await ask("live", "0.3", t0)
    assert isinstance(live, int)
    assert isinstance(await ask("big", "0.6", t0), Refusal)
    small = await ask("small", "0.3", t0 + timedelta(seconds=1))
    assert isinstance(small, int)
    await spend.settle(live, amount=Decimal(0), energy_joules=None, provenance=None,
                       released=True, now=t0)  # fmt: skip
    # Back from its deferral, the big call still does not fit (0.3 + 0.6), but now it can.
    assert isinstance(await ask("big", "0.6", t0 + timedelta(seconds=2)), Refusal)
    kept_back = await ask("next", "0.2", t0 + timedelta(seconds=2))
    assert isinstance(kept_back, Refusal) and "room kept for an earlier call" in kept_back.dimension
    await spend.settle(small, amount=Decimal(0), energy_joules=None, provenance=None,
                       released=True, now=t0)  # fmt: skip
    assert isinstance(await ask("big", "0.6", t0 + timedelta(seconds=3)), int)


async def test_two_waiters_stand_in_one_order_in_every_scope(
    spend: PgSpendStore, db: Database
) -> None:
    # A message has one place in line, its first refusal in any scope. Placed by scope, two
    # waiters of acme stood in opposite orders in acme's line and the appliance's, and with
    # nothing in flight neither fitted (nor did anyone behind them) for a minute at a time.
    await spend.set_cap("appliance", Decimal("12"))
    await spend.set_cap("tenant:acme", Decimal("10"))
    urgent = Lane.INTERACTIVE
    taken = await _running(
        db,
        {"h1": ("acme", urgent), "w1": ("acme", urgent), "h2": ("globex", urgent),
         "w2": ("acme", urgent)},
    )  # fmt: skip
    t0 = datetime(2031, 10, 10, 12, 0, tzinfo=UTC)

    ask = asker(spend, taken)

    h1 = await ask("h1", "4", t0)
    assert isinstance(h1, int)
    assert isinstance(await ask("w1", "7", t0 + timedelta(seconds=1)), Refusal)  # acme's line
    h2 = await ask("h2", "2", t0 + timedelta(seconds=2))
    assert isinstance(h2, int)
    assert isinstance(await ask("w2", "7", t0 + timedelta(seconds=3)), Refusal)  # both lines
    assert isinstance(await ask("w1", "7", t0 + timedelta(seconds=4)), Refusal)  # both lines
    for hold in (h1, h2):
        await spend.settle(hold, amount=Decimal(0), energy_joules=None, provenance=None,
                           released=True, now=t0)  # fmt: skip
    # Nothing in flight: the first in line fits at its next ask, in both scopes.
    assert isinstance(await ask("w1", "7", t0 + timedelta(seconds=5)), int)


async def test_a_waiter_its_tenants_cap_keeps_out_holds_no_room_for_other_tenants(
    spend: PgSpendStore, db: Database
) -> None:
    # Whether a waiter's room can gather is judged for the appliance and its tenant together:
    # acme's batch call cannot fit acme's cap of 3 while acme's interactive work holds 1.5,
    # so globex's batch work need not leave it room in the appliance's line.
    await spend.set_cap("appliance", Decimal("10"))
    await spend.set_cap("tenant:acme", Decimal("3"))
    taken = await _running(
        db,
        {
            "live": ("acme", Lane.INTERACTIVE),
            "wide": ("globex", Lane.BATCH),
            "big": ("acme", Lane.BATCH),
            "other": ("globex", Lane.BATCH),
        },
    )
    t0 = datetime(2031, 11, 10, 12, 0, tzinfo=UTC)

    ask = asker(spend, taken)

    assert isinstance(await ask("live", "1.5", t0), int)
    assert isinstance(await ask("wide", "5", t0), int)  # the appliance: 6.5 of batch's 8
    # acme's cap: 1.5 + 2 > 3; the appliance's batch share: 6.5 + 2 > 8. Refused in both.
    assert isinstance(await ask("big", "2", t0), Refusal)
    # 6.5 + 1 fits batch's 8: globex's call is not kept back for acme's.
    assert isinstance(await ask("other", "1", t0 + timedelta(seconds=1)), int)


async def test_a_waiter_counts_while_it_asks_and_keeps_its_place_for_ten_minutes(
    spend: PgSpendStore, db: Database
) -> None:
    # The runner asks again in place every fraction of a second for a few seconds; a waiter
    # silent for longer (deferred behind a backlog) stops holding room, and keeps its place.
    await spend.set_cap("appliance", Decimal("1.0"))
    lane = ("acme", Lane.INTERACTIVE)
    taken = await _running(db, {"first": lane, "slow": lane, "later": lane, "last": lane})
    t0 = datetime(2031, 12, 10, 12, 0, tzinfo=UTC)

    ask = asker(spend, taken)

    assert isinstance(await ask("first", "0.5", t0), int)
    assert isinstance(await ask("slow", "0.6", t0), Refusal)
    assert isinstance(await ask("later", "0.1", t0 + timedelta(seconds=14)), Refusal)
    # "slow" (still running, not asking) holds room for 15 seconds, no longer.
    assert isinstance(await ask("later", "0.1", t0 + timedelta(seconds=16)), int)
    # Back within 10 minutes, it is ahead of "last" again, which asked after it.
    assert isinstance(await ask("slow", "0.6", t0 + timedelta(minutes=9)), Refusal)
    kept_back = await ask("last", "0.1", t0 + timedelta(minutes=9))
    assert isinstance(kept_back, Refusal) and "room kept for an earlier call" in kept_back.dimension


async def test_waiters_of_less_urgent_lanes_do_not_hide_those_a_call_yields_to(
    spend: PgSpendStore, db: Database
) -> None:
    # Each lane's line is read no further than its first 100 places: 1,000 batch waiters
    # ahead once filled the one window there was, and an interactive call took the room of
    # the interactive waiter behind them.
    from appliance.bus.core import Bus
    from appliance.db.runner_store import PgRunnerStore

    await spend.set_cap("appliance", Decimal("1.0"))
    urgent = ("acme", Lane.INTERACTIVE)
    taken = await _running(db, {"first": urgent, "waiter": urgent, "late": urgent})
    bus = Bus(PgRunnerStore(db))
    await bus.enqueue_many(
        [bus.request(tenant="acme", pipeline="p", stage="s", source="t", source_id=f"b{i}",
                     directive="d", lane=Lane.BATCH) for i in range(1000)]
    )  # fmt: skip
    t0 = datetime(2031, 12, 20, 12, 0, tzinfo=UTC)
    async with await psycopg.AsyncConnection.connect(db.endpoints.admin) as conn:
        await conn.execute(
            "INSERT INTO appliance.spend_waiters (month, scope, message_id, lane, amount,"
            " since, seen_at) SELECT '2031-12-01', 'appliance', id, 'batch', 0.000001,"
            " %s, %s FROM appliance.agent_messages WHERE lane = 'batch'",
            (t0 - timedelta(seconds=10), t0),
        )
        await conn.commit()

    ask = asker(spend, taken)

    assert isinstance(await ask("first", "0.5", t0), int)
    assert isinstance(await ask("waiter", "0.6", t0), Refusal)
    kept_back = await ask("late", "0.1", t0 + timedelta(seconds=1))
    assert isinstance(kept_back, Refusal) and "room kept for an earlier call" in kept_back.dimension


async def test_calls_kept_back_for_the_head_do_not_join_the_line(
    spend: PgSpendStore, db: Database
) -> None:
    # Only the head of the line is waited for, and only calls refused by room held in flight
    # join it. Every refused call used to join with its ask, the line soon asked for more
    # than the cap, and its lane stalled with the room free until all of it came back.
    await spend.set_cap("appliance", Decimal("1.0"))
    batch = ("acme", Lane.BATCH)
    taken = await _running(db, {"first": batch, "big": batch, **{f"s{i}": batch for i in range(4)}})
    t0 = datetime(2032, 1, 10, 12, 0, tzinfo=UTC)

    ask = asker(spend, taken)

    first = await ask("first", "0.3", t0)
    assert isinstance(first, int)
    assert isinstance(await ask("big", "0.6", t0), Refusal)  # 0.3 + 0.6 > 0.8: in line
    await spend.settle(first, amount=Decimal(0), energy_joules=None, provenance=None,
                       released=True, now=t0)  # fmt: skip
    # The big call is away (deferred behind a backlog): for 15 s its room is kept, ...
    for i in range(4):
        assert isinstance(await ask(f"s{i}", "0.3", t0 + timedelta(seconds=5)), Refusal)
    async with db.system_conn() as conn:
        row = await (await conn.execute("SELECT count(*) AS n FROM spend_waiters")).fetchone()
    assert row is not None and row["n"] == 1  # the big call only
    # ... then the lane runs on in the room there is.
    later = t0 + timedelta(seconds=16)
    assert [isinstance(await ask(f"s{i}", "0.3", later), int) for i in range(4)] == [
        True, True, False, False,
    ]  # fmt: skip


async def test_only_the_head_whose_room_can_gather_is_told_to_wait_in_place(
    spend: PgSpendStore, db: Database
) -> None:
    # Migration 0030: every refused call with no head ahead used to wait in place, even one
    # whose room more urgent work held, and so held a runner slot for minutes.
    await spend.set_cap("appliance", Decimal("1.0"))
    taken = await _running(
        db,
        {"live": ("acme", Lane.INTERACTIVE), "flow": ("acme", Lane.BATCH),
         "big": ("acme", Lane.BATCH), "other": ("acme", Lane.BATCH)},
    )  # fmt: skip
    ask = asker(spend, taken)
    t0 = datetime(2032, 2, 10, 12, 0, tzinfo=UTC)
    live = await ask("live", "0.3", t0)
    assert isinstance(live, int)
    # 0.3 interactive in flight + 0.6 > batch's 0.8: its room cannot gather; no waiting.
    kept_out = await ask("big", "0.6", t0)
    assert isinstance(kept_out, Refusal) and not kept_out.wait and kept_out.behind is None
    await spend.settle(live, amount=Decimal(0), energy_joules=None, provenance=None,
                       released=True, now=t0)  # fmt: skip
    flow = await ask("flow", "0.3", t0 + timedelta(seconds=1))
    assert isinstance(flow, int)
    # Batch work in flight is all that is in its way: the head waits in place ...
    head = await ask("big", "0.6", t0 + timedelta(seconds=2))
    assert isinstance(head, Refusal) and head.wait and head.behind is None
    # ... and a call kept back for its room does not, and is told for whom.
    other = await ask("other", "0.3", t0 + timedelta(seconds=2))
    assert isinstance(other, Refusal) and not other.wait and other.behind == taken["big"].id


async def test_an_admitted_call_keeps_its_messages_place_for_its_next_call(
    spend: PgSpendStore, db: Database
) -> None:
    await spend.set_cap("appliance", Decimal("1.0"))
    lane = ("acme", Lane.INTERACTIVE)
    taken = await _running(db, {"first": lane, "two": lane, "late": lane})
    ask = asker(spend, taken)
    t0 = datetime(2032, 2, 20, 12, 0, tzinfo=UTC)
    first = await ask("first", "0.7", t0)
    assert isinstance(first, int)
    assert isinstance(await ask("two", "0.5", t0), Refusal)  # in line since t0
    small = await ask("two", "0.2", t0 + timedelta(seconds=1))  # its first, small call fits
    assert isinstance(small, int)
    assert isinstance(await ask("late", "0.5", t0 + timedelta(seconds=2)), Refusal)
    # Its second, larger call is still ahead of "late", which joined the line after it.
    second = await ask("two", "0.5", t0 + timedelta(seconds=3))
    assert isinstance(second, Refusal) and second.behind is None and second.wait
    behind = await ask("late", "0.5", t0 + timedelta(seconds=3))
    assert isinstance(behind, Refusal) and behind.behind == taken["two"].id


async def test_spend_and_model_call_rows_belong_to_their_messages_tenant(
    spend: PgSpendStore, db: Database
) -> None:
    # Given another tenant than the message's, a reservation charged that tenant's cap for the
    # message's call, and showed the message's id, pipeline, stage and model to that tenant
    # (migration 0038).
    async with db.system_conn() as conn:
        await conn.execute("INSERT INTO spend_caps (scope, monthly_cap) VALUES ('appliance', 10)")
    taken = await _running(db, {"a1": ("acme", Lane.INTERACTIVE)})
    m = taken["a1"]
    now = datetime.now(UTC)
    with pytest.raises(psycopg.errors.CheckViolation, match=r"names message .*of tenant acme"):
        await reserve(spend, now, tenant="globex", lease=m.lease)
    hold = await reserve(spend, now, tenant="acme", lease=m.lease)
    assert isinstance(hold, int)
    record = (
        "INSERT INTO inference_calls (tenant, message_id, pipeline, stage, kind, tier, min_tier,"
        " route_reason, model, model_sha256, status, at) VALUES (%s, %s, 'p', 's', 'classify',"
        " 'mechanical', 'mechanical', 'r', 'm', 'x', 'ok', now())"
    )
    async with db.system_conn() as conn:
        with pytest.raises(psycopg.errors.CheckViolation, match="inference_calls row of tenant"):
            await conn.execute(record, ("globex", m.id))
        await conn.execute(record, ("acme", m.id))
        rows = await (
            await conn.execute(
                "SELECT tenant, count(*) AS n FROM spend_ledger WHERE message_id = %s"
                " GROUP BY tenant",
                (m.id,),
            )
        ).fetchall()
    assert [dict(r) for r in rows] == [{"tenant": "acme", "n": 1}]
