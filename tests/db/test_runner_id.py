"""A runner id held by one live runner at a time: the registration that refuses a live holder's
id and takes over a stopped or silent one's, a start that waits for a holder that did not stop
to report (alive: refused) or to go quiet (taken over), the report fenced to the id's holder,
and a runner that stops when its id was taken over."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from appliance.bus.runner import Runner, RunnerConfig
from appliance.bus.runner_id import take_runner_id
from appliance.db.database import Endpoints
from appliance.db.runner_store import PgRunnerStore
from appliance.domain.errors import RunnerIdInUse
from appliance.domain.pipeline import Pipeline, Registry, Stage, StageContext, StageResult
from appliance.domain.ports import RUNNER_ALIVE, IdHolder
from tests.db.test_runner_inprocess import opened

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def _info(
    host: str, pid: int, started: datetime, seen: datetime | None, **kw: Any
) -> dict[str, Any]:
    return {
        "id": "r1", "host": host, "pid": pid, "started_at": started, "seen_at": seen,
        "listener_connected": False, "serves": {("p", "s")}, "last_missed_wakeup_at": None,
        "missed_wakeups": 0, "claimed": 0, "completed": 0, "failed": 0, "stats": {}, **kw,
    }  # fmt: skip


async def _row(store: PgRunnerStore) -> tuple[str, int, Any]:
    async with store.db.system_conn() as conn:
        row = await (
            await conn.execute("SELECT host, pid, stopped_at FROM runners WHERE id = 'r1'")
        ).fetchone()
    assert row is not None
    return row["host"], row["pid"], row["stopped_at"]


async def test_a_live_runner_keeps_its_id(db: Any) -> None:
    store = PgRunnerStore(db)
    first = _info("a", 1, T0, T0)
    assert await store.register_runner(first) is None
    # Another runner asks for the id 20 s after the holder's last report: refused, unchanged.
    holder = await store.register_runner(_info("b", 2, T0, T0 + timedelta(seconds=20)))
    assert holder == IdHolder("a", 1, T0, T0, 20.0)
    assert await _row(store) == ("a", 1, None)
    # The holder itself, registering again (the same host, pid and start): its own.
    assert await store.register_runner(first) is None


async def test_an_id_is_taken_from_a_runner_that_stopped_or_went_quiet(db: Any) -> None:
    store = PgRunnerStore(db)
    assert await store.register_runner(_info("a", 1, T0, T0)) is None
    quiet = T0 + RUNNER_ALIVE + timedelta(seconds=1)
    assert await store.register_runner(_info("b", 2, quiet, quiet)) is None
    assert await _row(store) == ("b", 2, None)
    assert await store.report_runner(_info("b", 2, quiet, quiet, stopped_at=quiet))
    assert (await _row(store))[2] is not None
    soon = quiet + timedelta(seconds=1)
    assert await store.register_runner(_info("c", 3, soon, soon)) is None
    assert await _row(store) == ("c", 3, None)  # and it runs: not stopped


async def test_a_report_of_a_runner_whose_id_was_taken_over_writes_nothing(db: Any) -> None:
    store = PgRunnerStore(db)
    old = _info("a", 1, T0, T0)
    assert await store.register_runner(old) is None
    later = T0 + RUNNER_ALIVE * 2
    assert await store.register_runner(_info("b", 2, later, later)) is None
    # The old runner wakes up and reports, or stops: neither touches the new holder's row.
    assert not await store.report_runner({**old, "seen_at": later, "claimed": 99})
    assert not await store.report_runner({**old, "seen_at": later, "stopped_at": later})
    assert await _row(store) == ("b", 2, None)
    assert await store.report_runner(_info("b", 2, later, later))


async def _age_report(store: PgRunnerStore, runner_id: str, seconds: float) -> None:
    async with store.db.system_conn() as conn:
        await conn.execute(
            "UPDATE runners SET seen_at = now() - make_interval(secs => %s) WHERE id = %s",
            (seconds, runner_id),
        )


async def test_a_start_waits_for_a_holder_that_did_not_stop_to_go_quiet(db: Any) -> None:
    store = PgRunnerStore(db)
    assert await store.register_runner(_info("a", 1, T0, None)) is None
    # It died without stopping 29 s ago: a restart under the id waits the last second out.
    await _age_report(store, "r1", RUNNER_ALIVE.total_seconds() - 1)
    taker = _info("b", 2, T0, None)
    taken = await asyncio.wait_for(take_runner_id(store, taker, asyncio.Event(), ask_every=0.1), 10)
    assert taken and await _row(store) == ("b", 2, None)


async def test_a_start_is_refused_when_the_holder_reports_meanwhile(db: Any) -> None:
    store = PgRunnerStore(db)
    holder = _info("a", 1, T0, None)
    assert await store.register_runner(holder) is None
    await _age_report(store, "r1", 10)
    waiting = asyncio.create_task(
        take_runner_id(store, _info("b", 2, T0, None), asyncio.Event(), ask_every=0.05)
    )
    await asyncio.sleep(0.3)
    assert not waiting.done()  # not refused on a report 10 s old: it may have died
    assert await store.report_runner(holder)  # alive after all
    with pytest.raises(RunnerIdInUse, match="held by a live runner"):
        await asyncio.wait_for(waiting, 10)
    assert await _row(store) == ("a", 1, None)


async def test_a_start_waiting_for_its_id_ends_on_stop(db: Any) -> None:
    store = PgRunnerStore(db)
    assert await store.register_runner(_info("a", 1, T0, None)) is None
    stop = asyncio.Event()
    waiting = asyncio.create_task(take_runner_id(store, _info("b", 2, T0, None), stop, ask_every=5))
    await asyncio.sleep(0.2)
    stop.set()
    assert await asyncio.wait_for(waiting, 5) is False
    assert await _row(store) == ("a", 1, None)


async def _idle(ctx: StageContext) -> StageResult:
    return ctx.finish(None)


PIPES = [Pipeline("idle", (Stage("run", _idle),))]


def _config(**kw: Any) -> RunnerConfig:
    return RunnerConfig(worker_id="shared", concurrency=4, poll_interval=timedelta(seconds=5), **kw)


async def test_a_second_runner_under_a_live_runners_id_refuses_to_start(
    fresh_db: Endpoints,
) -> None:
    async with opened(fresh_db, PIPES) as store:
        first = Runner(store, Registry(PIPES), _config())
        stop = asyncio.Event()
        task = asyncio.create_task(first.run(stop))
        try:
            for _ in range(200):  # registered
                if any(r.id == "shared" and r.alive for r in await store.runners()):
                    break
                await asyncio.sleep(0.02)
            second = Runner(store, Registry(PIPES), _config())
            with pytest.raises(RunnerIdInUse, match="held by a live runner"):
                await asyncio.wait_for(second.run(asyncio.Event()), 10)
            # The first one serves on, its registration untouched.
            (row,) = [r for r in await store.runners() if r.id == "shared"]
            assert row.alive and row.pid == os.getpid()
        finally:
            stop.set()
            await asyncio.wait_for(task, 20)
        # Stopped, it gives the id up: the next runner under it starts.
        third = Runner(store, Registry(PIPES), _config())
        stop = asyncio.Event()
        task = asyncio.create_task(third.run(stop))
        await asyncio.sleep(0.3)
        assert not task.done()
        stop.set()
        await asyncio.wait_for(task, 20)


async def test_a_runner_whose_id_was_taken_over_stops_with_that_error(
    fresh_db: Endpoints,
) -> None:
    async with opened(fresh_db, PIPES) as store:
        runner = Runner(store, Registry(PIPES), _config())
        stop = asyncio.Event()
        task = asyncio.create_task(runner.run(stop))
        await asyncio.sleep(0.3)
        assert not task.done()
        # Another runner took the id while this one was (taken as) silent.
        async with store.db.system_conn() as conn:
            await conn.execute(
                "UPDATE runners SET host = 'elsewhere', pid = 4242, started_at = now(),"
                " seen_at = now() WHERE id = 'shared'"
            )
        with pytest.raises(RunnerIdInUse, match="taken over"):
            await asyncio.wait_for(task, 20)
        assert stop.is_set()
        (row,) = [r for r in await store.runners() if r.id == "shared"]
        assert row.host == "elsewhere" and row.alive  # its stop did not mark the taker stopped
