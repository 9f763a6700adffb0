"""The composition root: builds the database, stores and bus from settings, in start order."""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta

from appliance.bus.core import Bus, BusConfig
from appliance.bus.runner import Runner, RunnerConfig
from appliance.db.cluster import LocalCluster, find_bindir
from appliance.db.database import Database, Endpoints
from appliance.db.listener import PgDoorbell
from appliance.db.runner_store import PgRunnerStore
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.errors import ConfigurationError
from appliance.domain.pipeline import Pipeline, Registry
from appliance.domain.schedule import Schedule
from appliance.inference.cache import ModelCache
from appliance.inference.lockfile import ModelsLock, load_lock
from appliance.inference.pool import InferencePool, TierSpec
from appliance.pipelines.registry import BUILT_IN
from appliance.scheduler import Maintenance
from appliance.settings import Settings


def local_cluster(settings: Settings) -> LocalCluster | None:
    """The cluster the appliance manages, or None when APPLIANCE_DATABASE_URL names a server."""
    if settings.db.url:
        return None
    return LocalCluster(
        settings.state_dir,
        bindir=settings.db.pg_bindir,
        port=settings.db.port,
        listen_addresses=settings.db.listen_addresses,
    )


def endpoints(settings: Settings) -> Endpoints:
    """Where each role connects: the given server, or the local cluster's socket."""
    if settings.db.url:
        return Endpoints.from_admin(
            settings.db.url, app=settings.db.app_url, system=settings.db.system_url
        )
    cluster = local_cluster(settings)
    assert cluster is not None
    return Endpoints.from_admin(cluster.conninfo(dbname=settings.db.name))


def pg_tool(settings: Settings, name: str) -> str:
    """A PostgreSQL client program (psql, pg_dump) from the server binaries found."""
    return str(find_bindir(settings.db.pg_bindir) / name)


def bus_config(settings: Settings) -> BusConfig:
    bus = settings.bus
    return BusConfig(
        lease=bus.lease,
        max_attempts=bus.max_attempts,
        retry=bus.retry,
        context_max_bytes=bus.context_max_bytes,
        idempotency_retention=bus.idempotency_retention,
        max_queue_age={
            lane: (timedelta(seconds=age) if age is not None else None)
            for lane, age in bus.max_queue_age_seconds.items()
        },
        maintenance_batch=bus.maintenance_batch,
    )


@dataclass
class Services:
    """What a command needs once the database is reachable."""

    db: Database
    bus: Bus
    store: PgRunnerStore
    tenants: PgTenantStore


@asynccontextmanager
async def services(settings: Settings, ends: Endpoints | None = None) -> AsyncIterator[Services]:
    """Open the pools, wire the stores and the bus; close everything on the way out."""
    db = Database(
        ends or endpoints(settings), min_size=settings.db.pool_min, max_size=settings.db.pool_max
    )
    await db.open()
    try:
        store = PgRunnerStore(db)
        yield Services(
            db=db, bus=Bus(store, bus_config(settings)), store=store, tenants=PgTenantStore(db)
        )
    finally:
        await db.close()


log = logging.getLogger("appliance.runtime")


def load_pipelines(settings: Settings) -> tuple[list[Pipeline], list[Schedule]]:
    """The built-in pipelines named in settings plus those of any extra modules."""
    pipelines: list[Pipeline] = []
    schedules: list[Schedule] = []
    for name in settings.runner.pipelines:
        if name not in BUILT_IN:
            known = ", ".join(sorted(BUILT_IN))
            raise ConfigurationError(
                f"runner.pipelines: unknown pipeline {name!r} (known: {known})"
            )
        pipelines.append(BUILT_IN[name])
    for module_name in settings.runner.pipeline_modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigurationError(
                f"runner.pipeline_modules: cannot import {module_name}: {exc}"
            ) from exc
        pipelines.extend(getattr(module, "PIPELINES", []))
        schedules.extend(getattr(module, "SCHEDULES", []))
    return pipelines, schedules


def model_lock(settings: Settings) -> ModelsLock:
    return load_lock(settings.inference.lock)


