"""The composition root: builds the database, stores and bus from settings, in start order."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from appliance.bus.core import Bus, BusConfig
from appliance.bus.governor import Governor, GovernorConfig
from appliance.bus.runner import Runner, RunnerConfig, default_worker_id
from appliance.db.cluster import LocalCluster, find_bindir
from appliance.db.database import Database, Endpoints
from appliance.db.listener import PgDoorbell
from appliance.db.migrate import schema_problem
from appliance.db.runner_store import PgRunnerStore
from appliance.db.spend_store import PgCalibrationStore, PgSpendStore
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.cost import Amortisation, Pricing, Tariff, TimeOfUse
from appliance.domain.errors import ClusterError, ConfigurationError, MigrationError
from appliance.domain.inference import InferenceRequest, Tier
from appliance.domain.pipeline import Pipeline, Registry
from appliance.domain.schedule import Schedule
from appliance.inference.cache import ModelCache
from appliance.inference.lockfile import ModelsLock, load_lock
from appliance.inference.pool import InferencePool, TierSpec, gpu_offload_supported
from appliance.metering.meter import Meter
from appliance.metering.sources import (
    EnergySource,
    EstimateSource,
    NvmlSource,
    RaplSource,
    ThreadCpu,
    choose_source,
    process_cpu_seconds,
)
from appliance.pipelines.registry import BUILT_IN
from appliance.scheduler import Maintenance, schedule_trigger
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


def database(
    settings: Settings, ends: Endpoints | None = None, *, min_size: int, max_size: int
) -> Database:
    """The runtime pools of these settings (their endpoints unless `ends` is given)."""
    return Database(
        ends or endpoints(settings),
        min_size=min_size,
        max_size=max_size,
        statement_timeout=settings.db.statement_timeout,
    )


def pg_tool(settings: Settings, name: str) -> str:
    """A PostgreSQL client program (psql, pg_dump): from the server binaries found, or, for an
    external server (which needs no local server package), from PATH."""
    try:
        tool = find_bindir(settings.db.pg_bindir) / name
    except ClusterError:
        found = shutil.which(name) if settings.db.url else None
        if found is None:
            raise
        return found
    if os.access(tool, os.X_OK):
        return str(tool)
    # A folder of the server binaries alone (APPLIANCE_PG_BINDIR may name one): the client
    # from PATH, which talks to any server of the same or an older major version.
    found = shutil.which(name)
    if found is None:
        raise ClusterError(
            f"{name} is neither in {tool.parent} nor on PATH: install the PostgreSQL client "
            "(package postgresql-client)"
        )
    return found


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
    spend: PgSpendStore


@asynccontextmanager
async def services(settings: Settings, ends: Endpoints | None = None) -> AsyncIterator[Services]:
    """Open the pools, wire the stores and the bus; close everything on the way out."""
    db = database(settings, ends, min_size=settings.db.pool_min, max_size=settings.db.pool_max)
    await db.open()
    try:
        store = PgRunnerStore(db)
        yield Services(
            db=db,
            bus=Bus(store, bus_config(settings)),
            store=store,
            tenants=PgTenantStore(db),
            spend=PgSpendStore(db),
        )
    finally:
        await db.close()


log = logging.getLogger("appliance.runtime")
# The runner's claim path reclaims too, as a fallback should the maintenance sweeper stall, at
# this multiple of the sweeper's interval: still well inside lease + 5 s, and beside the claims
# a fifth as often.
FALLBACK_RECLAIM_FACTOR = 5


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
    served = {(p.name, stage.name) for p in pipelines for stage in p.stages}
    seen: set[tuple[str, str]] = set()
    for schedule in schedules:
        if (schedule.tenant, schedule.name) in seen:
            # A firing is keyed by the schedule's name and slot: the second one's firings would
            # all be taken for the first's and dropped.
            raise ConfigurationError(
                f"schedule {schedule.name} of tenant {schedule.tenant} is declared twice"
            )
        seen.add((schedule.tenant, schedule.name))
        schedule_trigger(schedule)  # a bad crontab line stops the start, not each firing
        if (schedule.pipeline, schedule.stage) not in served:
            log.warning(
                "schedule %s enqueues %s.%s, which this runner does not serve (another must)",
                schedule.name,
                schedule.pipeline,
                schedule.stage,
            )
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
            TierSpec.of(
                entry,
                verified.path,
                tier=tier,
                file_stamp=verified.stamp,
                workers=ts.workers,
                n_ctx=ts.n_ctx,
                n_threads=ts.n_threads,
                n_gpu_layers=ts.n_gpu_layers,
                queue=ts.queue,
            )
        )
    return specs


def build_meter(settings: Settings) -> Meter:
    """The energy meter: a counter (NVML, RAPL) when one is usable, else the labelled estimate
    from the CPU time of this process at the configured watts."""
    m = settings.metering
    estimate = EstimateSource(
        m.idle_watts, m.watts_per_busy_core, process_cpu_seconds, time.monotonic()
    )
    source: EnergySource
    if m.source == "estimate":
        source = estimate
    elif m.source == "auto":
        on_gpu = "gpu" in tier_devices(settings).values()
        source, skipped = choose_source(estimate, gpu_in_use=on_gpu)
        for name, why in skipped:
            log.info("energy source %s not used: %s", name, why)
    else:
        source = NvmlSource() if m.source == "nvml" else RaplSource()
        usable, why = source.available()
        if not usable:
            raise ConfigurationError(f"metering.source={m.source}: {why}")
    if source.provenance == "estimated":
        log.warning(
            "no energy counter here: energy figures are ESTIMATES (%.1f W idle + %.1f W per busy "
            "core) and are labelled so",
            m.idle_watts,
            m.watts_per_busy_core,
        )
        return Meter(
            source,
            ThreadCpu(),
            {"cpu": m.idle_watts},
            call_device="cpu",
            watts_per_busy_core=m.watts_per_busy_core,
        )
    devices = list(source.read(time.monotonic()).joules)
    calls_on = [d for d in devices if d.startswith(("gpu", "package"))] or devices
    meter = Meter(
        source, ThreadCpu(), {}, call_device=calls_on, watts_per_busy_core=m.watts_per_busy_core
    )
    for tier, device in tier_devices(settings).items():
        if not meter.counts(device):
            # Mixed tiers (one on the CPU, one on the GPU) with a counter of one kind only.
            log.warning(
                "tier %s runs on the %s, which energy source %s does not count: its calls are "
                "ESTIMATED (%.1f W per busy core of its CPU time%s) and labelled so",
                tier.value,
                device.upper(),
                source.name,
                m.watts_per_busy_core,
                "; the GPU's own energy is not in it" if device == "gpu" else "",
            )
    return meter


def tier_devices(settings: Settings) -> dict[Tier, str]:
    """The device ("cpu" or "gpu") each tier of the profile computes on, as the pool loads it:
    on the GPU when it offloads layers and this llama.cpp build has a GPU backend."""
    inference = settings.inference
    gpu = gpu_offload_supported()
    return {
        tier: "gpu" if gpu and inference.tier(tier).n_gpu_layers != 0 else "cpu"
        for tier in model_lock(settings).profile(inference.profile)
        if inference.tier(tier).workers != 0
    }


def build_pool(settings: Settings, meter: Meter | None = None) -> InferencePool | None:
    """The runner's pool, or None when inference is off for this runner."""
    if not settings.inference.enabled:
        return None
    return InferencePool(tier_specs(settings), meter=meter)


