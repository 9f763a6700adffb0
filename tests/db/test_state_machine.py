"""The envelope as a state machine against real PostgreSQL: a model checked after every step.

Hypothesis drives enqueue (with duplicates), claim, heartbeat, complete, fail (each under any
lease ever handed out, current or stale, and by a worker that wakes up after its work was
reclaimed and claimed again), cancel, reclaim, redrive and an injected clock. A plain Python
model predicts every answer and every row; after each step the database must agree with it,
and the invariants of the envelope must hold:

* running iff leased, and only the latest lease token of a message can write; a write under
  an older token answers STALE (or CANCELLED) and changes nothing in the row;
* no lease reaches past its attempt's hard run deadline, and the tenant's running counter
  (what claims check concurrency against) equals its number of running messages;
* every status change is logged, the log of each message is a chain of legal transitions that
  ends in its current status, and its `running` entries count every attempt ever made;
* a duplicate (source, source id, stage) answers the same id, not new, and changes nothing;
* done stays done; a reclaimed lease goes back to pending, or to dead when attempts are used up.

One database serves the whole test; each example starts from emptied tables and restarted
sequences, and nothing in it is random (the Bus's generator is pinned and the database's jitter
is seeded from it), so an example replays exactly, as hypothesis needs to shrink it. The Bus
is async and the state machine sync, so each example runs the Bus on an event loop of its own.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar, TypeVar

import psycopg
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from appliance.bus.core import Bus, BusConfig
from appliance.db.database import Database, Endpoints
from appliance.db.message_store import DEFAULT_MAX_RUNTIME, PgMessageStore
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.envelope import LEGAL_TRANSITIONS, TERMINAL, Message, MessageStatus
from appliance.domain.ports import AckOutcome, FailOutcome
from appliance.domain.retry import RetryPolicy

T0 = datetime(2026, 11, 1, tzinfo=UTC)
TENANT = "acme"
SOURCE = "sm"
RETRY_BASE = timedelta(seconds=4)
RETRY_CAP = timedelta(seconds=40)
LEASES = (timedelta(seconds=5), timedelta(seconds=30), timedelta(seconds=60))
PIPELINE = "demo"
# "review" is a declared stage with a short hard runtime, so leases meet their run deadline;
# "intake" is undeclared and gets the store's default.
MAX_RUNTIME = {"review": timedelta(seconds=45), "intake": DEFAULT_MAX_RUNTIME}

REPEAT = st.none() | st.integers(0, 2)  # see EnvelopeMachine.enqueue
STAGES = st.sampled_from(["intake", "review"])
MAX_ATTEMPTS = st.integers(1, 3)
WRITES = st.sampled_from(["heartbeat", "complete", "fail"])

S = MessageStatus
T = TypeVar("T")


class _NoJitter(random.Random):
    """The retry jitter pinned to its floor, so the model knows each backoff exactly."""

    def random(self) -> float:
        return 0.0


def backoff(attempts: int) -> timedelta:
    """The model's retry delay: half of base * 2^(attempts-1), the ceiling capped (no jitter)."""
    ceiling: timedelta = min(RETRY_BASE * 2 ** (max(attempts, 1) - 1), RETRY_CAP)
    return ceiling / 2


@dataclass(frozen=True)
class Logged:
    """One expected row of `message_transitions`."""

    from_status: MessageStatus | None
    to_status: MessageStatus
    reason: str
    attempt: int
    lease_token: int | None


@dataclass
class Model:
    """What one message must look like in the database."""

    id: int
    max_attempts: int
    status: MessageStatus = S.PENDING
    attempts: int = 0
    stage: str = "intake"
    token: int | None = None
    expires: datetime | None = None
    run_deadline: datetime | None = None
    not_before: datetime = T0
    # Pending but not due when written: out of the claim's index until promoted.
    deferred: bool = False
    reset_by_redrive: int = 0
    log: list[Logged] = field(default_factory=list)

    def move(self, to: MessageStatus, reason: str) -> None:
        self.log.append(Logged(self.status, to, reason, self.attempts, self.token))
        self.status = to

    def ack_for(self, token: int) -> AckOutcome:
        """What a fenced write under `token` must answer now.

        CANCELLED means: the message was cancelled while running under this very lease. A
        lease that left running otherwise (reclaimed, failed, released) is cleared from the
        row, so a later cancel answers its old holder STALE.
        """
        if self.token == token and self.status is S.RUNNING:
            return AckOutcome.APPLIED
        if self.token == token and self.status is S.CANCELLED:
            return AckOutcome.CANCELLED
        return AckOutcome.STALE


