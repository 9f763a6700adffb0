"""Ports: the Protocols the bus talks to. Adapters (db/) implement them; nothing here does I/O."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from enum import StrEnum
from typing import Any, Protocol

from appliance.domain.budget import Refusal
from appliance.domain.envelope import (
    EnqueueRequest,
    EnqueueResult,
    JSONValue,
    Lane,
    LeaseRef,
    Message,
    MessageStatus,
)
from appliance.domain.inference import CallRecord, Tier
from appliance.domain.retry import RetryPolicy


class AckOutcome(StrEnum):
    """What a fenced write of a worker did."""

    APPLIED = "applied"
    STALE = "stale"  # the lease was reclaimed or replaced: nothing changed
    CANCELLED = "cancelled"  # the message was cancelled while running: nothing changed
    OVERRUN = "overrun"  # the attempt reached its hard maximum runtime: the lease will lapse


class FailOutcome(StrEnum):
    """Where a failed attempt went."""

    RETRY = "retry"
    DEAD = "dead"
    STALE = "stale"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class HeartbeatResult:
    """A heartbeat's answer: keep going (with the new expiry), or stop because of `outcome`."""

    outcome: AckOutcome
    lease_expires_at: datetime | None = None

    @property
    def keep_going(self) -> bool:
        return self.outcome is AckOutcome.APPLIED


@dataclass(frozen=True)
class LaneClaim:
    """What one claim of a lane leased, and whether it left claimable work behind (a tenant
    at its limit, rows another claimer held): a runner asks the lanes again when its own work
    finishes only then, and otherwise waits for the doorbell."""

    messages: list[Message]
    left_behind: bool


@dataclass(frozen=True)
class Completion:
    """One successful result to record under a lease (batched acknowledgements).

    The outcome picks the next stage of the message's pipeline (`stage_routes`).
    """

    lease: LeaseRef
    result: JSONValue = None
    outcome: str = "ok"
    # The result as encode_json's text, when the caller has it already (the runner validates
    # every result before queueing it): encoded once, not twice.
    result_json: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ExpireLimits:
    """How long pending work may wait per lane before it is expired (None: no limit)."""

    max_queue_age: dict[Lane, timedelta | None] = field(default_factory=dict)


@dataclass(frozen=True)
class LaneCounts:
    """Counts of one lane by status, and the ages that show stuck work."""

    counts: dict[MessageStatus, int]
    oldest_pending_age_s: float | None
    oldest_running_lease_age_s: float | None
    # Of the pending ones, those not due yet (a retry's backoff, work enqueued for later).
    deferred: int = 0


# A runner is alive while it reported within this and did not say it stopped (reports come
# every few seconds).
RUNNER_ALIVE = timedelta(seconds=30)


@dataclass(frozen=True)
class IdHolder:
    """The live runner that holds a runner id another one asked for."""

    host: str
    pid: int
    started_at: datetime
    reported_at: datetime  # its last report, by the database's clock
    seen_age_s: float


@dataclass(frozen=True)
class RunnerInfo:
    """One runner as it last reported itself."""

    id: str
    host: str
    pid: int
    seen_age_s: float
    alive: bool
    listener_connected: bool
    last_missed_wakeup_age_s: float | None
    missed_wakeups: int
    claimed: int
    completed: int
    failed: int
    stats: dict[str, Any]


@dataclass(frozen=True)
class Redrive:
    """What a redrive did: the dead messages sent back to pending, and the dead ones it left
    because their deadline has passed (they would expire unrun; redrive them clearing it)."""

    moved: list[int]
    past_deadline: list[int]


@dataclass(frozen=True)
class BusStatus:
    """The bus at a glance (appliance status)."""

    at: datetime
    lanes: dict[Lane, LaneCounts]
    tenants: int
    runners: list[RunnerInfo] = field(default_factory=list)
    reclaims_last_hour: int = 0
    dedup_keys_hit_last_hour: int = 0
    # Counts by pipeline, stage and status. Nested, not keyed "pipeline.stage": names may
    # hold dots, and pipeline "a.b" stage "c" is not pipeline "a" stage "b.c".
    stages: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    # Work past an expiry that maintenance has not moved yet: leases_expired,
    # due_not_promoted, past_deadline, waits_expired (each counted up to 10,000).
    overdue: dict[str, int] = field(default_factory=dict)


