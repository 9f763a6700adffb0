"""The doorbell against a real PostgreSQL whose backend stops answering (SIGSTOP).

Its LISTEN is bounded like its health check: a server that accepted the connection but never
answers the LISTEN held the doorbell's start for ever. Unanswered, the connection is closed
first and the statement cancelled then (cancelling alone waits for the server to confirm,
which a frozen backend never does). Closing the doorbell while a statement is out leaves no
task of it behind.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any

import psycopg
import pytest

from appliance.db.database import Endpoints
from appliance.db.listener import PgDoorbell


def pending_tasks(before: set[asyncio.Task[Any]]) -> list[asyncio.Task[Any]]:
    """Tasks still pending that were not there `before`, other than the caller's."""
    current = asyncio.current_task()
    return [t for t in asyncio.all_tasks() - before if t is not current and not t.done()]


def state(bell: PgDoorbell) -> tuple[bool, int | None]:
    """Whether the doorbell is connected, and to which backend."""
    return bell.connected, bell.backend_pid


def coroutine_name(task: asyncio.Task[Any]) -> str:
    return str(getattr(task.get_coro(), "__qualname__", ""))


async def test_a_listen_the_server_never_answers_ends_within_the_bound(
    fresh_db: Endpoints, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_connect = psycopg.AsyncConnection.connect
    frozen: list[tuple[psycopg.AsyncConnection[Any], int]] = []

    async def connect_then_freeze(*args: Any, **kwargs: Any) -> psycopg.AsyncConnection[Any]:
        # The first connection's backend stops right after the connection is made: the
        # LISTEN that follows is sent and never answered. Later connections are left alone.
        conn = await real_connect(*args, **kwargs)
        if not frozen:
            os.kill(conn.info.backend_pid, signal.SIGSTOP)
            frozen.append((conn, conn.info.backend_pid))
        return conn

    monkeypatch.setattr(psycopg.AsyncConnection, "connect", connect_then_freeze)
    caplog.set_level(logging.WARNING, logger="appliance.db.listener")
    bell = PgDoorbell(fresh_db.system, health_every=0.5)
    began = time.monotonic()
    starting = asyncio.ensure_future(bell.start())
    try:
        await asyncio.wait({starting}, timeout=3.0)
        assert starting.done(), "the doorbell's start waited on a LISTEN never answered"
        assert starting.exception() is None
        assert time.monotonic() - began < 2.0  # the bound (0.5 s), not psycopg's 5 s cancel
        ((conn, pid),) = frozen
        assert conn.closed  # the unanswered connection is closed, not left open
        assert state(bell) == (False, None)  # never connected
        assert "doorbell cannot connect yet (the server did not answer within 0.5 s)" in (
            caplog.text
        )
        # And it connects again in the background, to a backend that answers.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if state(bell)[0]:
                break
            await asyncio.sleep(0.05)
        connected, backend = state(bell)
        assert connected and backend not in (None, pid)
        assert bell.reconnects == 0  # connected at its first try in the background
    finally:
        for _, pid in frozen:
            os.kill(pid, signal.SIGCONT)
        if not starting.done():
            await asyncio.wait({starting}, timeout=15)
        await bell.close()


async def test_closing_the_doorbell_during_an_unanswered_health_check_leaves_no_task(
    fresh_db: Endpoints,
) -> None:
    before = asyncio.all_tasks()
    bell = PgDoorbell(fresh_db.system, health_every=1.0)
    await bell.start()
    pid = bell.backend_pid
    assert pid is not None and bell.connected
    os.kill(pid, signal.SIGSTOP)
    try:
        # After a quiet health_every the health check goes out; the frozen backend keeps it
        # unanswered (for up to health_every). Close the doorbell while it is out.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if any(coroutine_name(t).endswith("._healthy") for t in pending_tasks(before)):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the health check never went out")
        await bell.close()
        left = pending_tasks(before)
        assert left == [], [coroutine_name(t) for t in left]
        assert not bell.connected
    finally:
        os.kill(pid, signal.SIGCONT)