async def tick_meter(meter: Meter, every: float, stop: asyncio.Event) -> None:
    """Sample the meter steadily (calls also sample it as they begin and end)."""
    while not stop.is_set():
        try:
            await asyncio.to_thread(meter.tick)
        except Exception:
            log.exception("energy sample failed")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(every):
                await stop.wait()


def tariff(settings: Settings) -> Tariff:
    sp = settings.spend
    return Tariff(
        currency=sp.currency,
        price_per_kwh=sp.price_per_kwh,
        time_of_use=tuple(TimeOfUse(b.start, b.end, b.price_per_kwh) for b in sp.time_of_use),
        overhead=sp.power_overhead,
    )


async def pricing(settings: Settings, db: Database) -> Pricing:
    """How calls are priced: calibrated joules per token per model file, then the settings.

    A calibration counts only for the file it measured: one of another file under the same
    name (a smaller quantisation once pinned as that name) would under-price its calls."""
    try:
        pinned = {m.name: m.sha256 for m in model_lock(settings).models}
    except ConfigurationError:
        # No models.lock (a runner without inference): no model calls to price.
        pinned = {}
    per_token: dict[str, Decimal] = {}
    for row in await PgCalibrationStore(db).all():
        if pinned.get(str(row["model"])) == row["sha256"]:
            per_token[str(row["model"])] = Decimal(row["joules_per_token"])
    per_token.update(settings.spend.joules_per_token)
    return Pricing(
        tariff=tariff(settings),
        joules_per_token=per_token,
        default_joules_per_token=settings.spend.default_joules_per_token,
        safety_factor=settings.spend.safety_factor,
    )


