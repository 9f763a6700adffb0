"""The governor against the real ledger: what a call is charged in each way it can end."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from decimal import Decimal

import pytest

from appliance.bus.core import Bus
from appliance.bus.governor import Admission, Governor, GovernorConfig
from appliance.db.database import Database
from appliance.db.runner_store import PgRunnerStore
from appliance.db.spend_store import PgSpendStore
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.budget import BudgetBusy, BudgetExhausted, BudgetHeld, RunBudget
from appliance.domain.cost import Pricing, Tariff
from appliance.domain.envelope import Message
from appliance.domain.inference import InferenceRequest, ModelInfo, Tier, route
from appliance.metering.meter import Meter
from tests.energy_fakes import HandCpu, ListCounter

PRICING = Pricing(
    tariff=Tariff(price_per_kwh=Decimal("3.6")),  # 1e-6 EUR per joule: easy figures
    default_joules_per_token=Decimal("1"),
    safety_factor=Decimal("1"),
)
MODEL = ModelInfo("small", "0" * 64, 2048)
REQUEST = InferenceRequest("classify", prompt="x" * 8, max_tokens=10)  # 20 tokens at most


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


async def claimed(db: Database, source_id: str) -> Message:
    bus = Bus(PgRunnerStore(db))
    await bus.enqueue(tenant="acme", pipeline="p", stage="s", source="t", source_id=source_id,
                      directive="d")  # fmt: skip
    (message,) = await bus.claim("w", limit=1)
    return message


@pytest.fixture
async def governor(db: Database) -> Governor:
    await PgTenantStore(db).add("acme")
    spend = PgSpendStore(db)
    await spend.set_cap("appliance", Decimal("1"))
    # No in-place wait: a refusal for room in flight is answered at once (see the test of
    # the wait below).
    return Governor(spend, GovernorConfig(PRICING, busy_wait=timedelta(0)), actor="test")


async def admit(governor: Governor, message: Message, wait_until: float | None = None) -> Admission:
    found = route("classify", {Tier.MECHANICAL})
    assert found is not None
    return await governor.admit(
        message, budget=None, verification=False, request=REQUEST, route=found, model=MODEL,
        wait_until=wait_until,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("energy", "failed", "unknown", "charged", "status"),
    [
        (5.0, False, False, Decimal("0.000005"), "settled"),  # measured: what it used
        (None, False, False, Decimal("0.00002"), "settled"),  # ran, no figure: the reservation
        (None, True, False, Decimal(0), "released"),  # never ran: nothing
        (None, True, True, Decimal("0.00002"), "settled"),  # cancelled while out: reservation
        (2.0, True, False, Decimal("0.000002"), "settled"),  # failed after using some energy
    ],
)
async def test_what_a_call_is_charged(
    governor: Governor, db: Database, energy: float | None, failed: bool, unknown: bool,
    charged: Decimal, status: str,
) -> None:  # fmt: skip
    message = await claimed(db, "c")
    admission = await admit(governor, message)
    assert admission.estimate.amount == Decimal("0.00002")
    amount = await governor.settle(
        message, admission, energy_joules=energy, provenance="estimated" if energy else None,
        completion_tokens=0, prompt_tokens=0, failed=failed, usage_unknown=unknown,
    )  # fmt: skip
    assert amount == charged
    async with db.system_conn() as conn:
        row = await (
            await conn.execute("SELECT status, amount, reserved FROM spend_ledger")
        ).fetchone()
        month = await (
            await conn.execute("SELECT spent, reserved FROM spend_months WHERE scope='appliance'")
        ).fetchone()
    assert row is not None and (row["status"], row["amount"]) == (status, charged)
    assert month is not None and (month["spent"], month["reserved"]) == (charged, 0)


async def test_a_call_across_an_interval_its_counter_lost_is_settled_as_estimated(
    governor: Governor, db: Database
) -> None:
    # The meter's figure for a call whose counter went back part way (a driver reload): 3 J
    # measured over 3 s, the lost second made up at that rate. It was settled at 3 J, as
    # measured, in the ledger.
    clock = Clock()
    meter = Meter(ListCounter([1000.0, 1001.0, 0.0, 1.0, 2.0], device="package-0"),
                  HandCpu(), {}, clock=clock, call_device="package-0")  # fmt: skip
    meter.begin("call", 1)
    for t in (1.0, 2.0, 3.0):
        clock.now = t
        meter.tick()
    clock.now = 4.0
    energy = meter.end("call")
    message = await claimed(db, "lost")
    admission = await admit(governor, message)
    amount = await governor.settle(
        message, admission, energy_joules=energy.joules, provenance=energy.provenance,
        completion_tokens=5, prompt_tokens=5, failed=False,
    )  # fmt: skip
    assert amount == Decimal("0.000004")
    async with db.system_conn() as conn:
        row = await (
            await conn.execute("SELECT amount, energy_joules, provenance FROM spend_ledger")
        ).fetchone()
    assert row is not None
    assert (row["amount"], row["provenance"]) == (Decimal("0.000004"), "estimated")
    assert row["energy_joules"] == pytest.approx(4.0)


async def test_refusals_hold_or_defer(governor: Governor, db: Database) -> None:
    first = await claimed(db, "a")
    await governor.spend.set_cap("appliance", Decimal("0.00003"))  # type: ignore[attr-defined]
    await admit(governor, first)  # holds 0.00002 of 0.00003
    second = await claimed(db, "b")
    with pytest.raises(BudgetBusy, match="deferred: money"):
        await admit(governor, second)  # only the first's hold is in the way
    await governor.spend.set_cap("appliance", Decimal("0.00001"))  # type: ignore[attr-defined]
    with pytest.raises(BudgetHeld, match="held_budget: money: appliance monthly cap"):
        await admit(governor, second)  # spend alone could not fit it: held


async def test_a_call_refused_for_room_in_flight_asks_again_in_place(
    governor: Governor, db: Database
) -> None:
    # The first call's hold fills the cap; it settles while the second asks again in place:
    # the second is admitted, neither deferred nor held. Without the settlement it gives up
    # after busy_wait, still only deferred.
    waiting = Governor(
        governor.spend,
        GovernorConfig(
            PRICING,
            busy_wait=timedelta(seconds=3),
            busy_retry=timedelta(seconds=0.05),
            kept_back_wait=timedelta(seconds=1),
            kept_back_retry=timedelta(seconds=0.3),
        ),
        actor="test",
    )
    first = await claimed(db, "a")
    await governor.spend.set_cap("appliance", Decimal("0.00003"))  # type: ignore[attr-defined]
    held = await admit(governor, first)
    second = await claimed(db, "b")

    async def settle_soon() -> None:
        await asyncio.sleep(0.3)
        await governor.settle(
            first, held, energy_joules=None, provenance=None, completion_tokens=0,
            prompt_tokens=0, failed=True,
        )  # fmt: skip

    began = time.monotonic()
    _, admitted = await asyncio.gather(settle_soon(), admit(waiting, second))
    assert admitted.hold is not None and time.monotonic() - began < 3
    third = await claimed(db, "c")
    began = time.monotonic()
    with pytest.raises(BudgetBusy, match="deferred: money"):
        await admit(waiting, third)  # the head of the line: it waited in place
    assert 2.5 < time.monotonic() - began < 6
    # A call kept back for the head's room asks again slowly, and briefly (kept_back_wait).
    fourth = await claimed(db, "d")
    began = time.monotonic()
    with pytest.raises(BudgetBusy, match=f"room kept for an earlier call .*message {third.id}"):
        await admit(waiting, fourth)
    assert 0.3 < time.monotonic() - began < 2.5  # at least one pause of 0.3-0.6 s


async def test_the_wait_in_place_ends_with_the_stage_and_holds_nothing_of_the_run(
    governor: Governor, db: Database
) -> None:
    # The stage's time bounds the wait; and the cap's hold is had before the run's budget is
    # touched, so other messages of the run keep its room meanwhile.
    waiting = Governor(
        governor.spend,
        GovernorConfig(
            PRICING, busy_wait=timedelta(seconds=30), busy_retry=timedelta(seconds=0.05)
        ),
        actor="test",
    )
    first = await claimed(db, "a")
    await governor.spend.set_cap("appliance", Decimal("0.00003"))  # type: ignore[attr-defined]
    await admit(governor, first)
    second = await claimed(db, "b")
    began = time.monotonic()
    found = route("classify", {Tier.MECHANICAL})
    assert found is not None
    waits = asyncio.create_task(
        waiting.admit(
            second,
            budget=RunBudget(calls=5),
            verification=False,
            request=REQUEST,
            route=found,
            model=MODEL,
            wait_until=began + 0.5,
        )
    )
    await asyncio.sleep(0.2)
    run = await waiting.spend.run_budget("acme", "t", "b")  # type: ignore[attr-defined]
    assert run is None or not run["used"], run  # nothing of the run's budget is held
    with pytest.raises(BudgetBusy):
        await waits
    assert time.monotonic() - began < 2  # the stage's time, not busy_wait's 30 s


async def cap_held(governor: Governor, db: Database, retry: float) -> tuple[Governor, Message]:
    """A call in flight holds the whole cap; the next claimed message, and a governor that asks
    again in place (every `retry` to twice that seconds, up to 30 s) for its room."""
    waiting = Governor(
        governor.spend,
        GovernorConfig(
            PRICING, busy_wait=timedelta(seconds=30), busy_retry=timedelta(seconds=retry)
        ),
        actor="test",
    )
    first = await claimed(db, "a")
    await governor.spend.set_cap("appliance", Decimal("0.00003"))  # type: ignore[attr-defined]
    await admit(governor, first)
    return waiting, await claimed(db, "b")


async def one_call(governor: Governor, budget: RunBudget) -> str | None:
    """Reserve one call of the second message's run (source t, id b) directly."""
    return await governor.spend.run_reserve(
        tenant="acme", source="t", source_id="b", pipeline="p", limits=budget.limits(),
        reserve=budget.verification_reserve, verification=False, ask={"calls": 1}, now=None,
    )  # fmt: skip


