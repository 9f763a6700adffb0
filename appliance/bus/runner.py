"""The stage runner: wakes on the doorbell or the fallback poll, claims work into free lane
slots, runs stage handlers, heartbeats their leases, and acknowledges results in batches.

Correctness rests on the store's fenced statements; the doorbell only makes pick-up fast. The
runner never dies with a handler: an exception fails that attempt and the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from appliance.bus.claim_ahead import ClaimAhead
from appliance.bus.governor import Admission, Governor
from appliance.bus.runner_id import take_runner_id, taken_over
from appliance.bus.slots import LaneSlots
from appliance.domain.budget import BudgetBusy, BudgetExhausted, BudgetHeld
from appliance.domain.envelope import (
    DEFAULT_CONTEXT_MAX_BYTES,
    NAME_RE,
    EnqueueRequest,
    Lane,
    LeaseRef,
    Message,
    bytes_over,
    encode_json,
    idempotency_key,
)
from appliance.domain.errors import InvalidInput, RowBusy
from appliance.domain.inference import (
    ENERGY_LIMIT,
    TIER_ORDER,
    CallCancelled,
    CallControl,
    CallRecord,
    CapabilityUnavailable,
    DeadlineExceeded,
    InferenceError,
    InferenceRequest,
    InferenceResult,
    InferenceService,
    OutputInvalid,
    QueueFull,
    Route,
    Tier,
    min_tier,
    resumable,
    route,
)
from appliance.domain.pipeline import Registry, Stage, StageContext, StageResult
from appliance.domain.ports import (
    RUNNER_ALIVE,
    AckOutcome,
    Completion,
    Doorbell,
    FailOutcome,
    RunnerStore,
)
from appliance.domain.retry import RetryPolicy

log = logging.getLogger("appliance.runner")

CLAIM_ORDER: tuple[Lane, ...] = (Lane.INTERACTIVE, Lane.SYSTEM, Lane.BATCH)
# A claimed-ahead message must start within this share of what its lease (which ends at its run
# deadline or its message's deadline if one comes first) had left when it was claimed, and
# within a heartbeat interval, or it is given back.
HELD_SHARE_OF_LEASE = 0.25
# Once stopping, how long the main loop's step in flight may still take (run).
STOP_GRACE_S = 5.0
# How long a cancelled handler has to end before it counts as ignoring cancellation.
ABANDON_AFTER_S = 1.0
# The reason a message deferred because the model pool had no room for a handler's call is
# logged with, and how many such deferrals it gets before the next is a failed attempt.
POOL_FULL = "deferred_pool_full"
POOL_FULL_DEFERRALS = 10
# How long a drain tries to acknowledge the results waiting before it stops the handlers
# left (each time; the stop's last step tries once more).
DRAIN_ACK_S = 2.0
# How soon leases that a heartbeat found held by another statement are asked again.
BUSY_REBEAT_S = 0.5


def _call_status(exc: BaseException) -> tuple[str, str]:
    """How a failed call is recorded: its status in inference_calls and the error text."""
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled", "the handler was cancelled while the call was out"
    if isinstance(exc, CallCancelled):
        return "cancelled", str(exc)
    if isinstance(exc, (DeadlineExceeded, CapabilityUnavailable, QueueFull)):
        return "refused", str(exc)
    if isinstance(exc, OutputInvalid):
        return "invalid_output", str(exc)
    return "error", _describe(exc)


# At most this much of a handler's error goes into one log line (the whole, cut to the
# database's limit, goes into the message's error).
_LOG_CHARS = 2000


def _span(wait: timedelta) -> str:
    """A wait as an operator reads it: 7 days, 2 h, 30 min, 45 s."""
    seconds = wait.total_seconds()
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"


def _describe(exc: BaseException) -> str:
    """`Type: message` for a failure's record, even when the exception's own str() fails."""
    try:
        text = str(exc)
    except Exception:
        text = "(its message could not be rendered)"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# A representative task kind per tier, to ask the routing policy about a tier as a whole.
_KIND_OF: dict[Tier, str] = {Tier.MECHANICAL: "classify", Tier.REASONING: "draft"}


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class RunnerConfig:
    """How one runner process behaves (validated settings land here)."""

    worker_id: str = field(default_factory=default_worker_id)
    concurrency: int = 8
    reserved_interactive: int = 2
    reserved_system: int = 1
    # Leases a tenant may hold at once across all runners, claimed-ahead ones included (a
    # tenant's own max_running overrides it). None: what one runner can hold (concurrency +
    # claim_ahead), so that a lone tenant is not held below what one runner can do.
    tenant_limit: int | None = None
    lease: timedelta = timedelta(seconds=30)
    poll_interval: timedelta = timedelta(seconds=30)
    poll_jitter: float = 0.2
    drain_timeout: timedelta = timedelta(seconds=10)
    cancel_grace: timedelta = timedelta(seconds=5)
    # The most messages one claim asks for (free slots plus claim-ahead).
    claim_batch: int = 48
    # The most messages the runner holds leased beyond its free slots (see claim_ahead.py:
    # only for stages quick enough that its slots finish them within two claim round trips).
    claim_ahead: int = 40
    # Claim round trips' worth of work the slots may have held for them (claim_ahead.py).
    claim_ahead_window: float = 2.0
    # How long finished results may wait for those of a claim in flight, to share one
    # acknowledgement statement (0 = send at once). Nothing waits on an acknowledgement but its
    # commit: slots are free when handlers return, and claims discount finished attempts.
    ack_linger: timedelta = timedelta(milliseconds=2)
    # The claim path's own reclaim: a fallback for a stalled sweeper (the maintenance service
    # reclaims every second), so rarer: each one is a statement beside the claims.
    reclaim_every: timedelta = timedelta(seconds=5)
    report_every: timedelta = timedelta(seconds=5)
    # How long model work may wait in waiting_capability for its tier before it expires.
    capability_wait: timedelta = timedelta(hours=1)
    # How long work waits for a runner that serves its stage (no live runner does).
    stage_wait: timedelta = timedelta(days=7)
    # Kept free at the end of a stage for writing its result: a model call must end earlier.
    persist_margin: timedelta = timedelta(seconds=2)
    # How many hand-offs a message may be from its run's start (a pipeline's budget may say
    # fewer): bounds a message that keeps re-enqueueing itself.
    max_hops: int = 1000
    # Spawned work is enqueued as the bus enqueues: keys kept this long (bus settings), and
    # this many attempts for a stage that declares none.
    idempotency_retention: timedelta = timedelta(days=90)
    max_attempts: int = 5
    context_max_bytes: int = DEFAULT_CONTEXT_MAX_BYTES
    # How long a message may wait in held_budget before it expires.
    budget_hold_max: timedelta = timedelta(days=32)
    # How soon work that found the cap held by calls in flight tries again.
    budget_busy_delay: timedelta = timedelta(seconds=1)

    @property
    def tenant_cap(self) -> int:
        """The limit of a tenant without its own max_running."""
        if self.tenant_limit is not None:
            return self.tenant_limit
        return self.concurrency + self.claim_ahead

    @property
    def heartbeat_every(self) -> timedelta:
        return self.lease / 3


@dataclass(frozen=True)
class AttemptStop:
    """Why a running attempt must stop before its handler returns."""

    CANCELLED = "cancelled"
    LEASE_LOST = "lease_lost"
    OVERRUN = "overrun"
    SHUTDOWN = "shutdown"


@dataclass
class _Attempt:
    message: Message
    context: StageContext
    cancelled: asyncio.Event
    tier: Tier | None = None  # the tier its stage's model work is counted against
    step_reserved: bool = False  # one step of its run's budget was reserved for it
    task: asyncio.Task[None] | None = None
    stop_reason: str | None = None
    hard_cancel_at: float | None = None
    acked: bool = False
    # The runner is writing its end itself (failed, parked, deferred, held, ended): a
    # heartbeat that finds its lease gone meanwhile has found that write, not a lost lease.
    settling: bool = False
    acked_at: float = 0.0  # monotonic, when its result was queued for acknowledgement
    slot_free: bool = False
    started: float = 0.0  # monotonic, when it took its slot
    # Waiting (between asks) for the cap's room: not using the model pool meanwhile.
    waiting_for_room: bool = False

    @property
    def lease(self) -> LeaseRef:
        return self.message.lease


@dataclass
class RunnerStats:
    """Counters a runner reports (mirrored into `runners` and the cockpit)."""

    claimed: int = 0
    completed: int = 0
    failed: int = 0
    late_acks: int = 0
    released: int = 0
    abandoned: int = 0
    missed_wakeups: int = 0
    last_missed_wakeup_at: datetime | None = None
    wakeups_rung: int = 0
    polls: int = 0
    parked: int = 0
    parked_unserved: int = 0  # work of a stage no live runner serves, parked until one does
    resumed: int = 0
    held_budget: int = 0
    deferred: int = 0
    budget_exhausted: int = 0
    given_back_ahead: int = 0  # claimed-ahead messages given back unstarted (also in released)


class Runner:
    """One asyncio runner: claim -> execute -> heartbeat -> complete, until told to stop."""

    def __init__(
        self,
        store: RunnerStore,
        registry: Registry,
        config: RunnerConfig | None = None,
        *,
        doorbell: Doorbell | None = None,
        retry: RetryPolicy | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        rng: random.Random | None = None,
        inference: InferenceService | None = None,
        governor: Governor | None = None,
    ) -> None:
        self.store = store
        self.inference = inference
        self.governor = governor
        self.registry = registry
        self.config = config or RunnerConfig()
        self.doorbell = doorbell
        self.retry = retry or RetryPolicy()
        self.clock = clock
        self.rng = rng or random.Random()
        self.slots = LaneSlots(
            self.config.concurrency,
            self.config.reserved_interactive,
            self.config.reserved_system,
        )
        self.stats = RunnerStats()
        # By lease token, not message id: the same message can be claimed again by this runner
        # while an earlier attempt of it still runs (its lease lapsed unseen and was reclaimed);
        # each attempt must keep its own heartbeats, slot and end.
        self._attempts: dict[int, _Attempt] = {}
        # Tasks of handlers that ignored cancellation, with the lane of the slot each holds
        # until it ends (LaneSlots.abandon); the process cannot wait for them when it exits
        # (abandoned_tasks()).
        self._abandoned_tasks: dict[asyncio.Task[None], Lane | None] = {}
        self._ahead = ClaimAhead(self.config.claim_ahead, self.config.claim_ahead_window)
        self._give_back_timer: asyncio.TimerHandle | None = None
        self._giving_back: set[asyncio.Task[None]] = set()
        self._backlogged: dict[Lane, bool] = {lane: False for lane in Lane}
        self._acks: list[tuple[_Attempt, Completion]] = []
        self._acking: list[tuple[_Attempt, Completion]] = []  # the batch being acknowledged
        self._alone = 0  # items at the head of _acks to send one by one (a refused batch)
        # The last acknowledgement failed (the database took the claims but not the results):
        # no claims until one commits, or results would pile up unacknowledged.
        self._acks_failing = False
        # This clock minus the database's, as the last claim showed (see _claim_into).
        self._db_skew = timedelta(0)
        self._ack_ready = asyncio.Event()
        self._wake = asyncio.Event()
        # Lanes that may hold claimable work: set by the doorbell (its payload is the lane), by
        # a poll or a local timer (all lanes), cleared by a claim that came back short. Empty
        # lanes are not asked again until something says they may have work.
        self._maybe: set[Lane] = set(Lane)
        # Bumped by every hint, so a claim that was in flight while a hint arrived does not
        # clear the lane on the strength of its older snapshot.
        self._hints: dict[Lane, int] = {lane: 0 for lane in Lane}
        self._left_behind: dict[Lane, bool] = {lane: False for lane in Lane}
        # Lanes whose last claim came back short while this runner's own model attempts kept a
        # tier's work out of it: asked again when one of those attempts frees its slot.
        self._short_of_model: set[Lane] = set()
        # The lane whose claim the fill loop awaits now, and the interactive claim started
        # beside it (see _claim_interactive_beside).
        self._claiming_lane: Lane | None = None
        self._claims_full = False  # the last claim that found work got all it asked for
        self._side_claim: asyncio.Task[None] | None = None
        self._stopping = False
        self._stopping_event = asyncio.Event()
        # Set by a local wake-up's timer (a retry's backoff or a deferral ended, a failed claim
        # is due again): the next wake-up asks every lane.
        self._local_woken = False
        # Set when a wake-up may be for deferred work come due (a retry's backoff ended, or the
        # fallback poll): it is made claimable before the claims (message_promote_due).
        self._promote_first = False
        self._last_reclaim = 0.0
        self._resume_task: asyncio.Task[None] | None = None
        self._reclaim_task: asyncio.Task[None] | None = None
        self._resume_again = False
        # The tiers whose waiting work could resume when the pool last said it changed: a
        # resume is asked for when one comes up, not after every model call.
        self._resumable_seen: frozenset[Tier] = frozenset()
        # Counts every change of the pool's room (a model attempt freed its place, the pool
        # changed): a claim that came back short of model room while it moved asks again.
        self._model_room_moves = 0
        # Stages other live runners serve and this one does not: its claims leave them alone.
        self._skip: frozenset[tuple[str, str]] = frozenset()
        self._unserved_seen: set[tuple[str, str]] = set()  # stages whose parking was logged
        # Set by run(): what stops this runner, and whether another runner took its id.
        self._stop: asyncio.Event | None = None
        self._taken_over = False
        self.started_at = self.clock()
        # Read once: reports are fenced by host, pid and start, and a host renamed while the
        # runner runs must not make its own reports look like another runner's.
        self._host = socket.gethostname()
        if inference is not None:
            inference.subscribe(self._inference_changed)

    # -- the main loop ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then drain gracefully."""
        if self.doorbell is not None:
            await self.doorbell.start()
        taken = False
        try:
            info = {**self._info(), "serves": self.registry.served}
            taken = await take_runner_id(self.store, info, stop)
        finally:
            if not taken and self.doorbell is not None:
                with contextlib.suppress(Exception):
                    await self.doorbell.close()
        if not taken:
            return  # stopped while it waited for its id
        self._stop = stop
        await self._share_stages()
        side = [
            asyncio.create_task(self._ack_loop(), name="acks"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeats"),
            asyncio.create_task(self._report_loop(), name="report"),
            asyncio.create_task(self._stop_watch(stop), name="stop-watch"),
        ]
        if self.doorbell is not None:
            side.append(asyncio.create_task(self._doorbell_loop(), name="doorbell"))
        serving = asyncio.create_task(self._serve(stop), name="serve")
        stopped = asyncio.create_task(stop.wait(), name="stop")
        try:
            await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not serving.done():
                # It ends at its next step; a step waiting on a database that does not answer
                # is cancelled after a grace rather than waited out (a pool's timeout is 30 s).
                # A claim cancelled after it committed leaves leases that lapse and are
                # reclaimed.
                await asyncio.wait({serving}, timeout=STOP_GRACE_S)
            if not serving.done():
                log.warning("stopping: the serving loop's database call did not finish in "
                            "%.0f s; cancelled", STOP_GRACE_S)  # fmt: skip
                serving.cancel()
                # Waited for, not awaited: a cancellation of run() itself must not be swallowed.
                await asyncio.wait({serving})
            else:
                serving.result()  # its failure, if any, is this call's
        finally:
            stopped.cancel()
            if not serving.done():  # run() itself was cancelled
                serving.cancel()
            self._mark_stopping()
            # Every step that waits on the database is bounded: with the database down, a
            # stop must still end in about the drain timeout (a service manager kills a stop
            # that takes too long). What is not written lapses and is reclaimed.
            try:
                # The handlers' drain timeout, the last second a cancelled one gets, and
                # seconds for the database's part (a claim in flight, give-backs, releases).
                async with asyncio.timeout(self.config.drain_timeout.total_seconds() + 10.0):
                    await self._drain()
            except TimeoutError:
                log.error("stopping: the drain took too long (database unreachable?); the "
                          "leases left lapse and are reclaimed")  # fmt: skip
            side += [t for t in (self._reclaim_task, self._resume_task) if t is not None]
            for task in side:
                task.cancel()
            # Bounded: a side task that will not finish must not keep the process alive.
            await asyncio.wait(side, timeout=5.0)
            # A claim still in flight at the drain (it waited 10 s for it) may have held more.
            if self._side_claim is not None:
                self._side_claim.cancel()
            try:
                async with asyncio.timeout(5.0):
                    await self._flush_acks()
                    await self._give_back_all_held()
                    with contextlib.suppress(Exception):
                        await self.store.report_runner({**self._info(), "stopped_at": self.clock()})
            except TimeoutError:
                log.error("stopping: could not write the last acknowledgements or give back "
                          "held leases; they lapse and are reclaimed")  # fmt: skip
            if self.doorbell is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(5.0):
                        await self.doorbell.close()
        if self._taken_over:
            raise taken_over(self.config.worker_id)

    async def _serve(self, stop: asyncio.Event) -> None:
        """The main loop: wait for a reason, promote due work when asked, claim into free
        slots; until `stop` is set."""
        # After every (re)start: sweep for work first, then wait. A sweep is not a poll: work
        # found now was not missed by the doorbell.
        await self._resume_waiting()
        await self._resume_stages()
        self._wake.set()
        while not stop.is_set():
            polled = await self._wait_for_reason()
            if stop.is_set():
                break
            if polled:
                self.stats.polls += 1
            if self._promote_first:
                self._promote_first = False
                await self._promote_due()
            claimed = await self._fill(polled)
            if claimed and any(self.slots.free(lane) for lane in CLAIM_ORDER):
                self._wake.set()  # a full claim may have left more behind

    async def _stop_watch(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._mark_stopping()
        self._wake.set()

    def _mark_stopping(self) -> None:
        self._stopping = True
        self._stopping_event.set()  # ends the waits for the cap's room at once

    def _poll_timeout(self) -> float:
        base = self.config.poll_interval.total_seconds()
        jitter = self.config.poll_jitter
        return base * self.rng.uniform(1 - jitter, 1 + jitter)

    async def _wait_for_reason(self) -> bool:
        """Wait for a wake-up; True when it was the fallback poll (nothing else woke us)."""
        polled = False
        if not self._wake.is_set():
            try:
                # asyncio.timeout, not wait_for: on 3.11 wait_for can lose a cancellation that
                # races its inner future, which hung shutdown here.
                async with asyncio.timeout(self._poll_timeout()):
                    await self._wake.wait()
            except TimeoutError:
                polled = True
                self._promote_first = True
                self._hint(*Lane)  # the fallback poll: ask every lane
        if self._local_woken:
            self._local_woken = False
            # A retry's backoff ended: its lane is unknown here, and the maintenance's
            # promoter may not have made it claimable yet (_promote_first is set).
            self._hint(*Lane)
            polled = False
        self._wake.clear()
        return polled

    async def _doorbell_loop(self) -> None:
        assert self.doorbell is not None
        while True:
            try:
                lanes = await self.doorbell.wait(1.0)
                if lanes:
                    self.stats.wakeups_rung += 1
                    self._hint(*lanes)
                    self._wake.set()
                    if Lane.INTERACTIVE in lanes:
                        self._claim_interactive_beside()
            except asyncio.CancelledError:
                raise
            except Exception:  # the doorbell reconnects itself; never let it take the loop down
                log.exception("doorbell failed; relying on the fallback poll")
                await asyncio.sleep(1.0)

    # -- claiming ------------------------------------------------------------------------------

    async def _fill(self, polled: bool) -> int:
        """Claim into every free slot, lane by lane in strict order; returns how many."""
        if self._stopping or self._acks_failing:
            # Not while results cannot be stored: a handler's slot is free as soon as its
            # result is queued, so claims would go on taking work whose results (and leases,
            # lapsing meanwhile) are then lost to a re-run elsewhere. A commit wakes us.
            return 0
        if self._wedged():
            # As many handlers as slots ignore cancellation and run on, each holding its slot
            # (no lane has one free): no claims until one of them ends (which wakes us); the
            # work waits for other runners.
            return 0
        now_mono = time.monotonic()
        if now_mono - self._last_reclaim >= self.config.reclaim_every.total_seconds():
            self._last_reclaim = now_mono
            # Reclaim on the claim path too (bounded): a stalled sweeper must not strand work.
            # Beside the claims, never before them: a reclaim in the way of every 50th wake-up
            # made it the slowest pickup. What it returns to pending is claimed once it ends.
            if self._reclaim_task is None or self._reclaim_task.done():
                self._reclaim_task = asyncio.get_running_loop().create_task(
                    self._reclaim_on_claim_path(), name="reclaim-on-claim-path"
                )
        total = 0
        for lane in CLAIM_ORDER:
            if self._stop_requested() or self._acks_failing:
                # Told to stop, or acknowledgements began to fail, while an earlier lane's
                # claim was in flight.
                break
            # Its claimed-ahead messages first: they were claimed before anything asked now.
            self._start_held(lane)
            free = self.slots.free(lane)
            if free <= 0 or lane not in self._maybe:
                continue
            if lane is Lane.INTERACTIVE and self._side_claim is not None:
                # Claimed beside the last fill, still in flight; it wakes this loop when it
                # ends. Lower lanes wait for it: claimed now, they would take the shared slots
                # its work beyond the reserved ones needs (strict lane order).
                return total
            self._claiming_lane = lane
            try:
                claimed = await self._claim_into(lane, free, polled)
            finally:
                self._claiming_lane = None
            if claimed is None:
                return total
            total += claimed
        return total

    def _stop_requested(self) -> bool:
        """The stop flag, read afresh (a method: checked after an await, where the flag may
        have changed since the last look)."""
        return self._stopping

    def _claim_interactive_beside(self) -> None:
        """An interactive ring while the fill loop awaits another lane's claim: claim for it
        now, beside that claim, rather than after it (a batch claim in flight was most of
        the interactive pickup's tail under a backlog). It claims into the slots reserved
        for interactive work only, held for it while it runs: the claim in flight may fill
        every shared slot."""
        if (
            self._stopping
            or self._acks_failing
            or self._claiming_lane in (None, Lane.INTERACTIVE)
            or self._side_claim is not None
            or (free := self.slots.own_free(Lane.INTERACTIVE)) <= 0
        ):
            return
        asked = min(free, self.config.claim_batch)
        self.slots.take(Lane.INTERACTIVE, asked)

        async def side() -> None:
            try:
                await self._claim_into(Lane.INTERACTIVE, asked, False, reserved=asked)
            finally:
                self._side_claim = None
                self._wake.set()

        self._side_claim = asyncio.get_running_loop().create_task(side(), name="claim-beside")

    async def _claim_into(
        self, lane: Lane, free: int, polled: bool, reserved: int = 0
    ) -> int | None:
        """One claim of `lane` into `free` slots (`reserved` of them held for it already);
        how many messages it started, None when the claim failed."""
        ahead = 0
        if not reserved and self._backlogged[lane]:
            # Only behind a claim that got all it asked for: an idle lane's claim asks for its
            # free slots alone, exactly as without claim-ahead.
            ahead = self._ahead.allowance(lane, self.slots.capacity(lane))
        asked = min(free + ahead, self.config.claim_batch)
        blocked, model_room = self._model_room()
        if model_room is not None:
            # A claim may return model work of any open tier: never more than it can queue.
            asked = max(1, min(asked, model_room))
        hints = self._hints[lane]
        room_moves = self._model_room_moves
        began = time.monotonic()
        try:
            found = await self.store.claim_lane(
                worker=self.config.worker_id,
                lane=lane,
                limit=asked,
                lease=self.config.lease,
                tenant_limit=self.config.tenant_cap,
                now=None,
                blocked_tiers=blocked,
                # Handlers done, outcomes on their way: the database counts them as running
                # until their acknowledgement commits; they do not hold back this claim.
                finished=[c.lease for _, c in self._acks + self._acking],
                # Work that other live runners serve (and this one does not) is theirs.
                skip=self._skip,
            )
        except Exception:
            log.exception("claim failed; retrying on the next wake-up")
            self._schedule_local_wake(1.0)
            return None
        finally:
            self.slots.give(lane, reserved)  # each message claimed takes its slot below
        self._ahead.observe_claim(time.monotonic() - began)
        messages = found.messages
        self._backlogged[lane] = len(messages) >= asked
        if len(messages) < asked and self._hints[lane] == hints:
            self._maybe.discard(lane)
        self._left_behind[lane] = found.left_behind
        if blocked and self.inference is not None and len(messages) < asked:
            # The backlog it reports leaves blocked tiers out: their work may wait here.
            if self._model_room_moves != room_moves:
                # Room came while the claim was out (its blocked tiers were read before): what
                # frees room has been and gone, so ask again now.
                self._hint(lane)
                self._wake.set()
            else:
                self._short_of_model.add(lane)
        if messages:
            # A claim that got all it asked for: a backlog, results arriving claim after claim.
            self._claims_full = len(messages) >= asked
        if messages:
            # How far this machine's clock is from the database's (which stamped the claim):
            # the deadlines a claim returns are the database's, and the handlers' timeouts are
            # measured on this clock.
            self._db_skew = self.clock() - max(m.updated_at for m in messages)
        now = asyncio.get_running_loop().time()
        for message in messages:
            self._hold(message, now)
        # Into the free slots now, in the order claimed, after any held before; the rest wait
        # for slots (or, when stopping, are given back by the drain).
        self._start_held(lane)
        self._arm_give_back()
        self.stats.claimed += len(messages)
        if polled and self.doorbell is not None and self.doorbell.connected:
            missed = [m for m in messages if m.attempts == 1 and m.not_before <= m.created_at]
            if missed:
                self.stats.missed_wakeups += len(missed)
                self.stats.last_missed_wakeup_at = self.clock()
        return len(messages)

    async def _promote_due(self) -> None:
        try:
            await self.store.promote_due(lanes=CLAIM_ORDER, batch=500, now=None)
        except Exception:
            log.exception("promoting due work on the claim path failed")

    async def _reclaim_on_claim_path(self) -> None:
        try:
            reclaimed = await self.store.reclaim_due(batch=20, now=None, backoff=self.retry)
        except Exception:
            log.exception("reclaim on the claim path failed")
            return
        # Each goes back after a retry's backoff: woken for when it is due, as for a failed
        # attempt (neither the doorbell nor the sweeper's promoter may be there to say so).
        for due_in in sorted({round(d, 1) for _, d in reclaimed if d is not None}):
            self._schedule_local_wake(due_in + 0.05)

    def _model_room(self) -> tuple[list[Tier], int | None]:
        """Tiers whose model work must not be claimed now (no room), and the least room left
        among the others (None when no tier limits the claim).

        A runner without a pool blocks every tier: it leaves model work to runners that have
        one. A tier that is down is not blocked: its work is claimed and parked in
        waiting_capability, where it is visible, instead of sitting pending.
        """
        if self.inference is None:
            return list(TIER_ORDER), None
        available = self.inference.available()
        blocked: list[Tier] = []
        rooms: list[int] = []
        for need in TIER_ORDER:
            found = route(_KIND_OF[need], available)
            if found is None:
                continue
            room = min(
                self.inference.capacity(found.tier) - self._model_attempts(found.tier),
                self.inference.room(found.tier),
            )
            if room <= 0:
                blocked.append(need)
            else:
                rooms.append(room)
        return blocked, (min(rooms) if rooms else None)

    def _model_attempts(self, tier: Tier) -> int:
        # Held model work will want the pool too: a claim must not take more than it can queue.
        held = sum(1 for m in self._ahead.messages() if self._tier_of(m) is tier)
        # An attempt waiting for the cap's room uses no place of the pool: work of another lane
        # that the cap admits may be claimed meanwhile.
        return held + sum(
            1
            for a in self._attempts.values()
            if a.tier is tier and not a.slot_free and not a.waiting_for_room
        )

    def _tier_of(self, message: Message) -> Tier | None:
        """The pool tier a message's model work would be routed to now (None: no model work)."""
        if self.inference is None:
            return None
        stage = self.registry.stage(message.pipeline, message.stage)
        if stage is None or stage.tier is None:
            return None
        found = route(stage.task_kind, self.inference.available())
        return found.tier if found is not None else None

    def _hint(self, *lanes: Lane) -> None:
        """These lanes may hold claimable work: ask them at the next fill."""
        for lane in lanes:
            self._maybe.add(lane)
            self._hints[lane] += 1

    def _schedule_local_wake(self, seconds: float) -> None:
        """Wake the loop in `seconds` (a retry's backoff, a deferral): a timer for each, since
        the loop may be waiting out a long poll timeout computed before this was known, and
        every retry must be woken for, not only the earliest."""
        asyncio.get_running_loop().call_later(max(0.0, seconds), self._local_wake_due)

    def _local_wake_due(self) -> None:
        self._local_woken = True
        self._promote_first = True
        self._wake.set()

    def _deadline_of(self, message: Message) -> datetime | None:
        """The attempt's deadline (its run deadline, or its message's if sooner) on this
        runner's clock: the database's time, moved by the skew the last claim showed. Read on
        this clock as it was, a clock ahead of the database's by a stage's maximum runtime
        ended every handler at its first await."""
        run_deadline = message.extra.get("run_deadline")
        candidates = [d for d in (message.deadline, run_deadline) if d is not None]
        return min(candidates) + self._db_skew if candidates else None

    def _hold(self, message: Message, now: float) -> None:
        """Hold a claimed message until a slot frees, with a time by which it must start.

        Its lease counts from the claim (the claim ends it at the run deadline or the
        message's deadline if one comes first) and held work is not heartbeated, so it must
        start within a small share of the lease (and within a heartbeat interval), or go back
        for any runner to claim.
        `now` is the loop's clock. The lease's length is read from the database's own two
        times (its end and the claim's, `updated_at`), never against this machine's clock: one
        ahead of the database's by a lease gave every claimed message no time at all, and the
        runner claimed and gave back without running anything."""
        limit = self.config.heartbeat_every.total_seconds()
        end = message.lease_expires_at
        if end is not None:
            span = (end - message.updated_at).total_seconds()
            limit = min(limit, max(0.0, span * HELD_SHARE_OF_LEASE))
        self._ahead.hold(message, now + limit)

    def _start_held(self, lane: Lane) -> None:
        """Start `lane`'s claimed-ahead messages into its free slots."""
        if self._stopping:
            return
        free = self.slots.free(lane)
        late: list[Message] = []
        now = asyncio.get_running_loop().time()
        while free > 0 and (held := self._ahead.pop(lane)) is not None:
            if held.due <= now:
                # Its time to start is over: it goes back, and its place goes to the next
                # held one (a slot left empty would wait for the give-back's wake-up).
                late.append(held.message)
            else:
                self._start(held.message)  # each start takes one free slot
                free -= 1
        self._spawn_give_back(late)

    def _arm_give_back(self) -> None:
        """Keep one timer at the earliest time a held message must have started by."""
        due = self._ahead.next_due()
        timer = self._give_back_timer
        if timer is not None and (due is None or timer.when() > due):
            timer.cancel()
            self._give_back_timer = timer = None
        if due is not None and timer is None:
            self._give_back_timer = asyncio.get_running_loop().call_at(due, self._give_back_due)

    def _give_back_due(self) -> None:
        self._give_back_timer = None
        due = self._ahead.take_due(asyncio.get_running_loop().time())
        self._spawn_give_back(due)
        self._arm_give_back()

    def _spawn_give_back(self, messages: list[Message]) -> None:
        if messages:
            task = asyncio.get_running_loop().create_task(self._give_back_held(messages))
            self._giving_back.add(task)
            task.add_done_callback(self._giving_back.discard)

    def _start_held_in_order(self) -> None:
        """Start claimed-ahead messages into free slots, lanes in strict order: a lane that may
        hold work and has room stops it there, so held work of a lower lane never takes a slot
        before the claim of a higher one (the fill loop starts it after that claim)."""
        for lane in CLAIM_ORDER:
            self._start_held(lane)
            if lane in self._maybe and self.slots.free(lane) > 0:
                return

    def _start(self, message: Message) -> None:
        self.slots.take(message.lane)
        cancelled = asyncio.Event()
        attempt_ref: list[_Attempt] = []

        async def inferrer(
            request: InferenceRequest, parse: Callable[[str], Any] | None
        ) -> InferenceResult:
            return await self._infer(attempt_ref[0], request, parse)

        async def writer(count: int) -> None:
            await self._reserve_run(attempt_ref[0], {"writes": count})

        context = StageContext(
            message,
            deadline=self._deadline_of(message),
            cancelled=cancelled,
            clock=self.clock,
            inferrer=inferrer if self.inference is not None else None,
            writer=writer,
            context_max_bytes=self.config.context_max_bytes,
        )
        attempt = _Attempt(
            message=message, context=context, cancelled=cancelled, started=time.monotonic()
        )
        attempt_ref.append(attempt)
        attempt.tier = self._tier_of(message)
        for earlier in [a for a in self._attempts.values() if a.message.id == message.id]:
            # Its lease was reclaimed and this claim took the message again: that attempt's
            # writes will be refused, so it stops now rather than run beside this one.
            if earlier.stop_reason is None:
                self._stop_attempt(earlier, AttemptStop.LEASE_LOST)
        self._attempts[attempt.lease.lease_token] = attempt
        attempt.task = asyncio.create_task(self._execute(attempt), name=f"message-{message.id}")

    # -- executing -----------------------------------------------------------------------------

    async def _execute(self, attempt: _Attempt) -> None:
        message = attempt.message
        stage = self.registry.stage(message.pipeline, message.stage)
        try:
            if stage is None:
                # Not skipped, so no live runner said it serves this stage (none runs, or this
                # claim came before its first report): it waits for one, out of every claim's
                # way, instead of failing until dead.
                await self._park_unserved(attempt)
                return
            if stage.tier is not None and self._route_stage(stage) is None:
                # Checked before the run budget: parking does not use up a step.
                await self._park(attempt, stage.task_kind, stage.tier)
                return
            await self._check_run(attempt)
            deadline = attempt.context.deadline
            timeout = None
            if deadline is not None:
                timeout = max(0.0, (deadline - self.clock()).total_seconds())
            limit = asyncio.timeout(timeout)
            try:
                async with limit:
                    # Typed as object: a handler from elsewhere may return anything at run time.
                    result = cast(object, await stage.handler(attempt.context))
            except TimeoutError:
                if not limit.expired():
                    raise
                await self._overran(attempt)
                return
            if not isinstance(result, StageResult):
                await self._broke_contract(
                    attempt,
                    f"handler {message.pipeline}.{message.stage} returned "
                    f"{type(result).__name__}, not a StageResult (use ctx.finish(...))",
                )
                return
            if not isinstance(result.outcome, str) or not NAME_RE.match(result.outcome):
                # Built without ctx.finish: an outcome the database cannot store would fail
                # every acknowledgement sent with it.
                await self._broke_contract(
                    attempt,
                    f"handler {message.pipeline}.{message.stage} returned the outcome "
                    f"{result.outcome!r}, which is not a valid name",
                )
                return
            try:
                result_json = encode_json(result.result, "result")
            except InvalidInput as exc:
                # Failed here, visibly: queued as an acknowledgement it would be refused on
                # every retry while its lease was kept alive.
                await self._broke_contract(
                    attempt,
                    f"handler {message.pipeline}.{message.stage} returned a result that "
                    f"{exc.problem}",
                )
                return
            size = bytes_over(result_json, self.config.context_max_bytes)
            if size is not None:
                # A result becomes the next stage's context: held to the context's limit, here
                # and visibly, rather than handed off past it or refused by the database with
                # the rest of its acknowledgement batch.
                await self._broke_contract(
                    attempt,
                    f"handler {message.pipeline}.{message.stage} returned a result of {size} "
                    f"bytes, over the limit of {self.config.context_max_bytes} bytes (a "
                    "result becomes the next stage's context)",
                )
                return
            if attempt.context.spawned:
                await self._enqueue_spawned(attempt)
            attempt.acked = True
            attempt.acked_at = time.monotonic()
            self._acks.append(
                (attempt, Completion(attempt.lease, result.result, result.outcome, result_json))
            )
            self._ack_ready.set()
            # The slot is free as soon as the handler is: the acknowledgement is in flight on
            # its own connection, and the database still counts the message against its
            # tenant's limit until it commits.
            self._free_slot(attempt)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if attempt.stop_reason is not None or (task is not None and task.cancelling()):
                # Cancelled by us: the message was cancelled, its lease lost, or we are
                # stopping. Nothing to write: the store already knows, or the drain releases it.
                return
            # The handler raised CancelledError of its own accord: a failure like any other,
            # recorded now rather than left to look like a dead worker when its lease lapses.
            await self._fail(attempt, f"handler raised {_describe(asyncio.CancelledError())}")
        except CapabilityUnavailable as exc:
            # No tier allowed to do this work is up: it waits, visibly, and is never sent to a
            # weaker model. Not a failure: the attempt is not counted. It waits for the weakest
            # tier its kind allows (the one that failed may have been an upgrade).
            await self._give_back_step(attempt)
            await self._park(attempt, exc.kind, min_tier(exc.kind))
        except BudgetBusy as exc:
            # The cap has room once the calls in flight settle: try again in a moment.
            await self._give_back_step(attempt)
            await self._defer(attempt, exc.reason)
        except QueueFull as exc:
            # The pool had no room after all (several calls in one handler): not a failure,
            # unless it keeps happening. A handler that always starts more calls at once than
            # the pool has room for was deferred for ever, its sibling calls using the pool
            # each time; after POOL_FULL_DEFERRALS it is a failed attempt like any other.
            await self._give_back_step(attempt)
            try:
                before = await self.store.deferrals(message.id, POOL_FULL)
            except Exception:
                before = 0  # not known: deferred, as before
            if before >= POOL_FULL_DEFERRALS:
                await self._fail(
                    attempt,
                    f"the model pool had no room for this stage's calls {before + 1} times"
                    f" (does it start more calls at once than the pool takes?): {exc}",
                )
            else:
                await self._defer(attempt, f"{POOL_FULL}: {exc}")
        except BudgetHeld as exc:
            # No hold against the monthly cap: it waits for a raised cap or a new month. Never a
            # retry (that would be a storm against a closed cap).
            await self._give_back_step(attempt)
            await self._hold_budget(attempt, exc.reason)
        except BudgetExhausted as exc:
            # The run used up a dimension of its budget: the message ends, naming it.
            await self._terminate(attempt, str(exc))
        except BaseException as exc:
            # Anything a handler raises, KeyboardInterrupt and SystemExit too (raised by a
            # handler, never by a signal: the runner handles those; they would leave the event
            # loop and stop the runner, and every runner that picked the message up after it),
            # and other BaseExceptions (a library's own cancel signal), which were not written
            # down at all: the message ran on until its lease lapsed, blamed on a dead worker.
            # GeneratorExit is the coroutine being closed: nothing may be awaited then.
            if isinstance(exc, GeneratorExit):
                raise
            if attempt.stop_reason == AttemptStop.OVERRUN:
                # Told by a heartbeat that it ran past its deadline, the handler gave up by
                # raising: the attempt ends as an overrun (expired past the message's
                # deadline), not as a failure retried past it.
                await self._overran(attempt)
                return
            text = _describe(exc)
            if isinstance(exc, InvalidInput):
                # The handler refused its input (a context of the wrong shape, a value it
                # cannot take, work it spawns past a limit): the same input fails every
                # attempt, so the message is dead at once, saying why, rather than retried
                # until they run out.
                log.warning(
                    "handler %s.%s refused its input: %s",
                    message.pipeline,
                    message.stage,
                    text[:_LOG_CHARS],
                )
                await self._terminate(attempt, f"handler refused its input: {text}", budget=False)
                return
            log.warning(
                "handler %s.%s failed: %s", message.pipeline, message.stage, text[:_LOG_CHARS]
            )
            await self._fail(attempt, text)
        finally:
            if not attempt.acked:
                self._finish(attempt)

    # -- model work ----------------------------------------------------------------------------

    def _route_stage(self, stage: Stage) -> Route | None:
        if self.inference is None:
            return None
        return route(stage.task_kind, self.inference.available())

    async def _infer(
        self,
        attempt: _Attempt,
        request: InferenceRequest,
        parse: Callable[[str], Any] | None = None,
    ) -> InferenceResult:
        """One model call of a handler: routed, bounded by the stage, recorded on the message."""
        assert self.inference is not None
        message = attempt.message
        found = route(request.kind, self.inference.available())
        if found is None:
            raise CapabilityUnavailable(request.kind, min_tier(request.kind))
        control = CallControl(cancel=attempt.cancelled)
        deadline = attempt.context.deadline
        if deadline is not None:
            # The stage bounds the call, leaving room to persist the result.
            left = (deadline - self.clock() - self.config.persist_margin).total_seconds()
            if left <= 0:
                raise DeadlineExceeded("no time left in the stage for a model call")
            control.start_deadline = time.monotonic() + left
            control.timeout = left
            # An end, not a length: time queued in the pool comes out of it, or the call ran
            # past the stage's margin and the stage's own timeout ended it as an overrun.
            control.finish_by = control.start_deadline
        info = self.inference.describe(found.tier)
        if info is None:
            raise CapabilityUnavailable(request.kind, found.min_tier)
        admission: Admission | None = None
        if self.governor is not None:
            pipeline = self.registry.pipeline(message.pipeline)
            stage = self.registry.stage(message.pipeline, message.stage)
            # A wait for the cap's room may take half the stage's time left, no more: the call
            # needs the rest (deferred, its stage starts afresh).
            wait_until = None
            if control.start_deadline is not None:
                wait_until = time.monotonic() + (control.start_deadline - time.monotonic()) / 2

            def waiting(now_waiting: bool) -> None:
                attempt.waiting_for_room = now_waiting

            admission = await self.governor.admit(
                message,
                budget=pipeline.budget if pipeline is not None else None,
                verification=bool(stage and stage.verification),
                request=request,
                route=found,
                model=info,
                wait_until=wait_until,
                waiting=waiting,
                stopping=self._stopping_event,
            )
            if control.start_deadline is not None:
                # The wait for the cap's room came out of the stage's time.
                control.timeout = max(control.start_deadline - time.monotonic(), 0.001)
            # The pool stops the generation before its metered energy passes what the hold
            # paid for, so the call settles within its hold even when the joules-per-token
            # figure behind the estimate is too low.
            control.energy_limit = float(admission.estimate.joules)
        status, error, result = "ok", None, None
        energy: float | None = None
        provenance: str | None = None
        used_tokens = (0, 0)  # (prompt, completion) of a call stopped part way
        usage_unknown = False
        try:
            result = await self.inference.infer(request, found.tier, control)
            energy, provenance = result.energy_joules, result.energy_provenance
            try:
                data = parse(result.text) if parse is not None else None
            except OutputInvalid as exc:
                if result.finish_reason != ENERGY_LIMIT:
                    raise
                raise OutputInvalid(
                    f"{exc} (the answer was cut at the energy its hold paid for: the model's "
                    "joules-per-token figure is too low; run `appliance energy calibrate`)"
                ) from exc
            return dataclasses.replace(result, route=found, data=data)
        except BaseException as exc:
            status, error = _call_status(exc)
            if isinstance(exc, InferenceError):
                energy, provenance = exc.energy_joules, exc.energy_provenance
                used_tokens = (exc.prompt_tokens or 0, exc.completion_tokens or 0)
            # Our task was cancelled (lease lost, overrun, shutdown) while the call was out:
            # what it used is not known here, so it is charged its whole reservation.
            # Or the meter failed around it: what it used is not known either way.
            usage_unknown = isinstance(exc, asyncio.CancelledError) or (
                isinstance(exc, InferenceError) and exc.unmetered
            )
            raise
        finally:
            if admission is not None and self.governor is not None:
                try:
                    await self.governor.settle(
                        message,
                        admission,
                        energy_joules=energy,
                        provenance=provenance,
                        completion_tokens=result.completion_tokens if result else used_tokens[1],
                        prompt_tokens=result.prompt_tokens if result else used_tokens[0],
                        failed=result is None,
                        usage_unknown=usage_unknown,
                        cut=result is not None and result.finish_reason == ENERGY_LIMIT,
                    )
                except Exception:
                    # The hold stays reserved; the reclaimer releases it once the lease is gone.
                    log.exception("could not settle the spend of message %s", message.id)
            record = CallRecord(
                message_id=message.id,
                tenant=message.tenant,
                pipeline=message.pipeline,
                stage=message.stage,
                kind=request.kind,
                tier=found.tier,
                min_tier=found.min_tier,
                route_reason=found.reason,
                model=result.model if result else info.model,
                model_sha256=result.model_sha256 if result else info.sha256,
                status=status,
                error=error,
                prompt_tokens=result.prompt_tokens if result else used_tokens[0],
                completion_tokens=result.completion_tokens if result else used_tokens[1],
                queue_seconds=result.queue_seconds if result else 0.0,
                ttft_seconds=result.ttft_seconds if result else 0.0,
                total_seconds=result.total_seconds if result else 0.0,
            )
            try:
                await self.store.record_call(record)
            except Exception:
                log.exception("could not record a model call of message %s", message.id)

    async def _check_run(self, attempt: _Attempt) -> None:
        """Before a stage runs: the hop limit, then one step of its run's budget."""
        message = attempt.message
        pipeline = self.registry.pipeline(message.pipeline)
        budget = pipeline.budget if pipeline is not None else None
        max_hops = self.config.max_hops
        if budget is not None and budget.max_hops is not None:
            max_hops = min(max_hops, budget.max_hops)
        if message.hops > max_hops:
            raise BudgetExhausted("hops", f"{message.hops} hand-offs, limit {max_hops}")
        if budget is not None and self.governor is not None:
            stage = self.registry.stage(message.pipeline, message.stage)
            await self.governor.reserve_steps(
                message, budget, verification=bool(stage and stage.verification), ask={"steps": 1}
            )
            attempt.step_reserved = True

    async def _give_back_step(self, attempt: _Attempt) -> None:
        """An attempt that waits instead of working does not use up a step of its run."""
        if not attempt.step_reserved or self.governor is None:
            return
        attempt.step_reserved = False
        message = attempt.message
        try:
            await self.governor.spend.run_adjust(
                tenant=message.tenant,
                source=message.source,
                source_id=message.source_id,
                delta={"steps": -1},
            )
        except Exception:
            log.exception("could not give back a step of message %s", message.id)

    async def _reserve_run(self, attempt: _Attempt, ask: dict[str, object]) -> None:
        message = attempt.message
        pipeline = self.registry.pipeline(message.pipeline)
        if pipeline is None or pipeline.budget is None or self.governor is None:
            return
        stage = self.registry.stage(message.pipeline, message.stage)
        await self.governor.reserve_steps(
            message, pipeline.budget, verification=bool(stage and stage.verification), ask=ask
        )

    async def _enqueue_spawned(self, attempt: _Attempt) -> None:
        """Follow-up work, enqueued before the completion is acknowledged, while the attempt's
        lease holds (a retried attempt finds its keys taken and enqueues nothing twice)."""
        message = attempt.message
        requests = [
            # Keyed by the bus itself, in its derived namespace (run, "stage#spawn:key"), which
            # a caller's explicit key may not take: set after the caller-facing checks.
            dataclasses.replace(
                EnqueueRequest.build(
                    tenant=message.tenant,
                    pipeline=message.pipeline,
                    stage=spawn.stage,
                    source=message.source,
                    source_id=message.source_id,  # the same run, the same run budget
                    directive=spawn.directive or message.directive,
                    context=spawn.context,
                    hops=message.hops + 1,
                    context_max_bytes=self.config.context_max_bytes,
                ),
                idempotency_key=idempotency_key(
                    message.source, message.source_id, f"{spawn.stage}#spawn:{spawn.key}"
                ),
            )
            for spawn in attempt.context.spawned
        ]
        # Under the attempt's lease: one cancelled (or lost) while its handler ran spawns
        # nothing; its completion is refused as late.
        if not await self.store.enqueue_spawned(
            attempt.lease,
            requests,
            retention=self.config.idempotency_retention,
            default_max_attempts=self.config.max_attempts,
        ):
            log.info("message %s: its lease is gone; the work it spawned is not enqueued",
                     message.id)  # fmt: skip

    async def _hold_budget(self, attempt: _Attempt, reason: str) -> None:
        if self.governor is None:
            return
        attempt.settling = True
        try:
            held = await self.governor.spend.hold_budget(
                attempt.lease,
                reason=reason,
                expires_at=self.clock() + self.config.budget_hold_max,
                actor=self.config.worker_id,
                now=None,
            )
            if held:
                self.stats.held_budget += 1
        except Exception:
            log.exception("could not hold message %s for budget", attempt.message.id)

    async def _defer(self, attempt: _Attempt, reason: str) -> None:
        attempt.settling = True
        # Jittered, so deferred messages do not come back in step.
        delay = self.config.budget_busy_delay * self.rng.uniform(1.0, 2.0)
        try:
            if await self.store.defer(
                attempt.lease, delay=delay, reason=reason, actor=self.config.worker_id, now=None
            ):
                self.stats.deferred += 1
                self._schedule_local_wake(delay.total_seconds())
        except Exception:
            log.exception("could not defer message %s", attempt.message.id)

    async def _terminate(self, attempt: _Attempt, reason: str, *, budget: bool = True) -> None:
        """End the message for good (dead, never retried): its run's budget is used up
        (`budget`), or its handler refused its input."""
        attempt.settling = True
        try:
            if await self.store.terminate(
                attempt.lease, reason=reason, actor=self.config.worker_id, now=None
            ):
                if budget:
                    self.stats.budget_exhausted += 1
                else:
                    self.stats.failed += 1
        except Exception:
            log.exception("could not end message %s (%s)", attempt.message.id, reason)

    async def _park(self, attempt: _Attempt, kind: str, tier: Tier) -> None:
        attempt.settling = True
        now = self.clock()
        expires = now + self.config.capability_wait
        try:
            parked = await self.store.wait_capability(
                attempt.lease,
                tier=tier,
                expires_at=expires,
                reason=f"waiting_capability: no {tier.value} model up for {kind!r} "
                f"(never downgraded; waits until {expires.isoformat(timespec='seconds')})",
                actor=self.config.worker_id,
                now=None,
            )
        except Exception:
            log.exception("could not park message %s; its lease will lapse", attempt.message.id)
            return
        if parked:
            self.stats.parked += 1
            # The tier may have come back while we parked (its change seen before this park
            # committed): look again.
            if self.inference is not None and tier in resumable(self.inference.available()):
                self._hint(*Lane)
                self._wake.set()
                self._resume_soon()

    async def _park_unserved(self, attempt: _Attempt) -> None:
        attempt.settling = True
        message = attempt.message
        wait = self.config.stage_wait
        try:
            took = await self.store.wait_stage(
                attempt.lease,
                pipeline=message.pipeline,
                stage=message.stage,
                wait=wait,
                reason=f"waiting for a runner that serves {message.pipeline}.{message.stage}"
                f" (no live runner does; for {_span(wait)} at most)",
                actor=self.config.worker_id,
                now=None,
            )
        except Exception:
            log.exception("could not park message %s; its lease will lapse", message.id)
            return
        if took == "pending":
            # A runner that serves the stage started since this claim: given back to it, and
            # this runner leaves the stage alone from now (before the doorbell of the give-back
            # wakes it), and learns the rest of that runner's stages.
            self.stats.released += 1
            self._skip = self._skip | {(message.pipeline, message.stage)}
            await self._share_stages()
        elif took is not None:
            self.stats.parked_unserved += 1
            key = (message.pipeline, message.stage)
            if key not in self._unserved_seen:
                # Once per stage: a backlog of it would otherwise log a line per message.
                self._unserved_seen.add(key)
                log.warning(
                    "no live runner serves %s.%s: its work waits, parked, for one that does"
                    " (message %s first)",
                    message.pipeline,
                    message.stage,
                    message.id,
                )

    async def _share_stages(self) -> None:
        """Learn which stages other live runners serve (this runner's claims skip those it
        does not serve itself)."""
        try:
            elsewhere = await self.store.stages_elsewhere(self.config.worker_id, now=None)
        except Exception:
            log.exception("could not read the stages other runners serve")
            return
        self._skip = elsewhere - self.registry.served
        # A stage served again, and later not, is logged again when its work is parked.
        self._unserved_seen -= elsewhere

    async def _resume_stages(self) -> None:
        """Resume work parked until a runner serves one of this runner's stages."""
        if self._stopping:
            return  # it would not be claimed here, and others still leave it to this runner
        try:
            n = await self.store.resume_stages(
                self.registry.served, actor=self.config.worker_id, batch=500, now=None
            )
        except Exception:
            log.exception("could not resume work waiting for this runner's stages")
            return
        if n:
            self.stats.resumed += n
            log.info("resumed %d messages waiting for a runner of their stage", n)

    def _inference_changed(self) -> None:
        """The pool's availability or room changed (a model call ended, a tier came up or
        went down). A tier that came up: waiting work resumes and every lane is asked. Room
        only: the lanes whose claims left model work behind for want of it are asked again
        (without a resume statement and an empty claim per lane after every model call)."""
        self._model_room_moves += 1
        if self._reask_short_of_model():
            self._wake.set()
        if self.inference is None:
            return
        now = resumable(self.inference.available())
        came_up = now - self._resumable_seen
        self._resumable_seen = now
        if not came_up:
            return
        self._hint(*Lane)
        self._wake.set()
        self._resume_soon()

    def _resume_soon(self) -> None:
        """Resume work waiting for a tier that is up, in a task of its own (one at a time)."""
        if self._stopping:
            return  # the pools are closing; the next runner resumes what waits
        if self._resume_task is None or self._resume_task.done():
            self._resume_task = asyncio.get_running_loop().create_task(
                self._resume_waiting(), name="resume-capability"
            )
        else:
            self._resume_again = True

    async def _resume_waiting(self) -> None:
        if self.inference is None:
            return
        while True:
            self._resume_again = False
            tiers = sorted(resumable(self.inference.available()), key=lambda t: t.rank)
            if tiers:
                try:
                    n = await self.store.resume_capability(
                        tiers, actor=self.config.worker_id, batch=500, now=None
                    )
                    if n:
                        self.stats.resumed += n
                        log.info("resumed %d messages waiting for %s", n, tiers)
                except Exception:
                    log.exception("could not resume messages waiting for a model tier")
            if not self._resume_again:
                return

    async def _overran(self, attempt: _Attempt) -> None:
        attempt.settling = True
        message = attempt.message
        now = self.clock()
        # The skew on this side: a deadline near the calendar's end plus a skew is no date
        # (OverflowError), and the attempt failed with that instead of its overrun.
        if message.deadline is not None and now - self._db_skew >= message.deadline:
            with contextlib.suppress(Exception):
                await self.store.expire_running(
                    attempt.lease, reason="deadline_passed", actor=self.config.worker_id, now=None
                )
            return
        await self._fail(attempt, "exceeded the stage's maximum runtime")

    async def _broke_contract(self, attempt: _Attempt, error: str) -> None:
        """The handler returned what no acknowledgement can carry (not a StageResult, an
        outcome that is not a name, a result that is not JSON or is over the context limit).
        The same code returns the same on every attempt: the message is dead at once, saying
        why, and can be redriven once the handler is fixed. Retried, each attempt ran its
        handler again (its model calls, its electricity) to fail alike."""
        message = attempt.message
        log.warning(
            "handler %s.%s broke its contract: %s",
            message.pipeline,
            message.stage,
            error[:_LOG_CHARS],
        )
        await self._terminate(attempt, error, budget=False)

    async def _fail(self, attempt: _Attempt, error: str) -> None:
        attempt.settling = True
        try:
            delay = self.retry.delay(attempt.message.attempts, self.rng)
            outcome = await self.store.fail(
                attempt.lease,
                error=error,
                retry_delay=delay,
                actor=self.config.worker_id,
                now=None,
            )
            if outcome in (FailOutcome.STALE, FailOutcome.CANCELLED):
                # Not this attempt's to record any more: its lease went, or it was cancelled.
                self.stats.late_acks += 1
                return
            self.stats.failed += 1
            if outcome is FailOutcome.RETRY:
                self._schedule_local_wake(delay.total_seconds())
        except Exception:
            # The lease will lapse and the reclaimer will retry the message.
            log.exception("could not record the failure of message %s", attempt.message.id)

    def _free_slot(self, attempt: _Attempt, *, abandoned: bool = False) -> None:
        """The attempt no longer runs in its slot: given back, or, when its handler was given
        up on (`abandoned`), held by its task as an abandoned one until that ends."""
        if not attempt.slot_free:
            attempt.slot_free = True
            lane = attempt.message.lane
            if abandoned:
                # Moved to the shared slots where they have room: what its lane's reserve
                # gains, the shared slots lose (no lane may start more than before).
                self.slots.abandon(lane)
            else:
                self.slots.give(lane)
            self._ahead.observe_busy(lane, time.monotonic() - attempt.started)
            self._start_held_in_order()
            # Claim into the slot for any lane that may hold work and can use it (the shared
            # slots serve every lane: a finished batch message makes room for interactive work
            # that rang while all slots were busy). A lane whose last claim came back short is
            # not asked again here: if its tenants were at their limit, the database still
            # counts this attempt until its outcome commits, and _finish asks again then.
            if attempt.tier is not None:
                # Model work a claim left for want of room in the pool: room now (this
                # attempt's place), and nothing else (doorbell, backlog) would ask again
                # before the fallback poll.
                self._model_room_moves += 1
                self._reask_short_of_model()
            if any(self.slots.free(lane) > 0 for lane in self._maybe):
                self._wake.set()

    def _reask_short_of_model(self) -> bool:
        """Ask again the lanes whose last claim left model work behind for want of room in
        the pool; whether there were any."""
        if not self._short_of_model:
            return False
        self._hint(*self._short_of_model)
        self._short_of_model.clear()
        return True

    def _finish(self, attempt: _Attempt) -> None:
        if self._attempts.pop(attempt.lease.lease_token, None) is not None:
            self._free_slot(attempt)
            # Its outcome is committed: the tenant's running count in the database went down
            # too, so work that a lane's last claim left behind (a tenant at its limit) may be
            # claimable now, in any lane: the limit counts the tenant's work in all of them. A
            # lane whose last claim left nothing waits for the doorbell: an empty claim after
            # every message would occupy the loop when the next one rings.
            behind = [lane for lane, left in self._left_behind.items() if left]
            if behind:
                self._hint(*behind)
                self._wake.set()

    # -- acknowledgements ------------------------------------------------------------------------

    async def _ack_loop(self) -> None:
        linger = self.config.ack_linger.total_seconds()
        while True:
            await self._ack_ready.wait()
            if (
                linger > 0
                and len(self._acks) < self.config.claim_batch
                and self._claims_full
                and (self._claiming_lane is not None or self._side_claim is not None)
            ):
                # Under a backlog, with a claim in flight: its messages' results follow within
                # about a round trip. Waiting for them makes one statement of two (each costs a
                # commit, a trigger pass and a slice of the CPU the claims need). A runner
                # without a backlog acknowledges at once.
                await asyncio.sleep(linger)
            await self._flush_acks()

    def _acks_answered(self) -> None:
        """The database answered an acknowledgement: if they were failing, claim again."""
        if self._acks_failing:
            self._acks_failing = False
            log.info("acknowledgements are answered again; claiming again")
            self._hint(*Lane)
            self._wake.set()

    async def _flush_acks(self) -> None:
        self._ack_ready.clear()
        while self._acks:
            # After a batch was refused as data, its items go one by one (self._alone of them,
            # at the head of the queue), so that only the refused one fails.
            alone = self._alone > 0
            if alone:
                batch, self._acks = self._acks[:1], self._acks[1:]
                self._alone -= 1
            else:
                batch, self._acks = self._acks, []
            self._acking = batch
            try:
                outcomes = await self.store.complete(
                    [c for _, c in batch], actor=self.config.worker_id, now=None
                )
            except asyncio.CancelledError:
                # Stopping with this batch in flight: it goes back, for the drain's last flush
                # (acknowledging twice is harmless: the second is answered applied, by the first).
                self._acks = batch + self._acks
                self._alone += alone
                raise
            except (RowBusy, InvalidInput) as exc:
                # The database answered (claims may go on: a lone result left behind has no
                # later commit to say so), but not for this whole batch: retried whole, it
                # would fail again, and every result queued after it with it. Its items go one
                # by one, so that only the one at fault is held back:
                # - RowBusy: a row another session holds in an open transaction (an
                #   operator's SELECT ... FOR UPDATE); that result is tried again after the
                #   others, until the session lets go.
                # - InvalidInput: a result refused as data, never worth sending again: that
                #   attempt fails.
                self._acks_answered()
                if len(batch) > 1:
                    self._acks = batch + self._acks
                    self._alone = len(batch)
                    continue
                ((attempt, _),) = batch
                if isinstance(exc, RowBusy):
                    log.warning(
                        "message %s: its row is locked by another session; its result waits",
                        attempt.message.id,
                    )
                    self._acks = self._acks + batch
                    if len(self._acks) == 1:
                        await asyncio.sleep(0.5)
                    continue
                log.error("message %s: its result was refused: %s", attempt.message.id, exc)
                await self._fail(attempt, f"its result could not be stored: {exc.problem}")
                self._finish(attempt)
                continue
            except Exception:
                log.exception("acknowledging %d results failed; retrying", len(batch))
                self._acks = batch + self._acks
                self._alone += alone
                self._acks_failing = True
                await asyncio.sleep(0.5)
                continue
            finally:
                self._acking = []
            self._acks_answered()
            for (attempt, _), outcome in zip(batch, outcomes, strict=True):
                if outcome is AckOutcome.APPLIED:
                    self.stats.completed += 1
                else:
                    self.stats.late_acks += 1
                self._finish(attempt)

    # -- heartbeats ---------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        every = self.config.heartbeat_every.total_seconds()
        pause = every
        while True:
            await asyncio.sleep(pause)
            pause = every
            try:
                if await self._heartbeat_once():
                    # Leases whose rows another statement held: not extended. Asked again
                    # soon rather than a third of a lease later: a lock held that long (an
                    # operator's open transaction) would otherwise let them lapse.
                    pause = min(every, BUSY_REBEAT_S)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("heartbeat failed; leases may lapse and be reclaimed")

    async def _heartbeat_once(self) -> int:
        """Extend the leases of the attempts running; stop those the answers say must stop.
        Returns how many leases were not extended because another statement held their rows
        (they still run)."""
        now = time.monotonic()
        for attempt in list(self._attempts.values()):
            if attempt.hard_cancel_at is not None and now >= attempt.hard_cancel_at:
                self._abandon(attempt)
        # Results waiting for their acknowledgement longer than a heartbeat's period (it keeps
        # failing) keep their leases too: lapsed, the message would be reclaimed and run again
        # elsewhere while its result waits here. Acknowledged within the period (as always
        # when the database answers), they are left alone.
        every = self.config.heartbeat_every.total_seconds()
        live = [
            a
            for a in self._attempts.values()
            if a.stop_reason is None
            and not a.settling
            and (not a.acked or now - a.acked_at >= every)
        ]
        if not live:
            return 0
        results = await self.store.heartbeat_many(
            [a.lease for a in live], extend=self.config.lease, now=None
        )
        busy = 0
        for attempt, beat in zip(live, results, strict=True):
            if beat.outcome is AckOutcome.APPLIED and beat.lease_expires_at is None:
                busy += 1
            if beat.outcome is AckOutcome.APPLIED or attempt.acked or attempt.settling:
                # An acknowledged attempt's handler has ended: its acknowledgement reports
                # what became of it (a lease lost meanwhile makes it late). One that began its
                # own end while the heartbeat was out was found by it, not lost.
                continue
            reason = {
                AckOutcome.CANCELLED: AttemptStop.CANCELLED,
                AckOutcome.OVERRUN: AttemptStop.OVERRUN,
            }.get(beat.outcome, AttemptStop.LEASE_LOST)
            self._stop_attempt(attempt, reason)
        return busy

    def _stop_attempt(self, attempt: _Attempt, reason: str) -> None:
        attempt.stop_reason = reason
        attempt.context.cancel_reason = reason
        attempt.cancelled.set()
        log.info("message %s: stopping its handler (%s)", attempt.message.id, reason)
        if reason == AttemptStop.LEASE_LOST and attempt.task is not None:
            # Its writes would be refused anyway: stop now; the slot is freed when the task
            # ends, or after the grace if it ignores the cancellation (_abandon).
            attempt.task.cancel()
        # Cooperative first: the handler sees ctx.cancelled; after the grace, we cancel it.
        # At the grace's end itself, not at the first heartbeat tick after it (up to a third
        # of a lease later); the tick still checks, should this timer be lost.
        grace = self.config.cancel_grace.total_seconds()
        attempt.hard_cancel_at = time.monotonic() + grace
        asyncio.get_running_loop().call_later(grace, self._hard_cancel_due, attempt)

    def _hard_cancel_due(self, attempt: _Attempt) -> None:
        due = attempt.hard_cancel_at
        if due is not None and time.monotonic() >= due:
            self._abandon(attempt)

    def _abandon(self, attempt: _Attempt) -> None:
        attempt.hard_cancel_at = None
        if attempt.task is None or attempt.task.done():
            return
        attempt.task.cancel()
        # A handler that honours the cancellation ends at its next await and frees its slot
        # itself; one that ignores it is given up on a moment later.
        asyncio.get_running_loop().call_later(ABANDON_AFTER_S, self._give_up, attempt)

    def _give_up(self, attempt: _Attempt) -> None:
        task = attempt.task
        if task is None or task.done() or attempt.lease.lease_token not in self._attempts:
            return
        # Whatever stopped it (cancelled, lease lost, overrun): the handler ignores
        # cancellation and keeps its task. The attempt ends here (the database already has
        # its outcome, cancelled, or will: the reclaimer), but the task still uses what the
        # concurrency promises (CPU, the model pool, memory): it holds a slot until it ends,
        # so that running and abandoned handlers together never outnumber the slots. It used
        # to give its slot back: with 8 slots, 7 abandoned ran beside 8 new ones.
        self.stats.abandoned += 1
        # (None: its slot was free already, its handler having returned; never seen, since
        # its task then ends in the same step.)
        self._abandoned_tasks[task] = None if attempt.slot_free else attempt.message.lane
        self._free_slot(attempt, abandoned=True)
        task.add_done_callback(self._abandoned_ended)  # kept only while it runs
        if self._wedged():
            log.error(
                "%d handlers ignore cancellation and run on (the last: %s.%s); no claims until"
                " one of them ends",
                len(self._abandoned_tasks),
                attempt.message.pipeline,
                attempt.message.stage,
            )
        self._finish(attempt)

    def _wedged(self) -> bool:
        """Abandoned handlers hold every slot: the runner claims no more."""
        return self.slots.abandoned_total >= self.config.concurrency

    def _abandoned_ended(self, task: asyncio.Task[None]) -> None:
        was_wedged = self._wedged()
        if task not in self._abandoned_tasks:
            return
        lane = self._abandoned_tasks.pop(task)
        if lane is not None:
            self.slots.abandoned_ended(lane)  # its slot is free now
        if was_wedged:
            log.info("an abandoned handler ended; claiming again")
        # Its slot may serve any lane (the shared slots serve them all): held work first,
        # then a claim of every lane, as when a runner's claims had stopped for it.
        self._start_held_in_order()
        self._hint(*Lane)
        self._wake.set()

    def abandoned_tasks(self) -> list[asyncio.Task[None]]:
        """Handler tasks that ignored cancellation and are still running."""
        return list(self._abandoned_tasks)

    # -- shutdown -------------------------------------------------------------------------------

    async def _give_back_held(self, messages: list[Message]) -> None:
        """Give claimed-ahead messages back without counting an attempt: they never ran."""
        if not messages:
            return
        try:
            given = await self.store.release(
                [m.lease for m in messages], actor=self.config.worker_id, now=None
            )
        except Exception:
            log.exception("could not give back %d claimed-ahead leases; they lapse", len(messages))
            return
        self.stats.released += given
        self.stats.given_back_ahead += given
        self._hint(*{m.lane for m in messages})
        self._wake.set()

    async def _give_back_all_held(self) -> None:
        if self._give_back_timer is not None:
            self._give_back_timer.cancel()
            self._give_back_timer = None
        await self._give_back_held(self._ahead.take_all())
        if self._giving_back:
            await asyncio.wait(list(self._giving_back), timeout=5.0)

    async def _flush_acks_for(self, seconds: float) -> None:
        """Acknowledge the results waiting, trying for at most `seconds` (those left stay
        queued: cancelled mid-statement, a batch goes back to the queue)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._flush_acks()

    async def _drain(self) -> None:
        if self._side_claim is not None:
            # A claim in flight holds what it returns (nothing starts while stopping).
            await asyncio.wait([self._side_claim], timeout=10.0)
        await self._give_back_all_held()
        tasks = [a.task for a in self._attempts.values() if a.task is not None]
        if tasks:
            log.info("draining %d running handlers", len(tasks))
            await asyncio.wait(tasks, timeout=self.config.drain_timeout.total_seconds())
        # Bounded: while acknowledgements fail (it retries them until they commit), the
        # handlers still running were never stopped nor their leases given back, and ran on
        # after the runner had stopped. The results left are tried again below and last.
        await self._flush_acks_for(DRAIN_ACK_S)
        left = [a for a in self._attempts.values() if not a.acked]
        if not left:
            return
        for attempt in left:
            attempt.stop_reason = AttemptStop.SHUTDOWN
            attempt.cancelled.set()
            if attempt.task is not None:
                attempt.task.cancel()
        pending = [a.task for a in left if a.task is not None and not a.task.done()]
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        # A handler may still have returned in that last second: its result wins.
        await self._flush_acks_for(DRAIN_ACK_S)
        left = [a for a in left if not a.acked]
        leases = [a.lease for a in left]
        try:
            released = await self.store.release(leases, actor=self.config.worker_id, now=None)
            self.stats.released += released
            log.info("gave back %d leases without counting an attempt", released)
        except Exception:
            log.exception("could not give back leases; they will lapse and be reclaimed")
        for attempt in left:
            self._finish(attempt)

    # -- reporting ------------------------------------------------------------------------------

    def _info(self) -> dict[str, Any]:
        return {
            "id": self.config.worker_id,
            "host": self._host,
            "pid": os.getpid(),
            "started_at": self.started_at,
            # The database's clock: liveness (which stages other runners skip) is judged by
            # it, and a runner whose clock is behind must not look gone.
            "seen_at": None,
            "listener_connected": bool(self.doorbell and self.doorbell.connected),
            "last_missed_wakeup_at": self.stats.last_missed_wakeup_at,
            "missed_wakeups": self.stats.missed_wakeups,
            "claimed": self.stats.claimed,
            "completed": self.stats.completed,
            "failed": self.stats.failed,
            "stats": {
                "running": {lane.value: n for lane, n in self.slots.running.items()},
                # Handlers given up on that run on: each holds one of the `concurrency` slots.
                "abandoned_running": {lane.value: n for lane, n in self.slots.abandoned.items()},
                "concurrency": self.config.concurrency,
                "claimed_ahead": len(self._ahead),
                "given_back_ahead": self.stats.given_back_ahead,
                "late_acks": self.stats.late_acks,
                "released": self.stats.released,
                "abandoned": self.stats.abandoned,
                "wakeups_rung": self.stats.wakeups_rung,
                "polls": self.stats.polls,
                "parked": self.stats.parked,
                "parked_unserved": self.stats.parked_unserved,
                "held_budget": self.stats.held_budget,
                "deferred": self.stats.deferred,
                "budget_exhausted": self.stats.budget_exhausted,
                "resumed": self.stats.resumed,
                "inference": self.inference.stats() if self.inference is not None else None,
            },
        }

    def _displaced(self) -> None:
        """Another runner has taken this one's id (this one was silent past RUNNER_ALIVE and
        taken as gone): it stops, as on SIGTERM, and run() then raises RunnerIdInUse, rather
        than serve under an id whose stages are now another's."""
        log.error(
            "runner id %s has been taken over by another runner (this one did not report "
            "for %.0f s and was taken as gone); stopping",
            self.config.worker_id,
            RUNNER_ALIVE.total_seconds(),
        )
        self._taken_over = True
        if self._stop is not None:
            self._stop.set()

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.report_every.total_seconds())
            try:
                if not await self.store.report_runner(self._info()):
                    self._displaced()
                    return
                # Work parked by any runner resumes here too once a tier it waits for is up,
                # or once this runner serves its stage; and the stages other runners serve
                # are learnt afresh (one started or stopped).
                if self.inference is not None:
                    await self._resume_waiting()
                await self._share_stages()
                await self._resume_stages()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("could not report runner health")
