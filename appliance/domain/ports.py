"""Ports: the Protocols the bus talks to. Adapters (db/) implement them; nothing here does I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Protocol

from appliance.domain.envelope import (
    EnqueueRequest,
    EnqueueResult,
    JSONValue,
    Lane,
    LeaseRef,
    Message,
    MessageStatus,
)


class AckOutcome(StrEnum):
    """What a fenced write of a worker did."""

    APPLIED = "applied"
    STALE = "stale"  # the lease was reclaimed or replaced: nothing changed
    CANCELLED = "cancelled"  # the message was cancelled while running: nothing changed


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
class Completion:
    """One successful result to record under a lease (batched acknowledgements)."""

    lease: LeaseRef
    result: JSONValue = None


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


@dataclass(frozen=True)
class BusStatus:
    """The bus at a glance (appliance status)."""

    at: datetime
    lanes: dict[Lane, LaneCounts]
    tenants: int


class MessageStore(Protocol):
    """The durable envelope: every state change is one fenced statement or transaction."""

    async def enqueue(
        self, requests: Sequence[EnqueueRequest], *, retention: timedelta, now: datetime | None
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

    async def reclaim(self, *, batch: int, now: datetime | None) -> list[int]: ...

    async def redrive(
        self, tenant: str, message_ids: Sequence[int] | None, *, actor: str, now: datetime | None
    ) -> int: ...

    async def get(self, tenant: str, message_id: int) -> Message | None: ...

    async def status(self, *, now: datetime | None) -> BusStatus: ...


class TenantStore(Protocol):
    """Tenants: the unit of isolation (row-level security) and fairness."""

    async def add(self, name: str, *, display_name: str | None = None) -> bool: ...

    async def list(self) -> list[str]: ...

    async def exists(self, name: str) -> bool: ...
