"""The runner under governance with the real pool and real PostgreSQL: a call that does not fit
the cap parks its message in held_budget (figures in the reason) and resumes when the cap is
raised; a run budget ends its message naming the exhausted dimension; the hop limit stops a
message that keeps re-enqueueing itself; settled spend equals the recorded calls."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest

from appliance.bus.core import Bus
from appliance.bus.governor import Governor, prompt_token_bound
from appliance.db.database import Database, Endpoints
from appliance.db.runner_store import PgRunnerStore
from appliance.db.spend_store import PgSpendStore
from appliance.domain.budget import RunBudget
from appliance.domain.cost import Pricing, Tariff
from appliance.domain.inference import ENERGY_LIMIT, InferenceRequest, Tier
from appliance.domain.pipeline import Pipeline, Stage, StageContext, StageResult
from appliance.inference.pool import InferencePool
from tests.inference.models import spec
from tests.inference.rigs import DbChecks, estimate_meter, governed_runner, tenant_db


async def label(ctx: StageContext) -> StageResult:
    answer = await ctx.infer("classify", f"Ticket: {ctx.message.directive}\nLabel:", max_tokens=8)
    return ctx.finish({"text": answer.text, "tokens": answer.completion_tokens})


# A prompt the model keeps writing after (max_tokens ends it, not the model).
RAMBLE = "Here is a very long story about a dragon, told in great detail. Once upon a time,"


async def story(ctx: StageContext) -> StageResult:
    answer = await ctx.infer(
        "extract", RAMBLE, max_tokens=int((ctx.message.context or {}).get("n", 64))
    )
    return ctx.finish({"text": answer.text, "finish": answer.finish_reason})


async def story_json(ctx: StageContext) -> StageResult:
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    answer = await ctx.infer("extract", RAMBLE, schema=schema, max_tokens=64)
    return ctx.finish({"data": answer.data})


async def again(ctx: StageContext) -> StageResult:
    # Re-enqueues itself forever: only the hop limit (or the cap) stops it.
    ctx.spawn("again", f"hop-{ctx.message.hops + 1}", context={"n": ctx.message.hops + 1})
    return ctx.finish({"hops": ctx.message.hops})


async def split(ctx: StageContext) -> StageResult:
    # Fans out: every message spawns two more of the same run.
    for branch in ("a", "b"):
        ctx.spawn("split", f"{ctx.message.hops}-{ctx.message.id}-{branch}")
    return ctx.finish({"hops": ctx.message.hops})


async def write_twice(ctx: StageContext) -> StageResult:
    await ctx.reserve_write()
    await ctx.reserve_write()
    return ctx.finish({"wrote": 2})


PIPES = [
    Pipeline("label", (Stage("run", label, task_kind="classify", uses_model=True),)),
    Pipeline("story", (Stage("run", story, task_kind="extract", uses_model=True),)),
    Pipeline(
        "story_json",
        (Stage("run", story_json, task_kind="extract", uses_model=True, max_attempts=1),),
    ),
    Pipeline(
        "tight",
        (Stage("run", label, task_kind="classify", uses_model=True),),
        budget=RunBudget(tokens=40, verification_reserve=Decimal(0)),
    ),
    Pipeline("loop", (Stage("again", again),), budget=RunBudget(max_hops=3)),
    Pipeline("writes", (Stage("run", write_twice),), budget=RunBudget(writes=1)),
    Pipeline(
        "fan", (Stage("split", split),), budget=RunBudget(steps=3, verification_reserve=Decimal(0))
    ),
]


@dataclass
class Rig(DbChecks):
    bus: Bus
    spend: PgSpendStore
    db: Database
    pool: InferencePool
    governor: Governor
    stop: asyncio.Event
    serving: asyncio.Task[None]

    async def status_of(self, pipeline: str) -> list[str]:
        rows = await self.rows(
            "SELECT status::text AS s FROM agent_messages WHERE pipeline = %(p)s ORDER BY id",
            {"p": pipeline},
        )
        return [str(r["s"]) for r in rows]


@pytest.fixture
async def rig(fresh_db: Endpoints, request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    # How long a call refused for room in flight asks again in place: none unless a test
    # asks (its message is deferred at once), as it was before that wait existed.
    options: dict[str, Any] = getattr(request, "param", {})
    busy_wait = options.get("busy_wait", timedelta(0))
    db = await tenant_db(fresh_db, PIPES)
    store, spend = PgRunnerStore(db), PgSpendStore(db)
    pool = InferencePool(
        [spec(Tier.MECHANICAL, queue=options.get("queue", 4))], cores=2, meter=estimate_meter()
    )
    await pool.start()
    try:
        runner = governed_runner(fresh_db, store, PIPES, pool, spend, busy_wait=busy_wait)
        async with runner as (governor, stop, task):
            yield Rig(Bus(store), spend, db, pool, governor, stop, task)
    finally:
        await pool.close()
        await db.close()


async def submit(rig: Rig, pipeline: str, source_id: str, stage: str = "run") -> int:
    result = await rig.bus.enqueue(
        tenant="acme", pipeline=pipeline, stage=stage, source="t", source_id=source_id,
        directive="I was charged twice",
    )  # fmt: skip
    return result.id


async def test_a_call_over_the_cap_is_held_then_resumes_when_the_cap_is_raised(rig: Rig) -> None:
    await rig.spend.set_cap("appliance", Decimal("0.000001"))
    # A park within 0.1 s of a cap change is resumed to be tried again (the change may have
    # come after the refusal): submitted after that, the call is held at its first refusal.
    await asyncio.sleep(0.2)
    mid = await submit(rig, "label", "h1")

    async def held() -> bool:
        return await rig.status_of("label") == ["held_budget"]

    await rig.wait(held, what="held_budget")
    (row,) = await rig.rows("SELECT status_reason, attempts FROM agent_messages WHERE id = %(i)s",
                            {"i": mid})  # fmt: skip
    assert row["status_reason"].startswith("held_budget: money: appliance monthly cap 0.000001")
    assert "this call needs" in row["status_reason"]
    assert row["attempts"] == 0  # a budget refusal is not an attempt, and never retried
    await asyncio.sleep(1.0)
    assert await rig.status_of("label") == ["held_budget"]
    assert rig.pool.stats()["mechanical"]["requests_total"] == 0  # nothing ran

    await rig.spend.set_cap("appliance", Decimal("10"))
    assert await rig.spend.resume_budget(reason="cap_set", now=None) == 1

    async def done() -> bool:
        return await rig.status_of("label") == ["done"]

    await rig.wait(done, what="done after the cap was raised")
    ledger = await rig.rows(
        "SELECT status, reserved, amount, energy_joules, provenance, note FROM spend_ledger"
    )
    assert [r["status"] for r in ledger] == ["settled"]
    (entry,) = ledger
    assert entry["provenance"] == "estimated" and entry["energy_joules"] > 0
    assert 0 < entry["amount"] <= entry["reserved"] and entry["note"] is None
    (month,) = await rig.rows("SELECT spent, reserved FROM spend_months WHERE scope = 'appliance'")
    assert month["reserved"] == 0 and month["spent"] == entry["amount"]


async def test_a_run_budget_ends_the_message_naming_the_dimension(rig: Rig) -> None:
    await rig.spend.set_cap("appliance", Decimal("10"))
    mid = await submit(rig, "tight", "b1")

    async def dead() -> bool:
        return await rig.status_of("tight") == ["dead"]

    await rig.wait(dead, what="budget_exhausted")
    (row,) = await rig.rows("SELECT status_reason FROM agent_messages WHERE id = %(i)s", {"i": mid})
    assert row["status_reason"].startswith("budget_exhausted: tokens")
    # The cap's hold (had first) was released at 0 when the run's budget refused the call,
    # and nothing ran.
    lines = await rig.rows("SELECT status, amount, note FROM spend_ledger")
    assert [(r["status"], r["amount"]) for r in lines] == [("released", 0)], lines
    assert "run's budget refused" in lines[0]["note"]
    assert rig.pool.stats()["mechanical"]["requests_total"] == 0


async def test_the_hop_limit_stops_a_self_enqueueing_message(rig: Rig) -> None:
    await submit(rig, "loop", "x", stage="again")

    async def stopped() -> bool:
        return "dead" in await rig.status_of("loop")

    await rig.wait(stopped, what="the hop limit")
    rows = await rig.rows(
        "SELECT hops, status::text AS s, status_reason FROM agent_messages "
        "WHERE pipeline = 'loop' ORDER BY hops"
    )
    assert [(r["hops"], r["s"]) for r in rows] == [
        (0, "done"), (1, "done"), (2, "done"), (3, "done"), (4, "dead"),
    ]  # fmt: skip
    assert rows[-1]["status_reason"].startswith("budget_exhausted: hops")


async def test_external_writes_are_reserved_before_they_happen(rig: Rig) -> None:
    await submit(rig, "writes", "w1")

    async def dead() -> bool:
        return await rig.status_of("writes") == ["dead"]

    await rig.wait(dead, what="writes exhausted")
    (row,) = await rig.rows("SELECT status_reason FROM agent_messages WHERE pipeline = 'writes'")
    assert row["status_reason"].startswith("budget_exhausted: writes")


async def test_work_waits_briefly_while_the_cap_is_only_held_by_calls_in_flight(
    rig: Rig,
) -> None:
    # Room for one reservation at a time (about 0.013 EUR each here), though each call settles
    # far below it: the second call is deferred, not held, and runs once the first settles.
    await rig.spend.set_cap("appliance", Decimal("0.02"))
    ids = [await submit(rig, "label", f"d{i}") for i in range(3)]

    async def done() -> bool:
        return await rig.status_of("label") == ["done"] * 3

    await rig.wait(done, what="all three done")
    reasons = await rig.rows(
        "SELECT reason FROM message_transitions WHERE message_id = ANY(%(ids)s) "
        "AND to_status = 'pending' AND reason LIKE 'deferred:%%'",
        {"ids": ids},
    )
    assert reasons, "no call was deferred: the cap never filled"
    assert await rig.rows("SELECT id FROM agent_messages WHERE status = 'held_budget'") == []


@pytest.mark.parametrize("rig", [{"busy_wait": timedelta(seconds=5)}], indirect=True)
async def test_a_call_waits_in_place_while_the_cap_is_held_by_calls_in_flight(
    rig: Rig,
) -> None:
    # The same cap, with the runner's in-place wait: the head of the cap's line asks again
    # until the call before it settles, and runs without being deferred or held.
    await rig.spend.set_cap("appliance", Decimal("0.02"))
    ids = [await submit(rig, "label", f"w{i}") for i in range(3)]

    async def done() -> bool:
        return await rig.status_of("label") == ["done"] * 3

    await rig.wait(done, what="all three done")
    moves = await rig.rows(
        "SELECT reason FROM message_transitions WHERE message_id = ANY(%(ids)s) "
        "AND to_status IN ('pending', 'held_budget') AND from_status IS NOT NULL",
        {"ids": ids},
    )
    # The head of the line waited in place; only calls kept back for its room were deferred.
    assert all("room kept for an earlier call" in m["reason"] for m in moves), moves
    calls = await rig.rows(
        "SELECT count(*) AS n FROM spend_ledger WHERE message_id = ANY(%(ids)s)", {"ids": ids}
    )
    assert calls[0]["n"] == 3


async def test_fan_out_cannot_escape_its_run_budget(rig: Rig) -> None:
    await submit(rig, "fan", "f1", stage="split")

    async def settled() -> bool:
        statuses = await rig.status_of("fan")
        return len(statuses) == 7 and "pending" not in statuses and "running" not in statuses

    await rig.wait(settled, what="the fan-out to stop")
    rows = await rig.rows(
        "SELECT source_id, status::text AS s, status_reason FROM agent_messages "
        "WHERE pipeline = 'fan' ORDER BY id"
    )
    # One run: three steps ran (the root and its two children), the four grandchildren ended.
    assert {r["source_id"] for r in rows} == {"f1"}
    assert [r["s"] for r in rows].count("done") == 3
    dead = [r for r in rows if r["s"] == "dead"]
    assert len(dead) == 4
    assert all(r["status_reason"].startswith("budget_exhausted: steps") for r in dead)


async def test_a_call_priced_too_low_stops_within_its_hold(rig: Rig) -> None:
    # What the story's call really uses, measured through the pool and its meter.
    whole = await rig.pool.infer(
        InferenceRequest("extract", prompt=RAMBLE, max_tokens=64), Tier.MECHANICAL
    )
    assert whole.finish_reason == "length" and whole.energy_joules is not None
    # A joules-per-token figure a third of the truth: the hold pays for a third of the call.
    tokens = prompt_token_bound(InferenceRequest("extract", prompt=RAMBLE)) + 64
    pricing = Pricing(
        tariff=Tariff(price_per_kwh=Decimal("1.0")),
        default_joules_per_token=Decimal(str(whole.energy_joules / 3 / tokens)),
        safety_factor=Decimal("1.0"),
    )
    rig.governor.config = dataclasses.replace(rig.governor.config, pricing=pricing)
    # A cap with room for one such hold, no more.
    reserved = pricing.worst_case(whole.model, tokens - 64, 64, 1024).amount
    await rig.spend.set_cap("appliance", reserved)
    mid = await submit(rig, "story", "s1")

    async def done() -> bool:
        return await rig.status_of("story") == ["done"]

    await rig.wait(done, what="done")
    (row,) = await rig.rows("SELECT result FROM agent_messages WHERE id = %(i)s", {"i": mid})
    assert row["result"]["finish"] == ENERGY_LIMIT
    assert row["result"]["text"] and whole.text.startswith(row["result"]["text"])
    (entry,) = await rig.rows("SELECT status, reserved, amount, note FROM spend_ledger")
    assert entry["status"] == "settled" and entry["reserved"] == reserved
    assert 0 < entry["amount"] <= entry["reserved"]
    assert entry["note"].startswith("generation stopped at the energy its hold paid for")
    (month,) = await rig.rows("SELECT spent, reserved FROM spend_months WHERE scope = 'appliance'")
    assert month["reserved"] == 0 and month["spent"] == entry["amount"] <= reserved
    (call,) = await rig.rows("SELECT status, completion_tokens FROM inference_calls")
    assert call["status"] == "ok" and 0 < call["completion_tokens"] < 64
    # An answer cut short cannot match a schema: its failure says why, and what to do.
    await rig.spend.set_cap("appliance", reserved * 10)
    jid = await submit(rig, "story_json", "s2")

    async def dead() -> bool:
        return await rig.status_of("story_json") == ["dead"]

    await rig.wait(dead, what="dead")
    (row,) = await rig.rows("SELECT error FROM agent_messages WHERE id = %(i)s", {"i": jid})
    assert "does not match the schema" in row["error"], row["error"]
    assert "cut at the energy its hold paid for" in row["error"], row["error"]


@pytest.mark.parametrize("rig", [{"busy_wait": timedelta(seconds=60)}], indirect=True)
async def test_a_stopping_runner_defers_a_call_waiting_for_the_caps_room(rig: Rig) -> None:
    # A long call holds the cap's room; a second call waits in place for it (up to 60 s). The
    # runner stops meanwhile: the waiting call is deferred at once, never admitted into the
    # drain, and its message is left pending for another runner.
    story = InferenceRequest("extract", prompt=RAMBLE, max_tokens=400)
    label = InferenceRequest("classify", prompt="Ticket: I was charged twice\nLabel:", max_tokens=8)
    pricing = rig.governor.config.pricing
    long_hold = pricing.worst_case("m", prompt_token_bound(story), 400, 1024).amount
    await rig.spend.set_cap("appliance", long_hold + pricing.worst_case(
        "m", prompt_token_bound(label), 8, 1024).amount / 2)  # fmt: skip
    sid = (await rig.bus.enqueue(
        tenant="acme", pipeline="story", stage="run", source="t", source_id="long",
        directive="d", context={"n": 400},
    )).id  # fmt: skip

    async def story_running() -> bool:
        return bool(await rig.rows("SELECT 1 FROM spend_ledger WHERE status = 'reserved'"))

    await rig.wait(story_running, what="the long call admitted")
    lid = await submit(rig, "label", "waits")

    async def label_waiting() -> bool:
        return bool(await rig.rows(
            "SELECT 1 FROM spend_waiters WHERE message_id = %(i)s", {"i": lid}))  # fmt: skip

    await rig.wait(label_waiting, what="the second call waiting in the cap's line")
    await asyncio.sleep(0.5)
    rig.stop.set()
    await asyncio.wait_for(rig.serving, 30)
    statuses = {r["id"]: r["status"] for r in await rig.rows(
        "SELECT id, status::text AS status FROM agent_messages")}  # fmt: skip
    assert statuses[lid] == "pending", statuses  # deferred, not run in the drain
    calls = await rig.rows(
        "SELECT message_id FROM inference_calls WHERE message_id = %(i)s", {"i": lid}
    )
    assert calls == []
    assert statuses[sid] in {"done", "pending"}  # finished in the drain, or given back
    lines = await rig.rows("SELECT status FROM spend_ledger WHERE message_id = %(i)s", {"i": lid})
    assert lines == []  # it never held anything


@pytest.mark.parametrize("rig", [{"queue": 1}], indirect=True)  # room for 2, 4 slots
async def test_admission_does_not_let_the_runner_claim_past_its_models_queue(rig: Rig) -> None:
    # Only a call waiting between asks for the cap's room leaves the pool's count: counted
    # out for its whole admission, calls being admitted let the runner claim more model work
    # than the pool could queue, and those were deferred (QueueFull), their holds released.
    await rig.spend.set_cap("appliance", Decimal("10"))
    ids = [await submit(rig, "label", f"q{i}") for i in range(12)]

    async def done() -> bool:
        return await rig.status_of("label") == ["done"] * 12

    await rig.wait(done, what="all twelve done")
    lines = await rig.rows("SELECT status FROM spend_ledger")
    assert [r["status"] for r in lines] == ["settled"] * 12, lines
    deferred = await rig.rows(
        "SELECT reason FROM message_transitions WHERE message_id = ANY(%(ids)s) "
        "AND to_status = 'pending' AND from_status IS NOT NULL",
        {"ids": ids},
    )
    assert deferred == [], deferred
