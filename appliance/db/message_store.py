"""The envelope in PostgreSQL: the MessageStore port as named queries, fenced by lease token."""

from __future__ import annotations

import functools
import random
from collections.abc import Collection, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import tuple_row

from appliance.db.database import Database
from appliance.db.message_rows import message_rows, row_to_message
from appliance.db.queries import q
from appliance.domain.envelope import (
    COMPACT_JSON,
    EnqueueRequest,
    EnqueueResult,
    Lane,
    LeaseRef,
    Message,
    MessageStatus,
    encode_json,
    storable_text,
)
from appliance.domain.errors import InvalidInput, RowBusy, UnknownTenant
from appliance.domain.inference import Tier
from appliance.domain.ports import (
    AckOutcome,
    BusStatus,
    Completion,
    ExpireLimits,
    FailOutcome,
    HeartbeatResult,
    LaneClaim,
    LaneCounts,
    Redrive,
)
from appliance.domain.retry import RetryPolicy

SYSTEM_ACTOR = "bus"
# A claim through the API applies no tenant concurrency limit unless asked (the runner does).
UNLIMITED = 1_000_000
# Requests per statement of a large enqueue (see PgMessageStore.enqueue), and the most bytes of
# contexts and directives one statement carries: its JSON must stay under PostgreSQL's 256 MiB
# limit of a jsonb value, which 280 contexts of 1 MB passed (and failed every request with it).
ENQUEUE_CHUNK = 1000
ENQUEUE_STATEMENT_BYTES = 64 * 2**20
# A stage not declared in any pipeline still gets a hard runtime limit.
DEFAULT_MAX_RUNTIME = timedelta(minutes=10)

# The default backoff of a reclaimed message: a failed attempt's (BusConfig.retry).
RETRY = RetryPolicy()


async def run_fenced(db: Database, name: str, lease: LeaseRef, **params: Any) -> bool:
    """Run a named statement fenced by `lease` (it names %(id)s and %(token)s and returns the
    row it changed); True when the lease was still current and the row changed."""
    values = {"id": lease.message_id, "token": lease.lease_token, **params}
    async with db.system_conn() as conn:
        row = await (await conn.execute(q(name), values)).fetchone()
    return row is not None


async def run_batches(db: Database, name: str, params: dict[str, Any]) -> int:
    """Run a named bounded-batch statement (LIMIT %(batch)s) until a batch comes back short;
    how many rows it changed in all."""
    total = 0
    while True:
        async with db.system_conn() as conn:
            rows = await (await conn.execute(q(name), params)).fetchall()
        total += len(rows)
        if len(rows) < params["batch"]:
            return total


def _ack(
    applied: bool, status: str | None, same_lease: bool | None, same_answer: bool | None = True
) -> AckOutcome:
    """A completion's answer. Done under the same lease with the same result and outcome is a
    retried completion (its first commit's answer was lost with the connection): applied, by
    that first one, not a lost lease; a completion must be safe to send again. With another
    result it changed nothing, and is told so (stale), not that it was recorded."""
    if applied or (same_lease and status == MessageStatus.DONE and same_answer):
        return AckOutcome.APPLIED
    if same_lease and status == MessageStatus.CANCELLED:
        return AckOutcome.CANCELLED
    return AckOutcome.STALE


def _raced(applied: bool, status: str | None, same_lease: bool | None) -> bool:
    """A write under a lease that changed nothing though its snapshot shows the lease still
    running: it waited behind another statement (a cancel, a reclaim) that changed the row, and
    only a fresh read can say what that was."""
    return not applied and bool(same_lease) and status == MessageStatus.RUNNING


def enqueue_chunks(requests: Sequence[EnqueueRequest]) -> list[Sequence[EnqueueRequest]]:
    """The requests in statements of at most ENQUEUE_CHUNK requests and, beyond a first
    request, ENQUEUE_STATEMENT_BYTES of contexts and directives (UTF-8 at most 4 bytes a
    character; the rest of a request is a few hundred bytes)."""
    out: list[Sequence[EnqueueRequest]] = []
    start, size = 0, 0
    for i, req in enumerate(requests):
        cost = len(req.context_json) * 4 + len(req.directive) * 4 + 1024
        if i > start and (i - start >= ENQUEUE_CHUNK or size + cost > ENQUEUE_STATEMENT_BYTES):
            out.append(requests[start:i])
            start, size = i, 0
        size += cost
    if start < len(requests):
        out.append(requests[start:])
    return out