class EnvelopeMachine(RuleBasedStateMachine):
    """The Bus against PostgreSQL, checked against `Model` after every step."""

    endpoints: ClassVar[Endpoints]  # set by a subclass per test: the database to use

    messages = Bundle("messages")

    def __init__(self) -> None:
        super().__init__()
        endpoints = self.endpoints
        with psycopg.connect(endpoints.admin, autocommit=True) as conn:
            # Sequences restart too: the reclaim's backoff jitter is a hash of the message id
            # under the Bus's seed (pinned here), so the same steps must meet the same ids,
            # or a replayed example takes another path and hypothesis calls the test flaky.
            conn.execute(
                "TRUNCATE appliance.agent_messages, appliance.idempotency_keys,"
                " appliance.message_transitions RESTART IDENTITY"
            )
            conn.execute("ALTER SEQUENCE appliance.agent_messages_lease_token_seq RESTART")
            conn.execute("UPDATE appliance.tenant_runtime SET claimed = 0, last_claimed_at = NULL")
            conn.execute("UPDATE appliance.tenant_released_shards SET released = 0")
        self.loop = asyncio.new_event_loop()
        self.db = Database(endpoints, min_size=1, max_size=2)
        try:
            self.run(self.db.open())
            self.run(PgTenantStore(self.db).add(TENANT))
        except BaseException:
            self.loop.close()
            raise
        self.store = PgMessageStore(self.db)
        config = BusConfig(retry=RetryPolicy(base=RETRY_BASE, cap=RETRY_CAP))
        self.bus = Bus(self.store, config, rng=_NoJitter())
        self.now = T0
        self.model: dict[int, Model] = {}
        self.keys: dict[tuple[str, str], int] = {}
        self.source_ids: list[str] = []
        self.leases: list[Message] = []  # every lease ever handed out
        self.top_token = 0
        self.done: dict[int, Any] = {}  # completed messages and their results: forever

    def teardown(self) -> None:
        try:
            self.run(self.db.close())
        finally:
            self.loop.close()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def row(self, message_id: int) -> Message:
        message = self.run(self.bus.get(TENANT, message_id))
        assert message is not None
        return message

    # -- rules -----------------------------------------------------------------------------

    @initialize(
        target=messages, work=st.lists(st.tuples(STAGES, MAX_ATTEMPTS), min_size=1, max_size=4)
    )
    def some_work(self, work: list[tuple[str, int]]) -> Any:
        # Swarm testing may switch `enqueue` off for a whole example; start with work anyway.
        return multiple(*(self.enqueue(None, stage, n) for stage, n in work))

    @rule(target=messages, repeat=REPEAT, stage=STAGES, max_attempts=MAX_ATTEMPTS)
    def enqueue(self, repeat: int | None, stage: str, max_attempts: int) -> int:
        """A fresh source id (None), or one of the last few again: a duplicate if the stage
        matches too. Fresh ids keep work coming when cancels and completions use it up."""
        if repeat is None or repeat >= len(self.source_ids):
            self.source_ids.append(f"s{len(self.source_ids)}")
            source_id = self.source_ids[-1]
        else:
            source_id = self.source_ids[-1 - repeat]
        return self.enqueue_one(source_id, stage, max_attempts)

    def enqueue_one(self, source_id: str, stage: str, max_attempts: int) -> int:
        known = self.keys.get((source_id, stage))
        before = self.row(known) if known is not None else None
        result = self.run(
            self.bus.enqueue(
                now=self.now,
                tenant=TENANT,
                pipeline=PIPELINE,
                stage=stage,
                source=SOURCE,
                source_id=source_id,
                directive=f"do {source_id}",
                max_attempts=max_attempts,
            )
        )
        if known is not None:
            assert (result.id, result.new) == (known, False)
            assert self.row(known) == before, "a duplicate enqueue changed its message"
            return known
        assert result.new and result.id not in self.model
        self.keys[(source_id, stage)] = result.id
        m = Model(result.id, max_attempts, not_before=self.now, stage=stage)
        m.log.append(Logged(None, S.PENDING, "enqueued", 0, None))
        self.model[result.id] = m
        return result.id

    def any_in(self, status: MessageStatus) -> bool:
        return any(m.status is status for m in self.model.values())

    def _ready(self) -> list[Model]:
        return sorted(
            (
                m
                for m in self.model.values()
                if m.status is S.PENDING and not m.deferred and m.not_before <= self.now
            ),
            key=lambda m: (m.not_before, m.id),
        )

    @precondition(lambda self: self.any_in(S.PENDING))
    @rule(limit=st.integers(1, 3), lease=st.sampled_from(LEASES))
    def claim(self, limit: int, lease: timedelta) -> None:
        ready = self._ready()[:limit]
        if len(ready) < limit:
            # A claim that finds too little promotes what has come due, and asks again for
            # the rest: all it found first, then the first of the promoted, in claim order.
            for m in self.model.values():
                if m.status is S.PENDING and m.deferred and m.not_before <= self.now:
                    m.deferred = False
            first = {m.id for m in ready}
            more = [m for m in self._ready() if m.id not in first][: limit - len(ready)]
            ready = sorted([*ready, *more], key=lambda m: (m.not_before, m.id))
        got = self.run(self.bus.claim("w", limit=limit, lease=lease, now=self.now))
        assert [g.id for g in got] == [m.id for m in ready]
        tokens = [g.lease_token for g in got]
        assert len(set(tokens)) == len(tokens)
        # Fresh: above every token given out before this claim (a claim that asked again
        # after promoting returns both rounds' in claim order, not token order).
        before = self.top_token
        for g, m in zip(got, ready, strict=True):
            assert g.lease_token is not None and g.lease_token > before
            self.top_token = max(self.top_token, g.lease_token)
            m.attempts += 1
            m.token = g.lease_token
            m.run_deadline = self.now + MAX_RUNTIME[m.stage]
            m.expires = min(self.now + lease, m.run_deadline)
            m.move(S.RUNNING, "claimed")
            assert g.status is S.RUNNING and g.attempts == m.attempts
            assert g.lease_expires_at == m.expires and g.claimed_by == "w"
        self.leases.extend(got)

    @precondition(lambda self: bool(self.leases))
    @rule(
        data=st.data(),
        act=WRITES,
        extend=st.sampled_from(LEASES),
    )
    def worker_writes(self, data: st.DataObject, act: str, extend: timedelta) -> None:
        """A worker writes under a lease: any lease ever handed out, current or long lost.

        One rule for the three writes, so that swarm testing does not switch fencing off
        piecemeal. Most leases ever issued are long dead, so the lease is drawn from all of
        them, or from those still held, or from those lost to a newer claim that is running
        now (the case fencing exists for).
        """
        running = [g for g in self.leases if self.model[g.id].status is S.RUNNING]
        held = [g for g in running if self.model[g.id].token == g.lease_token]
        lost = [g for g in running if self.model[g.id].token != g.lease_token]
        pool = data.draw(st.sampled_from([p for p in (self.leases, held, lost) if p]))
        self.write(act, data.draw(st.sampled_from(pool)), extend)

    def write(self, act: str, message: Message, extend: timedelta) -> None:
        if act == "heartbeat":
            self.heartbeat(message, extend)
        elif act == "complete":
            self.complete(message)
        else:
            self.fail(message)

    def heartbeat(self, message: Message, extend: timedelta) -> None:
        m = self.model[message.id]
        expected = m.ack_for(message.lease.lease_token)
        overran = expected is AckOutcome.APPLIED and self.now >= (m.run_deadline or self.now)
        before = self.row(m.id)
        beat = self.run(self.bus.heartbeat(message.lease, extend=extend, now=self.now))
        if overran:
            # Past its hard run deadline the current lease is not extended: OVERRUN.
            assert beat.outcome is AckOutcome.OVERRUN
            assert self.row(m.id) == before, "an overrun heartbeat changed the row"
            return
        assert beat.outcome is expected
        if expected is AckOutcome.APPLIED:
            assert m.run_deadline is not None
            m.expires = min(self.now + extend, m.run_deadline)
            assert beat.lease_expires_at == m.expires
            assert self.row(m.id).lease_expires_at == m.expires
        else:
            assert beat.lease_expires_at is None
            assert self.row(m.id) == before, f"a {expected} heartbeat changed the row"

    def complete(self, message: Message) -> None:
        m = self.model[message.id]
        expected = m.ack_for(message.lease.lease_token)
        before = self.row(m.id)
        result = {"token": message.lease.lease_token}
        outcome = self.run(self.bus.complete(message.lease, result, now=self.now))
        if m.token == message.lease.lease_token and m.status is S.DONE:
            # Sent again under the lease that completed it: applied (by the first), unchanged.
            assert outcome is AckOutcome.APPLIED
            assert self.row(m.id) == before, "a completion sent again changed the row"
            return
        assert outcome is expected
        if expected is AckOutcome.APPLIED:
            m.expires = None
            m.move(S.DONE, "completed")
            self.done[m.id] = result
        else:
            assert self.row(m.id) == before, f"a {expected} completion changed the row"

    def fail(self, message: Message) -> None:
        m = self.model[message.id]
        ack = m.ack_for(message.lease.lease_token)
        before = self.row(m.id)
        outcome = self.run(self.bus.fail(message, "boom", now=self.now))
        if ack is not AckOutcome.APPLIED:
            assert outcome is FailOutcome(ack.value)
            assert self.row(m.id) == before, f"a {ack} failure changed the row"
            return
        m.expires = None
        m.not_before = self.now + backoff(message.attempts)
        if m.attempts >= m.max_attempts:
            assert outcome is FailOutcome.DEAD
            m.move(S.DEAD, "attempts_exhausted")
        else:
            assert outcome is FailOutcome.RETRY
            m.move(S.PENDING, "attempt_failed")
            m.deferred = m.not_before > self.now
        m.token = None
        after = self.row(m.id)
        assert after.error == "boom" and after.not_before == m.not_before

    @rule(message_id=messages)
    def cancel(self, message_id: int) -> None:
        m = self.model[message_id]
        before = self.row(m.id)
        done = self.run(self.bus.cancel(TENANT, message_id, reason="stop", now=self.now))
        if m.status in TERMINAL:
            assert not done
            assert self.row(m.id) == before, "a refused cancel changed the row"
            return
        assert done
        m.expires = None
        m.deferred = False
        m.move(S.CANCELLED, "stop")

    @precondition(lambda self: self.any_in(S.RUNNING))
    @rule()
    def reclaim(self) -> None:
        stuck = [
            m
            for m in self.model.values()
            if m.status is S.RUNNING and m.expires is not None and m.expires < self.now
        ]
        got = self.run(self.bus.reclaim(now=self.now))
        assert sorted(got) == sorted(m.id for m in stuck)
        for m in stuck:
            m.expires = None
            if m.attempts >= m.max_attempts:
                m.not_before = self.now
                m.move(S.DEAD, "lease_expired")
            else:
                # A failed attempt's backoff, jittered by the database per row: anywhere from
                # the model's floor to twice it.
                floor = self.now + backoff(m.attempts)
                got_at = self.row(m.id).not_before
                assert floor <= got_at <= floor + backoff(m.attempts), (got_at, floor)
                m.not_before = got_at
                m.deferred = True
                m.move(S.PENDING, "lease_expired")
            m.token = None

    @precondition(lambda self: self.any_in(S.DEAD))
    @rule(target_id=st.none() | messages)
    def redrive(self, target_id: int | None) -> None:
        dead = [
            m
            for m in self.model.values()
            if m.status is S.DEAD and (target_id is None or m.id == target_id)
        ]
        ids = None if target_id is None else [target_id]
        moved = self.run(self.bus.redrive(TENANT, ids, now=self.now)).moved
        assert moved == sorted(m.id for m in dead)
        for m in dead:
            m.reset_by_redrive += m.attempts
            m.attempts = 0
            m.not_before = self.now
            m.move(S.PENDING, "redriven")

    @precondition(lambda self: self.any_in(S.PENDING))
    @rule()
    def promote_due(self) -> None:
        due = [
            m
            for m in self.model.values()
            if m.status is S.PENDING and m.deferred and m.not_before <= self.now
        ]
        assert self.run(self.bus.promote_due(now=self.now)) == len(due)
        for m in due:
            m.deferred = False

    @rule(seconds=st.integers(0, 90))
    def advance_clock(self, seconds: int) -> None:
        self.now += timedelta(seconds=seconds)

    @precondition(lambda self: self.any_in(S.RUNNING))
    @rule(data=st.data(), lease=st.sampled_from(LEASES), act=WRITES)
    def worker_comes_back(self, data: st.DataObject, lease: timedelta, act: str) -> None:
        """The race fencing exists for, as one step: a worker goes silent, the clock passes its
        lease, the reclaimer runs, a claimer takes work again, and then the first worker wakes
        up and writes. Made of the rules above; a rule of its own so that the race is common,
        not a rare alignment of five steps (swarm testing switches a random subset of rules
        off in each example)."""
        running = sorted(m.id for m in self.model.values() if m.status is S.RUNNING)
        m = self.model[data.draw(st.sampled_from(running))]
        (silent,) = (g for g in self.leases if g.lease_token == m.token)
        assert m.expires is not None
        self.advance_clock(max(0, int((m.expires - self.now).total_seconds()) + 1))
        self.reclaim()
        self.claim(3, lease)
        self.write(act, silent, lease)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def database_agrees_with_the_model(self) -> None:
        rows, log = self.run(self._snapshot())
        assert set(rows) == set(self.model)
        for message_id, m in self.model.items():
            row = rows[message_id]
            assert (row["status"], row["attempts"], row["lease_token"]) == (
                m.status,
                m.attempts,
                m.token,
            ), f"message {message_id}"
            # Running iff leased: at most one current lease per message.
            assert (row["status"] == S.RUNNING) == (row["lease_expires_at"] is not None)
            assert row["lease_expires_at"] == m.expires
            assert row["run_deadline"] == m.run_deadline
            assert row["max_attempts"] == m.max_attempts
            if m.status is S.PENDING:
                assert row["not_before"] == m.not_before
            assert row["deferred"] == m.deferred, f"message {message_id}"
            self._check_log(message_id, row, log.get(message_id, []), m)
        for message_id, result in self.done.items():
            assert (rows[message_id]["status"], rows[message_id]["result"]) == (S.DONE, result)

    @staticmethod
    def _check_log(
        message_id: int, row: dict[str, Any], entries: list[dict[str, Any]], m: Model
    ) -> None:
        assert entries, f"message {message_id} has no log"
        assert (entries[0]["from_status"], entries[0]["to_status"]) == (None, S.PENDING)
        for prev, cur in itertools.pairwise(entries):
            assert cur["from_status"] == prev["to_status"], f"message {message_id}: broken chain"
            pair = (MessageStatus(cur["from_status"]), MessageStatus(cur["to_status"]))
            assert pair in LEGAL_TRANSITIONS, f"message {message_id}: illegal {pair}"
        assert entries[-1]["to_status"] == row["status"]
        runs = sum(1 for e in entries if e["to_status"] == S.RUNNING)
        assert runs == row["attempts"] + m.reset_by_redrive
        got = [
            Logged(
                None if e["from_status"] is None else MessageStatus(e["from_status"]),
                MessageStatus(e["to_status"]),
                e["reason"],
                e["attempt"],
                e["lease_token"],
            )
            for e in entries
        ]
        assert got == m.log, f"message {message_id}: log differs from the model"

    async def _snapshot(
        self,
    ) -> tuple[dict[int, dict[str, Any]], dict[int, list[dict[str, Any]]]]:
        async with self.db.system_conn() as conn:
            cur = await conn.execute(
                "SELECT id, status::text AS status, attempts, max_attempts, lease_token,"
                " lease_expires_at, run_deadline, not_before, deferred, result"
                " FROM agent_messages"
            )
            rows = {r["id"]: r for r in await cur.fetchall()}
            cur = await conn.execute(
                "SELECT running FROM tenant_running WHERE tenant = %s", (TENANT,)
            )
            counter = await cur.fetchone()
            assert counter is not None
            # The tenant's running counter (what claims check concurrency against) stays exact.
            assert counter["running"] == sum(r["status"] == S.RUNNING for r in rows.values())
            cur = await conn.execute(
                "SELECT message_id, from_status::text AS from_status,"
                " to_status::text AS to_status, reason, attempt, lease_token"
                " FROM message_transitions ORDER BY id"
            )
            log: dict[int, list[dict[str, Any]]] = {}
            for r in await cur.fetchall():
                log.setdefault(r["message_id"], []).append(r)
        return rows, log


def test_envelope_state_machine(fresh_db: Endpoints) -> None:
    with psycopg.connect(fresh_db.admin, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO appliance.pipeline_stages"
            " (pipeline, stage, lane, task_kind, handler, directive, max_runtime, max_attempts)"
            " VALUES (%s, 'review', 'interactive', 'test', 'test', 'review it', %s, 3)",
            (PIPELINE, MAX_RUNTIME["review"]),
        )

    class Machine(EnvelopeMachine):
        endpoints = fresh_db

    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=40,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        ),
    )
