"""The bus core: validated enqueue, claim, heartbeat, complete, fail-with-retry, and maintenance.

It talks to the MessageStore port only; which database sits behind it is not its business.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from appliance.bus.group_commit import EnqueueGroupCommit
from appliance.domain.envelope import (
    DEFAULT_CONTEXT_MAX_BYTES,
    EnqueueRequest,
    EnqueueResult,
    JSONValue,
    Lane,
    LeaseRef,
    Message,
    MessageStatus,
    bytes_over,
    check_free_text,
    check_name,
    encode_json,
    lease_duration_ok,
    parse_lane,
    parse_status,
    utc_moment,
)
from appliance.domain.errors import InvalidInput
from appliance.domain.ports import (
    AckOutcome,
    BusStatus,
    Completion,
    ExpireLimits,
    FailOutcome,
    HeartbeatResult,
    MessageStore,
    Redrive,
)
from appliance.domain.retry import RetryPolicy

ALL_LANES: tuple[Lane, ...] = (Lane.INTERACTIVE, Lane.SYSTEM, Lane.BATCH)

# A cancel's reason is written on the message and in its transition log.
REASON_MAX_CHARS = 500


@dataclass(frozen=True)
class BusConfig:
    """The rules the bus applies on top of the store."""

    lease: timedelta = timedelta(seconds=30)
    max_attempts: int = 5
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    context_max_bytes: int = DEFAULT_CONTEXT_MAX_BYTES
    idempotency_retention: timedelta = timedelta(days=90)
    max_queue_age: Mapping[Lane, timedelta | None] = field(default_factory=dict)
    maintenance_batch: int = 500
    # Group commit of concurrent single enqueues (appliance/bus/group_commit.py): requests per
    # shared statement, and statements in flight per tenant.
    enqueue_group_max: int = 1000
    enqueue_group_inflight: int = 2


# The most messages one list call returns: a page for a person to read, not an export.
LIST_MAX = 1000

# The most messages one claim leases: they come back in one answer, each to be worked on.
CLAIM_MAX = 10_000

# Who claims or writes (a worker's or an operator's name): stamped on the message and its log.
ACTOR_MAX_CHARS = 200

# Message ids and lease tokens are PostgreSQL bigints.
ID_MAX = 2**63 - 1


def check_id(field_name: str, value: object) -> int:
    """A message id or lease token as the database holds them (1 to 2**63 - 1), or an error
    naming the field, rather than the database's own refusal of the type or range."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= ID_MAX:
        raise InvalidInput(field_name, f"{value!r} is not an id (a whole number 1 to {ID_MAX})")
    return value


