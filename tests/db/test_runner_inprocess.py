"""A Runner in the test's own event loop against real PostgreSQL: cancellation reaching a
handler, bad handlers failing their attempt, and the runner's health in the status."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import psycopg
import pytest

from appliance.bus.core import Bus
from appliance.bus.runner import Runner, RunnerConfig
from appliance.db.database import Database, Endpoints
from appliance.db.listener import PgDoorbell
from appliance.db.runner_store import PgRunnerStore
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.envelope import EnqueueRequest, Lane, MessageStatus
from appliance.domain.errors import InvalidInput
from appliance.domain.inference import QueueFull, Tier
from appliance.domain.pipeline import Pipeline, Registry, Stage, StageContext, StageResult
from appliance.domain.ports import LaneClaim
from appliance.domain.retry import RetryPolicy

seen: dict[str, Any] = {}


async def patient(ctx: StageContext) -> StageResult:
    started = time.monotonic()
    await ctx.wait_cancelled()
    seen["waited"] = time.monotonic() - started
    seen["reason"] = ctx.cancel_reason
    return ctx.finish({"saw": "cancel"})


async def wrong(ctx: StageContext) -> StageResult:
    return "not a result"  # type: ignore[return-value]


async def unstorable(ctx: StageContext) -> StageResult:
    return ctx.finish({"at": datetime.now(UTC)})  # not JSON


async def quick(ctx: StageContext) -> StageResult:
    return ctx.finish({"ok": True})


async def interrupts(ctx: StageContext) -> StageResult:
    raise KeyboardInterrupt


async def exits(ctx: StageContext) -> StageResult:
    raise SystemExit(3)


class LibrarySignal(BaseException):
    """A BaseException of a library's own (neither Exception nor a cancellation)."""


async def signals(ctx: StageContext) -> StageResult:
    raise LibrarySignal("stop here")


async def self_cancels(ctx: StageContext) -> StageResult:
    raise asyncio.CancelledError


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


async def unprintable(ctx: StageContext) -> StageResult:
    raise Unprintable


async def sleepy(ctx: StageContext) -> StageResult:
    await asyncio.sleep(30)  # never looks at ctx.cancelled, but a task cancel ends it
    return ctx.finish({"slept": True})


# Lets the stubborn handler end when its test is over (its task would outlive the loop).
stubborn_may_end = asyncio.Event()


async def stubborn(ctx: StageContext) -> StageResult:
    while not stubborn_may_end.is_set():
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            continue  # ignores every cancellation
    return ctx.finish({"ended": "late"})


async def oversized(ctx: StageContext) -> StageResult:
    return ctx.finish({"blob": "z" * 3000})


async def spawns_too_much(ctx: StageContext) -> StageResult:
    try:
        ctx.spawn("run", "child", context={"blob": "z" * 3000})
    except InvalidInput as exc:
        return ctx.finish({"refused": str(exc)})  # told at once: it can act on it
    return ctx.finish({"refused": None})


async def refuses(ctx: StageContext) -> StageResult:
    raise InvalidInput("context", "a ticket is an object with subject and body")


PIPES = [
    Pipeline("refuses", (Stage("run", refuses, max_attempts=5),)),
    Pipeline("oversized", (Stage("run", oversized, max_attempts=3),)),
    Pipeline("spawns_too_much", (Stage("run", spawns_too_much),)),
    Pipeline("patient", (Stage("run", patient),)),
    Pipeline("wrong", (Stage("run", wrong, max_attempts=3),)),
    Pipeline("unstorable", (Stage("run", unstorable, max_attempts=3),)),
    Pipeline("quick", (Stage("run", quick),)),
    Pipeline("interrupts", (Stage("run", interrupts, max_attempts=1),)),
    Pipeline("exits", (Stage("run", exits, max_attempts=1),)),
    Pipeline("self_cancels", (Stage("run", self_cancels, max_attempts=1),)),
    Pipeline("signals", (Stage("run", signals, max_attempts=1),)),
    Pipeline("unprintable", (Stage("run", unprintable, max_attempts=1),)),
    Pipeline("stubborn", (Stage("run", stubborn),)),
    Pipeline("sleepy", (Stage("run", sleepy),)),
]


S = TypeVar("S", bound=PgRunnerStore)


def opened(
    fresh_db: Endpoints, pipes: list[Pipeline]
) -> AbstractAsyncContextManager[PgRunnerStore]:
    """The product's store, as opened_as gives it."""
    return opened_as(fresh_db, pipes, PgRunnerStore)


@asynccontextmanager
async def opened_as(
    fresh_db: Endpoints, pipes: list[Pipeline], store_cls: type[S]
) -> AsyncIterator[S]:
    """A store (of `store_cls`) on its own pools, tenant `acme` added and `pipes` synced."""
    db = Database(fresh_db, max_size=8)
    await db.open()
    try:
        await PgTenantStore(db).add("acme")
        store = store_cls(db)
        await store.sync_pipelines(pipes)
        yield store
    finally:
        await db.close()


@asynccontextmanager
async def serving(
    store: PgRunnerStore,
    pipes: list[Pipeline],
    config: RunnerConfig,
    doorbell: PgDoorbell | None,
    *gates: asyncio.Event,
    **options: Any,
) -> AsyncIterator[Runner]:
    """A runner of `pipes` in this event loop; on the way out its `gates` open, then it stops.
    `options`: more Runner arguments (its clock)."""
    for g in gates:
        g.clear()
    runner = Runner(store, Registry(pipes), config, doorbell=doorbell, **options)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        yield runner
    finally:
        for g in gates:
            g.set()
        stop.set()
        await asyncio.wait_for(task, 20)


@pytest.fixture
async def running(fresh_db: Endpoints) -> AsyncIterator[tuple[Bus, PgRunnerStore, Runner]]:
    config = RunnerConfig(
        worker_id="inproc",
        concurrency=4,
        lease=timedelta(seconds=1.5),
        poll_interval=timedelta(seconds=5),
        cancel_grace=timedelta(seconds=1),
        report_every=timedelta(seconds=0.5),
    )
    async with (
        opened(fresh_db, PIPES) as store,
        serving(store, PIPES, config, PgDoorbell(fresh_db.system)) as runner,
    ):
        yield Bus(store), store, runner


async def wait_status(bus: Bus, mid: int, status: MessageStatus, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await bus.get("acme", mid)
        if got is not None and got.status is status:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"message {mid} never became {status}")


def request(bus: Bus, pipeline: str, sid: str = "1") -> dict[str, Any]:
    return {
        "tenant": "acme",
        "pipeline": pipeline,
        "stage": "run",
        "source": "t",
        "source_id": sid,
        "directive": "go",
    }


async def test_cancellation_reaches_the_running_handler(running) -> None:
    bus, _, runner = running
    seen.clear()
    r = await bus.enqueue(**request(bus, "patient"))
    await wait_status(bus, r.id, MessageStatus.RUNNING)
    assert await bus.cancel("acme", r.id, reason="operator")
    for _ in range(100):  # the next heartbeat (every 0.5 s) carries the cancellation
        if "waited" in seen:
            break
        await asyncio.sleep(0.05)
    assert seen.get("reason") == "cancelled"
    got = await bus.get("acme", r.id)
    assert got is not None and got.status is MessageStatus.CANCELLED
    await asyncio.sleep(0.5)
    assert runner.stats.late_acks == 1  # its result was refused: the message stays cancelled


async def test_handler_returning_the_wrong_type_fails_clearly(running) -> None:
    bus, _, _ = running
    r = await bus.enqueue(**request(bus, "wrong"))
    await wait_status(bus, r.id, MessageStatus.DEAD)
    got = await bus.get("acme", r.id)
    assert got is not None and "returned str, not a StageResult" in (got.error or "")
    # Dead at once: the same code returns the same on every attempt (its stage allows 3).
    assert got.attempts == 1


async def test_a_result_that_is_not_json_fails_the_attempt_clearly(running) -> None:
    # Not queued as an acknowledgement the database would refuse forever (its lease kept
    # alive by heartbeats meanwhile): the attempt fails, naming the problem.
    bus, _, runner = running
    r = await bus.enqueue(**request(bus, "unstorable"))
    await wait_status(bus, r.id, MessageStatus.DEAD)
    got = await bus.get("acme", r.id)
    assert got is not None and "returned a result that is not JSON-serialisable" in (
        got.error or ""
    )
    assert got.attempts == 1  # not retried (its stage allows 3)
    assert runner.stats.failed == 1


@pytest.mark.parametrize(
    ("pipeline", "error"),
    [
        # Left to propagate, these two stopped the event loop: the runner died, and so did
        # every runner that picked the message up after it.
        ("interrupts", "KeyboardInterrupt"),
        ("exits", "SystemExit: 3"),
        # These were written nowhere: the lease lapsed and the reclaimer blamed a dead worker.
        ("self_cancels", "handler raised CancelledError"),
        ("unprintable", "Unprintable: (its message could not be rendered)"),
        ("signals", "LibrarySignal: stop here"),
    ],
)
async def test_a_handler_raising_anything_fails_only_its_attempt(
    running, pipeline: str, error: str
) -> None:
    bus, _, runner = running
    r = await bus.enqueue(**request(bus, pipeline))
    await wait_status(bus, r.id, MessageStatus.DEAD, timeout=5)  # well inside its lease
    got = await bus.get("acme", r.id)
    assert got is not None and got.error == error
    after = await bus.enqueue(**request(bus, "quick", "after"))
    await wait_status(bus, after.id, MessageStatus.DONE)
    assert runner.stats.failed == 1


async def test_a_handler_that_refuses_its_input_ends_the_message_at_once(running) -> None:
    # The same input fails every attempt: dead after the first, saying why, not retried four
    # more times with backoff.
    bus, _, runner = running
    r = await bus.enqueue(**request(bus, "refuses"))
    await wait_status(bus, r.id, MessageStatus.DEAD, timeout=5)
    got = await bus.get("acme", r.id)
    assert got is not None and got.attempts == 1
    assert got.error == (
        "handler refused its input: InvalidInput: context: a ticket is an object with subject"
        " and body"
    )
    assert runner.stats.failed == 1 and runner.stats.budget_exhausted == 0


