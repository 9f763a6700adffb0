"""A runner id held by one live runner at a time: the registration that refuses a live holder's
id, takes over a stopped, silent or exited one's, the report fenced to the id's holder, and a
runner that stops when its id was taken over."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from appliance.bus.runner import Runner, RunnerConfig
from appliance.bus.runner_id import holder_gone_here
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
    assert holder == IdHolder("a", 1, T0, 20.0)
    assert await _row(store) == ("a", 1, None)
    # The holder itself, registering again (the same host, pid and start): its own.
    assert await store.register_runner(first) is None
    # Asked with take_over (its caller found the holder gone): taken.
    assert await store.register_runner(_info("b", 2, T0, T0), take_over=True) is None
    assert await _row(store) == ("b", 2, None)


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


def test_a_holder_is_gone_only_when_its_process_on_this_host_is() -> None:
    here = socket.gethostname()
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    long_ago = datetime(2000, 1, 1, tzinfo=UTC)
    now = datetime.now(UTC)
    # Another host's runner: only its silence tells.
    assert not holder_gone_here(IdHolder(here + "-elsewhere", exited.pid, now, 0.0))
    # A pid of this host that no process has now.
    assert holder_gone_here(IdHolder(here, exited.pid, now, 0.0))
    # A live process that started before the holder did: taken as the holder.
    assert not holder_gone_here(IdHolder(here, os.getpid(), now, 0.0))
    # A live process that started after the holder: the pid was reused, the holder is gone.
    assert holder_gone_here(IdHolder(here, os.getpid(), long_ago, 0.0))


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
        runner = Runner(store, Registry(PIPES), _config(report_every=timedelta(seconds=0.1)))
        stop = asyncio.Event()
        task = asyncio.create_task(runner.run(stop))
        await asyncio.sleep(0.3)
        assert not task.done()
        # Another runner took the id while this one was (taken as) silent.
        now = datetime.now(UTC)
        taker = _info("elsewhere", 4242, now, None, id="shared")
        assert await store.register_runner(taker, take_over=True) is None
        with pytest.raises(RunnerIdInUse, match="taken over"):
            await asyncio.wait_for(task, 20)
        assert stop.is_set()
        (row,) = [r for r in await store.runners() if r.id == "shared"]
        assert row.host == "elsewhere" and row.alive  # its stop did not mark the taker stopped
