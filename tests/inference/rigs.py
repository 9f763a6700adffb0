"""What the in-process runner rigs share: reading the database and waiting for a condition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from appliance.db.database import Database


class DbChecks:
    """Mixed into a rig that has a `db`: query it as the system role, poll until true."""

    db: Database

    async def rows(self, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        async with self.db.system_conn() as conn:
            return list(await (await conn.execute(sql, params or {})).fetchall())

    async def wait(self, check: Callable[[], Any], timeout: float = 60.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await check():
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")