async def test_a_handler_that_ignores_cancellation_is_given_up_on(running) -> None:
    bus, _, runner = running
    stubborn_may_end.clear()
    try:
        r = await bus.enqueue(**request(bus, "stubborn"))
        await wait_status(bus, r.id, MessageStatus.RUNNING)
        assert await bus.cancel("acme", r.id, reason="operator")
        # The heartbeat (every 0.5 s) carries the cancellation; after the 1 s grace the task
        # is cancelled (ignored) and given up on: no longer running, its task holds its slot
        # as an abandoned one until it ends.
        for _ in range(200):
            if runner.stats.abandoned:
                break
            await asyncio.sleep(0.05)
        assert runner.stats.abandoned == 1
        assert runner.slots.running[Lane.INTERACTIVE] == 0
        assert runner.slots.abandoned[Lane.INTERACTIVE] == 1
        assert [t.get_name() for t in runner.abandoned_tasks()] != []
    finally:
        stubborn_may_end.set()


async def test_a_handler_that_ends_when_cancelled_is_not_counted_as_abandoned(running) -> None:
    bus, _, runner = running
    r = await bus.enqueue(**request(bus, "sleepy"))
    await wait_status(bus, r.id, MessageStatus.RUNNING)
    assert await bus.cancel("acme", r.id, reason="operator")
    for _ in range(100):  # heartbeat 0.5 s + grace 1 s: the task cancel ends it
        if runner.slots.running[Lane.INTERACTIVE] == 0:
            break
        await asyncio.sleep(0.05)
    assert runner.slots.running[Lane.INTERACTIVE] == 0
    await asyncio.sleep(1.5)  # past the moment a stubborn one would be given up on
    assert runner.stats.abandoned == 0 and runner.abandoned_tasks() == []


async def test_work_no_live_runner_serves_waits_parked_for_one_that_does(running) -> None:
    bus, store, _ = running
    # Another pipeline, and a stage that a pipeline this runner serves does not have (a
    # newer version's): claimed before, failed "no handler" and dead after its attempts.
    elsewhere = await bus.enqueue(**request(bus, "elsewhere"))
    newer = await bus.enqueue(**{**request(bus, "quick"), "stage": "newer"})
    mine = await bus.enqueue(**request(bus, "quick", sid="2"))
    await wait_status(bus, mine.id, MessageStatus.DONE)
    for mid, waits in ((elsewhere.id, "stage:elsewhere/run"), (newer.id, "stage:quick/newer")):
        await wait_status(bus, mid, MessageStatus.WAITING_CAPABILITY)
        got = await bus.get("acme", mid)
        assert got is not None and got.attempts == 0 and got.error is None
        assert got.extra["waiting_for"] == waits
    other = [
        Pipeline("elsewhere", (Stage("run", quick),)),
        Pipeline("quick", (Stage("run", quick), Stage("newer", quick))),
    ]
    config = RunnerConfig(worker_id="other", concurrency=4, poll_interval=timedelta(seconds=5))
    # A runner that serves them resumes them when it starts.
    async with serving(store, other, config, None):
        await wait_status(bus, elsewhere.id, MessageStatus.DONE)
        await wait_status(bus, newer.id, MessageStatus.DONE)


async def test_unserved_work_waits_as_long_as_the_stage_wait_and_a_stopping_runner_leaves_it(
    fresh_db: Endpoints,
) -> None:
    mine = [Pipeline("quick", (Stage("run", quick),))]
    theirs = [Pipeline("elsewhere", (Stage("run", quick),))]
    async with opened(fresh_db, mine + theirs) as store:
        bus = Bus(store)
        config = RunnerConfig(
            worker_id="mine",
            concurrency=4,
            poll_interval=timedelta(seconds=5),
            stage_wait=timedelta(minutes=3),
        )
        async with serving(store, mine, config, PgDoorbell(fresh_db.system)):
            parked = await bus.enqueue(**request(bus, "elsewhere"))
            await wait_status(bus, parked.id, MessageStatus.WAITING_CAPABILITY)
        got = await bus.get("acme", parked.id)
        assert got is not None
        # The runner's stage wait, from the moment of parking (the database's clock).
        assert got.extra["wait_expires_at"] - got.updated_at == timedelta(minutes=3)
        # A runner of that stage that is stopping does not resume it: it would not claim it,
        # and the others would still leave it to this runner.
        runner = Runner(store, Registry(theirs), replace(config, worker_id="theirs"))
        runner._mark_stopping()
        await runner._resume_stages()
        got = await bus.get("acme", parked.id)
        assert got is not None and got.status is MessageStatus.WAITING_CAPABILITY
        runner._stopping = False
        await runner._resume_stages()
        got = await bus.get("acme", parked.id)
        assert got is not None and got.status is MessageStatus.PENDING


