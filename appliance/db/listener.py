"""The doorbell: a dedicated LISTEN connection, health-checked, reconnected with backoff.

It is never shared with queries (a shared one adds a constant tail to both). After every
(re)connect it LISTENs first and then rings once, so the runner sweeps for work that arrived
while it was deaf; only then does it wait. A notification is a hint, never data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable
from typing import TypeVar

import psycopg

from appliance.db.database import SEARCH_PATH_OPTION
from appliance.domain.envelope import Lane

T = TypeVar("T")
Conn = psycopg.AsyncConnection[tuple[object, ...]]

log = logging.getLogger("appliance.db.listener")

CHANNEL = "appliance_work"


class PgDoorbell:
    """Rings when a notification arrives on `appliance_work` (or after a reconnect)."""

    def __init__(
        self,
        conninfo: str,
        *,
        channel: str = CHANNEL,
        health_every: float = 10.0,
        backoff_max: float = 5.0,
    ) -> None:
        self.conninfo = conninfo
        self.channel = channel
        self.health_every = health_every
        self.backoff_max = backoff_max
        self._ring = asyncio.Event()
        self._lanes: set[Lane] = set()
        self._conn: Conn | None = None
        self._task: asyncio.Task[None] | None = None
        self._connected = False
        self.reconnects = 0
        self.backend_pid: int | None = None

    @property
    def connected(self) -> bool:
        return self._connected

    async def start(self) -> None:
        """Connect now if the server answers (else keep trying in the background)."""
        try:
            await self._connect()
        except Exception as exc:
            log.warning("doorbell cannot connect yet (%s); retrying in the background", exc)
        self._task = asyncio.create_task(self._run(), name="doorbell")

    async def wait(self, timeout: float) -> frozenset[Lane]:
        """The lanes rung within `timeout` seconds (consumed); empty when none rang."""
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can lose a cancellation that
            # races its inner future, and the runner's shutdown waited on it forever.
            async with asyncio.timeout(timeout):
                await self._ring.wait()
        except TimeoutError:
            return frozenset()
        self._ring.clear()
        lanes, self._lanes = frozenset(self._lanes), set()
        return lanes

    def _rang(self, lanes: set[Lane]) -> None:
        self._lanes |= lanes
        self._ring.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self._disconnect()

    async def _disconnect(self) -> None:
        self._connected = False
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
            self._conn = None

    async def _connect(self) -> None:
        # Keepalives (TCP only; a Unix socket ignores them): a server that vanished without
        # closing the connection is noticed in seconds, not after the kernel's 15 minutes.
        async with asyncio.timeout(self.health_every):
            conn = await psycopg.AsyncConnection.connect(
                self.conninfo,
                autocommit=True,
                options=SEARCH_PATH_OPTION,
                keepalives=1,
                keepalives_idle=10,
                keepalives_interval=5,
                keepalives_count=3,
            )
        # LISTEN first, then ring: work committed while we were away is swept, not lost.
        await self._answered(conn, conn.execute(f"LISTEN {self.channel}"))
        self._conn = conn
        self.backend_pid = conn.info.backend_pid
        self._connected = True
        self._rang(set(Lane))

    async def _answered(self, conn: Conn, query: Awaitable[T]) -> T:
        """`query` on `conn`, or OperationalError when the server has not answered within
        health_every. The connection is closed first: cancelling a query waits for the server
        to confirm it, which a server that does not answer never does (a frozen backend, a
        partition), and keepalives do not end a wait for an answer."""
        task = asyncio.ensure_future(query)
        try:
            await asyncio.wait({task}, timeout=self.health_every)
        finally:
            if not task.done():  # timed out, or this coroutine is being cancelled
                with contextlib.suppress(Exception):
                    await conn.close()
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if task.cancelled():
            raise psycopg.OperationalError(
                f"the server did not answer within {self.health_every:g} s"
            )
        return task.result()

    async def _healthy(self) -> bool:
        assert self._conn is not None
        cur = await self._conn.execute(
            "SELECT %s IN (SELECT pg_listening_channels())", (self.channel,)
        )
        row = await cur.fetchone()
        return bool(row and row[0])

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                if self._conn is None:
                    await self._connect()
                    backoff = 0.1
                assert self._conn is not None
                async for note in self._conn.notifies(timeout=self.health_every):
                    # The payload is the lane; anything else rings every lane (a hint only).
                    try:
                        self._rang({Lane(note.payload)})
                    except ValueError:
                        self._rang(set(Lane))
                # Bounded: a connection that stopped answering without closing would keep
                # this wait, and the doorbell "connected" but deaf, for ever; the fallback
                # poll alone would then find work.
                if not await self._answered(self._conn, self._healthy()):
                    raise psycopg.OperationalError("the LISTEN registration was lost")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._connected:
                    log.warning("doorbell connection lost (%s); reconnecting", exc)
                await self._disconnect()
                self.reconnects += 1
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, self.backoff_max)
