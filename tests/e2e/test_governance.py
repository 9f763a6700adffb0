"""Governance with real runner processes, the real small model and real PostgreSQL: the runaway
loop halts at its cap (or earlier at its hop limit) while another tenant's work flows, and
SIGKILLed runners leak no reservations."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from decimal import Decimal
from pathlib import Path

import pytest

from appliance.bus.core import Bus
from appliance.db.database import Database, Endpoints
from appliance.db.runner_store import PgRunnerStore
from appliance.db.spend_store import PgSpendStore
from appliance.db.tenant_store import PgTenantStore
from tests.e2e.runners import query, runners, wait_until

pytestmark = pytest.mark.slow

# The figure; lower it locally with APPLIANCE_TEST_RUNAWAY_SECONDS to iterate faster.
RUNAWAY_SECONDS = float(os.environ.get("APPLIANCE_TEST_RUNAWAY_SECONDS", "60"))
LEASE = 2.0
GOVERNED = {
    "APPLIANCE_INFERENCE__ENABLED": "true",
    "APPLIANCE_INFERENCE__TIERS": '{"mechanical": {"workers": 1, "queue": 2}, '
    '"reasoning": {"workers": 0}}',
    "APPLIANCE_RUNNER__PIPELINES": "[]",
    "APPLIANCE_RUNNER__PIPELINE_MODULES": '["tests.e2e.governed_pipelines"]',
    "APPLIANCE_METERING__SOURCE": "estimate",
    # A figure close to what these short calls use (the estimate here: about 1.3 J a call, up
    # to 3 J when the cores are contended, over 11 tokens), still conservative with the safety
    # factor, so that the cap and not the reservation is what stops the loop.
    "APPLIANCE_SPEND__DEFAULT_JOULES_PER_TOKEN": "0.5",
}


async def setup(ends: Endpoints, caps: dict[str, Decimal]) -> None:
    db = Database(ends, max_size=2)
    await db.open()
    try:
        tenants = PgTenantStore(db)
        spend = PgSpendStore(db)
        for name in ("loopy", "hoppy", "other"):
            await tenants.add(name)
        for scope, cap in caps.items():
            await spend.set_cap(scope, cap)
    finally:
        await db.close()


async def enqueue(ends: Endpoints, tenant: str, pipeline: str, stage: str, ids: list[str]) -> None:
    db = Database(ends, max_size=2)
    await db.open()
    try:
        bus = Bus(PgRunnerStore(db))
        await bus.enqueue_many(
            [
                bus.request(
                    tenant=tenant,
                    pipeline=pipeline,
                    stage=stage,
                    source="e2e",
                    source_id=i,
                    directive="go",
                )
                for i in ids
            ]
        )
    finally:
        await db.close()


def scope_row(admin: str, scope: str) -> dict[str, object]:
    rows = query(
        admin,
        "SELECT spent, reserved FROM spend_months WHERE scope = %s ORDER BY month DESC LIMIT 1",
        (scope,),
    )
    return rows[0] if rows else {"spent": Decimal(0), "reserved": Decimal(0)}


def test_a_runaway_loop_halts_at_its_cap_while_other_work_flows(
    fresh_db: Endpoints, tmp_path: Path
) -> None:
    # A loop call reserves about 2.1e-6 EUR (0.5 J/token x 1.5 x 33 tokens at 0.30 EUR/kWh)
    # and costs 1e-7 to 2.5e-7 (1.3 to 3 J, estimated): the tenant's cap admits calls until
    # spend passes 4e-6 - 2.1e-6, some 8 to 15 calls, a small fraction of what 60 s could run.
    cap = Decimal("0.000004")
    asyncio.run(setup(fresh_db, {"appliance": Decimal("10"), "tenant:loopy": cap,
                                 "tenant:hoppy": cap}))  # fmt: skip
    asyncio.run(enqueue(fresh_db, "loopy", "runaway", "loop", ["L"]))
    asyncio.run(enqueue(fresh_db, "hoppy", "hopper", "loop", ["H"]))
    with runners(fresh_db.admin, tmp_path, **GOVERNED) as procs:
        procs.start("r1")
        started = time.monotonic()
        other_sent = 0
        try:
            while time.monotonic() - started < RUNAWAY_SECONDS:
                # Another tenant keeps submitting; its work must keep flowing.
                batch = [f"o{other_sent + i}" for i in range(3)]
                asyncio.run(enqueue(fresh_db, "other", "steady", "run", batch))
                other_sent += len(batch)
                row = scope_row(fresh_db.admin, "tenant:loopy")
                spent, reserved = Decimal(row["spent"]), Decimal(row["reserved"])  # type: ignore[arg-type]
                assert spent + reserved <= cap, f"the loop went past its cap: {row}"
                time.sleep(RUNAWAY_SECONDS / 12)
            wait_until(
                lambda: (
                    query(
                        fresh_db.admin,
                        "SELECT count(*) AS n FROM agent_messages WHERE tenant = 'other' "
                        "AND status <> 'done'",
                    )[0]["n"]
                    == 0
                ),
                timeout=120,
                what="the other tenant's work",
            )
            # The hop-limited loop's end: its model calls share the cores with the rest, so
            # on a busy machine it may not have got there within the runaway period.
            wait_until(
                lambda: (
                    query(
                        fresh_db.admin,
                        "SELECT count(*) AS n FROM agent_messages WHERE tenant = 'hoppy' "
                        "AND status = 'dead'",
                    )[0]["n"]
                    == 1
                ),
                timeout=120,
                what="the hop-limited loop's end",
            )
        except AssertionError:
            raise AssertionError(procs.logs()) from None

    loop = query(
        fresh_db.admin,
        "SELECT hops, status::text AS s, status_reason FROM agent_messages "
        "WHERE tenant = 'loopy' ORDER BY hops",
    )
    # It ran until its cap, then waits, held (not failing, not retrying).
    assert loop[-1]["s"] == "held_budget", loop[-3:]
    assert str(loop[-1]["status_reason"]).startswith("held_budget: money: tenant:loopy")
    assert all(r["s"] == "done" for r in loop[:-1]) and len(loop) > 5
    final = scope_row(fresh_db.admin, "tenant:loopy")
    assert Decimal(final["spent"]) <= cap and Decimal(final["reserved"]) == 0  # type: ignore[arg-type]
    # Settled spend is exactly the sum of the recorded calls.
    (ledger,) = query(
        fresh_db.admin,
        "SELECT coalesce(sum(amount), 0) AS total, count(*) AS n FROM spend_ledger "
        "WHERE tenant = 'loopy' AND status = 'settled'",
    )
    assert Decimal(ledger["total"]) == Decimal(final["spent"])  # type: ignore[arg-type]
    (calls,) = query(
        fresh_db.admin,
        "SELECT count(*) AS n FROM inference_calls WHERE tenant = 'loopy' AND status = 'ok'",
    )
    assert ledger["n"] == calls["n"] == len(loop) - 1

    # The same loop with a hop limit of 5 stopped there, well under the same cap.
    hops = query(
        fresh_db.admin,
        "SELECT hops, status::text AS s, status_reason FROM agent_messages "
        "WHERE tenant = 'hoppy' ORDER BY hops",
    )
    assert [r["hops"] for r in hops] == [0, 1, 2, 3, 4, 5, 6]
    assert hops[-1]["s"] == "dead"
    assert str(hops[-1]["status_reason"]).startswith("budget_exhausted: hops")
    assert Decimal(scope_row(fresh_db.admin, "tenant:hoppy")["spent"]) < cap  # type: ignore[arg-type]


def test_sigkilled_runners_leak_no_reservations(fresh_db: Endpoints, tmp_path: Path) -> None:
    asyncio.run(setup(fresh_db, {"appliance": Decimal("10")}))
    asyncio.run(enqueue(fresh_db, "other", "long", "long", ["k1", "k2"]))
    with runners(fresh_db.admin, tmp_path, **GOVERNED) as procs:
        # A runner without models: it leaves the model work alone, but its reclaimer runs.
        procs.start("sweeper", APPLIANCE_INFERENCE__ENABLED="false")
        procs.start("victim")

        def held() -> int:
            rows = query(
                fresh_db.admin, "SELECT count(*) AS n FROM spend_ledger WHERE status = 'reserved'"
            )
            return int(str(rows[0]["n"]))

        try:
            wait_until(lambda: held() == 2, timeout=60, what="two calls holding reservations")
        except AssertionError:
            raise AssertionError(procs.logs()) from None
        procs.signal("victim", signal.SIGKILL)
        procs.wait("victim")
        # Every hold of the dead runner is closed within its lease plus 5 s: charged in full,
        # an upper bound (its calls ran until the kill), so its room is never handed on.
        try:
            wait_until(lambda: held() == 0, timeout=LEASE + 5, what="released holds")
        except AssertionError:
            raise AssertionError(procs.logs()) from None
        charged = query(
            fresh_db.admin,
            "SELECT count(*) AS n, coalesce(sum(amount - reserved), 0) AS gap FROM spend_ledger"
            " WHERE status = 'settled' AND note LIKE 'lease gone%%'",
        )[0]
        assert (charged["n"], charged["gap"]) == (2, 0)
        assert Decimal(scope_row(fresh_db.admin, "appliance")["reserved"]) == 0  # type: ignore[arg-type]
        # A runner with models finishes the work; spend settles to the recorded calls.
        procs.start("finisher")
        try:
            wait_until(
                lambda: (
                    query(
                        fresh_db.admin,
                        "SELECT count(*) AS n FROM agent_messages WHERE status = 'done'",
                    )[0]["n"]
                    == 2
                ),
                timeout=120,
                what="the work finished",
            )
        except AssertionError:
            raise AssertionError(procs.logs()) from None
    final = scope_row(fresh_db.admin, "appliance")
    (ledger,) = query(
        fresh_db.admin,
        "SELECT coalesce(sum(amount), 0) AS total, count(*) AS n FROM spend_ledger "
        "WHERE status = 'settled'",
    )
    assert Decimal(final["reserved"]) == 0  # type: ignore[arg-type]
    assert Decimal(ledger["total"]) == Decimal(final["spent"])  # type: ignore[arg-type]
    assert ledger["n"] == 4  # the victim's two upper bounds and the finisher's two calls