class _GatedClaims(PgRunnerStore):
    """The store, holding every claim until `gate` opens."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.gate = asyncio.Event()

    async def claim_lane(self, **kw: Any) -> LaneClaim:
        await self.gate.wait()
        return await super().claim_lane(**kw)


async def test_work_another_live_runner_serves_is_left_to_it(fresh_db: Endpoints) -> None:
    mine = [Pipeline("quick", (Stage("run", quick),))]
    theirs = [Pipeline("elsewhere", (Stage("run", quick),))]
    async with (
        opened_as(fresh_db, mine + theirs, PgRunnerStore) as store,
        opened_as(fresh_db, [], _GatedClaims) as gated,
    ):
        bus = Bus(store)
        slow = RunnerConfig(worker_id="theirs", concurrency=4, poll_interval=timedelta(seconds=5))
        # Their runner is up (registered, reporting) but claims nothing until the gate opens.
        async with serving(gated, theirs, slow, None, gated.gate):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if await store.stages_elsewhere("mine", now=None):
                    break  # registered: this runner's claims will skip its stages
                await asyncio.sleep(0.02)
            config = RunnerConfig(
                worker_id="mine", concurrency=4, poll_interval=timedelta(seconds=1)
            )
            async with serving(store, mine, config, PgDoorbell(fresh_db.system)) as runner:
                ids = [
                    (await bus.enqueue(**request(bus, "elsewhere", sid=f"e{i}"))).id
                    for i in range(3)
                ]
                # Keys ignore the pipeline: a source id of its own.
                done = await bus.enqueue(**request(bus, "quick", sid="q"))
                await wait_status(bus, done.id, MessageStatus.DONE)
                await asyncio.sleep(1.5)  # doorbells and a fallback poll of this runner
                for mid in ids:
                    got = await bus.get("acme", mid)
                    assert got is not None and got.status is MessageStatus.PENDING
                    assert got.attempts == 0
                assert runner.stats.parked_unserved == 0
                gated.gate.set()
                for mid in ids:
                    await wait_status(bus, mid, MessageStatus.DONE)


async def test_status_shows_the_runner_and_its_listener(running) -> None:
    bus, store, _ = running
    r = await bus.enqueue(**request(bus, "quick"))
    await wait_status(bus, r.id, MessageStatus.DONE)
    await asyncio.sleep(0.7)
    st = await store.status()
    (me,) = [x for x in st.runners if x.id == "inproc"]
    assert me.alive and me.listener_connected and me.completed >= 1
    # Everything was announced by the doorbell: no poll found work it had missed.
    assert me.missed_wakeups == 0 and me.last_missed_wakeup_age_s is None
    assert st.stages["quick"]["run"] == {"done": 1}


gate = asyncio.Event()


async def gated(ctx: StageContext) -> StageResult:
    await gate.wait()
    return ctx.finish({"ok": True})


async def test_work_held_back_by_the_tenant_limit_runs_when_other_lane_work_ends(
    fresh_db: Endpoints,
) -> None:
    """The tenant limit counts all lanes: when batch work of a tenant at its limit ends, the
    interactive work its claim left behind runs at once, not at the next fallback poll."""
    pipes = [
        Pipeline("gated", (Stage("run", gated, lane=Lane.BATCH),)),
        Pipeline("quick", (Stage("run", quick),)),
    ]
    config = RunnerConfig(
        worker_id="limited", concurrency=6, tenant_limit=2, poll_interval=timedelta(seconds=60)
    )
    async with (
        opened(fresh_db, pipes) as store,
        serving(store, pipes, config, PgDoorbell(fresh_db.system), gate) as runner,
    ):
        bus = Bus(store)
        held = [await bus.enqueue(**request(bus, "gated", str(i))) for i in range(2)]
        for r in held:
            await wait_status(bus, r.id, MessageStatus.RUNNING)
        probe = await bus.enqueue(**request(bus, "quick", "probe"))
        await asyncio.sleep(0.5)  # rung and claimed for: the tenant is at its limit
        got = await bus.get("acme", probe.id)
        assert got is not None and got.status is MessageStatus.PENDING
        gate.set()
        await wait_status(bus, probe.id, MessageStatus.DONE, timeout=5)
        assert runner.stats.polls == 0


gate_i = asyncio.Event()


async def gated_interactive(ctx: StageContext) -> StageResult:
    await gate_i.wait()
    return ctx.finish({"ok": True})


async def test_a_freed_shared_slot_serves_another_lane_that_rang(fresh_db: Endpoints) -> None:
    """Interactive work that rang while every slot was busy starts as soon as a batch message
    frees a shared slot, although the batch lane itself has nothing more to claim."""
    pipes = [
        Pipeline("gated", (Stage("run", gated, lane=Lane.BATCH),)),
        Pipeline("held", (Stage("run", gated_interactive),)),
        Pipeline("quick", (Stage("run", quick),)),
    ]
    # One interactive slot of its own, two shared, none for system.
    config = RunnerConfig(
        worker_id="shared",
        concurrency=3,
        reserved_interactive=1,
        reserved_system=0,
        poll_interval=timedelta(seconds=60),
    )
    doorbell = PgDoorbell(fresh_db.system)
    async with (
        opened(fresh_db, pipes) as store,
        serving(store, pipes, config, doorbell, gate, gate_i) as runner,
    ):
        bus = Bus(store)
        batch = await bus.enqueue(**request(bus, "gated", "b"))
        await wait_status(bus, batch.id, MessageStatus.RUNNING)  # the batch lane is now empty
        for sid in ("i1", "i2"):
            r = await bus.enqueue(**request(bus, "held", sid))
            await wait_status(bus, r.id, MessageStatus.RUNNING)
        probe = await bus.enqueue(**request(bus, "quick", "probe"))  # rings; no slot is free
        await asyncio.sleep(0.5)
        got = await bus.get("acme", probe.id)
        assert got is not None and got.status is MessageStatus.PENDING
        gate.set()  # the batch message ends and frees a shared slot
        await wait_status(bus, probe.id, MessageStatus.DONE, timeout=5)
        assert runner.stats.polls == 0


async def test_the_claim_path_reclaims_and_runs_stranded_work_without_a_doorbell(
    fresh_db: Endpoints,
) -> None:
    """No sweeper and no doorbell: a lease left behind by a dead worker is reclaimed on the
    claim path, and the work runs once its retry backoff is over (1-2 s), not at the next
    fallback poll."""
    async with opened(fresh_db, PIPES) as store:
        bus = Bus(store)
        r = await bus.enqueue(**request(bus, "quick", "stranded"))
        found = await store.claim_lane(
            worker="dead", lane=Lane.INTERACTIVE, limit=1, lease=timedelta(seconds=0.2),
            tenant_limit=8, now=None,
        )  # fmt: skip
        assert [m.id for m in found.messages] == [r.id]
        await asyncio.sleep(0.4)  # its lease has expired; nothing has reclaimed it
        config = RunnerConfig(worker_id="alone", poll_interval=timedelta(seconds=60))
        async with serving(store, PIPES, config, None) as runner:
            await wait_status(bus, r.id, MessageStatus.DONE, timeout=5)
            assert runner.stats.polls == 0


async def fans_out(ctx: StageContext) -> StageResult:
    ctx.spawn("leaf", "only")
    ctx.spawn("undeclared", "only")  # no stage declares its attempts: the bus setting does
    return ctx.finish()


FAN = [Pipeline("fan", (Stage("run", fans_out), Stage("leaf", quick, max_attempts=2)))]


async def test_spawned_work_is_enqueued_under_the_bus_settings(fresh_db: Endpoints) -> None:
    """A spawned message's key is kept for the configured retention, not a fixed 90 days, and
    one for a stage that declares no attempts gets the configured default, not a fixed 5."""
    async with opened(fresh_db, FAN) as store:
        bus = Bus(store)
        r = await bus.enqueue(**request(bus, "fan", "spawner"))
        config = RunnerConfig(
            worker_id="fan", poll_interval=timedelta(seconds=1),
            idempotency_retention=timedelta(days=3), max_attempts=7,
        )  # fmt: skip
        async with serving(store, FAN, config, None):
            await wait_status(bus, r.id, MessageStatus.DONE)
        async with store.db.system_conn() as conn:
            leaf = await (
                await conn.execute(
                    "SELECT m.stage, m.max_attempts, k.expires_at - k.created_at AS kept"
                    " FROM agent_messages m JOIN idempotency_keys k ON k.message_id = m.id"
                    " WHERE m.stage <> 'run' ORDER BY m.stage"
                )
            ).fetchall()
    # Spawned before the spawner's completion was recorded, so there once it is done.
    assert leaf == [
        {"stage": "leaf", "max_attempts": 2, "kept": timedelta(days=3)},
        {"stage": "undeclared", "max_attempts": 7, "kept": timedelta(days=3)},
    ]


spawn_gate = asyncio.Event()


async def spawns_after_gate(ctx: StageContext) -> StageResult:
    await spawn_gate.wait()
    ctx.spawn("leaf", "child")
    return ctx.finish()


LATE_SPAWN = [
    Pipeline("late", (Stage("run", spawns_after_gate), Stage("leaf", quick))),
]


async def test_an_attempt_cancelled_while_it_ran_spawns_nothing(fresh_db: Endpoints) -> None:
    # Cancelled while its handler ran, before the next heartbeat told it: the handler spawned
    # a child and returned. Its completion was refused (late), but the child was enqueued and
    # ran: spawns went in before, and apart from, the fenced completion.
    config = RunnerConfig(
        worker_id="late", lease=timedelta(seconds=30), poll_interval=timedelta(seconds=1)
    )
    async with (
        opened(fresh_db, LATE_SPAWN) as store,
        serving(store, LATE_SPAWN, config, None, spawn_gate) as runner,
    ):
        bus = Bus(store)
        r = await bus.enqueue(**request(bus, "late", "parent"))
        await wait_status(bus, r.id, MessageStatus.RUNNING)
        assert await bus.cancel("acme", r.id, reason="operator")
        spawn_gate.set()  # well before the next heartbeat (every 10 s)
        for _ in range(100):
            if runner.stats.late_acks:
                break
            await asyncio.sleep(0.05)
        assert runner.stats.late_acks == 1
        async with store.db.system_conn() as conn:
            rows = await (
                await conn.execute("SELECT stage, status FROM agent_messages ORDER BY id")
            ).fetchall()
    assert [(row["stage"], row["status"]) for row in rows] == [("run", "cancelled")]


async def spawns_big(ctx: StageContext) -> StageResult:
    ctx.spawn("leaf", "big", context={"blob": "x" * 2000})
    return ctx.finish()


BIG = [Pipeline("big", (Stage("run", spawns_big, max_attempts=1), Stage("leaf", quick)))]


async def test_spawned_work_is_held_to_the_configured_context_limit(fresh_db: Endpoints) -> None:
    """The bus's context limit (lowered here) binds work a stage spawns as it binds work
    enqueued from outside: the attempt fails naming the limit, and nothing is spawned."""
    async with opened(fresh_db, BIG) as store:
        bus = Bus(store)
        r = await bus.enqueue(**request(bus, "big", "over"))
        config = RunnerConfig(
            worker_id="big", poll_interval=timedelta(seconds=1), context_max_bytes=1024
        )
        async with serving(store, BIG, config, None):
            await wait_status(bus, r.id, MessageStatus.DEAD)
        got = await bus.get("acme", r.id)
        assert got is not None and got.error is not None
        assert "context" in got.error and "1024" in got.error
        async with store.db.system_conn() as conn:
            leaves = await (
                await conn.execute("SELECT count(*) AS n FROM agent_messages WHERE stage = 'leaf'")
            ).fetchone()
        assert leaves == {"n": 0}


async def bad_outcome(ctx: StageContext) -> StageResult:
    return StageResult({"ok": 1}, "label\x00")  # built without ctx.finish, say from model output


POISON = [
    Pipeline("badout", (Stage("run", bad_outcome, max_attempts=3),)),
    Pipeline("poison", (Stage("run", quick, max_attempts=1),)),
    Pipeline("quick", (Stage("run", quick),)),
]


class RefusingStore(PgRunnerStore):
    """Refuses, as the database refuses data it cannot hold, any batch with a poison message."""

    poison: set[int] = set()

    async def complete(self, completions: Any, **kw: Any) -> Any:
        if any(c.lease.message_id in self.poison for c in completions):
            raise InvalidInput("completion", "rejected by the database: unstorable")
        return await super().complete(completions, **kw)


async def test_a_result_that_cannot_be_stored_fails_alone_and_blocks_no_other(
    fresh_db: Endpoints,
) -> None:
    """One refused acknowledgement was retried with every later one, for ever: no result of the
    runner committed again, and work that had succeeded was re-run until dead."""
    async with opened_as(fresh_db, POISON, RefusingStore) as store:
        bus = Bus(store)
        bad = await bus.enqueue(**request(bus, "badout", "b"))
        poison = await bus.enqueue(**request(bus, "poison", "p"))
        store.poison = {poison.id}
        good = [(await bus.enqueue(**request(bus, "quick", f"q{i}"))).id for i in range(4)]
        config = RunnerConfig(worker_id="poison", poll_interval=timedelta(seconds=1))
        async with serving(store, POISON, config, None) as runner:
            for mid in good:
                await wait_status(bus, mid, MessageStatus.DONE)
            await wait_status(bus, bad.id, MessageStatus.DEAD)
            await wait_status(bus, poison.id, MessageStatus.DEAD)
            assert runner.stats.completed == 4
        got = await bus.get("acme", bad.id)
        assert got is not None and "outcome 'label\\x00', which is not a valid name" in str(
            got.error
        )
        assert got.attempts == 1  # not retried (its stage allows 3)
        got = await bus.get("acme", poison.id)
        assert got is not None and "could not be stored: rejected by the database" in str(got.error)


async def test_a_doorbell_whose_server_stops_answering_reconnects(fresh_db: Endpoints) -> None:
    """A connection that stops answering without closing (a frozen backend here; a partition
    or a vanished host alike) held the health check for ever: the doorbell said it was
    connected and heard nothing, and work waited for the fallback poll."""
    bell = PgDoorbell(fresh_db.system, health_every=0.5)
    await bell.start()
    frozen = bell.backend_pid
    assert frozen is not None
    os.kill(frozen, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if bell.reconnects and bell.connected and bell.backend_pid != frozen:
                break
            await asyncio.sleep(0.1)
        assert bell.reconnects >= 1 and bell.connected and bell.backend_pid != frozen
    finally:
        os.kill(frozen, signal.SIGCONT)
        await bell.close()


alone_started = asyncio.Event()
GATED = [Pipeline("gated", (Stage("run", gated, max_attempts=3),))]


class SlowAloneStore(RefusingStore):
    """Refuses batches with a poison message; each result sent alone takes a while."""

    async def complete(self, completions: Any, **kw: Any) -> Any:
        if len(completions) == 1 and not any(
            c.lease.message_id in self.poison for c in completions
        ):
            alone_started.set()
            await asyncio.sleep(0.3)
        return await super().complete(completions, **kw)


async def test_a_stop_while_a_refused_batch_goes_one_by_one_loses_no_result(
    fresh_db: Endpoints,
) -> None:
    """The results not yet sent alone were held by the sending coroutine only: a stop then
    dropped them, and work that had succeeded stayed running until reclaimed and re-run."""
    gate.clear()
    alone_started.clear()
    async with opened_as(fresh_db, GATED, SlowAloneStore) as store:
        bus = Bus(store)
        ids = [(await bus.enqueue(**request(bus, "gated", f"g{i}"))).id for i in range(6)]
        store.poison = {ids[0]}
        config = RunnerConfig(worker_id="alone", poll_interval=timedelta(seconds=0.5))
        async with serving(store, GATED, config, None) as runner:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if len(runner._attempts) == 6:
                    break
                await asyncio.sleep(0.05)
            gate.set()
            await asyncio.wait_for(alone_started.wait(), 10)
        # Stopped while the refused batch went one by one: every result is recorded.
        for mid in ids[1:]:
            got = await bus.get("acme", mid)
            assert got is not None and got.status is MessageStatus.DONE, (mid, got)


late_started = asyncio.Event()
late_gate = asyncio.Event()


async def fails_late(ctx: StageContext) -> StageResult:
    late_started.set()
    await late_gate.wait()
    raise RuntimeError("too late")


LATE = [Pipeline("late", (Stage("run", fails_late),))]


async def test_a_failure_of_an_attempt_cancelled_meanwhile_is_not_counted_as_one(
    fresh_db: Endpoints,
) -> None:
    late_started.clear()
    late_gate.clear()
    async with opened(fresh_db, LATE) as store:
        bus = Bus(store)
        r = await bus.enqueue(**request(bus, "late", "x"))
        config = RunnerConfig(worker_id="late", poll_interval=timedelta(seconds=0.5))
        async with serving(store, LATE, config, None) as runner:
            await asyncio.wait_for(late_started.wait(), 10)
            assert await bus.cancel("acme", r.id)
            late_gate.set()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if not runner._attempts:
                    break
                await asyncio.sleep(0.05)
            assert (runner.stats.failed, runner.stats.late_acks) == (0, 1)
        got = await bus.get("acme", r.id)
        assert got is not None and got.status is MessageStatus.CANCELLED


relapsed: list[str] = []
first_started = asyncio.Event()


async def outlives_its_lease(ctx: StageContext) -> StageResult:
    n = ctx.message.attempts
    relapsed.append(f"start {n}")
    first_started.set()
    if n > 1:
        return ctx.finish({"attempt": n})
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        relapsed.append(f"stopped {n} ({ctx.cancel_reason})")
        raise
    return ctx.finish({"attempt": n})


RELAPSE = [Pipeline("relapse", (Stage("run", outlives_its_lease, max_attempts=5),))]


async def test_a_message_claimed_again_while_its_lost_attempt_runs_keeps_both_apart(
    fresh_db: Endpoints,
) -> None:
    """The lease of a running attempt lapses unseen (a stalled loop, a slow database) and is
    reclaimed; the same runner claims the message again. Attempts were kept by message id: the
    new one replaced the old (never told it lost its lease, it ran on), and the old one's end
    then removed the new one (left without heartbeats, its slot never given back)."""
    relapsed.clear()
    first_started.clear()
    async with opened(fresh_db, RELAPSE) as store:
        bus = Bus(store)
        r = await bus.enqueue(**request(bus, "relapse", "once"))
        config = RunnerConfig(
            worker_id="relapse", poll_interval=timedelta(seconds=0.5),
            cancel_grace=timedelta(seconds=1), reclaim_every=timedelta(hours=1),
        )  # fmt: skip
        async with serving(store, RELAPSE, config, None) as runner:
            await asyncio.wait_for(first_started.wait(), 10)
            with psycopg.connect(fresh_db.admin, autocommit=True) as admin:
                admin.execute(
                    "UPDATE appliance.agent_messages SET lease_expires_at = now()"
                    " - interval '1 second' WHERE id = %s",
                    (r.id,),
                )
            # Reclaimed by this call, or by the runner's own reclaim beside its first claim (it
            # runs as a task of its own, which a loaded box may start only now): once.
            await store.reclaim()
            await wait_status(bus, r.id, MessageStatus.DONE)
            log = await store.transitions("acme", r.id)
            assert [t["reason"] for t in log].count("lease_expired") == 1
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if not runner._attempts:
                    break
                await asyncio.sleep(0.05)
            assert runner._attempts == {}
            assert sum(runner.slots.running.values()) == 0  # every slot given back
        assert relapsed[0] == "start 1" and "start 2" in relapsed
        assert "stopped 1 (lease_lost)" in relapsed  # told, not left running beside it
        got = await bus.get("acme", r.id)
        assert got is not None and got.result == {"attempt": 2}


flaky_calls: dict[str, list[float]] = {}


async def flaky(ctx: StageContext) -> StageResult:
    calls = flaky_calls.setdefault(ctx.message.source_id, [])
    calls.append(time.monotonic())
    if len(calls) == 1:
        raise RuntimeError("first attempt fails")
    return ctx.finish()


FLAKY = [Pipeline("flaky", (Stage("run", flaky),))]


async def test_retries_run_when_their_backoffs_end_without_doorbell_or_maintenance(
    fresh_db: Endpoints,
) -> None:
    """Failed attempts back off out of the claim's index; when each backoff ends, the runner
    that failed it makes it claimable again and runs it, rather than at the next poll: every
    retry's wake-up, not only the earliest."""
    flaky_calls.clear()
    async with opened(fresh_db, FLAKY) as store:
        bus = Bus(store)
        ids = [(await bus.enqueue(**request(bus, "flaky", sid))).id for sid in ("a", "b")]
        config = RunnerConfig(worker_id="retrier", poll_interval=timedelta(seconds=60))
        retry = RetryPolicy(base=timedelta(seconds=0.8), cap=timedelta(seconds=0.8))
        # Both fail in one claim, with backoffs apart (0.4-0.8 s, seeded).
        runner = Runner(
            store, Registry(FLAKY), config, doorbell=None, retry=retry, rng=random.Random(7)
        )
        stop = asyncio.Event()
        task = asyncio.create_task(runner.run(stop))
        try:
            for mid in ids:
                await wait_status(bus, mid, MessageStatus.DONE, timeout=10)
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)
        assert runner.stats.polls == 0
    gaps = [second - first for first, second in flaky_calls.values()]
    assert all(0.3 <= gap < 5 for gap in gaps), gaps  # the backoffs, not the 60 s poll
    assert abs(gaps[0] - gaps[1]) > 0.02, gaps  # the backoffs really differed


