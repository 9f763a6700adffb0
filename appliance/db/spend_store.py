"""The spend ledger in PostgreSQL: holds against the monthly cap, settlement, caps, run budgets,
and the messages parked for budget (the SpendStore port)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from psycopg.types.json import Jsonb

from appliance.db.database import Database
from appliance.db.message_store import SYSTEM_ACTOR, run_batches, run_fenced
from appliance.db.queries import q
from appliance.domain.budget import Refusal
from appliance.domain.envelope import Lane, LeaseRef

log = logging.getLogger("appliance.db.spend")


class PgSpendStore:
    """Reservations and settlement are single statements (plpgsql functions) on the system
    role; reads for operators go through the same role."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def reserve(
        self,
        *,
        tenant: str,
        lane: Lane,
        amount: Decimal,
        lease: LeaseRef | None,
        pipeline: str | None,
        stage: str | None,
        kind: str | None,
        model: str | None,
        tier: str | None,
        now: datetime | None = None,
    ) -> int | Refusal:
        """A hold's id, or the refusal with its figures. Nothing is held on refusal."""
        params = {
            "tenant": tenant,
            "lane": lane.value,
            "amount": amount,
            "message_id": lease.message_id if lease else None,
            "lease_token": lease.lease_token if lease else None,
            "pipeline": pipeline,
            "stage": stage,
            "kind": kind,
            "model": model,
            "tier": tier,
            "now": now,
        }
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("spend_reserve"), params)).fetchone()
        assert row is not None
        if row["hold_id"] is not None:
            return int(row["hold_id"])
        return Refusal(
            dimension=str(row["refusal"]),
            month=row["month"],
            limit=row["cap"],
            spent=row["spent"],
            reserved=row["reserved"],
            asked=amount,
            behind=row["behind"],
            wait=bool(row["wait"]),
        )

    async def settle(
        self,
        hold: int,
        *,
        amount: Decimal,
        energy_joules: float | None,
        provenance: str | None,
        released: bool = False,
        note: str | None = None,
        now: datetime | None = None,
    ) -> Decimal | None:
        """Charge what the call cost (or release the hold); None when already done.

        A cost that replaces the larger upper bound charged while the call's lease was gone
        lowers the month's spend: the work held for budget meanwhile goes back to pending, as
        when a cap is raised (nothing else would wake it before the month's end)."""
        params = {
            "hold": hold,
            "amount": amount,
            "energy": energy_joules,
            "provenance": provenance,
            "status": "released" if released else "settled",
            "note": note,
            "now": now,
        }
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("spend_settle"), params)).fetchone()
        if row is None or row["charged"] is None:
            return None
        charged = Decimal(row["charged"])
        if row["lowered"]:
            await self.resume_budget(
                reason=f"spend_lowered: hold {hold} cost {charged}, less than the upper bound"
                " charged while its lease was gone",
                now=now,
            )
        return charged

    async def platform_month(self, *, now: datetime | None = None) -> Decimal:
        """Charge this month's amortisation once (0 when already charged or none is set)."""
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("spend_platform_month"), {"now": now})).fetchone()
        return Decimal(row["charged"]) if row else Decimal(0)

    async def release_dead(self, *, batch: int = 500, now: datetime | None = None) -> int:
        async with self.db.system_conn() as conn:
            row = await (
                await conn.execute(q("spend_release_dead"), {"batch": batch, "now": now})
            ).fetchone()
        return int(row["released"]) if row else 0

    async def set_cap(self, scope: str, cap: Decimal, *, actor: str = SYSTEM_ACTOR) -> None:
        async with self.db.system_conn() as conn:
            await conn.execute(q("spend_cap_set"), {"scope": scope, "cap": cap, "actor": actor})

    async def default_cap(self, cap: Decimal) -> None:
        async with self.db.system_conn() as conn:
            await conn.execute(q("spend_cap_default"), {"cap": cap})

    async def configure(
        self,
        *,
        time_zone: str,
        currency: str,
        interactive_share: Decimal,
        alert_fractions: Sequence[Decimal],
        amortisation_monthly: Decimal,
    ) -> None:
        params = {
            "time_zone": time_zone,
            "currency": currency,
            "interactive_share": interactive_share,
            "alert_fractions": list(alert_fractions),
            "amortisation_monthly": amortisation_monthly,
        }
        async with self.db.system_conn() as conn:
            await conn.execute(q("spend_config_set"), params)

    async def status(self, *, now: datetime | None = None) -> list[dict[str, Any]]:
        async with self.db.system_conn() as conn:
            return list(await (await conn.execute(q("spend_status"), {"now": now})).fetchall())

    async def today(self, *, now: datetime | None = None) -> dict[str, Any]:
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("spend_today"), {"now": now})).fetchone()
        return dict(row) if row else {}

    async def alerts(self, *, now: datetime | None = None) -> list[dict[str, Any]]:
        async with self.db.system_conn() as conn:
            return list(await (await conn.execute(q("spend_alerts"), {"now": now})).fetchall())

    async def month(self, *, now: datetime | None = None) -> Any:
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("spend_month_now"), {"now": now})).fetchone()
        return row["month"] if row else None

    async def hold_budget(
        self,
        lease: LeaseRef,
        *,
        reason: str,
        expires_at: datetime,
        actor: str = SYSTEM_ACTOR,
        now: datetime | None = None,
    ) -> bool:
        """Park a running attempt in held_budget (fenced by the lease). A cap set, or a month
        turned, between the refusal and the park resumes it at once: `appliance cap set` and
        the rollover sweep only resume what is parked when they run."""
        held = await run_fenced(
            self.db, "message_park", lease, status="held_budget", waiting_for="budget",
            expires_at=expires_at, reason=reason, actor=actor, now=now,
        )  # fmt: skip
        if held:
            try:
                async with self.db.system_conn() as conn:
                    params = {"id": lease.message_id, "actor": actor, "now": now}
                    cur = await conn.execute(q("message_budget_recheck"), params)
                    if await cur.fetchone() is not None:
                        log.info("message %s: cap or month changed while parking; resumed",
                                 lease.message_id)  # fmt: skip
            except Exception:
                # Parked all the same: `cap set` or the rollover sweep resumes it.
                log.exception("message %s: parked; the recheck of its cap failed",
                              lease.message_id)  # fmt: skip
        return held

    async def resume_budget(
        self,
        *,
        reason: str,
        actor: str = SYSTEM_ACTOR,
        batch: int = 500,
        tenant: str | None = None,
        now: datetime | None = None,
    ) -> int:
        """Send every message held for budget (of `tenant`, when given) back to pending."""
        params: dict[str, Any] = {
            "tenant": tenant,
            "reason": reason,
            "actor": actor,
            "batch": batch,
            "now": now,
            "earlier_months_only": False,
        }
        return await run_batches(self.db, "message_resume_budget", params)

    async def resume_stale(
        self, *, actor: str = SYSTEM_ACTOR, batch: int = 500, now: datetime | None = None
    ) -> int:
        """Resume messages held for budget in an earlier month (all batches)."""
        month = await self.month(now=now)
        params = {
            "tenant": None,
            "reason": f"month_rollover: {month}",
            "actor": actor,
            "batch": batch,
            "now": now,
            "earlier_months_only": True,
        }
        return await run_batches(self.db, "message_resume_budget", params)

    async def run_reserve(
        self,
        *,
        tenant: str,
        source: str,
        source_id: str,
        pipeline: str,
        limits: dict[str, Any],
        reserve: Decimal,
        verification: bool,
        ask: dict[str, Any],
        now: datetime | None = None,
    ) -> str | None:
        params = {"tenant": tenant, "source": source, "source_id": source_id}
        return await self._run_exhausted(
            "run_budget_reserve",
            {**params, "pipeline": pipeline, "reserve": reserve, "verification": verification},
            limits, ask, now,
        )  # fmt: skip

    async def run_check(
        self,
        *,
        tenant: str,
        source: str,
        source_id: str,
        limits: dict[str, Any],
        reserve: Decimal,
        verification: bool,
        ask: dict[str, Any],
        now: datetime | None = None,
    ) -> str | None:
        params = {"tenant": tenant, "source": source, "source_id": source_id}
        return await self._run_exhausted(
            "run_budget_check",
            {**params, "reserve": reserve, "verification": verification},
            limits, ask, now,
        )  # fmt: skip

    async def run_refused(
        self,
        *,
        tenant: str,
        source: str,
        source_id: str,
        pipeline: str,
        limits: dict[str, Any],
        reserve: Decimal,
        exhausted: str,
        now: datetime | None = None,
    ) -> None:
        params = {
            "tenant": tenant, "source": source, "source_id": source_id, "pipeline": pipeline,
            "limits": Jsonb(limits), "reserve": reserve, "exhausted": exhausted, "now": now,
        }  # fmt: skip
        async with self.db.system_conn() as conn:
            await conn.execute(q("run_budget_refused"), params)

    async def _run_exhausted(
        self,
        query: str,
        params: dict[str, Any],
        limits: dict[str, Any],
        ask: dict[str, Any],
        now: datetime | None,
    ) -> str | None:
        """The dimension a run-budget query answers exhausted (None: it fits)."""
        full = {**params, "limits": Jsonb(limits), "ask": Jsonb(_json_numbers(ask)), "now": now}
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q(query), full)).fetchone()
        return None if row is None or row["exhausted"] is None else str(row["exhausted"])

    async def run_adjust(
        self, *, tenant: str, source: str, source_id: str, delta: dict[str, Any]
    ) -> None:
        params = {
            "tenant": tenant,
            "source": source,
            "source_id": source_id,
            "delta": Jsonb(_json_numbers(delta)),
        }
        async with self.db.system_conn() as conn:
            await conn.execute(q("run_budget_adjust"), params)

    async def purge_run_budgets(
        self, *, idle: timedelta, batch: int = 1000, now: datetime | None = None
    ) -> int:
        """Delete one bounded batch of the budgets of runs that reserved nothing for longer
        than `idle`; how many. Keeps the table from growing with every run ever started."""
        params = {"idle": idle, "batch": batch, "now": now}
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("run_budgets_purge"), params)).fetchone()
        return int(row["purged"]) if row else 0

    async def purge_waiters(self, *, batch: int = 1000, now: datetime | None = None) -> int:
        """Delete one bounded batch of waiting-line places unasked-for for an hour; how many.
        Refusals delete them too, 100 at a time; without refusals they would stay."""
        params = {"batch": batch, "now": now}
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("spend_waiters_purge"), params)).fetchone()
        return int(row["purged"]) if row else 0

    async def run_budget(self, tenant: str, source: str, source_id: str) -> dict[str, Any] | None:
        params = {"tenant": tenant, "source": source, "source_id": source_id}
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("run_budget_get"), params)).fetchone()
        return dict(row) if row else None


def _json_numbers(values: dict[str, Any]) -> dict[str, Any]:
    # Decimals travel as strings (exact): the SQL reads every value with ->> and ::numeric.
    return {k: str(v) if isinstance(v, Decimal) else v for k, v in values.items()}


class PgCalibrationStore:
    """Joules per token per model file (energy calibrate)."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def save(
        self,
        *,
        model: str,
        sha256: str,
        joules_per_token: Decimal,
        idle_watts: Decimal,
        tokens: int,
        provenance: str,
        source: str,
    ) -> None:
        params = {
            "model": model,
            "sha256": sha256,
            "joules_per_token": joules_per_token,
            "idle_watts": idle_watts,
            "tokens": tokens,
            "provenance": provenance,
            "source": source,
        }
        async with self.db.system_conn() as conn:
            await conn.execute(q("calibration_upsert"), params)

    async def all(self) -> list[dict[str, Any]]:
        async with self.db.system_conn() as conn:
            return list(await (await conn.execute(q("calibration_list"))).fetchall())
