"""A model call stopped part way charges its run the tokens it used, and its record shows them.

The runner, the real pool and the real small model, real PostgreSQL and the governor: a stage
whose call runs past the time its deadline leaves it is stopped by the pool after some tokens.
The run budget settled such a call at 0 tokens (the whole token reservation given back, so a
run's timed-out calls used tokens its budget never counted) and the call was recorded with 0
tokens; both now carry what the model read and wrote before the stop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from appliance.bus.core import Bus
from appliance.db.database import Database, Endpoints
from appliance.db.runner_store import PgRunnerStore
from appliance.db.spend_store import PgSpendStore
from appliance.domain.budget import RunBudget
from appliance.domain.inference import Tier
from appliance.domain.pipeline import Pipeline, Stage, StageContext, StageResult
from appliance.inference.pool import InferencePool
from appliance.metering.meter import CallEnergy, Meter
from tests.inference.models import spec
from tests.inference.rigs import DbChecks, estimate_meter, governed_runner, tenant_db

# A prompt the model keeps writing after: 800 tokens take it about 10 s on one thread here.
RAMBLE = "Here is a very long story about a dragon, told in great detail. Once upon a time,"
# What the stage's deadline leaves its call, once the runner's persist margin is kept free.
CALL_TIME = timedelta(seconds=2)
MARGIN = timedelta(seconds=60)


async def ramble(ctx: StageContext) -> StageResult:
    await ctx.infer("extract", RAMBLE, max_tokens=800)
    return ctx.finish({"unreachable": True})


PIPES = [
    Pipeline(
        "ramble",
        (Stage("run", ramble, task_kind="extract", uses_model=True, max_attempts=1),),
        budget=RunBudget(tokens=100_000, verification_reserve=Decimal(0)),
    )
]


@dataclass
class Rig(DbChecks):
    bus: Bus
    db: Database


class FailsAtEnd(Meter):
    """The estimate meter whose figure for a finished call cannot be read."""

    def end(self, call_id: str) -> CallEnergy:
        super().end(call_id)
        raise RuntimeError("the energy counter could not be read")


@pytest.fixture
async def rig(fresh_db: Endpoints, request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    db = await tenant_db(fresh_db, PIPES)
    store, spend = PgRunnerStore(db), PgSpendStore(db)
    await spend.set_cap("appliance", Decimal("10"))
    meter = estimate_meter(FailsAtEnd if getattr(request, "param", "") == "meter fails" else Meter)
    pool = InferencePool([spec(Tier.MECHANICAL, n_ctx=1024)], cores=2, meter=meter)
    await pool.start()
    try:
        async with governed_runner(
            fresh_db, store, PIPES, pool, spend, worker_id="stopped", persist_margin=MARGIN
        ):
            yield Rig(Bus(store), db)
    finally:
        await pool.close()
        await db.close()


async def rambling(rig: Rig, source_id: str) -> int:
    """A message of the ramble pipeline whose deadline leaves its call CALL_TIME."""
    result = await rig.bus.enqueue(
        tenant="acme", pipeline="ramble", stage="run", source="t", source_id=source_id,
        directive="tell it", deadline=datetime.now(UTC) + MARGIN + CALL_TIME,
    )  # fmt: skip
    return result.id


async def test_a_call_stopped_by_its_timeout_charges_the_run_the_tokens_it_used(rig: Rig) -> None:
    mid = await rambling(rig, "r1")

    async def ended() -> bool:
        rows = await rig.rows(
            "SELECT status::text AS s FROM agent_messages WHERE id = %(i)s", {"i": mid}
        )
        settled = await rig.rows("SELECT 1 FROM spend_ledger WHERE status <> 'reserved'")
        return bool(settled) and [r["s"] for r in rows] == ["dead"]

    await rig.wait(ended, timeout=30, what="the stopped call's message to end")
    (call,) = await rig.rows(
        "SELECT status, error, prompt_tokens, completion_tokens FROM inference_calls "
        "WHERE message_id = %(i)s",
        {"i": mid},
    )
    assert call["status"] == "refused" and "ran past its timeout" in call["error"], call
    # Stopped part way: the prompt was read and some of the 800 tokens written, not all.
    assert call["prompt_tokens"] > 0, call
    assert 0 < call["completion_tokens"] < 800, call
    used = call["prompt_tokens"] + call["completion_tokens"]
    (run,) = await rig.rows("SELECT used FROM run_budgets WHERE source = 't' AND source_id = 'r1'")
    # The run keeps what the call used: its reservation settled to the tokens, not to 0.
    assert run["used"]["tokens"] == used, run
    assert run["used"]["calls"] == 1, run


@pytest.mark.parametrize("rig", ["meter fails"], indirect=True)
async def test_a_stopped_call_the_meter_lost_is_charged_its_reservation(rig: Rig) -> None:
    # No energy figure, and a call that failed: it was charged nothing and its hold released,
    # as if it had never run. What it used is not known: its reservation, money and tokens.
    mid = await rambling(rig, "r2")

    async def settled() -> bool:
        return bool(await rig.rows("SELECT 1 FROM spend_ledger WHERE status <> 'reserved'"))

    await rig.wait(settled, timeout=30, what="the stopped call's hold to settle")
    (hold,) = await rig.rows("SELECT status, amount, reserved, provenance FROM spend_ledger")
    assert hold["status"] == "settled" and hold["amount"] == hold["reserved"] > 0, hold
    assert hold["provenance"] == "estimated", hold
    (call,) = await rig.rows(
        "SELECT status, completion_tokens FROM inference_calls WHERE message_id = %(i)s",
        {"i": mid},
    )
    assert call["status"] == "refused" and 0 < call["completion_tokens"] < 800, call
    (run,) = await rig.rows("SELECT used FROM run_budgets WHERE source = 't' AND source_id = 'r2'")
    assert run["used"]["tokens"] > 800, run  # the whole token reservation, prompt included