async def open_holds(db: Database) -> int:
    async with db.system_conn() as conn:
        row = await (
            await conn.execute("SELECT count(*) AS n FROM spend_ledger WHERE status = 'reserved'")
        ).fetchone()
    assert row is not None
    return int(row["n"])


async def test_the_wait_in_place_ends_when_the_runner_stops(
    governor: Governor, db: Database
) -> None:
    # A stop must not wait out a wait for the cap's room (a drain would wait for it up to its
    # timeout, then cancel the handler): the call is deferred at once, for another runner.
    # Asks again every 2-4 s: the stop must end the pause itself, not the next ask.
    waiting, second = await cap_held(governor, db, retry=2)
    found = route("classify", {Tier.MECHANICAL})
    assert found is not None
    stopping = asyncio.Event()
    asked: list[bool] = []
    waits = asyncio.create_task(
        waiting.admit(
            second,
            budget=None,
            verification=False,
            request=REQUEST,
            route=found,
            model=MODEL,
            waiting=asked.append,
            stopping=stopping,
        )
    )
    await asyncio.sleep(0.5)
    assert asked and not waits.done()  # the head of the line, waiting in place
    began = time.monotonic()
    stopping.set()
    with pytest.raises(BudgetBusy, match="deferred: money"):
        await waits
    assert time.monotonic() - began < 0.5  # at once, not after busy_wait's 30 s
    assert asked[-1] is False
    assert await open_holds(db) == 1  # the first call's hold: the stopped one has none