class _ClaimSizes(PgRunnerStore):
    """The store, noting how many messages each claim returned."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.sizes: list[int] = []

    async def claim_lane(self, **kw: Any) -> LaneClaim:
        found = await super().claim_lane(**kw)
        self.sizes.append(len(found.messages))
        return found


async def test_a_tenant_at_its_limit_is_claimed_for_in_full_batches(fresh_db: Endpoints) -> None:
    """A tenant at its limit: the database counts an attempt until its acknowledgement
    commits, but the runner's claims do not count its own finished attempts, so a claim sent
    beside their acknowledgements fills every slot they held rather than finding no room."""
    config = RunnerConfig(
        worker_id="full",
        concurrency=4,
        reserved_interactive=1,
        reserved_system=0,
        tenant_limit=4,
        poll_interval=timedelta(seconds=60),
    )
    async with opened_as(fresh_db, PIPES, _ClaimSizes) as store:
        async with serving(store, PIPES, config, PgDoorbell(fresh_db.system)) as runner:
            bus = Bus(store)
            await asyncio.sleep(0.3)  # the start-up claims of every lane are over
            results = await bus.enqueue_many(
                [bus.request(**request(bus, "quick", str(i))) for i in range(40)]
            )
            for r in results:
                await wait_status(bus, r.id, MessageStatus.DONE)
            assert runner.stats.completed == 40
        # Empty claims may come before the work arrives and after it is done, none between.
        sizes = store.sizes
        first = next(i for i, n in enumerate(sizes) if n)
        last = max(i for i, n in enumerate(sizes) if n)
        assert sizes[first : last + 1] == [4] * 10, sizes


class _GatedBatchClaims(PgRunnerStore):
    """The store, holding every batch-lane claim until `gate` opens."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.gate = asyncio.Event()

    async def claim_lane(self, **kw: Any) -> LaneClaim:
        if kw["lane"] is Lane.BATCH:
            await self.gate.wait()
        return await super().claim_lane(**kw)


async def test_an_interactive_ring_is_claimed_beside_a_batch_claim_in_flight(
    fresh_db: Endpoints,
) -> None:
    """Interactive work that rings while the runner awaits a batch claim is claimed at once,
    into the slots reserved for it, not after that claim returns."""
    pipes = [
        Pipeline("bulk", (Stage("run", quick, lane=Lane.BATCH),)),
        Pipeline("quick", (Stage("run", quick),)),
    ]
    config = RunnerConfig(worker_id="beside", poll_interval=timedelta(seconds=60))
    async with opened_as(fresh_db, pipes, _GatedBatchClaims) as store:
        doorbell = PgDoorbell(fresh_db.system)
        async with serving(store, pipes, config, doorbell, store.gate) as runner:
            bus = Bus(store)
            held = await bus.enqueue(**request(bus, "bulk", "held"))
            await asyncio.sleep(0.3)  # the runner's first fill now waits in its batch claim
            probe = await bus.enqueue(**request(bus, "quick", "probe"))
            await wait_status(bus, probe.id, MessageStatus.DONE, timeout=5)
            got = await bus.get("acme", held.id)
            assert got is not None and got.status is MessageStatus.PENDING
            store.gate.set()
            await wait_status(bus, held.id, MessageStatus.DONE, timeout=5)
            assert runner.stats.polls == 0


async def test_acknowledgements_linger_only_under_a_backlog(fresh_db: Endpoints) -> None:
    # Results wait (ack_linger) for those of a claim in flight, to share a statement. An idle
    # runner has no backlog: its single result is acknowledged at once, not after the
    # (here absurdly long) linger; and a drain still completes everything.
    config = RunnerConfig(
        worker_id="linger",
        concurrency=4,
        poll_interval=timedelta(seconds=5),
        ack_linger=timedelta(seconds=30),
    )
    async with opened(fresh_db, PIPES) as store:
        bus = Bus(store)
        async with serving(store, PIPES, config, PgDoorbell(fresh_db.system)):
            r = await bus.enqueue(**request(bus, "quick", "idle"))
            await wait_status(bus, r.id, MessageStatus.DONE, timeout=5)
        config = replace(config, ack_linger=timedelta(milliseconds=50))
        async with serving(store, PIPES, config, PgDoorbell(fresh_db.system)) as runner:
            ids = [
                r.id
                for r in await bus.enqueue_many(
                    [bus.request(**request(bus, "quick", f"d{i}")) for i in range(200)]
                )
            ]
            for mid in ids:
                await wait_status(bus, mid, MessageStatus.DONE, timeout=20)
            assert runner.stats.completed == 200