async def configure_spend(settings: Settings, spend: PgSpendStore) -> None:
    """The ledger's settings from this process's settings; the cap only when none is set."""
    sp = settings.spend
    try:
        ZoneInfo(sp.time_zone)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ConfigurationError(f"spend.time_zone: unknown time zone {sp.time_zone!r}") from exc
    await spend.configure(
        time_zone=sp.time_zone,
        currency=sp.currency,
        interactive_share=sp.interactive_share,
        alert_fractions=sp.alert_fractions,
        amortisation_monthly=Amortisation(sp.amortisation_price, sp.amortisation_months).monthly(),
    )
    await spend.default_cap(sp.monthly_cap)


def runner_config(settings: Settings) -> RunnerConfig:
    r = settings.runner
    return RunnerConfig(
        worker_id=r.id if r.id is not None else default_worker_id(),
        concurrency=r.concurrency,
        reserved_interactive=r.reserved_interactive,
        reserved_system=r.reserved_system,
        tenant_limit=r.tenant_limit,
        lease=settings.bus.lease,
        poll_interval=timedelta(seconds=r.poll_interval_seconds),
        drain_timeout=timedelta(seconds=r.drain_timeout_seconds),
        cancel_grace=timedelta(seconds=r.cancel_grace_seconds),
        claim_batch=r.claim_batch,
        claim_ahead=r.claim_ahead,
        reclaim_every=timedelta(seconds=FALLBACK_RECLAIM_FACTOR * r.reclaim_interval_seconds),
        capability_wait=timedelta(seconds=r.capability_wait_seconds),
        stage_wait=timedelta(seconds=r.stage_wait_seconds),
        max_hops=r.max_hops,
        idempotency_retention=settings.bus.idempotency_retention,
        max_attempts=settings.bus.max_attempts,
        context_max_bytes=settings.bus.context_max_bytes,
    )


