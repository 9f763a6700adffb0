"""Connections: where each role connects, the runtime pools, and tenant-scoped transactions."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import DictRow, dict_row
from psycopg.types.json import set_json_loads
from psycopg_pool import AsyncConnectionPool

from appliance.db.pool import LifoConnectionPool
from appliance.db.queries import q
from appliance.domain.errors import DatabaseUnavailable

APP_ROLE = "appliance_app"
SYSTEM_ROLE = "appliance_system"
# Every runtime connection resolves names in the appliance schema only.
SEARCH_PATH_OPTION = "-c search_path=appliance,pg_catalog"
# Runtime connections run a fixed set of named queries, prepared after a few uses. Left to
# choose, the server re-plans the large ones (the claim, the enqueue, the triggers' statements)
# on every call, since their generic plan's estimates look worse than a custom plan's: that
# planning was about a third of a claim's server time. The queries are written for a generic
# plan (the hot ones read their lane's pending index whatever the parameters), and
# tests/db/test_runner_store.py checks the claim's plan on a large table with this setting.
#
# Pinned as well, over any default a role set for itself (an ordinary role may ALTER ROLE its
# own defaults, and every tenant's statements run as one role): reads and writes under
# row-level security, writable transactions, and durable commits (a statement that may lose
# its commit says so itself, with SET LOCAL).
RUNTIME_OPTIONS = (
    f"{SEARCH_PATH_OPTION} -c plan_cache_mode=force_generic_plan -c row_security=on"
    " -c default_transaction_read_only=off -c synchronous_commit=on"
)
# A runtime statement that runs longer than this is cancelled by the server: behind a lock a
# forgotten session holds (an operator's open psql transaction), a claim or an acknowledgement
# waited for ever and its runner with it. Every runtime statement is a bounded batch, far
# below it; the setting db.statement_timeout_seconds changes it.
DEFAULT_STATEMENT_TIMEOUT = timedelta(minutes=5)
# TCP keepalives (ignored on the Unix socket): a server that vanished from the network (a
# partition, a host gone without closing) is noticed in about a minute; without them a
# statement waited for an answer for as long as the kernel keeps the connection (hours).
# tcp_user_timeout bounds data sent and never acknowledged the same way.
KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 60_000,
}

Conn = psycopg.AsyncConnection[DictRow]


@dataclass(frozen=True)
class Endpoints:
    """libpq connection strings of the three roles: admin/owner (migrations), app, system."""

    admin: str
    app: str
    system: str

    @classmethod
    def from_admin(
        cls, admin: str, *, app: str | None = None, system: str | None = None
    ) -> Endpoints:
        """Derive the runtime roles' endpoints from the admin one, changing only the user."""
        base = conninfo_to_dict(admin)
        base.pop("password", None)
        return cls(
            admin=admin,
            app=app or make_conninfo("", **{**base, "user": APP_ROLE}),
            system=system or make_conninfo("", **{**base, "user": SYSTEM_ROLE}),
        )

    def with_dbname(self, dbname: str) -> Endpoints:
        """The same servers and roles, another database (tests clone one per test)."""
        return Endpoints(
            admin=make_conninfo(self.admin, dbname=dbname),
            app=make_conninfo(self.app, dbname=dbname),
            system=make_conninfo(self.system, dbname=dbname),
        )


def client_command(program: str, conninfo: str) -> tuple[list[str], dict[str, str]]:
    """argv and extra environment for a libpq client program (psql, pg_dump) connecting like
    `conninfo`: every parameter (sslmode, options, ...) goes in its --dbname connection string,
    except the password, which goes in the environment rather than on a visible command line."""
    params = {k: str(v) for k, v in conninfo_to_dict(conninfo).items() if v is not None}
    password = params.pop("password", None)
    env = {"PGPASSWORD": password} if password else {}
    return [program, "--dbname", make_conninfo("", **params)], env


def check_server(conninfo: str, timeout_s: int = 5) -> str:
    """Connect once and return the server's version: a reachable, correctly named server, or
    DatabaseUnavailable saying why not (for the commands that manage no cluster)."""
    try:
        with psycopg.connect(conninfo, connect_timeout=timeout_s) as conn:
            row = conn.execute("SHOW server_version").fetchone()
    except psycopg.Error as exc:
        raise DatabaseUnavailable(f"cannot connect to the database: {error_text(exc)}") from None
    return str(row[0]) if row else "unknown"


# What a command may meet when the database is down, misnamed or refuses a statement: the CLI
# prints error_text(exc) on one line instead of a driver traceback.
DATABASE_ERRORS: tuple[type[Exception], ...] = (psycopg.Error,)