running_now = {"n": 0, "max": 0}


async def counted(ctx: StageContext) -> StageResult:
    running_now["n"] += 1
    running_now["max"] = max(running_now["max"], running_now["n"])
    try:
        await asyncio.sleep(0.001)  # long enough for others to start meanwhile, if allowed
        return ctx.finish({"ok": True})
    finally:
        running_now["n"] -= 1


async def test_a_backlog_of_quick_stages_is_claimed_ahead_of_the_free_slots(
    fresh_db: Endpoints,
) -> None:
    """Claims take more than the free slots (held, leased, started as slots free), yet never
    more handlers run than the runner's concurrency, and each message is done once."""
    pipes = [Pipeline("counted", (Stage("run", counted),))]
    config = RunnerConfig(
        worker_id="ahead",
        concurrency=2,
        reserved_interactive=1,
        reserved_system=0,
        claim_batch=8,
        claim_ahead=6,
        poll_interval=timedelta(seconds=60),
    )
    running_now.update(n=0, max=0)
    async with opened_as(fresh_db, pipes, _ClaimSizes) as store:
        async with serving(store, pipes, config, PgDoorbell(fresh_db.system)) as runner:
            bus = Bus(store)
            results = await bus.enqueue_many(
                [bus.request(**request(bus, "counted", str(i))) for i in range(300)]
            )
            for r in results:
                await wait_status(bus, r.id, MessageStatus.DONE)
            assert runner.stats.completed == 300 and runner.stats.late_acks == 0
        assert running_now["max"] <= 2
        assert max(store.sizes) > 2, store.sizes  # claimed ahead of the two slots
        assert runner.stats.released == 0  # nothing held long enough to be given back


gate_ahead = asyncio.Event()


async def gated_ahead(ctx: StageContext) -> StageResult:
    await gate_ahead.wait()
    return ctx.finish({"ok": True})


AHEAD_PIPES = [
    Pipeline("quick", (Stage("run", quick),)),
    Pipeline("gated", (Stage("run", gated_ahead),)),
    # A run may take 2 s: what is held for it must start well within that, or go back.
    Pipeline("short", (Stage("run", gated_ahead, max_runtime=timedelta(seconds=2)),)),
]


def ahead_config(worker_id: str, **kw: Any) -> RunnerConfig:
    """Two slots, five held at most, the whole limit whatever the measured rates (a wide
    window): which messages end up held does not depend on this box's speed."""
    return RunnerConfig(
        worker_id=worker_id,
        concurrency=2,
        reserved_interactive=0,
        reserved_system=0,
        claim_ahead=5,
        claim_ahead_window=1e9,
        poll_interval=timedelta(seconds=60),
        **kw,
    )


def two_quick_then_eight(bus: Bus, quick: str, gated: str, **kw: Any) -> list[EnqueueRequest]:
    """Two quick messages first in line, then eight gated ones. On an idle runner with two
    slots this plays out the same way whatever the box's speed: the first claim asks for the
    two free slots and gets the quick pair, all it asked for; the next, made when a slot frees,
    asks for that slot plus all the room left (a wide window) and gets gated work, which
    takes both slots and blocks there; the rest of that claim is held (4 or 5)."""
    return [bus.request(**request(bus, quick, f"w{i}"), **kw) for i in range(2)] + [
        bus.request(**request(bus, gated, f"g{i}"), priority=-1, **kw) for i in range(8)
    ]


async def hold_some(bus: Bus, runner: Runner, pipeline: str) -> tuple[list[int], int]:
    """Eight gated messages of `pipeline` (two_quick_then_eight): their ids and how many of
    them are held once both slots are blocked."""
    results = await bus.enqueue_many(two_quick_then_eight(bus, "quick", pipeline))
    deadline = time.monotonic() + 5
    while runner.slots.busy < 2 or runner._info()["stats"]["claimed_ahead"] < 4:
        assert time.monotonic() < deadline, runner._info()["stats"]
        await asyncio.sleep(0.01)
    return [r.id for r in results[2:]], runner._info()["stats"]["claimed_ahead"]


async def statuses(bus: Bus, ids: list[int]) -> list[tuple[MessageStatus, int]]:
    found = [await bus.get("acme", mid) for mid in ids]
    return sorted((m.status, m.attempts) for m in found if m is not None)


async def test_claimed_ahead_work_is_given_back_uncounted_when_the_runner_stops(
    fresh_db: Endpoints,
) -> None:
    config = ahead_config("stopper", drain_timeout=timedelta(seconds=0.3))
    gate_ahead.clear()
    try:
        async with opened(fresh_db, AHEAD_PIPES) as store:
            bus = Bus(store)
            async with serving(store, AHEAD_PIPES, config, PgDoorbell(fresh_db.system)) as runner:
                ids, held = await hold_some(bus, runner, "gated")
                assert 4 <= held <= 5
            # The held ones never ran; the two blocked were given back after the drain
            # timeout; the rest were never claimed. None of them counts an attempt.
            assert runner.stats.given_back_ahead == held
            assert runner.stats.released == held + 2
            assert await statuses(bus, ids) == [(MessageStatus.PENDING, 0)] * 8
    finally:
        gate_ahead.set()


async def test_held_work_goes_back_before_its_run_deadline_would_pass(
    fresh_db: Endpoints,
) -> None:
    """The slots stay busy far longer than measured: what was claimed ahead goes back (no
    attempt counted) well inside its 2 s run deadline, which counts from the claim, although
    leases here are 30 s and heartbeats every 10 s; then everything runs once."""
    config = ahead_config("holder")
    gate_ahead.clear()
    async with opened(fresh_db, AHEAD_PIPES) as store:
        bus = Bus(store)
        async with serving(
            store, AHEAD_PIPES, config, PgDoorbell(fresh_db.system), gate_ahead
        ) as runner:
            ids, held = await hold_some(bus, runner, "short")
            assert 4 <= held <= 5
            await asyncio.sleep(1.0)  # a quarter of the 2 s, and some
            assert runner._info()["stats"]["claimed_ahead"] == 0
            assert runner.stats.given_back_ahead == held
            # The two in the slots still run; the rest wait, no attempt counted.
            assert await statuses(bus, ids) == sorted(
                [(MessageStatus.RUNNING, 1)] * 2 + [(MessageStatus.PENDING, 0)] * 6
            )
            gate_ahead.set()  # the slots free: all of them run, each once
            for mid in ids:
                await wait_status(bus, mid, MessageStatus.DONE)
            assert runner.stats.late_acks == 0 and runner.stats.failed == 0


started: list[tuple[str, str]] = []
gates: dict[str, asyncio.Event] = {}


async def noted(ctx: StageContext) -> StageResult:
    started.append((ctx.message.lane.value, ctx.message.source_id))
    return ctx.finish({"ok": True})


async def noted_gated(ctx: StageContext) -> StageResult:
    started.append((ctx.message.lane.value, ctx.message.source_id))
    await gates.setdefault(ctx.message.source_id, asyncio.Event()).wait()
    return ctx.finish({"ok": True})


async def test_held_batch_work_waits_for_interactive_work_that_rang(fresh_db: Endpoints) -> None:
    """Batch work claimed ahead does not take a freed slot while interactive work waits: the
    slot goes to the interactive claim first (strict lane order), the held batch work after."""
    pipes = [
        Pipeline("bulk", (Stage("run", noted, lane=Lane.BATCH),)),
        Pipeline("bulkgated", (Stage("run", noted_gated, lane=Lane.BATCH),)),
        Pipeline("probe", (Stage("run", noted),)),
    ]
    started.clear()
    gates.clear()
    config = ahead_config("strict")
    try:
        async with opened(fresh_db, pipes) as store:
            bus = Bus(store)
            async with serving(store, pipes, config, PgDoorbell(fresh_db.system)) as runner:
                results = await bus.enqueue_many(
                    two_quick_then_eight(bus, "bulk", "bulkgated", lane=Lane.BATCH)
                )
                deadline = time.monotonic() + 10
                while (
                    len(blocking := [sid for _, sid in started if sid.startswith("g")]) < 2
                    or runner._info()["stats"]["claimed_ahead"] < 4
                ):
                    assert time.monotonic() < deadline, (started, runner._info()["stats"])
                    await asyncio.sleep(0.01)
                assert len(blocking) == 2 and runner.slots.busy == 2
                probe = await bus.enqueue(**request(bus, "probe", "p"))
                await asyncio.sleep(0.3)  # rung; no slot is free
                before = len(started)
                gates.setdefault(blocking[0], asyncio.Event()).set()  # one slot frees
                await wait_status(bus, probe.id, MessageStatus.DONE, timeout=5)
                assert started[before] == ("interactive", "p"), started[before:]
                for i in range(8):
                    gates.setdefault(f"g{i}", asyncio.Event()).set()
                for r in results:  # the rest, held or given back meanwhile, run once each
                    await wait_status(bus, r.id, MessageStatus.DONE, timeout=5)
                assert runner.stats.late_acks == 0
    finally:
        for event in gates.values():
            event.set()


async def test_a_result_over_the_context_limit_fails_its_attempt(fresh_db: Endpoints) -> None:
    """A result becomes the next stage's context: one over the limit was handed off past it
    (or, over PostgreSQL's own limit, refused with its whole acknowledgement batch)."""
    async with opened(fresh_db, PIPES) as store:
        bus = Bus(store)
        big = await bus.enqueue(**request(bus, "oversized", "big"))
        fine = await bus.enqueue(**request(bus, "quick", "fine"))
        spawner = await bus.enqueue(**request(bus, "spawns_too_much", "sp"))
        config = RunnerConfig(
            worker_id="limits", poll_interval=timedelta(seconds=1), context_max_bytes=2048
        )
        async with serving(store, PIPES, config, None):
            await wait_status(bus, big.id, MessageStatus.DEAD)
            await wait_status(bus, fine.id, MessageStatus.DONE)
            await wait_status(bus, spawner.id, MessageStatus.DONE)
        # A spawn over the limit is refused inside the handler, the first time it asks.
        told = await bus.get("acme", spawner.id)
        assert told is not None and told.attempts == 1 and told.result is not None
        assert "context: is 3011 bytes, over the limit of 2048 bytes" in told.result["refused"]
        got = await bus.get("acme", big.id)
        assert got is not None and got.result is None and got.attempts == 1  # of 3 allowed
        assert "returned a result of 3011 bytes, over the limit of 2048 bytes" in str(got.error)