async def test_a_call_its_run_budget_refuses_does_not_wait_for_the_caps_room(
    governor: Governor, db: Database
) -> None:
    # At the head of the cap's line, it would keep the room that frees for itself, only to be
    # refused by its run's budget once admitted. It ends at once, holding nothing.
    waiting, second = await cap_held(governor, db, retry=1)
    budget = RunBudget(calls=1, verification_reserve=Decimal(0))
    # The run (source t, id b) has already made its one call.
    assert await one_call(governor, budget) is None
    found = route("classify", {Tier.MECHANICAL})
    assert found is not None
    asked: list[bool] = []
    began = time.monotonic()
    with pytest.raises(BudgetExhausted, match="calls"):
        await waiting.admit(
            second, budget=budget, verification=False, request=REQUEST, route=found, model=MODEL,
            waiting=asked.append,
        )  # fmt: skip
    assert time.monotonic() - began < 1 and asked == []  # it never waited
    run = await governor.spend.run_budget("acme", "t", "b")  # type: ignore[attr-defined]
    assert run["exhausted"] == "calls" and run["used"] == {"calls": 1}  # recorded, as ever
    assert await open_holds(db) == 1  # the first call's hold only
    # With its run's budget free, the same call waits in place as before.
    third = await claimed(db, "c")
    waits = asyncio.create_task(
        waiting.admit(
            third,
            budget=budget,
            verification=False,
            request=REQUEST,
            route=found,
            model=MODEL,
            waiting=asked.append,
        )
    )
    await asyncio.sleep(0.3)
    assert asked == [True] and not waits.done()
    waits.cancel()