# Input PostgreSQL refused as such: not worth sending again as it is (unlike a lost
# connection). ProgramLimitExceeded: a value over one of its size limits; integrity and
# cardinality errors: what the statement asked cannot be, however often it is sent (a batch
# of them is then sent item by item, so that only the offending one fails).
REFUSED_INPUT = (
    psycopg.errors.CheckViolation,
    psycopg.errors.DataError,
    psycopg.errors.ProgramLimitExceeded,
    psycopg.errors.IntegrityError,
    psycopg.errors.CardinalityViolation,
)


def _refused(field_name: str, exc: psycopg.Error) -> InvalidInput:
    """Input the database refused, as the caller's error naming what was refused."""
    # A refusal of the driver's own (a NUL in text, say) carries no server diagnostics.
    reason = exc.diag.message_primary or str(exc)
    return InvalidInput(field_name, f"rejected by the database: {reason}")


def _oldest(ages: Iterable[Any]) -> float | None:
    """The largest of the groups' ages (seconds), None when no group has one."""
    known = [float(a) for a in ages if a is not None]
    return max(known) if known else None


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


# Seeds for the reclaim's backoff jitter when the caller gives none: spread, not secret.
_SEEDS = random.Random()

# Stands in for each request's context while the heads are encoded together: a JSON string of
# one NUL character, which no encoded text field can contain (enqueue refuses NUL in text
# fields, so no field's encoding starts a string with an escaped NUL).
_CONTEXT_SLOT = "\u0000"
_CONTEXT_SLOT_JSON = '"\\u0000"'


def _requests_json(requests: Sequence[EnqueueRequest]) -> str:
    """The requests as one JSON array in enqueue_requests' positional row layout (migration
    0007). The heads are encoded in one pass; each context, already compact validated JSON
    text, is spliced in as its row's last element rather than decoded and encoded again."""
    heads = COMPACT_JSON.encode(
        [
            [
                r.tenant,
                r.pipeline,
                r.stage,
                r.source,
                r.source_id,
                r.idempotency_key,
                r.directive,
                r.from_agent,
                r.to_agent,
                r.lane.value if r.lane else None,
                r.priority,
                r.max_attempts,
                _iso(r.not_before),
                _iso(r.deadline),
                r.hops,
                _CONTEXT_SLOT,
            ]
            for r in requests
        ]
    )
    parts = heads.split(_CONTEXT_SLOT_JSON)
    if len(parts) != len(requests) + 1:  # a field held the slot after all: never guess
        raise InvalidInput("request", "a text field contains a NUL character")
    out = [parts[0]]
    for r, part in zip(requests, parts[1:], strict=True):
        out.append(r.context_json)
        out.append(part)
    return "".join(out)


def enqueue_params(
    requests: Sequence[EnqueueRequest],
    retention: timedelta,
    now: datetime | None,
    default_max_attempts: int = 5,
) -> dict[str, Any]:
    return {
        "now": now,
        "retention": retention,
        "default_max_attempts": default_max_attempts,
        "scope": None,
        "requests": _requests_json(requests),
    }


@functools.lru_cache(maxsize=64)
def stage_array(stages: frozenset[tuple[str, str]]) -> str:
    """(pipeline, stage) pairs as an array literal of 'pipeline/stage' ('/' is in no name),
    built once per set rather than dumped on every claim."""

    def quoted(text: str) -> str:
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    return "{" + ",".join(quoted(f"{p}/{s}") for p, s in sorted(stages)) + "}"


@functools.lru_cache(maxsize=256)
def _json_text(value: str | None) -> str:
    """A short string (an outcome name) as JSON; a handful of distinct ones, encoded once each."""
    return COMPACT_JSON.encode(value)