async def test_a_runner_whose_clock_runs_ahead_of_the_database_still_runs_its_claims(
    fresh_db: Endpoints,
) -> None:
    """A claimed message may wait for a slot a share of its lease, read from the database's own
    times: measured against this machine's clock an hour ahead, every claim had no time left
    and was given back unrun, claim after claim."""
    async with opened(fresh_db, PIPES) as store:
        bus = Bus(store)
        ids = [(await bus.enqueue(**request(bus, "quick", f"c{i}"))).id for i in range(6)]
        config = RunnerConfig(worker_id="ahead", concurrency=4, poll_interval=timedelta(seconds=1))

        def ahead() -> datetime:
            return datetime.now(UTC) + timedelta(hours=1)

        async with serving(store, PIPES, config, None, clock=ahead) as runner:
            for mid in ids:
                await wait_status(bus, mid, MessageStatus.DONE)
            assert runner.stats.completed == 6


async def naps(ctx: StageContext) -> StageResult:
    await asyncio.sleep(0.01)
    return ctx.finish({"napped": True})


NAPS = [Pipeline("naps", (Stage("run", naps, max_runtime=timedelta(seconds=30), max_attempts=2),))]


async def test_a_runner_whose_clock_runs_ahead_gives_its_handlers_their_runtime(
    fresh_db: Endpoints,
) -> None:
    # The handler's timeout was the run deadline (the database's time) less this machine's
    # clock: 45 s ahead, a 30 s stage ended every handler at its first await, attempt after
    # attempt, until the message was dead.
    async with opened(fresh_db, NAPS) as store:
        bus = Bus(store)
        r = await bus.enqueue(**request(bus, "naps"))
        config = RunnerConfig(worker_id="ahead", concurrency=4, poll_interval=timedelta(seconds=1))

        def ahead() -> datetime:
            return datetime.now(UTC) + timedelta(seconds=45)

        async with serving(store, NAPS, config, None, clock=ahead) as runner:
            await wait_status(bus, r.id, MessageStatus.DONE)
            assert runner.stats.completed == 1 and runner.stats.failed == 0


async def overstays(ctx: StageContext) -> StageResult:
    await asyncio.sleep(30)
    return ctx.finish()


OVERSTAYS = [Pipeline("overstays", (Stage("run", overstays, max_runtime=timedelta(seconds=1)),))]


async def test_an_overrun_of_work_due_at_the_calendars_end_is_settled(
    fresh_db: Endpoints,
) -> None:
    # An overrun compared the clock with the message's deadline plus the runner's skew: for a
    # deadline within the skew of 9999-12-31 that sum is no date, and the attempt failed with
    # "OverflowError: date value out of range" instead of its overrun.
    async with opened(fresh_db, OVERSTAYS) as store:
        bus = Bus(store)
        last = datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)
        r = await bus.enqueue(deadline=last, **request(bus, "overstays"))
        config = RunnerConfig(
            worker_id="ahead",
            concurrency=4,
            poll_interval=timedelta(seconds=1),
            lease=timedelta(minutes=10),
        )

        def ahead() -> datetime:  # a skew of about a minute, this machine ahead
            return datetime.now(UTC) + timedelta(minutes=1)

        async with serving(store, OVERSTAYS, config, None, clock=ahead) as runner:
            stop = time.monotonic() + 15
            got = await bus.get("acme", r.id)
            while got is not None and got.error is None and time.monotonic() < stop:
                await asyncio.sleep(0.05)
                got = await bus.get("acme", r.id)
            assert runner.stats.failed == 1
        assert got is not None and got.status is MessageStatus.PENDING and got.attempts == 1
        assert "exceeded the stage's maximum runtime" in str(got.error)