async def run_runner(settings: Settings, stop: asyncio.Event) -> None:
    """The runner process: pools, stage graphs, doorbell, maintenance, then serve until stop."""
    pipelines, schedules = load_pipelines(settings)
    config = runner_config(settings)
    # Models first: a missing or corrupted model stops the runner before it touches the bus.
    meter = build_meter(settings) if settings.inference.enabled else None
    # Hashing gigabytes of model files takes seconds: off the event loop, so a SIGTERM meanwhile
    # is still handled.
    pool = await asyncio.to_thread(build_pool, settings, meter)
    ticking = None
    if pool is not None:
        await pool.start()
        down = {t: h for t, h in pool.health().items() if not h["up"]}
        if down:
            # A model that will not load is a configuration to fix, not a runner to start: its
            # tier's work would wait, parked, until it expired.
            await pool.close()
            raise ConfigurationError(
                "inference: "
                + "; ".join(
                    f"tier {t} could not load its model ({', '.join(h['errors']) or 'no worker'})"
                    for t, h in down.items()
                )
                + " (set its workers to 0 to run without it)"
            )
    if meter is not None:
        ticking = asyncio.create_task(
            tick_meter(meter, settings.metering.sample_seconds, stop), name="energy-sampler"
        )
    try:
        await _serve(settings, pipelines, schedules, config, pool, stop)
    finally:
        if ticking is not None:
            ticking.cancel()
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
    db = database(settings, ends, min_size=2, max_size=max(4, min(config.concurrency + 4, 32)))
    await db.open()
    try:
        # A schema this code was written for, or a clear stop (its service restarts it once
        # the database is migrated) rather than failing on every claim.
        problem = await asyncio.to_thread(schema_problem, ends.system)
        if problem is not None:
            raise MigrationError(problem)
        store = PgRunnerStore(db)
        bus = Bus(store, bus_config(settings))
        await store.sync_pipelines(pipelines)
        spend: PgSpendStore | None = None
        governor: Governor | None = None
        if not settings.spend.enabled:
            log.warning(
                "spend.enabled is false: no monthly cap and no run budgets are enforced by "
                "this runner (the hop limit still is)"
            )
        else:
            spend = PgSpendStore(db)
            await configure_spend(settings, spend)
            governor = Governor(
                spend,
                GovernorConfig(
                    await pricing(settings, db),
                    ZoneInfo(settings.spend.time_zone),
                    busy_wait=timedelta(seconds=settings.spend.busy_wait_seconds),
                ),
                actor=config.worker_id,
            )
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
            history_retention=(
                None
                if settings.runner.history_retention_days is None
                else timedelta(days=settings.runner.history_retention_days)
            ),
            spend=spend,
            # A run's budget outlives its keys and its longest hold for budget (see 0019).
            run_budget_idle=max(settings.bus.idempotency_retention, config.budget_hold_max),
        )
        runner = Runner(
            store,
            Registry(pipelines),
            config,
            doorbell=doorbell,
            retry=settings.bus.retry,
            inference=pool,
            governor=governor,
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
            await maintenance.stop()
    finally:
        await db.close()


CALIBRATION_PROMPT = "Count slowly from one to one hundred, one number per line:\n1\n2\n3\n"


async def calibrate(
    settings: Settings, *, calls: int = 3, max_tokens: int = 64
) -> list[dict[str, Any]]:
    """Measure idle power and joules per generated token of each tier's model with the chosen
    energy source (an estimate here, labelled so), and store them for pricing.

    Joules per token is the energy of whole calls over their generated tokens only: prompt
    tokens are far cheaper, so pricing every token of a call at this figure is conservative.
    """
    meter = build_meter(settings)
    pool = InferencePool(tier_specs(settings), meter=meter)
    await pool.start()
    figures: list[dict[str, Any]] = []
    try:
        # Idle: two samples with nothing running.
        meter.tick()
        before = meter.totals()
        t0 = time.monotonic()
        await asyncio.sleep(2.0)
        meter.tick()
        idle_watts = (meter.totals()["measured"] - before["measured"]) / (time.monotonic() - t0)
        for tier in sorted(pool.available(), key=lambda t: t.rank):
            info = pool.describe(tier)
            assert info is not None
            joules = 0.0
            tokens = 0
            provenance: str = meter.provenance
            for i in range(calls):
                result = await pool.infer(
                    InferenceRequest(
                        "health_check" if tier is Tier.MECHANICAL else "evaluate",
                        prompt=CALIBRATION_PROMPT + f"{4 + i}\n",
                        max_tokens=max_tokens,
                    ),
                    tier,
                )
                joules += result.energy_joules or 0.0
                tokens += result.completion_tokens
                provenance = result.energy_provenance or provenance
            if tokens == 0 or joules <= 0:
                raise ConfigurationError(f"calibration of {info.model} measured nothing")
            figures.append(
                {
                    "model": info.model,
                    "sha256": info.sha256,
                    "joules_per_token": Decimal(str(round(joules / tokens, 6))),
                    "idle_watts": Decimal(str(round(idle_watts, 3))),
                    "tokens": tokens,
                    "provenance": provenance,
                    "source": meter.source.name,
                }
            )
    finally:
        await pool.close()
    db = database(settings, min_size=1, max_size=2)
    await db.open()
    try:
        store = PgCalibrationStore(db)
        for figure in figures:
            await store.save(**figure)
    finally:
        await db.close()
    return figures