def model_cache(settings: Settings, log_line: Callable[[str], None] | None = None) -> ModelCache:
    return ModelCache(settings.inference.cache_dir, log=log_line)


def tier_specs(settings: Settings) -> list[TierSpec]:
    """The tiers to load: each profile model verified byte for byte (nothing is downloaded).

    A missing or wrong file is a ConfigurationError naming the model and what to run.
    """
    inference = settings.inference
    lock = model_lock(settings)
    cache = model_cache(settings)
    specs: list[TierSpec] = []
    for tier, entry in sorted(lock.profile(inference.profile).items(), key=lambda i: i[0].rank):
        ts = inference.tier(tier)
        if ts.workers == 0:
            log.info("tier %s is configured off (0 workers)", tier.value)
            continue
        verified = cache.verify(entry)
        specs.append(
            TierSpec(
                tier=tier,
                model=entry.name,
                sha256=entry.sha256,
                path=verified.path,
                chat_format=entry.chat_format,
                context_length=entry.context_length,
                workers=ts.workers,
                n_ctx=ts.n_ctx,
                n_threads=ts.n_threads,
                n_gpu_layers=ts.n_gpu_layers,
                queue=ts.queue,
            )
        )
    return specs


def build_pool(settings: Settings) -> InferencePool | None:
    """The runner's pool, or None when inference is off for this runner."""
    if not settings.inference.enabled:
        return None
    return InferencePool(tier_specs(settings))


def runner_config(settings: Settings) -> RunnerConfig:
    r = settings.runner
    return RunnerConfig(
        concurrency=r.concurrency,
        reserved_interactive=r.reserved_interactive,
        reserved_system=r.reserved_system,
        tenant_limit=r.tenant_limit,
        lease=settings.bus.lease,
        poll_interval=timedelta(seconds=r.poll_interval_seconds),
        drain_timeout=timedelta(seconds=r.drain_timeout_seconds),
        cancel_grace=timedelta(seconds=r.cancel_grace_seconds),
        claim_batch=r.claim_batch,
        reclaim_every=timedelta(seconds=r.reclaim_interval_seconds),
        capability_wait=timedelta(seconds=r.capability_wait_seconds),
    )


async def run_runner(settings: Settings, stop: asyncio.Event) -> None:
    """The runner process: pools, stage graphs, doorbell, maintenance, then serve until stop."""
    pipelines, schedules = load_pipelines(settings)
    config = runner_config(settings)
    # Models first: a missing or corrupted model stops the runner before it touches the bus.
    pool = build_pool(settings)
    if pool is not None:
        await pool.start()
    try:
        await _serve(settings, pipelines, schedules, config, pool, stop)
    finally:
        if pool is not None:
            await pool.close()


async def _serve(
    settings: Settings,
    pipelines: list[Pipeline],
    schedules: list[Schedule],
    config: RunnerConfig,
    pool: InferencePool | None,
    stop: asyncio.Event,
) -> None:
    ends = endpoints(settings)
    db = Database(ends, min_size=2, max_size=max(4, min(config.concurrency + 4, 32)))
    await db.open()
    try:
        store = PgRunnerStore(db)
        bus = Bus(store, bus_config(settings))
        await store.sync_pipelines(pipelines)
        doorbell = PgDoorbell(ends.system) if settings.runner.listen else None
        maintenance = Maintenance(
            bus,
            store,
            doorbell=doorbell,
            schedules=schedules,
            reclaim_every=timedelta(seconds=settings.runner.reclaim_interval_seconds),
            expire_every=timedelta(seconds=settings.runner.expire_interval_seconds),
            archive_every=timedelta(seconds=settings.runner.archive_interval_seconds),
            archive_retention=timedelta(days=settings.runner.archive_retention_days),
        )
        runner = Runner(
            store,
            Registry(pipelines),
            config,
            doorbell=doorbell,
            retry=settings.bus.retry,
            inference=pool,
        )
        maintenance.start()
        log.info(
            "runner %s serving %s (concurrency %d)",
            config.worker_id,
            ", ".join(p.name for p in pipelines) or "nothing",
            config.concurrency,
        )
        try:
            await runner.run(stop)
        finally:
            maintenance.shutdown()
    finally:
        await db.close()