def check_limit(limit: object, most: int) -> None:
    """How many rows a call may return: a whole number from 1 to `most`."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= most:
        raise InvalidInput("limit", f"{limit!r} is not from 1 to {most}")


def check_lease(lease: LeaseRef) -> LeaseRef:
    check_id("message_id", lease.message_id)
    check_id("lease_token", lease.lease_token)
    return lease


def check_now(now: datetime | None) -> datetime | None:
    """An injected clock reading: with a time zone (one without would be read in the database
    session's zone, or fail comparing with the request's times), as UTC."""
    return utc_moment("now", now)


class Bus:
    """The work bus API that the CLI, the runner and pipelines use."""

    def __init__(
        self, store: MessageStore, config: BusConfig | None = None, rng: random.Random | None = None
    ) -> None:
        self.store = store
        self.config = config or BusConfig()
        self._rng = rng or random.Random()
        self._group = EnqueueGroupCommit(
            self._send,
            max_batch=self.config.enqueue_group_max,
            max_inflight=self.config.enqueue_group_inflight,
        )

    def request(self, **fields: Any) -> EnqueueRequest:
        """Build and validate a request with this bus's defaults (max attempts, context limit).

        A deadline is checked against `now`, else against this machine's clock: a deadline
        already past is refused here, not accepted and then expired unseen.
        """
        # Never above the configured limit: a caller may ask for a smaller one, not a larger.
        fields["context_max_bytes"] = min(
            fields.get("context_max_bytes", self.config.context_max_bytes),
            self.config.context_max_bytes,
        )
        if fields.get("now") is None:
            fields["now"] = datetime.now(UTC)
        return EnqueueRequest.build(**fields)

    async def enqueue(self, *, now: datetime | None = None, **fields: Any) -> EnqueueResult:
        """Enqueue one message (validated first); a duplicate key returns the existing id.

        Durable when it returns. Concurrent calls share statements (group commit). Without
        `now` the rows are stamped by the database clock, the one every lease and expiry
        reads; this machine's clock only validates the request.
        """
        return await self._group.enqueue(self.request(now=now, **fields), now)

    async def _send(
        self, requests: Sequence[EnqueueRequest], now: datetime | None
    ) -> list[EnqueueResult]:
        return await self.store.enqueue(
            requests,
            retention=self.config.idempotency_retention,
            default_max_attempts=self.config.max_attempts,
            now=now,
        )

    async def enqueue_many(
        self, requests: Sequence[EnqueueRequest], *, now: datetime | None = None
    ) -> list[EnqueueResult]:
        """Enqueue a validated batch atomically (all rows or none)."""
        limit = self.config.context_max_bytes
        for i, request in enumerate(requests):
            # Built elsewhere (another bus's request(), or by hand) with a larger limit.
            size = bytes_over(request.context_json, limit)
            if size is not None:
                raise InvalidInput(
                    "context", f"of request {i} is {size} bytes, over the limit of {limit} bytes"
                )
        return await self._send(requests, check_now(now))

    async def claim(
        self,
        worker: str,
        *,
        lanes: Sequence[Lane] = ALL_LANES,
        limit: int = 1,
        lease: timedelta | None = None,
        tenant: str | None = None,
        now: datetime | None = None,
    ) -> list[Message]:
        """Lease up to `limit` messages of `lanes`, strict by lane: interactive, system, batch,
        whatever order `lanes` names them in (batch work never goes ahead of interactive)."""
        worker = check_free_text("worker", worker, ACTOR_MAX_CHARS)
        check_limit(limit, CLAIM_MAX)
        if tenant is not None:
            check_name("tenant", tenant)
        now = check_now(now)
        wanted = {parse_lane(lane) for lane in lanes}
        order = [lane for lane in ALL_LANES if lane in wanted]
        held = lease_duration_ok(lease if lease is not None else self.config.lease)
        claimed = await self.store.claim(
            worker=worker, lanes=order, limit=limit, lease=held, tenant=tenant, now=now
        )
        # Work that has come due (a failed attempt's backoff over, work enqueued for later) is
        # out of the claim's index until it is promoted, so that a worker of this API alone,
        # with no runner's maintenance anywhere, still gets its retries back: promoted when
        # the claim came back short, and asked for at once; and when it took work of a lane
        # below the first one asked for, or a due retry of a higher lane would wait behind
        # lower lanes' work for as long as that lasted (promoted now, it comes first in the
        # next claim).
        short = len(claimed) < limit
        if not short and all(m.lane == order[0] for m in claimed):
            return claimed
        promoted = await self.store.promote_due(
            lanes=order, batch=self.config.maintenance_batch, now=now
        )
        if short and promoted:
            claimed += await self.store.claim(
                worker=worker,
                lanes=order,
                limit=limit - len(claimed),
                lease=held,
                tenant=tenant,
                now=now,
            )
            # In one claim's order: by lane, then as each lane's claim orders its work.
            claimed.sort(key=lambda m: (order.index(m.lane), -m.priority, m.not_before, m.id))
        return claimed

    async def heartbeat(
        self, lease: LeaseRef, *, extend: timedelta | None = None, now: datetime | None = None
    ) -> HeartbeatResult:
        """Extend a lease; the answer tells a worker whose lease was lost or cancelled to stop."""
        # `is None`, not `or`: a zero extension is an error to report, not the default.
        extend = lease_duration_ok(extend if extend is not None else self.config.lease)
        return await self.store.heartbeat(check_lease(lease), extend=extend, now=check_now(now))

    async def complete(
        self,
        lease: LeaseRef,
        result: JSONValue = None,
        *,
        actor: str = "worker",
        now: datetime | None = None,
    ) -> AckOutcome:
        """Finish a message under its lease; a stale lease changes nothing (STALE)."""
        (outcome,) = await self.complete_many([Completion(lease, result)], actor=actor, now=now)
        return outcome

    async def complete_many(
        self,
        completions: Sequence[Completion],
        *,
        actor: str = "worker",
        now: datetime | None = None,
    ) -> list[AckOutcome]:
        """Batched acknowledgements: one statement, one flush. A result over the context limit
        refuses the batch (InvalidInput, nothing written), and so does one lease acknowledged
        twice with different answers (only one could be stored)."""
        actor = check_free_text("actor", actor, ACTOR_MAX_CHARS)
        checked = self._held_to_limit(completions)
        return await self.store.complete(checked, actor=actor, now=check_now(now))

    def _held_to_limit(self, completions: Sequence[Completion]) -> list[Completion]:
        """The completions with their results encoded (once), each held to the context limit:
        a result becomes the next stage's context, as the runner holds its handlers' results."""
        limit = self.config.context_max_bytes
        checked: list[Completion] = []
        answers: dict[LeaseRef, tuple[str, str | None]] = {}
        for c in completions:
            check_lease(c.lease)
            check_name("outcome", c.outcome)  # it picks the next stage by name
            if c.result is None and c.result_json is None:
                text = None  # the common no-op result: nothing to encode or measure
            else:
                text = (
                    c.result_json if c.result_json is not None else encode_json(c.result, "result")
                )
            # One statement stores one answer per lease: with two different ones for the same
            # lease, the other would be reported as stored and be lost.
            if answers.setdefault(c.lease, (c.outcome, text)) != (c.outcome, text):
                raise InvalidInput(
                    "completions",
                    f"message {c.lease.message_id} is acknowledged twice under lease "
                    f"{c.lease.lease_token} with different results or outcomes",
                )
            if text is None:
                checked.append(c)
                continue
            size = bytes_over(text, limit)
            if size is not None:
                raise InvalidInput(
                    "result",
                    f"of message {c.lease.message_id} is {size} bytes, over the limit of "
                    f"{limit} bytes (a result becomes the next stage's context)",
                )
            checked.append(c if c.result_json is not None else replace(c, result_json=text))
        return checked

    async def fail(
        self,
        message: Message,
        error: str,
        *,
        actor: str = "worker",
        now: datetime | None = None,
    ) -> FailOutcome:
        """Fail the attempt of a claimed message: retry after backoff with jitter, or dead."""
        actor = check_free_text("actor", actor, ACTOR_MAX_CHARS)
        delay = self.config.retry.delay(message.attempts, self._rng)
        return await self.store.fail(
            check_lease(message.lease),
            error=error,
            retry_delay=delay,
            actor=actor,
            now=check_now(now),
        )

    async def cancel(
        self,
        tenant: str,
        message_id: int,
        *,
        reason: str = "cancelled",
        actor: str = "operator",
        now: datetime | None = None,
    ) -> bool:
        reason = check_free_text("reason", reason, REASON_MAX_CHARS)
        actor = check_free_text("actor", actor, ACTOR_MAX_CHARS)
        return await self.store.cancel(
            check_name("tenant", tenant),
            check_id("message_id", message_id),
            reason=reason,
            actor=actor,
            now=check_now(now),
        )

    async def expire(self, *, now: datetime | None = None) -> int:
        limits = ExpireLimits(dict(self.config.max_queue_age))
        return await self.store.expire(
            limits, batch=self.config.maintenance_batch, now=check_now(now)
        )

    async def reclaim(self, *, now: datetime | None = None) -> list[int]:
        return [mid for mid, _ in await self.reclaim_due(now=now)]

    async def reclaim_due(self, *, now: datetime | None = None) -> list[tuple[int, float | None]]:
        """Reclaim a batch of expired leases; each message with the seconds until its retry is
        due (None: it went dead)."""
        # The jitter's seed comes from the Bus's own generator, so a Bus given a seeded (or
        # pinned) generator reclaims with reproducible delays, as its failures retry.
        return await self.store.reclaim_due(
            batch=self.config.maintenance_batch,
            now=check_now(now),
            backoff=self.config.retry,
            jitter_seed=int(self._rng.random() * 2**62),
        )

    async def promote_due(self, *, now: datetime | None = None) -> int:
        """Deferred work that has come due becomes claimable (a bounded batch); how many."""
        return await self.store.promote_due(
            lanes=ALL_LANES, batch=self.config.maintenance_batch, now=check_now(now)
        )

    async def redrive(
        self,
        tenant: str,
        message_ids: Sequence[int] | None = None,
        *,
        actor: str = "operator",
        now: datetime | None = None,
        clear_deadline: bool = False,
    ) -> Redrive:
        """Dead messages back to pending with fresh attempts (all the tenant's dead ones when
        no ids are given). A message that is not dead is left as it is, and so is one whose
        deadline has passed (it would only expire unrun) unless `clear_deadline` removes its
        deadline."""
        ids = None if message_ids is None else [check_id("message_id", i) for i in message_ids]
        return await self.store.redrive(
            check_name("tenant", tenant),
            ids,
            actor=check_free_text("actor", actor, ACTOR_MAX_CHARS),
            now=check_now(now),
            clear_deadline=clear_deadline,
        )

    async def get(self, tenant: str, message_id: int) -> Message | None:
        return await self.store.get(
            check_name("tenant", tenant), check_id("message_id", message_id)
        )

    async def list_messages(
        self,
        tenant: str,
        *,
        statuses: Sequence[MessageStatus | str] = (),
        lane: Lane | str | None = None,
        limit: int = 50,
        before: int | None = None,
    ) -> list[Message]:
        """The tenant's messages in the hot table, newest first: of `statuses` (all when none),
        of `lane` (any when None), at most `limit` (1 to LIST_MAX), below id `before` (the next
        page: pass the last id of the previous one). What an operator looks through, such as
        the dead work that `redrive` would send back; finished work leaves for the archive."""
        wanted = list(dict.fromkeys(parse_status(s) for s in statuses))
        picked = parse_lane(lane) if lane is not None else None
        check_limit(limit, LIST_MAX)
        if before is not None:
            check_id("before", before)
        return await self.store.list_messages(
            check_name("tenant", tenant), statuses=wanted, lane=picked, limit=limit, before=before
        )

    async def status(self, *, now: datetime | None = None) -> BusStatus:
        return await self.store.status(now=check_now(now))