async def test_a_refusal_of_the_run_check_reserves_nothing_of_the_run(
    governor: Governor, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Recorded on the run without a reservation: a reservation made only to be refused would
    # take room a sibling call of the run could be refused for meanwhile. (The check is faked
    # to refuse here, so that the run's room shows whether anything was taken.)
    waiting, second = await cap_held(governor, db, retry=1)

    async def refuses(**_: object) -> str:
        return "calls"

    monkeypatch.setattr(governor.spend, "run_check", refuses)
    found = route("classify", {Tier.MECHANICAL})
    assert found is not None
    budget = RunBudget(calls=1, verification_reserve=Decimal(0))
    with pytest.raises(BudgetExhausted, match="calls"):
        await waiting.admit(
            second, budget=budget, verification=False, request=REQUEST, route=found, model=MODEL
        )
    run = await governor.spend.run_budget("acme", "t", "b")  # type: ignore[attr-defined]
    assert run["exhausted"] == "calls" and run["used"] == {}
    # The run's one call is still there for a sibling.
    assert await one_call(governor, budget) is None


@pytest.mark.parametrize(
    ("unknown", "tokens", "kept"),
    [
        (False, (3, 4), 7),  # it ended and said what it used: that much
        (True, (0, 0), 20),  # cancelled while out, nothing known: the whole reservation
        (True, (12, 10), 22),  # cancelled, but it reported more than reserved: that
    ],
)
async def test_a_runs_tokens_keep_what_a_call_may_have_used(
    governor: Governor, db: Database, unknown: bool, tokens: tuple[int, int], kept: int
) -> None:
    # A call whose task was cancelled while it was out may have used every token it reserved;
    # its run keeps them as it keeps the money, or a run's cancelled calls could use tokens
    # its budget never counted.
    message = await claimed(db, "r")
    found = route("classify", {Tier.MECHANICAL})
    assert found is not None
    admission = await governor.admit(
        message, budget=RunBudget(tokens=1000), verification=False, request=REQUEST,
        route=found, model=MODEL,
    )  # fmt: skip
    assert admission.estimate.tokens == 20
    await governor.settle(
        message, admission, energy_joules=None, provenance=None, prompt_tokens=tokens[0],
        completion_tokens=tokens[1], failed=unknown, usage_unknown=unknown,
    )  # fmt: skip
    run = await governor.spend.run_budget("acme", "t", "r")  # type: ignore[attr-defined]
    assert run is not None and run["used"]["tokens"] == kept


@pytest.mark.parametrize(
    ("energy", "provenance", "charged"),
    [
        # The meter failed (no figure): it ran, so it is charged its reservation, as any call
        # that ran without a figure, never nothing.
        (None, None, Decimal("0.00002")),
        # A measured 0 J: it ran all the same, so its hold is settled, not released as one
        # that never started.
        (0.0, "measured", Decimal(0)),
    ],
)
async def test_a_call_stopped_part_way_after_reading_tokens_is_settled(
    governor: Governor, db: Database, energy: float | None, provenance: str | None,
    charged: Decimal,
) -> None:  # fmt: skip
    message = await claimed(db, "p")
    admission = await admit(governor, message)
    amount = await governor.settle(
        message, admission, energy_joules=energy, provenance=provenance, prompt_tokens=8,
        completion_tokens=3, failed=True,
    )  # fmt: skip
    assert amount == charged
    async with db.system_conn() as conn:
        row = await (await conn.execute("SELECT status, amount FROM spend_ledger")).fetchone()
    assert row is not None and (row["status"], row["amount"]) == ("settled", charged)