def unique_requests(
    requests: Sequence[EnqueueRequest],
) -> tuple[list[EnqueueRequest], dict[tuple[str, str], int]]:
    """Each (tenant, key) once, the first request of it, and where in that list each key is.

    The same key twice in one statement would make ON CONFLICT touch a row twice: each key is
    sent once, and its repeats are answered as duplicates of the first."""
    first: dict[tuple[str, str], int] = {}
    unique: list[EnqueueRequest] = []
    for req in requests:
        k = (req.tenant, req.idempotency_key)
        if k not in first:
            first[k] = len(unique)
            unique.append(req)
    return unique, first


# How long an acknowledgement waits for a row another session holds locked: a claim or a
# reclaim holds one for milliseconds; past this, the holder keeps a transaction open.
ACK_LOCK_TIMEOUT = "5s"


def complete_params(
    completions: Sequence[Completion], *, actor: str, now: datetime | None
) -> dict[str, Any]:
    """Parameters of `message_complete`: the completions as one JSON array."""
    acks = ",".join(
        f"[{c.lease.message_id},{c.lease.lease_token},"
        f"{c.result_json if c.result_json is not None else encode_json(c.result, 'result')},"
        f"{_json_text(c.outcome)}]"
        for c in completions
    )
    return {"acks": f"[{acks}]", "actor": actor, "now": now, "lock_timeout": ACK_LOCK_TIMEOUT}


# A claim's rows: each (the message, or None on the row that only carries the backlog; the
# lane's backlog as the claim found it).
CLAIM_ROWS = message_rows("lane_pending")


def lane_claim(rows: Sequence[tuple[Message | None, int]]) -> LaneClaim:
    """A claim's rows (CLAIM_ROWS) as what it took, in claim order, and whether it left work
    behind (a backlog larger than what it took)."""
    messages = [message for message, _ in rows if message is not None]
    found = rows[-1][1] if rows else 0
    messages.sort(key=lambda m: (-m.priority, m.not_before, m.id))
    return LaneClaim(messages, left_behind=found > len(messages))