class MessageStore(Protocol):
    """The durable envelope: every state change is one fenced statement or transaction."""

    async def enqueue(
        self,
        requests: Sequence[EnqueueRequest],
        *,
        retention: timedelta,
        default_max_attempts: int,
        now: datetime | None,
    ) -> list[EnqueueResult]: ...

    async def claim(
        self,
        *,
        worker: str,
        lanes: Sequence[Lane],
        limit: int,
        lease: timedelta,
        tenant: str | None,
        now: datetime | None,
    ) -> list[Message]: ...

    async def heartbeat(
        self, lease: LeaseRef, *, extend: timedelta, now: datetime | None
    ) -> HeartbeatResult: ...

    async def complete(
        self, completions: Sequence[Completion], *, actor: str, now: datetime | None
    ) -> list[AckOutcome]: ...

    async def fail(
        self,
        lease: LeaseRef,
        *,
        error: str,
        retry_delay: timedelta,
        actor: str,
        now: datetime | None,
    ) -> FailOutcome: ...

    async def cancel(
        self, tenant: str, message_id: int, *, reason: str, actor: str, now: datetime | None
    ) -> bool: ...

    async def expire(self, limits: ExpireLimits, *, batch: int, now: datetime | None) -> int: ...

    async def reclaim(
        self,
        *,
        batch: int,
        now: datetime | None,
        backoff: RetryPolicy,
        jitter_seed: int | None = None,
    ) -> list[int]: ...

    async def reclaim_due(
        self,
        *,
        batch: int,
        now: datetime | None,
        backoff: RetryPolicy,
        jitter_seed: int | None = None,
    ) -> list[tuple[int, float | None]]:
        """As reclaim, with each message's seconds until its retry is due (None: dead). The
        backoff's jitter is drawn from `jitter_seed` (a fresh one when None): the same seed
        gives the same delays."""
        ...

    async def promote_due(
        self, *, lanes: Sequence[Lane], batch: int, now: datetime | None
    ) -> int: ...

    async def redrive(
        self,
        tenant: str,
        message_ids: Sequence[int] | None,
        *,
        actor: str,
        now: datetime | None,
        clear_deadline: bool = False,
    ) -> Redrive: ...

    async def get(self, tenant: str, message_id: int) -> Message | None: ...

    async def list_messages(
        self,
        tenant: str,
        *,
        statuses: Sequence[MessageStatus],
        lane: Lane | None,
        limit: int,
        before: int | None,
    ) -> list[Message]: ...

    async def status(self, *, now: datetime | None) -> BusStatus: ...