def error_text(exc: BaseException) -> str:
    """One line: PostgreSQL's or libpq's own message, without the driver's decoration."""
    diag = getattr(exc, "diag", None)
    primary = getattr(diag, "message_primary", None)
    text = primary or str(exc) or type(exc).__name__
    return " ".join(text.split())


def _keepalives(conninfo: str) -> dict[str, Any]:
    """KEEPALIVES, less those the connection string sets itself (the operator's win)."""
    given = conninfo_to_dict(conninfo)
    return {k: v for k, v in KEEPALIVES.items() if k not in given}


_JSON = msgspec.json.Decoder()


def load_json(data: str | bytes) -> Any:
    """A json/jsonb value from the server as Python (what json.loads returns).

    The runtime connections read every claimed message's context, every result and every hold's
    limits through this: msgspec's decoder takes about a tenth of the standard library's time.
    A number beyond a float's range (jsonb keeps any numeric) is the one value it refuses;
    json.loads reads that as infinity, and so does this.
    """
    try:
        return _JSON.decode(data)
    except msgspec.DecodeError:
        return json.loads(data)


async def _configure(conn: Conn) -> None:
    # Autocommit: single statements cost one round trip; multi-statement work opens an explicit
    # transaction block.
    await conn.set_autocommit(True)
    set_json_loads(load_json, conn)


class Database:
    """The two runtime pools. Opening connects; closing waits for borrowed connections."""

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        min_size: int = 1,
        max_size: int = 8,
        statement_timeout: timedelta = DEFAULT_STATEMENT_TIMEOUT,
    ) -> None:
        if statement_timeout < timedelta(milliseconds=1):
            raise ValueError("statement_timeout must be at least 1 ms")
        self.endpoints = endpoints
        # Prepared at first use: with the driver's default (prepare after 5 uses on a
        # connection) every connection of the pool planned the claim, the enqueue and the
        # acknowledgement 5 times before reusing a plan. The pools hand out the connection
        # returned last (LifoConnectionPool): a sequential caller keeps one warm server process.
        timeout_ms = int(statement_timeout / timedelta(milliseconds=1))
        kwargs: dict[str, Any] = {
            "options": f"{RUNTIME_OPTIONS} -c statement_timeout={timeout_ms}",
            "row_factory": dict_row,
            "prepare_threshold": 0,
        }
        self.app_pool: AsyncConnectionPool[Conn] = LifoConnectionPool(
            endpoints.app,
            min_size=min_size,
            max_size=max_size,
            kwargs={**_keepalives(endpoints.app), **kwargs},
            configure=_configure,
            open=False,
            name="appliance-app",
        )
        self.system_pool: AsyncConnectionPool[Conn] = LifoConnectionPool(
            endpoints.system,
            min_size=min_size,
            max_size=max_size,
            kwargs={**_keepalives(endpoints.system), **kwargs},
            configure=_configure,
            open=False,
            name="appliance-system",
        )

    async def open(self, timeout: float = 30.0) -> None:
        try:
            await self.app_pool.open(wait=True, timeout=timeout)
            await self.system_pool.open(wait=True, timeout=timeout)
        except Exception as exc:
            await self.close()
            raise DatabaseUnavailable(
                f"cannot connect to the database ({exc}); is it running and migrated? "
                "(appliance db start && appliance db migrate)"
            ) from exc

    async def close(self) -> None:
        await self.app_pool.close()
        await self.system_pool.close()

    async def __aenter__(self) -> Database:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @asynccontextmanager
    async def tenant_tx(self, tenant: str) -> AsyncIterator[Conn]:
        """A transaction as the app role, scoped to one tenant with SET LOCAL (never leaks).

        Pipelined: BEGIN, the tenant, the work and COMMIT travel together, so a one-statement
        transaction costs one round trip instead of four.
        """
        async with self.app_pool.connection() as conn, conn.pipeline(), conn.transaction():
            await conn.execute(q("tenant_set"), {"tenant": tenant})
            yield conn

    def system_conn(self) -> AbstractAsyncContextManager[Conn]:
        """An autocommit connection of the bus machinery role.

        Statements are durable unless they say otherwise: claims and heartbeats set
        synchronous_commit off for their own implicit transaction (see their queries).
        The pool's own context manager, unwrapped: the claim and acknowledgement paths take a
        connection for every statement, and a generator-based wrapper cost more than the call.
        """
        return self.system_pool.connection()

    @asynccontextmanager
    async def system_tx(self) -> AsyncIterator[Conn]:
        """A durable transaction of the bus machinery role (several statements, one commit)."""
        async with self.system_pool.connection() as conn, conn.pipeline(), conn.transaction():
            yield conn