class RefusedAcks(PgRunnerStore):
    """The product's store whose acknowledgements fail while `refusing` (a database that takes
    claims but not results: a lock held on a table the completion writes, a full disk)."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.refusing = False
        self.refused = 0
        self.first_refusal = asyncio.Event()
        self.claims_after_refusal = 0

    async def complete(self, completions: Any, **kw: Any) -> Any:
        if self.refusing:
            self.refused += 1
            self.first_refusal.set()
            raise psycopg.OperationalError("acknowledgement refused (test)")
        return await super().complete(completions, **kw)

    async def claim_lane(self, **kw: Any) -> LaneClaim:
        if self.refused:
            self.claims_after_refusal += 1
        return await super().claim_lane(**kw)


async def test_a_stop_while_results_cannot_be_stored_still_stops_and_releases_the_handlers(
    fresh_db: Endpoints,
) -> None:
    # The drain acknowledged the waiting results first, retrying until they committed: with
    # acknowledgements failing it never got to stop the handlers still running or give their
    # leases back (they ran on after the runner stopped, and lapsed as counted attempts).
    pipes = [
        Pipeline("patient", (Stage("run", patient),)),
        Pipeline("quick", (Stage("run", quick),)),
    ]
    config = RunnerConfig(
        worker_id="stuck", concurrency=4, lease=timedelta(seconds=30),
        poll_interval=timedelta(seconds=1), drain_timeout=timedelta(seconds=0.3),
        cancel_grace=timedelta(seconds=0.3),
    )  # fmt: skip
    async with opened_as(fresh_db, pipes, RefusedAcks) as store:
        bus = Bus(store)
        slow = await bus.enqueue(**request(bus, "patient", "slow"))
        async with serving(store, pipes, config, PgDoorbell(fresh_db.system)) as runner:
            await wait_status(bus, slow.id, MessageStatus.RUNNING)
            store.refusing = True
            fast = await bus.enqueue(**request(bus, "quick", "fast"))
            await asyncio.wait_for(store.first_refusal.wait(), 10)
            began = time.monotonic()
        took = time.monotonic() - began  # the stop, on leaving `serving`
        assert all(a.task is None or a.task.done() for a in runner._attempts.values())
        got = await bus.get("acme", slow.id)  # stopped, and its lease given back uncounted
        assert got is not None and got.status is MessageStatus.PENDING and got.attempts == 0
        assert runner.stats.released >= 1
        assert took < config.drain_timeout.total_seconds() + 10
        left = await bus.get("acme", fast.id)
        assert left is not None and left.status is MessageStatus.RUNNING  # its lease lapses


class _FailThenRefuse(PgRunnerStore):
    """The store whose first acknowledgement fails (the database away), and whose second is
    refused as data; later ones go through."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.calls = 0
        self.refused = asyncio.Event()

    async def complete(self, completions: Any, **kw: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise psycopg.OperationalError("connection lost (test)")
        if self.calls == 2:
            self.refused.set()
            raise InvalidInput("result", "refused (test)")
        return await super().complete(completions, **kw)


async def test_a_refused_result_after_failed_acknowledgements_lets_claims_go_on(
    fresh_db: Endpoints,
) -> None:
    pipes = [Pipeline("quick", (Stage("run", quick),))]
    config = RunnerConfig(worker_id="refused", concurrency=4, poll_interval=timedelta(seconds=1))
    async with opened_as(fresh_db, pipes, _FailThenRefuse) as store:
        bus = Bus(store)
        async with serving(store, pipes, config, PgDoorbell(fresh_db.system)):
            first = await bus.enqueue(**request(bus, "quick"))
            await asyncio.wait_for(store.refused.wait(), 10)
            # The lone result was refused and recorded as a failure: nothing is left to
            # acknowledge, and the runner claims again (the first comes back as a retry).
            second = await bus.enqueue(**request(bus, "quick", sid="2"))
            await wait_status(bus, second.id, MessageStatus.DONE, timeout=10)
            await wait_status(bus, first.id, MessageStatus.DONE, timeout=20)


async def test_no_claims_while_results_cannot_be_stored_and_their_leases_are_kept(
    fresh_db: Endpoints,
) -> None:
    pipes = [Pipeline("quick", (Stage("run", quick),))]
    config = RunnerConfig(
        worker_id="acks",
        concurrency=4,
        lease=timedelta(seconds=1.5),
        poll_interval=timedelta(seconds=1),
    )
    async with opened_as(fresh_db, pipes, RefusedAcks) as store:
        bus = Bus(store)
        store.refusing = True
        async with serving(store, pipes, config, PgDoorbell(fresh_db.system)) as runner:
            first = await bus.enqueue(**request(bus, "quick"))
            await asyncio.wait_for(store.first_refusal.wait(), 10)
            claims = store.claims_after_refusal
            later = [(await bus.enqueue(**request(bus, "quick", sid=f"l{i}"))).id for i in range(5)]
            # Two leases' time: the doorbell rang, the fallback poll fired, the result waited.
            await asyncio.sleep(3.0)
            assert store.claims_after_refusal == claims
            for mid in later:
                got = await bus.get("acme", mid)
                assert got is not None and got.status is MessageStatus.PENDING
            # The waiting result's lease was kept alive: nothing to reclaim, no re-run.
            assert await bus.reclaim_due() == []
            store.refusing = False
            for mid in [first.id, *later]:
                await wait_status(bus, mid, MessageStatus.DONE)
            assert runner.stats.late_acks == 0
            got = await bus.get("acme", first.id)
            assert got is not None and got.attempts == 1


async def test_held_work_past_its_start_time_gives_its_slot_to_the_next_held(
    fresh_db: Endpoints,
) -> None:
    """Claimed-ahead messages whose time to start is over go back; the free slots go to the
    held messages behind them at once, not after the give-back's wake-up."""
    pipes = [Pipeline("patient", (Stage("run", patient),))]
    config = RunnerConfig(worker_id="held", concurrency=4, poll_interval=timedelta(seconds=60))
    async with opened(fresh_db, pipes) as store:
        bus = Bus(store)
        await bus.enqueue_many([bus.request(**request(bus, "patient", str(i))) for i in range(4)])
        claimed = await bus.claim("held", limit=4)
        runner = Runner(store, Registry(pipes), config, doorbell=None)
        now = asyncio.get_running_loop().time()
        late, fresh = claimed[:2], claimed[2:]
        for m in late:
            runner._ahead.hold(m, now - 1)
        for m in fresh:
            runner._ahead.hold(m, now + 60)
        runner.slots.take(Lane.INTERACTIVE, runner.slots.free(Lane.INTERACTIVE) - 2)
        runner._start_held(Lane.INTERACTIVE)
        try:
            assert sorted(a.message.id for a in runner._attempts.values()) == sorted(
                m.id for m in fresh
            )
            await asyncio.wait(list(runner._giving_back), timeout=10)
            for m in late:
                got = await bus.get("acme", m.id)
                assert got is not None and got.status is MessageStatus.PENDING
        finally:
            for a in runner._attempts.values():
                if a.task is not None:
                    a.task.cancel()
            await asyncio.gather(
                *(a.task for a in runner._attempts.values() if a.task is not None),
                return_exceptions=True,
            )


class _WriteBeforeBeat(PgRunnerStore):
    """The store, running `before` (the runner's own write) as a heartbeat goes out."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.before: Any = None

    async def heartbeat_many(self, leases: Any, **kw: Any) -> Any:
        if self.before is not None:
            await self.before()
        return await super().heartbeat_many(leases, **kw)


async def test_a_heartbeat_that_finds_the_runners_own_write_does_not_call_the_lease_lost(
    fresh_db: Endpoints,
) -> None:
    pipes = [Pipeline("patient", (Stage("run", patient),))]
    config = RunnerConfig(worker_id="own", concurrency=4, poll_interval=timedelta(seconds=60))
    async with opened_as(fresh_db, pipes, _WriteBeforeBeat) as store:
        bus = Bus(store)
        await bus.enqueue(**request(bus, "patient"))
        (message,) = await bus.claim("own", limit=1)
        runner = Runner(store, Registry(pipes), config, doorbell=None)
        runner._start(message)
        (attempt,) = runner._attempts.values()
        # The runner fails the attempt itself (as for an overrun) while the heartbeat is out.
        store.before = lambda: runner._fail(attempt, "its own end")
        try:
            await runner._heartbeat_once()
            assert attempt.stop_reason is None
            assert not attempt.cancelled.is_set()
            got = await bus.get("acme", message.id)
            assert got is not None and got.error == "its own end"
        finally:
            assert attempt.task is not None
            attempt.task.cancel()
            await asyncio.gather(attempt.task, return_exceptions=True)


async def gives_up_by_raising(ctx: StageContext) -> StageResult:
    await ctx.wait_cancelled()
    raise RuntimeError(f"gave up: {ctx.cancel_reason}")


async def test_a_handler_that_raises_when_told_it_overran_its_deadline_expires_its_message(
    fresh_db: Endpoints,
) -> None:
    # A heartbeat answers "overrun" past the message's deadline; the handler, told, gives up by
    # raising. That ends the attempt as an overrun (the message expired), not as a failure that
    # would be retried past its deadline.
    pipes = [Pipeline("gives_up", (Stage("run", gives_up_by_raising),))]
    config = RunnerConfig(worker_id="own", concurrency=4, poll_interval=timedelta(seconds=60))
    now = [datetime.now(UTC)]
    async with opened(fresh_db, pipes) as store:
        bus = Bus(store)
        r = await bus.enqueue(**request(bus, "gives_up"), deadline=now[0] + timedelta(minutes=10))
        (message,) = await bus.claim("own", limit=1)
        runner = Runner(store, Registry(pipes), config, doorbell=None, clock=lambda: now[0])
        runner._start(message)
        (attempt,) = runner._attempts.values()
        try:
            # Ten minutes on, on both clocks: the database's (the deadline moved back instead)
            # and the runner's.
            async with await psycopg.AsyncConnection.connect(
                fresh_db.admin, autocommit=True
            ) as admin:
                await admin.execute(
                    "UPDATE appliance.agent_messages SET deadline = now() - interval '1 second'"
                    " WHERE id = %s",
                    (r.id,),
                )
            now[0] += timedelta(minutes=10, seconds=1)
            await runner._heartbeat_once()
            assert attempt.stop_reason == "overrun"
            assert attempt.task is not None
            await asyncio.wait_for(asyncio.shield(attempt.task), 10)
            got = await bus.get("acme", r.id)
            assert got is not None and got.status is MessageStatus.EXPIRED, got
            assert "gave up" not in (got.error or "")
        finally:
            if attempt.task is not None and not attempt.task.done():
                attempt.task.cancel()
                await asyncio.gather(attempt.task, return_exceptions=True)


async def test_a_heartbeat_that_finds_a_lease_row_held_says_so_and_the_next_extends_it(
    fresh_db: Endpoints,
) -> None:
    # A heartbeat skips rows another statement holds (it never waits behind one): those leases
    # are not extended. The runner is told, to ask again soon rather than a third of a lease
    # later; once the row is free, the lease is extended.
    pipes = [Pipeline("patient", (Stage("run", patient),))]
    config = RunnerConfig(worker_id="own", concurrency=4, poll_interval=timedelta(seconds=60))
    async with opened(fresh_db, pipes) as store:
        bus = Bus(store)
        r = await bus.enqueue(**request(bus, "patient"))
        (message,) = await bus.claim("own", limit=1)
        runner = Runner(store, Registry(pipes), config, doorbell=None)
        runner._start(message)
        (attempt,) = runner._attempts.values()
        try:
            async with await psycopg.AsyncConnection.connect(fresh_db.admin) as holder:
                await holder.execute(
                    "SELECT 1 FROM appliance.agent_messages WHERE id = %s FOR UPDATE", (r.id,)
                )
                assert await runner._heartbeat_once() == 1
                await holder.rollback()
            held = await bus.get("acme", r.id)
            assert held is not None and held.lease_expires_at == message.lease_expires_at
            assert attempt.stop_reason is None  # still running: only not extended
            assert await runner._heartbeat_once() == 0
            got = await bus.get("acme", r.id)
            assert got is not None and got.lease_expires_at is not None
            assert message.lease_expires_at is not None
            assert got.lease_expires_at > message.lease_expires_at
        finally:
            assert attempt.task is not None
            attempt.task.cancel()
            await asyncio.gather(attempt.task, return_exceptions=True)


gate_open = asyncio.Event()


async def waits_for_gate_open(ctx: StageContext) -> StageResult:
    await gate_open.wait()
    return ctx.finish({"gated": True})


async def test_a_result_whose_row_another_session_holds_waits_alone(
    fresh_db: Endpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An acknowledgement waited on row locks: one row held by a session that keeps its
    # transaction open (an operator's SELECT ... FOR UPDATE) held the whole batch, and every
    # result queued after it, for up to the statement timeout (5 minutes), while the runner
    # went on claiming. Now only that result waits.
    monkeypatch.setattr("appliance.db.message_store.ACK_LOCK_TIMEOUT", "200ms", raising=False)
    pipes = [
        Pipeline("gated", (Stage("run", waits_for_gate_open),)),
        Pipeline("quick", (Stage("run", quick),)),
    ]
    config = RunnerConfig(
        worker_id="locks", concurrency=8, lease=timedelta(seconds=20),
        poll_interval=timedelta(seconds=1),
    )  # fmt: skip
    async with (
        opened(fresh_db, pipes) as store,
        serving(store, pipes, config, PgDoorbell(fresh_db.system), gate_open) as runner,
    ):
        bus = Bus(store)
        held = await bus.enqueue(**request(bus, "gated", "held"))
        await wait_status(bus, held.id, MessageStatus.RUNNING)
        async with await psycopg.AsyncConnection.connect(fresh_db.admin) as operator:
            await operator.execute(
                "SELECT 1 FROM appliance.agent_messages WHERE id = %s FOR UPDATE", (held.id,)
            )
            gate_open.set()  # its result is queued; its row is locked
            others = [await bus.enqueue(**request(bus, "quick", f"q{i}")) for i in range(5)]
            for r in others:
                await wait_status(bus, r.id, MessageStatus.DONE)
            got = await bus.get("acme", held.id)
            assert got is not None and got.status is MessageStatus.RUNNING
            await operator.rollback()
        await wait_status(bus, held.id, MessageStatus.DONE)
        assert runner.stats.completed == 6 and runner.stats.late_acks == 0


async def always_overfills(ctx: StageContext) -> StageResult:
    # As a handler that starts more model calls at once than the pool takes, every time.
    raise QueueFull("the mechanical tier's queue is full")


OVERFILLS = [Pipeline("overfills", (Stage("run", always_overfills, max_attempts=1),))]


async def test_a_handler_the_pool_never_has_room_for_fails_after_its_deferrals(
    fresh_db: Endpoints,
) -> None:
    # Deferred without counting an attempt whenever the pool had no room, such a handler was
    # deferred for ever (its sibling calls using the pool each time). Now the deferrals are
    # counted in its log, and the one after the last allowed is a failed attempt.
    from appliance.bus.runner import POOL_FULL, POOL_FULL_DEFERRALS

    config = RunnerConfig(
        worker_id="full", concurrency=4, poll_interval=timedelta(seconds=1),
        budget_busy_delay=timedelta(milliseconds=10),
    )  # fmt: skip
    async with opened(fresh_db, OVERFILLS) as store:
        bus = Bus(store)
        r = await bus.enqueue(**request(bus, "overfills"))
        async with serving(store, OVERFILLS, config, PgDoorbell(fresh_db.system)):
            await wait_status(bus, r.id, MessageStatus.DEAD, timeout=30)
        assert await store.deferrals(r.id, POOL_FULL) == POOL_FULL_DEFERRALS
        assert await store.deferrals(r.id, "deferred_pool") == POOL_FULL_DEFERRALS
        assert await store.deferrals(r.id, "deferred%pool") == 0  # a pattern, taken literally
        got = await bus.get("acme", r.id)
        assert got is not None and got.attempts == 1
        assert f"had no room for this stage's calls {POOL_FULL_DEFERRALS + 1} times" in (
            got.error or ""
        )


wedged_may_end = asyncio.Event()
wedged_alive: list[int] = [0, 0]  # now, most at once


async def wedges(ctx: StageContext) -> StageResult:
    wedged_alive[0] += 1
    wedged_alive[1] = max(wedged_alive[1], wedged_alive[0])
    try:
        while not wedged_may_end.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                continue  # ignores every cancellation
        return ctx.finish()
    finally:
        wedged_alive[0] -= 1


WEDGES = [Pipeline("wedges", (Stage("run", wedges, max_runtime=timedelta(seconds=1)),))]


async def test_handlers_that_ignore_cancellation_pile_up_no_further_than_the_slots(
    fresh_db: Endpoints,
) -> None:
    # Each abandoned handler gave its slot back and ran on: a stage whose handlers all wedge
    # added one more running task for every message claimed (all 12 at once with 4 slots).
    # Now an abandoned handler holds its slot until it ends: the runner claims nothing while
    # as many run on abandoned as it has slots, and claims again once one ends.
    config = RunnerConfig(
        worker_id="wedged", concurrency=4, lease=timedelta(seconds=3),
        poll_interval=timedelta(seconds=1), cancel_grace=timedelta(seconds=0.2),
    )  # fmt: skip
    wedged_alive[:] = [0, 0]
    wedged_may_end.clear()
    async with opened(fresh_db, WEDGES) as store:
        bus = Bus(store)
        ids = [(await bus.enqueue(**request(bus, "wedges", f"w{i}"))).id for i in range(12)]
        async with serving(
            store, WEDGES, config, PgDoorbell(fresh_db.system), wedged_may_end
        ) as runner:
            for _ in range(200):
                if runner.stats.abandoned >= config.concurrency:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(4)  # heartbeats enough to give up on every one claimed
            assert runner.stats.claimed < len(ids), runner.stats
            assert wedged_alive[1] <= config.concurrency, wedged_alive
            wedged_may_end.set()  # they end: claims go on, and the rest run (and end at once)
            for mid in ids:
                got = await bus.get("acme", mid)
                if got is not None and got.status is MessageStatus.PENDING:
                    await wait_status(bus, mid, MessageStatus.DONE, timeout=15)


# Gates by source id: each handler of `holds` runs until its own gate opens, ignoring every
# cancellation meanwhile; a count of the handlers alive, and the most alive at once.
hold_gates: dict[str, asyncio.Event] = {}
holds_alive: list[int] = [0, 0]  # now, most at once
holds_entered: list[str] = []


async def holds(ctx: StageContext) -> StageResult:
    holds_alive[0] += 1
    holds_alive[1] = max(holds_alive[1], holds_alive[0])
    holds_entered.append(ctx.message.source_id)
    try:
        gate = hold_gates[ctx.message.source_id]
        while not gate.is_set():
            try:
                await gate.wait()
            except asyncio.CancelledError:
                continue  # ignores every cancellation
        return ctx.finish()
    finally:
        holds_alive[0] -= 1


HOLDS = [Pipeline("holds", (Stage("run", holds),))]


async def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never {what}")
        await asyncio.sleep(0.02)


async def test_handlers_given_up_on_hold_their_slots_until_they_end(
    fresh_db: Endpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A handler given up on used to give its slot back and run on: with 3 slots, 3 abandoned
    # handlers and 3 newly claimed ones ran at once (up to twice the concurrency, less one).
    # The concurrency is a promise about resources: an abandoned handler's task holds a slot
    # until it ends, and the queued work is claimed one by one as they end.
    monkeypatch.setattr("appliance.bus.runner.ABANDON_AFTER_S", 0.05)
    config = RunnerConfig(
        worker_id="holds", concurrency=3, reserved_interactive=1, reserved_system=0,
        lease=timedelta(seconds=1.5), poll_interval=timedelta(seconds=1),
        cancel_grace=timedelta(seconds=0.1),
    )  # fmt: skip
    holds_alive[:] = [0, 0]
    holds_entered.clear()
    hold_gates.clear()
    wedged = [f"w{i}" for i in range(3)]
    queued = [f"q{i}" for i in range(3)]
    hold_gates.update({sid: asyncio.Event() for sid in wedged + queued})
    async with opened(fresh_db, HOLDS) as store:
        bus = Bus(store)
        async with serving(store, HOLDS, config, PgDoorbell(fresh_db.system)) as runner:
            try:
                ws = [(await bus.enqueue(**request(bus, "holds", s))).id for s in wedged]
                await wait_for(lambda: holds_alive[0] == 3, "all three slots busy")
                qs = [(await bus.enqueue(**request(bus, "holds", s))).id for s in queued]
                for mid in ws:
                    assert await bus.cancel("acme", mid, reason="operator")
                await wait_for(lambda: len(runner.abandoned_tasks()) == 3, "all given up on")
                assert runner.stats.abandoned == 3
                # Held by the abandoned: nothing free in any lane, and the status says so.
                assert runner.slots.abandoned[Lane.INTERACTIVE] == 3
                assert all(runner.slots.free(lane) == 0 for lane in Lane)
                assert runner._info()["stats"]["abandoned_running"] == {
                    "interactive": 3, "batch": 0, "system": 0,
                }  # fmt: skip
                # Each abandoned handler that ends gives back one slot: one more queued
                # message runs, never more.
                for n, sid in enumerate(wedged, start=1):
                    hold_gates[sid].set()

                    def ran(want: int = 3 + n) -> bool:
                        return len(holds_entered) >= want

                    await wait_for(ran, f"{n} queued ran")
                    assert holds_alive[1] <= config.concurrency, holds_alive
                    assert len(holds_entered) == 3 + n, holds_entered
                    assert len(runner.abandoned_tasks()) == 3 - n
                assert runner._info()["stats"]["abandoned_running"]["interactive"] == 0
                for sid in queued:
                    hold_gates[sid].set()
                for mid in qs:
                    await wait_status(bus, mid, MessageStatus.DONE)
                for mid in ws:
                    got = await bus.get("acme", mid)
                    assert got is not None and got.status is MessageStatus.CANCELLED
                assert sorted(holds_entered) == sorted(wedged + queued)  # each ran once
                assert holds_alive == [0, config.concurrency], holds_alive
                assert runner.stats.abandoned == 3 and runner.abandoned_tasks() == []
            finally:
                for gate in hold_gates.values():
                    gate.set()


class _Tiers:
    """An inference service as far as the runner's change handling reads it: which tiers are
    up (the pool itself is tested with the real model in tests/inference)."""

    def __init__(self) -> None:
        self.up: set[Tier] = set()
        self.subscribers: list[Any] = []

    def subscribe(self, callback: Any) -> None:
        self.subscribers.append(callback)

    def available(self) -> frozenset[Tier]:
        return frozenset(self.up)

    def changed(self) -> None:
        for callback in self.subscribers:
            callback()


class _Resumes(PgRunnerStore):
    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.resumes = 0

    async def resume_capability(self, *a: Any, **kw: Any) -> int:
        self.resumes += 1
        return await super().resume_capability(*a, **kw)


async def test_waiting_work_is_resumed_when_a_tier_comes_up_not_after_every_model_call(
    fresh_db: Endpoints,
) -> None:
    pipes = [Pipeline("quick", (Stage("run", quick),))]
    config = RunnerConfig(worker_id="tiers", concurrency=4, poll_interval=timedelta(seconds=60))
    tiers = _Tiers()
    async with opened_as(fresh_db, pipes, _Resumes) as store:
        runner = Runner(store, Registry(pipes), config, doorbell=None, inference=tiers)  # type: ignore[arg-type]

        async def settled() -> None:
            if runner._resume_task is not None:
                await runner._resume_task

        tiers.up.add(Tier.MECHANICAL)
        tiers.changed()  # the tier came up: one resume
        await settled()
        assert store.resumes == 1
        for _ in range(5):
            tiers.changed()  # model calls ending: room, not availability
            await settled()
        assert store.resumes == 1
        tiers.up.add(Tier.REASONING)
        tiers.changed()  # another tier up: work waiting for it resumes
        await settled()
        assert store.resumes == 2
        tiers.up.clear()
        tiers.changed()
        tiers.up.add(Tier.MECHANICAL)
        tiers.changed()  # down and up again
        await settled()
        assert store.resumes == 3


class _StartsBeforePark(PgRunnerStore):
    """The store, registering a runner of the stage just before the first park (a runner that
    started between the claim and the park)."""

    def __init__(self, db: Database) -> None:
        super().__init__(db)
        self.parks = 0

    async def wait_stage(self, lease: Any, **kw: Any) -> str | None:
        self.parks += 1
        if self.parks == 1:
            await self.register_runner(
                {
                    "id": "theirs", "host": "h", "pid": 1, "started_at": datetime.now(UTC),
                    "seen_at": None, "listener_connected": True,
                    "serves": {(kw["pipeline"], kw["stage"])},
                }
            )  # fmt: skip
        return await super().wait_stage(lease, **kw)


async def test_work_given_back_to_a_runner_that_started_since_the_claim_is_left_to_it(
    fresh_db: Endpoints,
) -> None:
    pipes = [Pipeline("quick", (Stage("run", quick),))]
    config = RunnerConfig(worker_id="mine", concurrency=4, poll_interval=timedelta(seconds=1))
    async with opened_as(fresh_db, pipes, _StartsBeforePark) as store:
        bus = Bus(store)
        async with serving(store, pipes, config, PgDoorbell(fresh_db.system)) as runner:
            theirs = await bus.enqueue(**request(bus, "elsewhere", sid="e"))
            mine = await bus.enqueue(**request(bus, "quick", sid="q"))
            await wait_status(bus, mine.id, MessageStatus.DONE)
            await asyncio.sleep(1.5)  # the give-back's doorbell and a fallback poll
            got = await bus.get("acme", theirs.id)
            assert got is not None and got.status is MessageStatus.PENDING
            assert got.attempts == 0 and got.claimed_by == "mine"  # claimed once, given back
            # Not claimed again and again: its stage is skipped now. Once more at most: a
            # claim that the give-back's own doorbell started before the runner had its reply.
            assert store.parks <= 2
            assert ("elsewhere", "run") in runner._skip
