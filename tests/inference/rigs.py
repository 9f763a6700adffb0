"""What the in-process runner rigs share: reading the database, waiting for a condition, and a
governed runner serving a model pool."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from decimal import Decimal
from typing import Any

from appliance.bus.governor import Governor, GovernorConfig
from appliance.bus.runner import Runner, RunnerConfig
from appliance.db.database import Database, Endpoints
from appliance.db.listener import PgDoorbell
from appliance.db.runner_store import PgRunnerStore
from appliance.db.spend_store import PgSpendStore
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.cost import Pricing, Tariff
from appliance.domain.pipeline import Pipeline, Registry
from appliance.inference.pool import InferencePool
from appliance.metering.meter import Meter
from appliance.metering.sources import EstimateSource, ThreadCpu, process_cpu_seconds

# 1,000 J per token at 1 EUR/kWh: one call's worst case is a visible fraction of a cent.
PRICING = Pricing(
    tariff=Tariff(price_per_kwh=Decimal("1.0")),
    default_joules_per_token=Decimal("1000"),
    safety_factor=Decimal("1.0"),
)


def estimate_meter(kind: type[Meter] = Meter) -> Meter:
    """The estimate source on this machine (no counters here): real thread CPU time, labelled."""
    return kind(
        EstimateSource(10.0, 15.0, process_cpu_seconds, time.monotonic()),
        ThreadCpu(),
        {"cpu": 10.0},
    )


async def tenant_db(ends: Endpoints, pipelines: Sequence[Pipeline]) -> Database:
    """An open Database with tenant `acme` and `pipelines` synced (the caller closes it)."""
    db = Database(ends, max_size=8)
    await db.open()
    await PgTenantStore(db).add("acme")
    await PgRunnerStore(db).sync_pipelines(list(pipelines))
    return db


@asynccontextmanager
async def governed_runner(
    ends: Endpoints,
    store: PgRunnerStore,
    pipelines: Sequence[Pipeline],
    pool: InferencePool,
    spend: PgSpendStore,
    *,
    busy_wait: timedelta = timedelta(0),
    **config: Any,
) -> AsyncIterator[tuple[Governor, asyncio.Event, asyncio.Task[None]]]:
    """A Runner with a governor at PRICING serving `pipelines` on `pool` (RunnerConfig fields
    in `config` override the rigs' defaults); stopped on the way out."""
    governor = Governor(spend, GovernorConfig(PRICING, busy_wait=busy_wait), actor="gov")
    settings: dict[str, Any] = {
        "worker_id": "gov",
        "concurrency": 4,
        "lease": timedelta(seconds=10),
        "poll_interval": timedelta(seconds=5),
        "report_every": timedelta(seconds=0.5),
        **config,
    }
    runner = Runner(
        store, Registry(list(pipelines)), RunnerConfig(**settings),
        doorbell=PgDoorbell(ends.system), inference=pool, governor=governor,
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        yield governor, stop, task
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


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