class PgMessageStore:
    """MessageStore on PostgreSQL.

    Tenant paths run as the app role under row-level security; the machinery (claim, reclaim,
    expire, status) runs as the system role.
    """

    def __init__(self, db: Database) -> None:
        self.db = db

    # -- enqueue ---------------------------------------------------------------------------

    async def enqueue(
        self,
        requests: Sequence[EnqueueRequest],
        *,
        retention: timedelta,
        default_max_attempts: int = 5,
        now: datetime | None = None,
    ) -> list[EnqueueResult]:
        """Insert a batch in one transaction: all of it or none of it.

        A batch of one tenant runs as that tenant (row-level security checks every row); a
        batch spanning tenants is bus machinery (stage hand-off, schedules) and runs as system.
        """
        if not requests:
            return []
        unique, first = unique_requests(requests)
        statements = [
            enqueue_params(chunk, retention, now, default_max_attempts)
            for chunk in enqueue_chunks(unique)
        ]
        tenants = {r.tenant for r in unique}
        scope = next(iter(tenants)) if len(tenants) == 1 else None
        # One tenant: as that tenant (its role, its function); several: as the machinery.
        query = q("message_enqueue_tenant") if scope else q("message_enqueue")
        for params in statements:
            params["scope"] = scope
        try:
            async with self.db.app_pool.connection() if scope else self.db.system_conn() as conn:
                # Plain tuples (ord, id, new): a thousand dicts cost more than the answers.
                if len(statements) == 1:
                    # One autocommit statement: atomic, one round trip.
                    cur = conn.cursor(row_factory=tuple_row)
                    rows = await (await cur.execute(query, statements[0])).fetchall()
                else:
                    # A large batch goes in chunks, pipelined in one transaction: the client
                    # prepares the next chunk while the server inserts this one (their CPU
                    # overlaps instead of adding up), and the batch stays all or nothing.
                    async with conn.pipeline(), conn.transaction():
                        cursors = [
                            await conn.cursor(row_factory=tuple_row).execute(query, params)
                            for params in statements
                        ]
                    rows = [row for cur in cursors for row in await cur.fetchall()]
        except psycopg.errors.ForeignKeyViolation as exc:
            # enqueue_requests names the unknown tenant in the error's detail.
            raise UnknownTenant(exc.diag.message_detail or ", ".join(sorted(tenants))) from None
        except REFUSED_INPUT as exc:
            # Validation should have caught it; as input the database refused, it stays the
            # caller's error (and a group of callers' statement is retried one by one).
            raise _refused("message", exc) from None
        answers = [EnqueueResult(id=row[1], new=row[2]) for row in rows]
        if len(unique) == len(requests):
            return answers  # no key repeated within the batch: the answers are in its order
        results: list[EnqueueResult] = []
        seen: set[tuple[str, str]] = set()
        for req in requests:
            k = (req.tenant, req.idempotency_key)
            answer = answers[first[k]]
            results.append(answer if k not in seen else EnqueueResult(answer.id, False))
            seen.add(k)
        return results

    # -- the worker's path -----------------------------------------------------------------

    async def claim(
        self,
        *,
        worker: str,
        lanes: Sequence[Lane],
        limit: int,
        lease: timedelta,
        tenant: str | None = None,
        now: datetime | None = None,
        tenant_limit: int = UNLIMITED,
    ) -> list[Message]:
        """Lease up to `limit` messages, strict by lane in the order given (fair within each)."""
        claimed: list[Message] = []
        for lane in lanes:
            if len(claimed) >= limit:
                break
            found = await self.claim_lane(
                worker=worker,
                lane=lane,
                limit=limit - len(claimed),
                lease=lease,
                tenant_limit=tenant_limit,
                tenant=tenant,
                now=now,
                backlog=False,  # a worker's claim takes what there is; it does not re-ask
            )
            claimed += found.messages
        return claimed

    async def claim_lane(
        self,
        *,
        worker: str,
        lane: Lane,
        limit: int,
        lease: timedelta,
        tenant_limit: int,
        now: datetime | None = None,
        tenant: str | None = None,
        max_runtime: timedelta = DEFAULT_MAX_RUNTIME,
        blocked_tiers: Sequence[Tier] = (),
        finished: Sequence[LeaseRef] = (),
        backlog: bool = True,
        skip: Collection[tuple[str, str]] | None = None,
    ) -> LaneClaim:
        """Lease up to `limit` messages of one lane, fairly across tenants; stages whose model
        tier is in `blocked_tiers` (no room in the caller's pool) are left for later.

        `finished`: the caller's attempts whose handlers have returned but whose outcome is not
        committed yet; they do not count against their tenants' limits.

        `backlog`: whether to look for work left behind (LaneClaim.left_behind). Only a claim
        of the whole lane does; one for a single `tenant` reports False.

        `skip`: (pipeline, stage) pairs whose work is left to other runners (not taken, not
        counted as backlog).
        """
        if limit <= 0:
            return LaneClaim([], left_behind=False)
        params = {
            "worker": worker,
            "lane": lane.value,
            "limit": limit,
            "lease": lease,
            "tenant_limit": tenant_limit,
            "tenant": tenant,
            "backlog_limit": limit + 1 if backlog and tenant is None else 0,
            "max_runtime": max_runtime,
            # Array literals, cast by the statement: the driver's list dumper cost about 50 us
            # of client CPU per claim for these three short arrays (tier names are plain words).
            # The tiers this claim may take work of, '' (no model calls) first: one bounded
            # scan of the pending index each (migration 0017).
            "open_tiers": '{""'
            + "".join(f",{t.value}" for t in Tier if t not in blocked_tiers)
            + "}",
            "now": now,
            "finished_ids": "{" + ",".join(str(f.message_id) for f in finished) + "}",
            "finished_tokens": "{" + ",".join(str(f.lease_token) for f in finished) + "}",
            "skip": stage_array(frozenset(skip)) if skip else None,
        }
        async with self.db.system_conn() as conn:
            cur = conn.cursor(row_factory=CLAIM_ROWS)
            rows = await (await cur.execute(q("message_claim_lane"), params)).fetchall()
        # Every row carries the lane's backlog; a row of NULLs carries it when none was claimed.
        return lane_claim(rows)

    async def heartbeat(
        self, lease: LeaseRef, *, extend: timedelta, now: datetime | None = None
    ) -> HeartbeatResult:
        """Extend the lease if it is still current; otherwise say why the worker must stop."""
        (result,) = await self.heartbeat_many([lease], extend=extend, now=now)
        return result

    async def heartbeat_many(
        self, leases: Sequence[LeaseRef], *, extend: timedelta, now: datetime | None = None
    ) -> list[HeartbeatResult]:
        """Extend many leases in one statement; each answer says whether to keep going."""
        if not leases:
            return []
        params = {
            "id": [lease.message_id for lease in leases],
            "token": [lease.lease_token for lease in leases],
            "extend": extend,
            "now": now,
        }
        async with self.db.system_conn() as conn:
            rows = await (await conn.execute(q("message_heartbeat_many"), params)).fetchall()
        # By lease, not by message: two attempts of one message (the older one's lease lost)
        # get their own answers.
        by_lease: dict[tuple[int, int], HeartbeatResult] = {}
        for row in rows:
            key = (row["id"], row["token"])
            if row["lease_expires_at"] is not None:
                by_lease[key] = HeartbeatResult(AckOutcome.APPLIED, row["lease_expires_at"])
            elif row["same_lease"] and row["status"] == MessageStatus.CANCELLED:
                by_lease[key] = HeartbeatResult(AckOutcome.CANCELLED)
            elif row["same_lease"] and row["status"] == MessageStatus.RUNNING:
                # Still ours: either past its hard run deadline, or written by another statement
                # at this instant (a completion racing the heartbeat); the next beat will tell.
                outcome = AckOutcome.OVERRUN if row["overran"] else AckOutcome.APPLIED
                by_lease[key] = HeartbeatResult(outcome)
            else:
                by_lease[key] = HeartbeatResult(AckOutcome.STALE)
        stale = HeartbeatResult(AckOutcome.STALE)
        return [by_lease.get((x.message_id, x.lease_token), stale) for x in leases]

    async def complete(
        self,
        completions: Sequence[Completion],
        *,
        actor: str = SYSTEM_ACTOR,
        now: datetime | None = None,
    ) -> list[AckOutcome]:
        """Record results (a batch, durable); each answer says whether that lease still held."""
        if not completions:
            return []
        params = complete_params(completions, actor=actor, now=now)
        try:
            async with self.db.system_conn() as conn:
                # (id, applied, status, same_lease, token, same_answer)
                cur = conn.cursor(row_factory=tuple_row)
                rows = await (await cur.execute(q("message_complete"), params)).fetchall()
        except psycopg.errors.LockNotAvailable:
            raise RowBusy(
                f"a row of these {len(completions)} completions is locked by another session"
            ) from None
        except REFUSED_INPUT as exc:
            # A result or outcome the database cannot hold: the caller's data, never worth
            # sending again as it is (unlike a lost connection).
            raise _refused("completion", exc) from None
        by_lease = {(r[0], r[4]): _ack(r[1], r[2], r[3], r[5]) for r in rows}
        raced = [(r[0], r[4]) for r in rows if _raced(r[1], r[2], r[3])]
        if raced:
            fresh = await self._lease_states([mid for mid, _ in raced])
            now_held = {mid: (status, token) for mid, status, token in fresh}
            for mid, token in raced:
                if mid in now_held:
                    status, current = now_held[mid]
                    by_lease[(mid, token)] = _ack(False, status, current == token)
        return [by_lease[(c.lease.message_id, c.lease.lease_token)] for c in completions]

    async def _lease_states(self, ids: Sequence[int]) -> list[tuple[int, str, int | None]]:
        """(id, status, lease token) as of now, for writes that raced another statement."""
        async with self.db.system_conn() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            rows = await (
                await cur.execute(q("message_lease_states"), {"ids": list(ids)})
            ).fetchall()
        return [(r[0], r[1], r[2]) for r in rows]

    async def fail(
        self,
        lease: LeaseRef,
        *,
        error: str,
        retry_delay: timedelta,
        actor: str = SYSTEM_ACTOR,
        now: datetime | None = None,
    ) -> FailOutcome:
        """Fail the attempt under its lease: retry later, or dead when attempts are used up."""
        params = {
            "id": lease.message_id,
            "token": lease.lease_token,
            "error": storable_text(error),
            "retry_delay": retry_delay,
            "actor": actor,
            "now": now,
        }
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("message_fail"), params)).fetchone()
        if row is None:
            return FailOutcome.STALE
        if row["new_status"] is not None:
            return FailOutcome.DEAD if row["new_status"] == "dead" else FailOutcome.RETRY
        status, same_lease = row["status"], row["same_lease"]
        if _raced(False, status, same_lease):
            fresh = await self._lease_states([lease.message_id])
            if fresh:
                (_, status, token), *_ = fresh
                same_lease = token == lease.lease_token
        if same_lease and status == MessageStatus.CANCELLED:
            return FailOutcome.CANCELLED
        return FailOutcome.STALE

    # -- operator and maintenance paths ----------------------------------------------------

    async def cancel(
        self,
        tenant: str,
        message_id: int,
        *,
        reason: str = "cancelled",
        actor: str = "operator",
        now: datetime | None = None,
    ) -> bool:
        """Cancel as the tenant: True if a non-terminal message was cancelled."""
        params = {"id": message_id, "reason": reason, "actor": actor, "now": now}
        async with self.db.tenant_tx(tenant) as conn:
            row = await (await conn.execute(q("message_cancel"), params)).fetchone()
        return row is not None

    async def expire(
        self, limits: ExpireLimits, *, batch: int = 500, now: datetime | None = None
    ) -> int:
        """Expire past-deadline and over-age pending work (one bounded batch of each)."""
        expired = 0
        async with self.db.system_conn() as conn:
            cur = await conn.execute(
                q("message_expire_deadline"), {"now": now, "batch": batch, "actor": SYSTEM_ACTOR}
            )
            expired += len(await cur.fetchall())
            for lane, age in limits.max_queue_age.items():
                if age is None:
                    continue
                params = {
                    "lane": lane.value,
                    "max_age": age,
                    "now": now,
                    "batch": batch,
                    "actor": SYSTEM_ACTOR,
                }
                cur = await conn.execute(q("message_expire_queue_age"), params)
                expired += len(await cur.fetchall())
        return expired

    async def reclaim(
        self,
        *,
        batch: int = 500,
        now: datetime | None = None,
        backoff: RetryPolicy = RETRY,
        jitter_seed: int | None = None,
    ) -> list[int]:
        """Return expired leases to pending after `backoff`'s delay for the attempts made (or
        to dead when attempts are used up, to expired when the message's deadline has passed);
        the ids reclaimed, logged `lease_expired`."""
        due = await self.reclaim_due(batch=batch, now=now, backoff=backoff, jitter_seed=jitter_seed)
        return [mid for mid, _ in due]

    async def reclaim_due(
        self,
        *,
        batch: int = 500,
        now: datetime | None = None,
        backoff: RetryPolicy = RETRY,
        jitter_seed: int | None = None,
    ) -> list[tuple[int, float | None]]:
        """As reclaim, with each message's seconds until its retry is due (None: dead or
        expired). Each row's jitter is a hash of the row under `jitter_seed` (a fresh random
        one when None), so a given seed reproduces the same delays."""
        params = {
            "now": now,
            "batch": batch,
            "actor": SYSTEM_ACTOR,
            "retry_base": backoff.base,
            "retry_cap": backoff.cap,
            "jitter_seed": _SEEDS.getrandbits(62) if jitter_seed is None else jitter_seed,
        }
        async with self.db.system_conn() as conn:
            cur = await conn.execute(q("message_reclaim"), params)
            return [(r["id"], r["due_in"]) for r in await cur.fetchall()]

    async def promote_due(
        self, *, lanes: Sequence[Lane], batch: int = 500, now: datetime | None = None
    ) -> int:
        """Make deferred work that has come due claimable again (its not_before reached: a
        retry's backoff over, work enqueued for later), a bounded batch taken lane by lane in
        the order of `lanes` (claim order); rings the lanes it fills. How many."""
        params = {
            "lanes": "{" + ",".join(lane.value for lane in lanes) + "}",
            "batch": batch,
            "now": now,
        }
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("message_promote_due"), params)).fetchone()
        return int(row["promoted"]) if row else 0

    async def redrive(
        self,
        tenant: str,
        message_ids: Sequence[int] | None,
        *,
        actor: str = "operator",
        now: datetime | None = None,
        clear_deadline: bool = False,
    ) -> Redrive:
        """Dead messages of a tenant back to pending with fresh attempts."""
        params = {
            "ids": list(message_ids) if message_ids is not None else None,
            "actor": actor,
            "now": now,
            "clear_deadline": clear_deadline,
        }
        async with self.db.tenant_tx(tenant) as conn:
            rows = await (await conn.execute(q("message_redrive"), params)).fetchall()
        return Redrive(
            moved=sorted(r["id"] for r in rows if r["moved"]),
            past_deadline=sorted(r["id"] for r in rows if not r["moved"]),
        )

    async def get(self, tenant: str, message_id: int) -> Message | None:
        """One message as the tenant sees it (None when absent or another tenant's)."""
        async with self.db.tenant_tx(tenant) as conn:
            row = await (await conn.execute(q("message_get"), {"id": message_id})).fetchone()
        return row_to_message(row) if row else None

    async def list_messages(
        self,
        tenant: str,
        *,
        statuses: Sequence[MessageStatus],
        lane: Lane | None,
        limit: int,
        before: int | None,
    ) -> list[Message]:
        """The tenant's messages in the hot table, newest first (see Bus.list_messages)."""
        params = {
            "statuses": [s.value for s in statuses] or None,
            "lane": lane.value if lane is not None else None,
            "limit": limit,
            "before": before,
        }
        async with self.db.tenant_tx(tenant) as conn:
            rows = await (await conn.execute(q("message_list"), params)).fetchall()
        return [row_to_message(row) for row in rows]

    async def transitions(self, tenant: str, message_id: int) -> list[dict[str, Any]]:
        """The transition log of one message, as the tenant sees it."""
        async with self.db.tenant_tx(tenant) as conn:
            cur = await conn.execute(q("message_transitions"), {"id": message_id})
            return list(await cur.fetchall())

    async def stage_outputs(
        self, tenant: str, *, pipeline: str, stage: str, source: str, source_ids: Sequence[str]
    ) -> list[dict[str, Any]]:
        """Where each work item stands at one stage: status and result, as the tenant sees it."""
        params = {
            "pipeline": pipeline,
            "stage": stage,
            "source": source,
            "source_ids": list(source_ids),
        }
        async with self.db.tenant_tx(tenant) as conn:
            cur = await conn.execute(q("stage_outputs"), params)
            return list(await cur.fetchall())

    async def waiting(self, tenant: str, *, limit: int = 100) -> list[dict[str, Any]]:
        """The tenant's messages in a waiting state, with the reason each waits."""
        async with self.db.tenant_tx(tenant) as conn:
            cur = await conn.execute(q("messages_waiting"), {"limit": limit})
            return list(await cur.fetchall())

    async def status(self, *, now: datetime | None = None) -> BusStatus:
        """Counts by lane and status, and the ages that show stuck work."""
        async with self.db.system_conn() as conn:
            rows = await (await conn.execute(q("bus_status"), {"now": now})).fetchall()
            overdue = await (await conn.execute(q("bus_overdue"), {"now": now})).fetchone()
            clock = await (await conn.execute("SELECT now() AS at")).fetchone()
            tenants = await (await conn.execute(q("tenant_count"))).fetchone()
        lanes: dict[Lane, LaneCounts] = {}
        for lane in Lane:
            mine = [r for r in rows if r["lane"] == lane.value]
            counts = {s: 0 for s in MessageStatus}
            deferred = 0
            for r in mine:
                counts[MessageStatus(r["status"])] += r["n"]
                deferred += r["deferred"]
            lanes[lane] = LaneCounts(
                counts,
                _oldest(r["oldest_pending_s"] for r in mine),
                _oldest(r["oldest_lease_s"] for r in mine),
                deferred,
            )
        stages: dict[str, dict[str, dict[str, int]]] = {}
        for r in rows:
            of_stage = stages.setdefault(r["pipeline"], {}).setdefault(r["stage"], {})
            of_stage[r["status"]] = of_stage.get(r["status"], 0) + r["n"]
        at = now or (clock["at"] if clock else datetime.now().astimezone())
        return BusStatus(
            at=at,
            lanes=lanes,
            tenants=tenants["n"] if tenants else 0,
            stages={p: dict(sorted(of.items())) for p, of in sorted(stages.items())},
            overdue={k: int(v) for k, v in (overdue or {}).items()},
        )
