"""The composition root: builds the database, stores and bus from settings, in start order."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta

from appliance.bus.core import Bus, BusConfig
from appliance.db.cluster import LocalCluster, find_bindir
from appliance.db.database import Database, Endpoints
from appliance.db.message_store import PgMessageStore
from appliance.db.tenant_store import PgTenantStore
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
    tenants: PgTenantStore


@asynccontextmanager
async def services(settings: Settings, ends: Endpoints | None = None) -> AsyncIterator[Services]:
    """Open the pools, wire the stores and the bus; close everything on the way out."""
    db = Database(
        ends or endpoints(settings), min_size=settings.db.pool_min, max_size=settings.db.pool_max
    )
    await db.open()
    try:
        yield Services(
            db=db, bus=Bus(PgMessageStore(db), bus_config(settings)), tenants=PgTenantStore(db)
        )
    finally:
        await db.close()