class RunnerStore(MessageStore, Protocol):
    """What the stage runner needs beyond the envelope's basic paths."""

    async def deferrals(self, message_id: int, reason: str) -> int:
        """How many times the message was deferred with a reason starting `reason` (its log)."""
        ...

    async def enqueue_spawned(
        self,
        lease: LeaseRef,
        requests: Sequence[EnqueueRequest],
        *,
        retention: timedelta,
        default_max_attempts: int,
    ) -> bool:
        """Enqueue an attempt's spawned work while its lease holds (False: it does not)."""
        ...

    async def claim_lane(
        self,
        *,
        worker: str,
        lane: Lane,
        limit: int,
        lease: timedelta,
        tenant_limit: int,
        now: datetime | None,
        blocked_tiers: Sequence[Tier] = (),
        finished: Sequence[LeaseRef] = (),
        skip: Collection[tuple[str, str]] | None = None,
    ) -> LaneClaim: ...

    async def heartbeat_many(
        self, leases: Sequence[LeaseRef], *, extend: timedelta, now: datetime | None
    ) -> list[HeartbeatResult]: ...

    async def expire_running(
        self, lease: LeaseRef, *, reason: str, actor: str, now: datetime | None
    ) -> bool: ...

    async def release(
        self, leases: Sequence[LeaseRef], *, actor: str, now: datetime | None
    ) -> int: ...

    async def wait_capability(
        self,
        lease: LeaseRef,
        *,
        tier: Tier,
        expires_at: datetime,
        reason: str,
        actor: str,
        now: datetime | None,
    ) -> bool: ...

    async def resume_capability(
        self, tiers: Sequence[Tier], *, actor: str, batch: int, now: datetime | None
    ) -> int: ...

    async def wait_stage(
        self,
        lease: LeaseRef,
        *,
        pipeline: str,
        stage: str,
        wait: timedelta,
        reason: str,
        actor: str,
        now: datetime | None,
    ) -> str | None: ...

    async def resume_stages(
        self, stages: Collection[tuple[str, str]], *, actor: str, batch: int, now: datetime | None
    ) -> int: ...

    async def stages_elsewhere(
        self, runner_id: str, *, now: datetime | None
    ) -> frozenset[tuple[str, str]]: ...

    async def record_call(self, record: CallRecord) -> None: ...

    async def terminate(
        self, lease: LeaseRef, *, reason: str, actor: str, now: datetime | None
    ) -> bool: ...

    async def defer(
        self,
        lease: LeaseRef,
        *,
        delay: timedelta,
        reason: str,
        actor: str,
        now: datetime | None,
    ) -> bool: ...

    async def register_runner(self, info: dict[str, Any]) -> IdHolder | None: ...

    async def report_runner(self, info: dict[str, Any]) -> bool: ...


class SpendStore(Protocol):
    """The spend ledger: holds against the monthly cap, settlement, run budgets, and the
    messages parked for budget. Every check-and-hold is one atomic statement."""

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
        now: datetime | None,
    ) -> int | Refusal: ...

    async def settle(
        self,
        hold: int,
        *,
        amount: Decimal,
        energy_joules: float | None,
        provenance: str | None,
        released: bool,
        note: str | None,
        now: datetime | None,
    ) -> Decimal | None: ...

    async def release_dead(self, *, batch: int, now: datetime | None) -> int: ...

    async def hold_budget(
        self,
        lease: LeaseRef,
        *,
        reason: str,
        expires_at: datetime,
        actor: str,
        now: datetime | None,
    ) -> bool: ...

    async def resume_budget(
        self,
        *,
        reason: str,
        actor: str,
        batch: int,
        tenant: str | None = None,
        now: datetime | None,
    ) -> int: ...

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
        now: datetime | None,
    ) -> str | None: ...

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
        now: datetime | None,
    ) -> str | None:
        """Read only: the dimension run_reserve would find exhausted for `ask` (None: fits)."""
        ...

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
        now: datetime | None,
    ) -> None:
        """Record on the run the refusal run_check found, reserving nothing."""
        ...

    async def run_adjust(
        self, *, tenant: str, source: str, source_id: str, delta: dict[str, Any]
    ) -> None: ...

    async def month(self, *, now: datetime | None) -> Any: ...


class Doorbell(Protocol):
    """The wake-up hint: rings when work may have become claimable. Only a hint: losing a ring
    costs latency (the fallback poll finds the work), never correctness."""

    @property
    def connected(self) -> bool: ...

    async def start(self) -> None: ...

    async def wait(self, timeout: float) -> frozenset[Lane]:
        """The lanes rung within `timeout` seconds (empty: none); all lanes after a reconnect."""
        ...

    async def close(self) -> None: ...


class TenantStore(Protocol):
    """Tenants: the unit of isolation (row-level security) and fairness."""

    async def add(self, name: str, *, display_name: str | None = None) -> bool: ...

    async def list(self) -> list[str]: ...

    async def exists(self, name: str) -> bool: ...
