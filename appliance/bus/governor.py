"""Admission control for model calls: reserve before work, settle after, in one place.

Before a call: the run's budget (tokens, calls, money) and the monthly cap each get a
reservation of the call's worst case; a call that cannot be priced is refused. During it, the
pool stops the generation before its metered energy passes what the hold paid for. After the
call: both settle to what it really used (the cap to the cost of its measured or estimated
energy).
A refusal never causes a retry: the runner parks the message (held_budget) or ends it
(budget_exhausted: X). The one exception is a cap whose room is only held by calls in flight:
the head of the cap's waiting line asks again in place, often, until the room it needs has
gathered (later calls leave it that room) or half its stage's time is gone; any other call
refused so asks again every second or two for a few seconds, holding its slot (freed, the slot
would only claim the next message of the backlog to be refused alike), then the runner defers
its message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from zoneinfo import ZoneInfo

from appliance.domain.budget import BudgetBusy, BudgetExhausted, BudgetHeld, Refusal, RunBudget
from appliance.domain.cost import CallEstimate, Pricing
from appliance.domain.envelope import Message
from appliance.domain.errors import ConfigurationError
from appliance.domain.inference import InferenceRequest, ModelInfo, Route
from appliance.domain.ports import SpendStore

log = logging.getLogger("appliance.governor")

# Chat templates wrap each message in a few tokens of markup.
TEMPLATE_TOKENS_PER_MESSAGE = 16


def prompt_token_bound(request: InferenceRequest) -> int:
    """An upper bound on the request's prompt tokens without a tokenizer: a token is at least
    one byte of UTF-8 (plus a start token and the chat template's markup)."""
    if request.prompt is not None:
        return len(request.prompt.encode()) + 2
    return (
        sum(
            len(m.content.encode()) + len(m.role) + TEMPLATE_TOKENS_PER_MESSAGE
            for m in request.messages
        )
        + TEMPLATE_TOKENS_PER_MESSAGE
    )


@dataclass
class Admission:
    """What was reserved for one call, to be settled when it ends."""

    hold: int | None
    estimate: CallEstimate
    run_ask: dict[str, object] | None


@dataclass(frozen=True)
class GovernorConfig:
    pricing: Pricing
    time_zone: ZoneInfo = field(default_factory=lambda: ZoneInfo("UTC"))
    # How long the head of the cap's waiting line asks again in place at most (every
    # busy_retry to twice that, jittered) before the runner defers its message; its stage's
    # deadline may end the wait sooner.
    busy_wait: timedelta = timedelta(seconds=120)
    busy_retry: timedelta = timedelta(milliseconds=200)
    # Any other call refused for room in flight (kept back for the head's room, or its room
    # cannot gather while more urgent work holds it) asks again this often, this long.
    kept_back_wait: timedelta = timedelta(seconds=10)
    kept_back_retry: timedelta = timedelta(seconds=1)


class Governor:
    """The bus's one place where model work is priced, reserved and settled."""

    def __init__(
        self,
        spend: SpendStore,
        config: GovernorConfig,
        *,
        actor: str,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.spend = spend
        self.config = config
        self.actor = actor
        self.clock = clock

    async def admit(
        self,
        message: Message,
        *,
        budget: RunBudget | None,
        verification: bool,
        request: InferenceRequest,
        route: Route,
        model: ModelInfo,
        wait_until: float | None = None,
        waiting: Callable[[bool], None] | None = None,
        stopping: asyncio.Event | None = None,
    ) -> Admission:
        """Reserve the call's worst case against the monthly cap and the run budget, or raise
        BudgetHeld / BudgetBusy / BudgetExhausted. Nothing is held when it raises.
        `wait_until` (time.monotonic()): when the head of the cap's line stops waiting in place
        at the latest (its stage's deadline, less the time to persist a result). `waiting` is
        told when the call starts and stops waiting for the cap's room. `stopping` (the runner
        stops) ends such a wait at once: the call is deferred, for another runner to take."""
        try:
            estimate = self.config.pricing.worst_case(
                model.model, prompt_token_bound(request), request.max_tokens, model.n_ctx
            )
        except ConfigurationError as exc:
            raise BudgetHeld(f"held_budget: money: {exc}") from exc
        run_ask: dict[str, object] = {
            "tokens": estimate.tokens,
            "calls": 1,
            "money": estimate.amount,
        }
        detail = f"a {request.kind} call asked {run_ask}"
        before_wait: Callable[[], Awaitable[None]] | None = None
        if budget is not None:

            async def run_refuses() -> None:
                # A call its run's budget will refuse must not wait for the cap's room (at the
                # head of the line, it would keep that room from others meanwhile).
                exhausted = await self.spend.run_check(
                    tenant=message.tenant, source=message.source, source_id=message.source_id,
                    limits=budget.limits(), reserve=budget.verification_reserve,
                    verification=verification, ask=run_ask, now=None,
                )  # fmt: skip
                if exhausted is None:
                    return
                # Recorded on the run (its exhausted dimension, its last use) as a refusal of
                # the reservation itself is, without reserving anything: a reservation made
                # only to be refused would, meanwhile, refuse a sibling call of the run.
                await self.spend.run_refused(
                    tenant=message.tenant, source=message.source, source_id=message.source_id,
                    pipeline=message.pipeline, limits=budget.limits(),
                    reserve=budget.verification_reserve, exhausted=exhausted, now=None,
                )  # fmt: skip
                raise BudgetExhausted(exhausted, detail)

            before_wait = run_refuses
        # The cap first: a wait in place for its room holds nothing of the run's budget, which
        # its other messages may need meanwhile.
        hold = await self._reserve(
            message, estimate.amount, request.kind, route, model, wait_until, waiting, stopping,
            before_wait,
        )  # fmt: skip
        if isinstance(hold, Refusal):
            if hold.exhausted:
                raise BudgetHeld(hold.reason())
            # Room is only held by calls in flight; they settle at or below their holds.
            raise BudgetBusy(hold.reason().replace("held_budget:", "deferred:", 1))
        if budget is not None:
            try:
                await self.reserve_steps(
                    message, budget, verification=verification, ask=run_ask, detail=detail
                )
            except BaseException:
                await self.spend.settle(
                    hold,
                    amount=Decimal(0),
                    energy_joules=None,
                    provenance=None,
                    released=True,
                    note="released: the run's budget refused the call",
                    now=None,
                )
                raise
        return Admission(hold, estimate, run_ask if budget is not None else None)

    async def _reserve(
        self,
        message: Message,
        amount: Decimal,
        kind: str,
        route: Route,
        model: ModelInfo,
        wait_until: float | None,
        waiting: Callable[[bool], None] | None = None,
        stopping: asyncio.Event | None = None,
        before_wait: Callable[[], Awaitable[None]] | None = None,
    ) -> int | Refusal:
        """A hold against the cap, or the refusal. The head of the cap's waiting line asks
        again in place until it fits, up to busy_wait or `wait_until`: the room that frees is
        kept for it only while it asks. Any other call refused for room in flight asks again
        slowly, up to kept_back_wait (or `wait_until`), then gives up (and is deferred)."""
        start = time.monotonic()
        head_ends = start + self.config.busy_wait.total_seconds()
        back_ends = start + self.config.kept_back_wait.total_seconds()
        if wait_until is not None:
            head_ends, back_ends = min(head_ends, wait_until), min(back_ends, wait_until)
        while True:
            hold = await self.spend.reserve(
                tenant=message.tenant,
                lane=message.lane,
                amount=amount,
                lease=message.lease,
                pipeline=message.pipeline,
                stage=message.stage,
                kind=kind,
                model=model.model,
                tier=route.tier.value,
                now=None,
            )
            if not isinstance(hold, Refusal) or hold.exhausted:
                return hold
            if hold.wait:
                every, ends = self.config.busy_retry, head_ends
            else:
                every, ends = self.config.kept_back_retry, back_ends
            pause = every.total_seconds() * random.uniform(1.0, 2.0)
            if time.monotonic() + pause > ends or (stopping is not None and stopping.is_set()):
                return hold
            if before_wait is not None:
                await before_wait()  # raises when the call must not wait
            if waiting is not None:
                waiting(True)
            try:
                if stopping is None:
                    await asyncio.sleep(pause)
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stopping.wait(), pause)
            finally:
                if waiting is not None:
                    waiting(False)
            if stopping is not None and stopping.is_set():
                return hold  # deferred, not admitted into a drain

    async def settle(
        self,
        message: Message,
        admission: Admission,
        *,
        energy_joules: float | None,
        provenance: str | None,
        completion_tokens: int | None,
        prompt_tokens: int | None,
        failed: bool,
        usage_unknown: bool = False,
        cut: bool = False,
    ) -> Decimal:
        """Charge what the call used (its energy at the tariff) and give back the rest. `cut`:
        the pool stopped the generation at the energy the hold paid for."""
        local = self.clock().astimezone(self.config.time_zone)
        note = None
        if cut:
            note = "generation stopped at the energy its hold paid for (joules per token too low)"
        # A call that read or wrote tokens ran, whatever else is known of it.
        ran = bool(prompt_tokens or completion_tokens)
        if energy_joules is not None:
            amount = self.config.pricing.tariff.cost(energy_joules, local)
        elif failed and not usage_unknown and not ran:
            # It never ran (refused, cancelled before its start). One stopped part way says
            # what it read and wrote: it ran, so without a meter figure it is charged below.
            amount = Decimal(0)
        else:
            # It ran (or may have) but no meter figure came back: charge the whole
            # reservation, never less.
            amount = admission.estimate.amount
            provenance = "estimated"
            note = "no energy figure: charged the reservation"
        if amount > admission.estimate.amount:
            # Should not happen with a conservative figure: record it, never hide it.
            note = f"measured cost above the reservation of {admission.estimate.amount}"
            log.warning("message %s: %s", message.id, note)
        if admission.hold is not None:
            charged = await self.spend.settle(
                admission.hold,
                amount=amount,
                energy_joules=energy_joules,
                provenance=provenance,
                # Released only if it never ran: one that ran is settled, even at 0 J.
                released=failed and amount == 0 and not usage_unknown and not ran,
                note=note,
                now=None,
            )
            if charged is None:
                log.warning(
                    "message %s: hold %s was released before settling (lease lost?)",
                    message.id,
                    admission.hold,
                )
        if admission.run_ask is not None:
            used_tokens = (prompt_tokens or 0) + (completion_tokens or 0)
            if usage_unknown:
                # As for its money: what it used is not known, so the run keeps the whole
                # token reservation, never less (giving it back let a run's cancelled calls
                # use tokens its budget never counted).
                used_tokens = max(used_tokens, admission.estimate.tokens)
            await self.spend.run_adjust(
                tenant=message.tenant,
                source=message.source,
                source_id=message.source_id,
                delta={
                    "tokens": used_tokens - admission.estimate.tokens,
                    "money": amount - admission.estimate.amount,
                },
            )
        return amount

    async def reserve_steps(
        self,
        message: Message,
        budget: RunBudget,
        *,
        verification: bool,
        ask: dict[str, object],
        detail: str = "",
    ) -> None:
        """Reserve work (steps, writes, a call's tokens and money) against the run's budget
        (BudgetExhausted, naming the dimension, if it does not fit)."""
        exhausted = await self.spend.run_reserve(
            tenant=message.tenant,
            source=message.source,
            source_id=message.source_id,
            pipeline=message.pipeline,
            limits=budget.limits(),
            reserve=budget.verification_reserve,
            verification=verification,
            ask=ask,
            now=None,
        )
        if exhausted is not None:
            raise BudgetExhausted(exhausted, detail)
