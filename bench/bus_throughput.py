"""Bus throughput against a raw-SQL job queue, on the same PostgreSQL in the same run.

What it measures (messages per second, median of 3 repeats, fresh data for every repeat):

1. single enqueue: `bus.enqueue(...)` one message per call, sequentially and from 8 concurrent
   tasks (the full envelope: validation, idempotency key, RLS tenant transaction, transition-log
   trigger, NOTIFY doorbell, durable commit);
2. batch enqueue: `bus.enqueue_many` in batches of 1,000 (request building is timed apart),
   from one task and from 2 concurrent tasks (a producer per core of this box; each batch one
   transaction, as ever; the raw side likewise on 2 connections);
3. claim + complete of pre-enqueued no-op messages: batches of 10 (`claim(limit=10)` then
   `complete_many`) with 1 and 4 concurrent workers, and one at a time (`limit=1` +
   `complete`);
4. the raw baseline for each of those, in a separate database of the same server: a minimal
   `jobs` table driven with plain async psycopg (single INSERT, unnest batch INSERT,
   `FOR UPDATE SKIP LOCKED` claim of 10 then `UPDATE ... WHERE id = ANY(...)`).

Diagnostic rows (clearly labelled, not product figures) follow: a bare round trip, the raw insert
wrapped in the bus's transaction shape, the bus with its log triggers or NOTIFY switched off
(scratch databases), claims against a shallow queue (also beside many messages held running,
claimed after the last ANALYZE), the floor (the raw queue plus only what the issue requires of
every message: a unique idempotency key, a lease fenced by its token and a transition log by
statement trigger, in a database of its own, measured beside raw in each repeat: how much of the
gap to raw those requirements explain), and per-statement plans and
timings of the Bus calls from auto_explain (ANALYZE, BUFFERS, nested statements and triggers
included, which a top-level EXPLAIN of the named queries cannot show once they call PL/pgSQL),
and what the server's backends waited on (pg_stat_activity sampled during one more batched
claim run of each side: CPU, locks, WAL flush).

CPU is accounted per measurement (this process, the PostgreSQL processes, and the rest of the
machine), because the box is shared: when other work ran meanwhile, the table says how much.

It starts its own PostgreSQL (LocalCluster, default durability: fsync on) in a temporary folder
on port 55433, and removes it at the end. The table is printed and written to the
`## bus_throughput` section of bench/RESULTS.md.

Run from the repository root:

    .venv/bin/python -m bench.bus_throughput            # the full run (4-5 minutes on a quiet box)
    .venv/bin/python -m bench.bus_throughput --quick    # small sizes, a smoke test
    .venv/bin/python -m bench.bus_throughput --no-write # do not touch bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from appliance.bus.core import Bus, BusConfig
from appliance.db.database import Database, Endpoints
from appliance.db.message_store import PgMessageStore
from appliance.db.migrate import migrate
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.envelope import EnqueueRequest, Lane, Message
from appliance.domain.inference import Tier
from appliance.domain.ports import Completion
from bench.harness import (
    Measurement,
    Meter,
    Sample,
    code_version,
    create_database,
    fmt_rate,
    fresh_tag,
    machine_facts,
    markdown_table,
    postmaster_pid,
    server_facts,
    temp_cluster,
    write_section,
)

PORT = 55433
TENANT = "bench"
BUS_DB = "bench_bus"
RAW_DB = "bench_raw"
FLOOR_DB = "bench_floor"
# Scratch databases for the diagnostics, each with one part of the envelope switched off.
DIAG_SETUP: dict[str, tuple[str, ...]] = {
    "bench_diag_no_triggers": (
        "ALTER TABLE appliance.agent_messages DISABLE TRIGGER agent_messages_insert_trg",
        "ALTER TABLE appliance.agent_messages DISABLE TRIGGER agent_messages_update_trg",
    ),
    "bench_diag_no_notify": ("ALTER DATABASE bench_diag_no_notify SET appliance.notify = 'off'",),
}
BATCH = 1_000
SETTINGS_SHOWN = (
    "fsync",
    "synchronous_commit",
    "full_page_writes",
    "wal_level",
    "wal_compression",
    "shared_buffers",
    "max_connections",
    "max_wal_size",
    "jit",
)

# Targets from the issue.
TARGET_BATCH = 50_000.0
TARGET_SINGLE = 4_000.0
TARGET_CLAIM_RATIO = 0.5


@dataclass(frozen=True)
class Sizes:
    """How many messages each measurement moves per repeat."""

    single: int
    batch_total: int
    claim_batched: int
    claim_one: int
    diag_single: int
    diag_claim: int
    rtt: int
    held: int  # messages kept running beside one diagnostic's claims
    repeats: int = 3


FULL = Sizes(
    single=5_000,
    batch_total=50_000,
    claim_batched=20_000,
    claim_one=1_000,
    diag_single=1_000,
    diag_claim=2_000,
    rtt=5_000,
    held=10_000,
)
QUICK = Sizes(
    single=400,
    batch_total=4_000,
    claim_batched=2_000,
    claim_one=200,
    diag_single=200,
    diag_claim=500,
    rtt=500,
    held=1_000,
)


def _fields(tag: str, i: int) -> dict[str, Any]:
    return {
        "tenant": TENANT,
        "pipeline": "bench",
        "stage": "noop",
        "source": "bench",
        "source_id": f"{tag}-{i}",
        "directive": "noop",
        "context": {"i": i},
    }


def _payload(i: int) -> str:
    return json.dumps({"i": i}, separators=(",", ":"))


# -- the bus side ---------------------------------------------------------------------------------


class BusTarget:
    """A migrated database with one tenant, and the real Bus over the runtime pools."""

    def __init__(self, admin: str, server_pid: int | None, pool: int = 10) -> None:
        self.admin = admin
        self.server_pid = server_pid
        self.pool = pool
        self.db = Database(Endpoints.from_admin(admin), min_size=pool, max_size=pool)
        self.bus = Bus(PgMessageStore(self.db), BusConfig())

    async def open(self) -> None:
        await self.db.open()
        await PgTenantStore(self.db).add(TENANT)

    async def close(self) -> None:
        await self.db.close()

    async def admin_sql(self, *statements: str) -> None:
        async with await psycopg.AsyncConnection.connect(self.admin, autocommit=True) as conn:
            for statement in statements:
                await conn.execute(statement)

    async def reset(self) -> None:
        """Empty the envelope tables and flush the server's dirty pages, like every repeat."""
        await self.admin_sql(
            "TRUNCATE appliance.agent_messages, appliance.idempotency_keys,"
            " appliance.message_transitions",
            "CHECKPOINT",
        )

    def requests(self, n: int) -> list[EnqueueRequest]:
        tag = fresh_tag()
        return [self.bus.request(**_fields(tag, i)) for i in range(n)]

    async def prefill(self, n: int) -> None:
        requests = self.requests(n)
        for start in range(0, n, BATCH):
            await self.bus.enqueue_many(requests[start : start + BATCH])
        await self.admin_sql("ANALYZE appliance.agent_messages", "CHECKPOINT")

    def meter(self, n: int) -> Meter:
        return Meter(self.server_pid, n)

    # The measurements: each resets, prepares untimed, then times exactly the work.

    async def single(self, n: int, tasks: int) -> Sample:
        await self.reset()
        tag = fresh_tag()
        bus = self.bus

        async def run(part: int) -> None:
            for i in range(part, n, tasks):
                await bus.enqueue(**_fields(tag, i))

        with self.meter(n) as m:
            await asyncio.gather(*(run(p) for p in range(tasks)))
        assert m.sample is not None
        return m.sample

    async def batch(self, total: int, build: Measurement, tasks: int = 1) -> Sample:
        await self.reset()
        with Meter(None, total) as b:
            requests = self.requests(total)
        assert b.sample is not None
        build.add(b.sample)
        starts = list(range(0, total, BATCH))

        async def run(part: int) -> None:
            for start in starts[part::tasks]:
                await self.bus.enqueue_many(requests[start : start + BATCH])

        with self.meter(total) as m:
            await asyncio.gather(*(run(p) for p in range(tasks)))
        assert m.sample is not None
        return m.sample

    async def claim_complete(
        self,
        n: int,
        workers: int,
        limit: int,
        held: int = 0,
        blocked: int = 0,
        deferred: int = 0,
        timing: asyncio.Event | None = None,
    ) -> Sample:
        """Claim and complete `n` messages; `held` more are claimed first (untimed) and kept
        running throughout, claimed after the statistics were taken (as when a burst of slow
        work outruns autovacuum). `blocked`: that many messages of a reasoning-tier stage are
        queued ahead of them, and every claim is made with the reasoning tier blocked (as by a
        runner whose reasoning pool is full): lane claims of the store, as the runner makes.
        `deferred`: that many messages of a higher priority wait for tomorrow ahead of them (a
        retry storm of urgent work backing off)."""
        await self.reset()
        if deferred:
            later = datetime.now(UTC) + timedelta(days=1)
            ahead = [replace(r, priority=5, not_before=later) for r in self.requests(deferred)]
            for start in range(0, deferred, BATCH):
                await self.bus.enqueue_many(ahead[start : start + BATCH])
        if blocked:
            await self.admin_sql(
                "INSERT INTO appliance.pipeline_stages (pipeline, stage, lane, task_kind, tier,"
                " handler, directive, max_runtime, max_attempts) VALUES ('bench', 'draft',"
                " 'interactive', 'draft', 'reasoning', 'bench', 'draft', '10 minutes', 5)"
                " ON CONFLICT DO NOTHING"
            )
            drafts = [replace(r, stage="draft") for r in self.requests(blocked)]
            for start in range(0, blocked, BATCH):
                await self.bus.enqueue_many(drafts[start : start + BATCH])
        await self.prefill(n + held)
        bus = self.bus
        while held > 0:
            taken = await bus.claim("holder", limit=min(held, 500))
            assert taken, "the backlog ran out while taking the held messages"
            held -= len(taken)

        store = bus.store
        assert isinstance(store, PgMessageStore)

        async def claim(name: str) -> list[Message]:
            if not blocked:
                return await bus.claim(name, limit=limit)
            found = await store.claim_lane(
                worker=name,
                lane=Lane.INTERACTIVE,
                limit=limit,
                lease=bus.config.lease,
                tenant_limit=10**6,
                blocked_tiers=(Tier.REASONING,),
            )
            return found.messages

        async def worker(name: str) -> int:
            done = 0
            while True:
                batch = await claim(name)
                if not batch:
                    return done
                if limit == 1:
                    await bus.complete(batch[0].lease)
                else:
                    await bus.complete_many([Completion(m.lease) for m in batch])
                done += len(batch)

        if timing is not None:
            timing.set()
        with self.meter(n) as m:
            counts = await asyncio.gather(*(worker(f"w{i}") for i in range(workers)))
        assert sum(counts) == n, f"claimed {sum(counts)} of {n}"
        assert m.sample is not None
        return m.sample

    async def round_trip(self, n: int) -> Sample:
        async with self.db.system_conn() as conn:
            with self.meter(n) as m:
                for _ in range(n):
                    await conn.execute("SELECT 1")
        assert m.sample is not None
        return m.sample


# -- the raw baseline -----------------------------------------------------------------------------

RAW_SCHEMA = (
    "DROP TABLE IF EXISTS jobs",
    "CREATE TABLE jobs (id bigserial PRIMARY KEY, payload jsonb,"
    " status text DEFAULT 'pending', locked_by text)",
    "CREATE INDEX jobs_pending_idx ON jobs (id) WHERE status = 'pending'",
)
RAW_INSERT = "INSERT INTO jobs (payload) VALUES (%s::jsonb) RETURNING id"
RAW_INSERT_MANY = "INSERT INTO jobs (payload) SELECT p FROM unnest(%s::jsonb[]) AS p RETURNING id"
RAW_CLAIM = (
    "WITH c AS MATERIALIZED (SELECT id FROM jobs WHERE status = 'pending' ORDER BY id"
    " LIMIT %(limit)s FOR UPDATE SKIP LOCKED)"
    " UPDATE jobs j SET status = 'running', locked_by = %(worker)s FROM c WHERE j.id = c.id"
    " RETURNING j.id"
)
RAW_DONE = "UPDATE jobs SET status = 'done' WHERE id = ANY(%s)"

# The floor: the raw queue plus only what the issue requires of every message, each done the
# cheapest way: an idempotency key (unique per tenant; a duplicate is a no-op that answers the
# existing row), a lease (a token from a sequence and an expiry on every claim; the completion
# fenced by the token), and a transition log written by statement-level triggers (from, to,
# reason, actor, at; the bus's two log indexes). No RLS, tenants, fairness, limits, hand-offs,
# doorbell or retries. What the bus costs above it is its own design, not what the issue asks.
FLOOR_SCHEMA = (
    "DROP TABLE IF EXISTS jobs, job_log CASCADE",
    "DROP SEQUENCE IF EXISTS job_lease_seq",
    "CREATE SEQUENCE job_lease_seq",
    "CREATE TABLE jobs (id bigserial PRIMARY KEY, tenant text NOT NULL DEFAULT 'bench',"
    " key text NOT NULL, payload jsonb, status text DEFAULT 'pending', locked_by text,"
    " lease_token bigint, lease_expires_at timestamptz)",
    "CREATE UNIQUE INDEX jobs_key_idx ON jobs (tenant, key)",
    "CREATE INDEX jobs_pending_idx ON jobs (id) WHERE status = 'pending'",
    "CREATE TABLE job_log (id bigserial PRIMARY KEY, job_id bigint NOT NULL,"
    " from_status text, to_status text NOT NULL, reason text NOT NULL, actor text,"
    " at timestamptz NOT NULL DEFAULT now())",
    "CREATE INDEX job_log_job_idx ON job_log (job_id, id)",
    "CREATE OR REPLACE FUNCTION log_inserted() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
    " INSERT INTO job_log (job_id, to_status, reason) SELECT n.id, n.status, 'enqueued'"
    " FROM new_rows n; RETURN NULL; END $$",
    "CREATE OR REPLACE FUNCTION log_updated() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
    " INSERT INTO job_log (job_id, from_status, to_status, reason, actor)"
    " SELECT n.id, o.status, n.status,"
    " CASE n.status WHEN 'running' THEN 'claimed' ELSE 'completed' END, n.locked_by"
    " FROM new_rows n JOIN old_rows o ON o.id = n.id WHERE n.status <> o.status;"
    " RETURN NULL; END $$",
    "CREATE TRIGGER jobs_inserted AFTER INSERT ON jobs REFERENCING NEW TABLE AS new_rows"
    " FOR EACH STATEMENT EXECUTE FUNCTION log_inserted()",
    "CREATE TRIGGER jobs_updated AFTER UPDATE ON jobs REFERENCING OLD TABLE AS old_rows"
    " NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION log_updated()",
)
FLOOR_INSERT = (
    "WITH ins AS (INSERT INTO jobs (key, payload) VALUES (%(key)s, %(payload)s::jsonb)"
    " ON CONFLICT (tenant, key) DO NOTHING RETURNING id)"
    " SELECT id, true AS new FROM ins"
    " UNION ALL SELECT id, false FROM jobs"
    " WHERE tenant = 'bench' AND key = %(key)s AND NOT EXISTS (SELECT FROM ins)"
)
FLOOR_CLAIM = (
    "WITH c AS MATERIALIZED (SELECT id FROM jobs WHERE status = 'pending' ORDER BY id"
    " LIMIT %(limit)s FOR UPDATE SKIP LOCKED)"
    " UPDATE jobs j SET status = 'running', locked_by = %(worker)s,"
    " lease_token = nextval('job_lease_seq'), lease_expires_at = now() + interval '30 seconds'"
    " FROM c WHERE j.id = c.id RETURNING j.id, j.lease_token"
)
FLOOR_DONE = (
    "UPDATE jobs j SET status = 'done', lease_expires_at = NULL"
    " FROM unnest(%s::bigint[], %s::bigint[]) AS a(id, token)"
    " WHERE j.id = a.id AND j.lease_token = a.token AND j.lease_expires_at IS NOT NULL"
)


class RawTarget:
    """The minimal job queue: one table, plain async psycopg, autocommit, default durability."""

    schema: tuple[str, ...] = RAW_SCHEMA
    tables = "jobs"
    claim_sql = RAW_CLAIM

    def __init__(self, admin: str, server_pid: int | None) -> None:
        self.admin = admin
        self.server_pid = server_pid
        self.conns: list[psycopg.AsyncConnection[Any]] = []
        # The product's own connection pool (autocommit, as bus.enqueue sends its one
        # statement), pointed at the raw table: the diagnostic that prices the pool's share.
        self.wrapped = Database(Endpoints(admin, admin, admin), min_size=1, max_size=1)

    async def open(self, count: int = 8) -> None:
        await self.sql(*self.schema)
        for _ in range(count):
            self.conns.append(await psycopg.AsyncConnection.connect(self.admin, autocommit=True))
        await self.wrapped.open()

    async def close(self) -> None:
        for conn in self.conns:
            await conn.close()
        await self.wrapped.close()

    async def sql(self, *statements: str) -> None:
        async with await psycopg.AsyncConnection.connect(self.admin, autocommit=True) as conn:
            for statement in statements:
                await conn.execute(statement)

    async def reset(self) -> None:
        await self.sql(f"TRUNCATE {self.tables}", "CHECKPOINT")

    def meter(self, n: int) -> Meter:
        return Meter(self.server_pid, n)

    async def single(self, n: int, tasks: int) -> Sample:
        await self.reset()

        tag = fresh_tag()

        async def run(conn: psycopg.AsyncConnection[Any], part: int) -> None:
            for i in range(part, n, tasks):
                await (await conn.execute(*self.insert(tag, i))).fetchone()

        with self.meter(n) as m:
            await asyncio.gather(*(run(self.conns[p], p) for p in range(tasks)))
        assert m.sample is not None
        return m.sample

    def insert(self, tag: str, i: int) -> tuple[str, Any]:
        """One message's INSERT and its parameters."""
        return RAW_INSERT, (_payload(i),)

    async def done(self, conn: psycopg.AsyncConnection[Any], claimed: list[Any]) -> None:
        """Mark the claimed rows done."""
        await conn.execute(RAW_DONE, ([row[0] for row in claimed],))

    def prefill(self, n: int) -> str:
        """The statement that queues `n` messages for the claim measurements."""
        return (
            "INSERT INTO jobs (payload) SELECT jsonb_build_object('i', g)"
            f" FROM generate_series(1, {int(n)}) AS g"
        )

    async def single_bus_shape(self, n: int) -> Sample:
        """Diagnostic: the raw insert on a pooled connection, the way bus.enqueue sends its
        one autocommit statement."""
        await self.reset()
        insert = RAW_INSERT.replace("INTO jobs", "INTO public.jobs")  # the pool's search_path
        with self.meter(n) as m:
            for i in range(n):
                async with self.wrapped.app_pool.connection() as conn:
                    await (await conn.execute(insert, (_payload(i),))).fetchone()
        assert m.sample is not None
        return m.sample

    async def batch(self, total: int, tasks: int = 1) -> Sample:
        await self.reset()
        payloads = [_payload(i) for i in range(total)]
        starts = list(range(0, total, BATCH))

        async def run(conn: psycopg.AsyncConnection[Any], part: int) -> None:
            for start in starts[part::tasks]:
                cur = await conn.execute(RAW_INSERT_MANY, (payloads[start : start + BATCH],))
                await cur.fetchall()

        with self.meter(total) as m:
            await asyncio.gather(*(run(self.conns[p], p) for p in range(tasks)))
        assert m.sample is not None
        return m.sample

    async def claim_complete(
        self, n: int, workers: int, limit: int, timing: asyncio.Event | None = None
    ) -> Sample:
        await self.reset()
        await self.sql(
            self.prefill(n),
            "ANALYZE jobs",
            "CHECKPOINT",
        )

        async def worker(conn: psycopg.AsyncConnection[Any], name: str) -> int:
            done = 0
            while True:
                cur = await conn.execute(self.claim_sql, {"limit": limit, "worker": name})
                claimed = await cur.fetchall()
                if not claimed:
                    return done
                await self.done(conn, claimed)
                done += len(claimed)

        if timing is not None:
            timing.set()
        with self.meter(n) as m:
            counts = await asyncio.gather(*(worker(self.conns[i], f"w{i}") for i in range(workers)))
        assert sum(counts) == n, f"claimed {sum(counts)} of {n}"
        assert m.sample is not None
        return m.sample


class FloorTarget(RawTarget):
    """The raw queue with only what the issue requires of every message (FLOOR_SCHEMA)."""

    schema = FLOOR_SCHEMA
    tables = "jobs, job_log"
    claim_sql = FLOOR_CLAIM

    def insert(self, tag: str, i: int) -> tuple[str, Any]:
        return FLOOR_INSERT, {"key": f"{tag}-{i}", "payload": _payload(i)}

    async def done(self, conn: psycopg.AsyncConnection[Any], claimed: list[Any]) -> None:
        ids, tokens = [row[0] for row in claimed], [row[1] for row in claimed]
        await conn.execute(FLOOR_DONE, (ids, tokens))

    def prefill(self, n: int) -> str:
        return (
            "INSERT INTO jobs (key, payload) SELECT g::text, jsonb_build_object('i', g)"
            f" FROM generate_series(1, {int(n)}) AS g"
        )


# -- EXPLAIN diagnostics --------------------------------------------------------------------------
#
# The bus's statements run inside PL/pgSQL (enqueue_messages, the log triggers) and RI triggers,
# which a top-level EXPLAIN shows only as one opaque node. So the plans are taken with
# auto_explain (ANALYZE, BUFFERS, nested statements, triggers): the same measurements as
# EXPLAIN (ANALYZE, BUFFERS), for every statement at every level, while the real Bus API runs
# against a scratch database whose sessions load it (ALTER DATABASE .. SET, superuser only).

EXPLAIN_DB = "bench_diag_explain"
EXPLAIN_SETUP = (
    f"ALTER DATABASE {EXPLAIN_DB} SET session_preload_libraries = 'auto_explain'",
    f"ALTER DATABASE {EXPLAIN_DB} SET auto_explain.log_min_duration = 0",
    f"ALTER DATABASE {EXPLAIN_DB} SET auto_explain.log_analyze = on",
    f"ALTER DATABASE {EXPLAIN_DB} SET auto_explain.log_buffers = on",
    f"ALTER DATABASE {EXPLAIN_DB} SET auto_explain.log_triggers = on",
    f"ALTER DATABASE {EXPLAIN_DB} SET auto_explain.log_nested_statements = on",
    f"ALTER DATABASE {EXPLAIN_DB} SET auto_explain.log_format = 'json'",
    f"ALTER DATABASE {EXPLAIN_DB} SET auto_explain.log_level = 'notice'",
    f"ALTER DATABASE {EXPLAIN_DB} SET client_min_messages = 'notice'",
)
_DURATION = re.compile(r"^duration: ([\d.]+) ms\s+plan:\s*(.*)$", re.DOTALL)
_SCANS = (
    "Seq Scan",
    "Index Scan",
    "Index Only Scan",
    "Bitmap Heap Scan",
    "Sort",
    "ModifyTable",
    "LockRows",
)


@dataclass
class Statement:
    """One executed statement as auto_explain reported it."""

    text: str
    ms: float
    plan: dict[str, Any]

    @property
    def label(self) -> str:
        words = " ".join(self.text.split())
        return words if len(words) <= 60 else words[:57] + "..."

    def scans(self) -> list[str]:
        """Scan and sort nodes of this statement's own plan: kind, relation, rows, time."""
        found: list[str] = []

        def walk(node: dict[str, Any]) -> None:
            kind = node.get("Node Type", "")
            if kind == "ModifyTable":
                kind = str(node.get("Operation", kind))
            if node.get("Node Type") in _SCANS:
                where = node.get("Relation Name") or ""
                index = node.get("Index Name")
                name = f"{kind} {where}".strip() + (f" ({index})" if index else "")
                rows = node.get("Actual Rows", 0)
                loops = node.get("Actual Loops", 1)
                found.append(
                    f"{name}: rows={rows:,.0f}x{loops} {node.get('Actual Total Time', 0):.2f} ms"
                )
            for child in node.get("Plans", []):
                walk(child)

        walk(self.plan.get("Plan", {}))
        return found


class PlanCapture:
    """Collects auto_explain notices from every connection of a Database's pools."""

    def __init__(self) -> None:
        self.statements: list[Statement] = []

    def __call__(self, diag: psycopg.errors.Diagnostic) -> None:
        match = _DURATION.match(diag.message_primary or "")
        if not match:
            return
        try:
            plan = json.loads(match[2])
        except ValueError:
            return
        text = str(plan.get("Query Text", "?"))
        self.statements.append(Statement(text, float(match[1]), plan))

    async def attach(self, db: Database, size: int) -> None:
        """Hold every pooled connection at once and give each the handler."""
        for pool in (db.app_pool, db.system_pool):
            conns = [await pool.getconn() for _ in range(size)]
            for conn in conns:
                conn.add_notice_handler(self)
            for conn in conns:
                await pool.putconn(conn)

    def take(self) -> list[Statement]:
        taken, self.statements = self.statements, []
        return taken


@dataclass
class Explained:
    """One Bus call under auto_explain, repeated: per statement label, calls and median ms."""

    name: str
    runs: list[list[Statement]] = field(default_factory=list)

    def add(self, statements: list[Statement]) -> None:
        self.runs.append(statements)

    def _top(self, run: list[Statement]) -> Statement | None:
        # Nested statements finish (and are reported) inside their caller: the longest one of
        # a call is its top-level statement, whose time includes everything below it.
        return max(run, key=lambda st: st.ms) if run else None

    def total_ms(self) -> float | None:
        tops = [t.ms for r in self.runs if (t := self._top(r))]
        return statistics.median(tops) if tops else None

    def top_label(self) -> str:
        top = self._top(self.runs[-1]) if self.runs else None
        return top.label if top else "-"

    def main_statement(self) -> Statement | None:
        """The statement doing the work: the top one, or when that only calls a function, the
        longest statement inside it."""
        if not self.runs:
            return None
        for st in sorted(self.runs[-1], key=lambda st: -st.ms):
            if st.plan.get("Plan", {}).get("Node Type") not in ("Function Scan", "Result"):
                return st
        return self._top(self.runs[-1])

    def main_scans(self) -> list[str]:
        main = self.main_statement()
        return main.scans() if main else []

    def message_scans(self) -> list[str]:
        """How the main statement reads agent_messages (its scan nodes on that table)."""
        return [x for x in self.main_scans() if "Scan agent_messages" in x]

    def triggers(self) -> list[str]:
        """Every trigger that fired, in any statement of the last run: calls and ms."""
        out: list[str] = []
        for st in self.runs[-1] if self.runs else []:
            for t in st.plan.get("Triggers", []):
                name = t.get("Constraint Name") or t.get("Trigger Name", "?")
                out.append(f"trigger {name} x{t.get('Calls', 0)} {t.get('Time', 0):.2f} ms")
        return out

    def inside(self, limit: int = 6) -> list[tuple[str, int, float]]:
        """The statements below the top one: label, calls per run, median ms per run."""
        per_run: list[dict[str, tuple[int, float]]] = []
        for run in self.runs:
            top = self._top(run)
            acc: dict[str, tuple[int, float]] = {}
            for st in run:
                if st is top:
                    continue
                calls, ms = acc.get(st.label, (0, 0.0))
                acc[st.label] = (calls + 1, ms + st.ms)
            per_run.append(acc)
        labels = {label for acc in per_run for label in acc}
        rows = []
        for label in labels:
            calls = max(acc.get(label, (0, 0.0))[0] for acc in per_run)
            ms = statistics.median(acc.get(label, (0, 0.0))[1] for acc in per_run)
            rows.append((label, calls, ms))
        rows.sort(key=lambda r: -r[2])
        return rows[:limit]


async def explain_calls(
    target: BusTarget,
    capture: PlanCapture,
    repeats: int,
    depth: int,
    *,
    enqueue_sizes: Sequence[int] = (),
    enqueue_depth: int = 0,
    claims: bool = False,
) -> list[Explained]:
    """Run Bus calls with every statement's plan captured: enqueue of the given sizes against
    `enqueue_depth` pending messages, and claim(10) + complete_many(10) at `depth` and at 100
    pending (and at `depth` again with RLS OFF). A warm-up round per case is discarded
    (PL/pgSQL compiles its functions once per backend)."""
    bus = target.bus
    out: dict[str, Explained] = {}

    async def record(name: str, call: Callable[[], Awaitable[Any]], keep: bool) -> Any:
        capture.take()
        result = await call()
        statements = capture.take()
        if keep:
            out.setdefault(name, Explained(name)).add(statements)
        return result

    if enqueue_sizes:
        await target.reset()
        await target.prefill(enqueue_depth)
        for i in range(repeats + 1):
            for size in enqueue_sizes:
                requests = target.requests(size)
                what = "bus.enqueue (1 message)" if size == 1 else f"bus.enqueue_many ({size:,})"
                await record(
                    f"{what}, {enqueue_depth:,} pending",
                    functools.partial(bus.enqueue_many, requests),
                    keep=i > 0,
                )

    async def claim_rounds(pending: int, label: str) -> None:
        await target.reset()
        await target.prefill(pending)
        for i in range(repeats + 1):
            batch = await record(
                f"bus.claim(limit=10), {pending:,} pending{label}",
                lambda: bus.claim("explain", limit=10),
                keep=i > 0,
            )
            await record(
                f"bus.complete_many (10), {pending:,} pending{label}",
                functools.partial(bus.complete_many, [Completion(m.lease) for m in batch]),
                keep=i > 0,
            )

    if claims:
        await claim_rounds(depth, "")
        await claim_rounds(100, "")
        await target.admin_sql("ALTER TABLE appliance.agent_messages DISABLE ROW LEVEL SECURITY")
        try:
            await claim_rounds(depth, ", RLS OFF")
        finally:
            await target.admin_sql("ALTER TABLE appliance.agent_messages ENABLE ROW LEVEL SECURITY")
    return list(out.values())


async def explain_all(
    admin: str, server_pid: int | None, depth: int, enqueue_depth: int
) -> list[Explained]:
    """Every statement logged for enqueue x1 and the claim path; for the 1,000-row enqueue only
    statements of 1 ms or more (logging its 2,000 tiny foreign-key checks one by one would
    inflate the very time it measures; their total still shows in the trigger list)."""
    explained: list[Explained] = []
    for min_ms, sizes, claims in ((0, (1,), True), (1, (BATCH,), False)):
        await BusTarget(admin, server_pid).admin_sql(
            f"ALTER DATABASE {EXPLAIN_DB} SET auto_explain.log_min_duration = {min_ms}"
        )
        target = BusTarget(admin, server_pid, pool=2)
        await target.open()
        try:
            capture = PlanCapture()
            await capture.attach(target.db, target.pool)
            explained += await explain_calls(
                target,
                capture,
                3,
                depth,
                enqueue_sizes=sizes,
                enqueue_depth=enqueue_depth,
                claims=claims,
            )
        finally:
            await target.close()
    return explained


# -- what the server's backends wait on ------------------------------------------------------------

WAIT_SAMPLE_S = 0.005
WAITS_QUERY = (
    "SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') FROM pg_stat_activity"
    " WHERE datname = %(db)s AND state = 'active' AND pid <> pg_backend_pid()"
)


async def sample_waits(
    admin: str, dbname: str, work: Callable[..., Awaitable[Any]]
) -> Counter[str]:
    """What the active backends of `dbname` were doing while `work` ran its timed part (from
    when it sets the event it is given as `timing=`; its set-up is not sampled):
    pg_stat_activity read every WAIT_SAMPLE_S from a connection of its own, each active backend
    counted under its wait event (`CPU` when it waits on nothing). Sampling costs some CPU: a
    diagnostic, never timed."""
    counts: Counter[str] = Counter()
    timing, done = asyncio.Event(), asyncio.Event()

    async def sampler() -> None:
        async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as conn:
            await timing.wait()
            while not done.is_set():
                rows = await (await conn.execute(WAITS_QUERY, {"db": dbname})).fetchall()
                counts.update(str(r[0]) for r in rows)
                await asyncio.sleep(WAIT_SAMPLE_S)

    task = asyncio.create_task(sampler())
    try:
        await work(timing=timing)
    finally:
        done.set()
        timing.set()  # a sampler still waiting for a start that never came
        await task
    return counts


# -- the run --------------------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the table: the bus figure and, where there is one, its raw counterpart."""

    label: str
    bus: Measurement
    raw: Measurement | None = None

    @property
    def ratio(self) -> float | None:
        if self.raw is None or not self.raw.samples or not self.bus.samples:
            return None
        return self.bus.median / self.raw.median


@dataclass
class Report:
    sizes: Sizes
    rows: list[Row]
    build: Measurement
    diagnostics: list[Row]
    explained: list[Explained]
    facts: dict[str, str]
    wall: float
    # label -> (bus samples by wait event, raw samples by wait event)
    waits: dict[str, tuple[Counter[str], Counter[str]]] = field(default_factory=dict)


Step = Callable[[], Awaitable[Sample]]


async def _repeat(steps: Sequence[tuple[Measurement, Step]], repeats: int) -> None:
    """Every step once per repeat, in order: bus and raw runs interleave, so drift hits both."""
    for r in range(repeats):
        for measurement, step in steps:
            sample = await step()
            measurement.add(sample)
            print(
                f"  [{r + 1}/{repeats}] {measurement.name:<48} {fmt_rate(sample.rate):>9} /s"
                f"  ({sample.n:,} in {sample.wall:.2f} s)",
                flush=True,
            )


FLOOR_LABEL = (
    "floor (the raw queue + a unique idempotency key + a fenced lease + a transition log by"
    " statement trigger, nothing else)"
)
FLOOR_SINGLE, FLOOR_CLAIM_W1, FLOOR_CLAIM_W4 = "floor: x1", "floor: claim10 x1", "floor: claim10 x4"


def _m(name: str) -> Measurement:
    return Measurement(name)


async def run_all(admin: str, server_pid: int | None, sizes: Sizes) -> Report:
    t0 = time.perf_counter()
    s = sizes
    load_start = machine_facts()["loadavg"]
    code = code_version()
    migrate(create_database(admin, BUS_DB))
    raw_admin = create_database(admin, RAW_DB)
    diag_admins: dict[str, str] = {}
    for name, statements in {**DIAG_SETUP, EXPLAIN_DB: EXPLAIN_SETUP}.items():
        diag_admins[name] = create_database(admin, name)
        migrate(diag_admins[name])
        with psycopg.connect(diag_admins[name], autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)  # before the pools connect: ALTER DATABASE SET needs it

    bus = BusTarget(psycopg.conninfo.make_conninfo(admin, dbname=BUS_DB), server_pid)
    raw = RawTarget(raw_admin, server_pid)
    floor = FloorTarget(create_database(admin, FLOOR_DB), server_pid)
    no_trg, no_notify = (BusTarget(diag_admins[n], server_pid) for n in DIAG_SETUP)
    targets = [bus, no_trg, no_notify]
    for target in targets:
        await target.open()
    await raw.open()
    await floor.open()
    try:
        rows = [
            Row("single enqueue, sequential", _m("bus enqueue x1"), _m("raw INSERT x1")),
            Row(
                "single enqueue, 8 concurrent tasks",
                _m("bus enqueue x8 tasks"),
                _m("raw INSERT x8 conns"),
            ),
            Row(
                f"batch enqueue ({BATCH:,}/batch)",
                _m("bus enqueue_many"),
                _m("raw INSERT .. unnest"),
            ),
            Row(
                "claim(10) + complete_many, 1 worker",
                _m("bus claim10+complete_many x1"),
                _m("raw claim10+done x1"),
            ),
            Row(
                "claim(10) + complete_many, 4 workers",
                _m("bus claim10+complete_many x4"),
                _m("raw claim10+done x4"),
            ),
            Row(
                "claim(1) + complete, 1 worker",
                _m("bus claim1+complete x1"),
                _m("raw claim1+done x1"),
            ),
            Row(
                f"batch enqueue ({BATCH:,}/batch), 2 concurrent tasks",
                _m("bus enqueue_many x2 tasks"),
                _m("raw INSERT .. unnest x2 conns"),
            ),
        ]
        build = Measurement("bus.request() building (client only)")
        single_seq, single_c8, batch, cc_w1, cc_w4, one_w1, batch2 = rows
        # The floor is a diagnostic, but measured beside the product figures (each repeat:
        # bus, raw, floor), so that its ratio to raw is taken from the same moment.
        floor_rows = [
            Row(FLOOR_LABEL + ": INSERT, sequential", _m(FLOOR_SINGLE)),
            Row(FLOOR_LABEL + ": claim10 + done, 1 worker", _m(FLOOR_CLAIM_W1)),
            Row(FLOOR_LABEL + ": claim10 + done, 4 workers", _m(FLOOR_CLAIM_W4)),
        ]
        floor_single, floor_w1, floor_w4 = floor_rows

        def pair(row: Row, bus_step: Step, raw_step: Step) -> list[tuple[Measurement, Step]]:
            assert row.raw is not None
            return [(row.bus, bus_step), (row.raw, raw_step)]

        steps: list[tuple[Measurement, Step]] = [
            *pair(single_seq, lambda: bus.single(s.single, 1), lambda: raw.single(s.single, 1)),
            (floor_single.bus, lambda: floor.single(s.single, 1)),
            *pair(single_c8, lambda: bus.single(s.single, 8), lambda: raw.single(s.single, 8)),
            *pair(batch, lambda: bus.batch(s.batch_total, build), lambda: raw.batch(s.batch_total)),
            *pair(
                cc_w1,
                lambda: bus.claim_complete(s.claim_batched, 1, 10),
                lambda: raw.claim_complete(s.claim_batched, 1, 10),
            ),
            (floor_w1.bus, lambda: floor.claim_complete(s.claim_batched, 1, 10)),
            *pair(
                cc_w4,
                lambda: bus.claim_complete(s.claim_batched, 4, 10),
                lambda: raw.claim_complete(s.claim_batched, 4, 10),
            ),
            (floor_w4.bus, lambda: floor.claim_complete(s.claim_batched, 4, 10)),
            *pair(
                one_w1,
                lambda: bus.claim_complete(s.claim_one, 1, 1),
                lambda: raw.claim_complete(s.claim_one, 1, 1),
            ),
            *pair(
                batch2,
                lambda: bus.batch(s.batch_total, Measurement("unused"), tasks=2),
                lambda: raw.batch(s.batch_total, tasks=2),
            ),
        ]
        print("measuring (product figures):", flush=True)
        await _repeat(steps, s.repeats)

        print("measuring (diagnostics):", flush=True)
        throwaway = Measurement("unused")
        n1, nb, nc, ns = s.diag_single, s.batch_total, s.claim_batched, s.diag_claim
        diag_plan: list[tuple[Row, Step]] = [
            (
                Row("round trip: SELECT 1 on a bus pool connection", _m("SELECT 1")),
                lambda: bus.round_trip(s.rtt),
            ),
            (
                Row(
                    "raw INSERT on a bus pool connection (autocommit, as bus.enqueue"
                    " sends its statement), sequential",
                    _m("raw INSERT, bus tx shape"),
                ),
                lambda: raw.single_bus_shape(n1),
            ),
            (
                Row("bus enqueue, sequential, log triggers OFF", _m("no triggers: enqueue x1")),
                lambda: no_trg.single(n1, 1),
            ),
            (
                Row("bus enqueue, 8 tasks, log triggers OFF", _m("no triggers: enqueue x8")),
                lambda: no_trg.single(n1, 8),
            ),
            (
                Row(
                    "bus enqueue, 8 tasks, NOTIFY OFF (appliance.notify=off)",
                    _m("no notify: enqueue x8"),
                ),
                lambda: no_notify.single(n1, 8),
            ),
            (
                Row("bus enqueue_many, log triggers OFF", _m("no triggers: enqueue_many")),
                lambda: no_trg.batch(nb, throwaway),
            ),
            (
                Row(
                    f"bus claim(10) + complete_many, 1 worker, {ns:,} pending",
                    _m("shallow: claim10 x1"),
                ),
                lambda: bus.claim_complete(ns, 1, 10),
            ),
            (
                Row(
                    f"bus claim(10) + complete_many, 4 workers, {ns:,} pending",
                    _m("shallow: claim10 x4"),
                ),
                lambda: bus.claim_complete(ns, 4, 10),
            ),
            (
                Row(
                    f"bus claim(10) + complete_many, 1 worker, {ns:,} pending, log triggers OFF",
                    _m("shallow, no triggers: claim10 x1"),
                ),
                lambda: no_trg.claim_complete(ns, 1, 10),
            ),
            (
                Row(
                    f"bus claim(10) + complete_many, 4 workers, {ns:,} pending, log triggers OFF",
                    _m("shallow, no triggers: claim10 x4"),
                ),
                lambda: no_trg.claim_complete(ns, 4, 10),
            ),
            (
                Row(
                    f"bus claim(10) + complete_many, 1 worker, {ns:,} pending, {s.held:,} more"
                    " held running (claimed after the last ANALYZE)",
                    _m("shallow, many running: claim10 x1"),
                ),
                lambda: bus.claim_complete(ns, 1, 10, held=s.held),
            ),
            (
                Row(
                    f"store lane claim(10) + complete_many, 1 worker, {ns:,} pending behind"
                    f" {s.held:,} of a blocked model tier (reasoning pool full)",
                    _m("shallow, behind a blocked tier: claim10 x1"),
                ),
                lambda: bus.claim_complete(ns, 1, 10, blocked=s.held),
            ),
            (
                Row(
                    f"bus claim(10) + complete_many, 1 worker, {ns:,} pending behind"
                    f" {s.held:,} of a higher priority not due until tomorrow",
                    _m("shallow, behind deferred work: claim10 x1"),
                ),
                lambda: bus.claim_complete(ns, 1, 10, deferred=s.held),
            ),
            (
                Row(
                    f"raw claim10 + done, 4 workers, {ns:,} pending", _m("shallow: raw claim10 x4")
                ),
                lambda: raw.claim_complete(ns, 4, 10),
            ),
            # Batches of 100: whether the gap to raw is each statement's fixed cost (it would
            # shrink here) or each message's (it stays).
            (
                Row("bus claim(100) + complete_many, 1 worker", _m("claim100 x1")),
                lambda: bus.claim_complete(nc, 1, 100),
            ),
            (
                Row("raw claim100 + done, 1 worker", _m("raw claim100 x1")),
                lambda: raw.claim_complete(nc, 1, 100),
            ),
        ]
        diagnostics = [row for row, _ in diag_plan] + floor_rows
        await _repeat([(row.bus, step) for row, step in diag_plan], s.repeats)

        print("auto_explain (ANALYZE, BUFFERS, nested) of the Bus calls ...", flush=True)
        explained = await explain_all(diag_admins[EXPLAIN_DB], server_pid, nc, ns)

        print("wait events of the server's backends during claim(10) + complete ...", flush=True)
        waits: dict[str, tuple[Counter[str], Counter[str]]] = {}
        for workers in (1, 4):
            waits[f"claim(10) + complete_many, {workers} worker{'s' if workers > 1 else ''}"] = (
                await sample_waits(
                    admin, BUS_DB, functools.partial(bus.claim_complete, nc, workers, 10)
                ),
                await sample_waits(
                    admin, RAW_DB, functools.partial(raw.claim_complete, nc, workers, 10)
                ),
            )
    finally:
        await raw.close()
        await floor.close()
        for target in targets:
            await target.close()

    facts = {**machine_facts(), **server_facts(admin, SETTINGS_SHOWN)}
    facts["loadavg_start"] = load_start
    facts["code"] = code
    return Report(
        sizes, rows, build, diagnostics, explained, facts, time.perf_counter() - t0, waits
    )


# -- rendering ------------------------------------------------------------------------------------


def _main_table(report: Report) -> str:
    header = [
        "measurement",
        "bus msgs/s",
        "raw msgs/s",
        "bus/raw",
        "bus us/msg",
        "bus runs (min-max)",
        "bus CPU us/msg client/server",
        "raw CPU us/msg client/server",
        "others' CPU, cores (bus/raw run)",
    ]
    rows: list[list[str]] = []
    for row in report.rows:
        raw = row.raw
        ratio = row.ratio
        rows.append(
            [
                row.label,
                fmt_rate(row.bus.median),
                fmt_rate(raw.median) if raw else "-",
                f"{ratio:.2f}" if ratio is not None else "-",
                f"{row.bus.us_per_item:,.0f}",
                row.bus.spread,
                row.bus.cpu_cell(),
                raw.cpu_cell() if raw else "-",
                f"{_share(row.bus.other_share)} / {_share(raw.other_share if raw else None)}",
            ]
        )
    b = report.build
    rows.append(
        [
            "(request building for the batch, client only)",
            fmt_rate(b.median),
            "-",
            "-",
            f"{b.us_per_item:,.1f}",
            b.spread,
            b.cpu_cell(),
            "-",
            "-",
        ]
    )
    return markdown_table(header, rows)


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _diag_table(report: Report) -> str:
    header = [
        "diagnostic (NOT a product figure)",
        "per second",
        "us each",
        "CPU us each client/server",
        "others' CPU, cores",
    ]
    rows = [
        [
            d.label,
            fmt_rate(d.bus.median),
            f"{d.bus.us_per_item:,.0f}",
            d.bus.cpu_cell(),
            _share(d.bus.other_share),
        ]
        for d in report.diagnostics
    ]
    return markdown_table(header, rows)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _explain_table(report: Report) -> str:
    header = [
        "Bus call (auto_explain, median of 3)",
        "top statement ms",
        "plan of the main statement; triggers",
        "statements inside it (calls: ms)",
    ]
    rows: list[list[str]] = []
    for e in report.explained:
        total = e.total_ms()
        plan = "; ".join([*e.main_scans()[:8], *e.triggers()]) or "-"
        inside = "; ".join(f"`{label}` x{calls}: {ms:.2f}" for label, calls, ms in e.inside())
        rows.append(
            [
                e.name,
                f"{total:.2f}" if total is not None else "-",
                _cell(plan),
                _cell(inside or "-"),
            ]
        )
    return markdown_table(header, rows)


def _targets(report: Report) -> list[tuple[str, str, bool]]:
    single_seq, single_c8, batch, cc_w1, cc_w4, _, batch2 = report.rows
    out: list[tuple[str, str, bool]] = []
    for row, how in ((batch, "1 task"), (batch2, "2 concurrent tasks")):
        b = row.bus.median
        out.append(
            (
                f"batch enqueue >= {TARGET_BATCH:,.0f} msgs/s, {how}",
                f"{fmt_rate(b)} msgs/s",
                b >= TARGET_BATCH,
            )
        )
    for row, how in ((single_seq, "sequential"), (single_c8, "8 concurrent tasks")):
        v = row.bus.median
        out.append(
            (
                f"single enqueue >= {TARGET_SINGLE:,.0f} msgs/s (full envelope), {how}",
                f"{fmt_rate(v)} msgs/s",
                v >= TARGET_SINGLE,
            )
        )
    for row, how in ((cc_w1, "1 worker"), (cc_w4, "4 workers")):
        ratio = row.ratio or 0.0
        raw = row.raw.median if row.raw else float("nan")
        out.append(
            (
                f"batched claim+complete >= {TARGET_CLAIM_RATIO} x raw, {how}",
                f"{ratio:.2f} x ({fmt_rate(row.bus.median)} vs {fmt_rate(raw)} msgs/s)",
                ratio >= TARGET_CLAIM_RATIO,
            )
        )
    return out


def _targets_table(report: Report) -> str:
    rows = [[t, got, "met" if ok else "**MISSED**"] for t, got, ok in _targets(report)]
    return markdown_table(["target (from the issue)", "measured (median)", "verdict"], rows)


def _cpu_ceiling(m: Measurement, cores: int) -> tuple[float, float] | None:
    """CPU us per message (client + server) and the rate that would saturate every core."""
    client, server = m.cpu_us_per_item
    if client is None or server is None or client + server <= 0:
        return None
    total = client + server
    return total, cores * 1e6 / total


def _reading(report: Report) -> list[str]:
    """Where the time goes, computed from this run's figures (no hand-written conclusions)."""
    cores = int(report.facts.get("cores", "2")) if report.facts.get("cores", "").isdigit() else 2
    single_seq, single_c8, batch, *_ = report.rows
    diag = {d.bus.name: d.bus for d in report.diagnostics}
    out: list[str] = []
    for row in (single_c8, batch):
        ceiling = _cpu_ceiling(row.bus, cores)
        if ceiling:
            total, rate = ceiling
            client, server = row.bus.cpu_us_per_item
            out.append(
                f"- {row.label}: {total:,.0f} CPU-us per message ({client:,.0f} client +"
                f" {server:,.0f} server); with {cores} cores fully busy that caps the rate at"
                f" about {fmt_rate(rate)} msgs/s, before any waiting (measured:"
                f" {fmt_rate(row.bus.median)})."
            )
    rtt, shape = diag.get("SELECT 1"), diag.get("raw INSERT, bus tx shape")
    if rtt and shape and single_seq.raw:
        out.append(
            f"- single enqueue, sequential ({single_seq.bus.us_per_item:,.0f} us each): one"
            f" bare round trip costs {rtt.us_per_item:,.0f} us here; the raw INSERT alone"
            f" {single_seq.raw.us_per_item:,.0f} us, and the same INSERT on a connection of"
            f" the bus's pool {shape.us_per_item:,.0f} us: the rest is the enqueue statement"
            " itself (idempotency key, envelope row, log and doorbell triggers)."
        )
    by_name = {e.name: e for e in report.explained}
    depth = f"{report.sizes.claim_batched:,} pending"
    claim = by_name.get(f"bus.claim(limit=10), {depth}")
    claim_off = by_name.get(f"bus.claim(limit=10), {depth}, RLS OFF")
    claim_small = by_name.get("bus.claim(limit=10), 100 pending")
    if claim and claim_off and claim_small:
        scans, scans_off = "; ".join(claim.message_scans()), "; ".join(claim_off.message_scans())
        out.append(
            f"- the claim statement (as the product runs it, role appliance_system) takes"
            f" {claim.total_ms() or 0:.2f} ms at {depth} ({scans}) and"
            f" {claim_small.total_ms() or 0:.2f} ms at 100 pending; with RLS OFF"
            f" {claim_off.total_ms() or 0:.2f} ms at {depth} ({scans_off})."
        )
    cc_w1, cc_w4 = report.rows[3], report.rows[4]
    names = (
        "shallow: claim10 x1",
        "shallow: claim10 x4",
        "shallow, no triggers: claim10 x1",
        "shallow, no triggers: claim10 x4",
        "shallow: raw claim10 x4",
    )
    if all(n in diag for n in names):
        w1, w4, t1, t4, r4 = (diag[n].median for n in names)
        ns = f"{report.sizes.diag_claim:,} pending"
        out.append(
            f"- claim(10) + complete_many: 1 worker {fmt_rate(cc_w1.bus.median)} msgs/s at"
            f" {depth} but {fmt_rate(w1)} at {ns}; 4 workers {fmt_rate(cc_w4.bus.median)} vs"
            f" {fmt_rate(w4)}. At {ns} with the log triggers OFF: {fmt_rate(t1)} (1 worker),"
            f" {fmt_rate(t4)} (4 workers); raw at {ns}, 4 workers: {fmt_rate(r4)}."
        )
    floors = [
        (single_seq, diag.get(FLOOR_SINGLE)),
        (cc_w1, diag.get(FLOOR_CLAIM_W1)),
        (cc_w4, diag.get(FLOOR_CLAIM_W4)),
    ]
    parts = [
        f"{row.label}: floor {fmt_rate(f.median)} msgs/s = {f.median / row.raw.median:.2f}x raw"
        f" (the bus: {row.bus.median / row.raw.median:.2f}x)"
        for row, f in floors
        if f is not None and row.raw is not None and row.raw.samples and f.samples
    ]
    if parts:
        out.append(
            "- what the issue itself asks of every message (a unique idempotency key, a lease"
            " fenced by its token, a transition log by trigger), added to the raw queue and"
            " nothing else, measured beside raw in each repeat: "
            + "; ".join(parts)
            + ". The rest of the gap is the bus's own design (tenants, fairness, limits, RLS,"
            " hand-offs, retries, doorbell, wide rows) and its client."
        )
    many, alone = diag.get("shallow, many running: claim10 x1"), diag.get("shallow: claim10 x1")
    if many and alone:
        out.append(
            f"- with {report.sizes.held:,} more messages running, claimed after the last"
            f" ANALYZE: claim(10) + complete_many, 1 worker, {fmt_rate(many.median)} msgs/s,"
            f" {many.median / alone.median:.2f}x the rate without them in this run."
        )
    behind = diag.get("shallow, behind a blocked tier: claim10 x1")
    if behind and alone:
        out.append(
            f"- with {report.sizes.held:,} messages of a blocked model tier queued ahead (claims"
            f" made with that tier blocked, as by a runner whose reasoning pool is full):"
            f" claim(10) + complete_many, 1 worker, {fmt_rate(behind.median)} msgs/s,"
            f" {behind.median / alone.median:.2f}x the rate without them in this run."
        )
    later = diag.get("shallow, behind deferred work: claim10 x1")
    if later and alone:
        out.append(
            f"- with {report.sizes.held:,} messages of a higher priority queued for tomorrow"
            f" (deferred, out of the claim's index): claim(10) + complete_many, 1 worker,"
            f" {fmt_rate(later.median)} msgs/s, {later.median / alone.median:.2f}x the rate"
            " without them in this run."
        )
    enq = by_name.get(f"bus.enqueue_many ({BATCH:,}), {report.sizes.diag_claim:,} pending")
    if enq:
        inside = "; ".join(f"`{label}` x{calls} {ms:.1f} ms" for label, calls, ms in enq.inside(4))
        out.append(
            f"- enqueue_many of {BATCH:,}: {enq.total_ms() or 0:.1f} ms in the top statement;"
            f" inside it: {inside}."
        )
    for label, (bus_counts, raw_counts) in report.waits.items():

        def share(counts: Counter[str], pick: Callable[[str], bool]) -> float:
            return 100 * sum(n for e, n in counts.items() if pick(e)) / (sum(counts.values()) or 1)

        def locks(e: str) -> bool:
            return e.startswith("Lock:")

        def flush(e: str) -> bool:
            return e in ("IO:WALSync", "LWLock:WALWrite", "IO:WALWrite")

        bus_locks = share(bus_counts, locks)
        line = (
            f"- {label}: the bus's active backends waited on row or transaction locks in"
            f" {bus_locks:.0f} % of the samples (raw {share(raw_counts, locks):.0f} %) and on"
            f" the WAL flush in {share(bus_counts, flush):.0f} % (raw"
            f" {share(raw_counts, flush):.0f} %)."
        )
        if bus_locks >= LOCK_SHARE_NOTED:
            line += (
                " Claims lock their tenant's `tenant_runtime` row until they commit: one"
                " tenant's claims queue there (completions count their ended leases up in"
                " one of the tenant's 8 `tenant_released_shards`, one no other transaction"
                " holds, so they share WAL flushes instead of queueing)."
            )
        out.append(line)
    return out


def _load_warning(report: Report) -> list[str]:
    """A loud note when other work shared the box during the measured runs."""
    shares = [
        x.other_share
        for row in report.rows
        for m in (row.bus, row.raw)
        if m is not None
        for x in m.samples
        if x.other_share is not None
    ]
    if not shares:
        return []
    median = statistics.median(shares)
    if median < 0.25:
        return []
    return [
        f"**Warning: the box was not quiet.** Other processes used a median {median:.2f} cores"
        f" (max {max(shares):.2f}) of the {report.facts.get('cores', '?')} during the measured"
        " runs, so every wall-clock rate here (bus and raw alike) is depressed; the ratios and"
        " the CPU-per-message columns are the more robust figures.",
        "",
    ]


WAIT_ROWS = 8
# A share of lock waits worth explaining in the reading.
LOCK_SHARE_NOTED = 10.0


def _waits_section(report: Report) -> list[str]:
    """The share of the active backends' samples spent in each wait event, bus beside raw."""
    if not report.waits:
        return []
    out = [
        f"What the server's active backends were doing (pg_stat_activity every"
        f" {WAIT_SAMPLE_S * 1000:.0f} ms during one more run of each, product sizes; `CPU` = not"
        " waiting; a share of all samples of active backends):",
        "",
    ]
    for label, (bus_counts, raw_counts) in report.waits.items():
        bus_total, raw_total = sum(bus_counts.values()) or 1, sum(raw_counts.values()) or 1
        # The largest share on either side first: raw's own waits are shown too.
        events = sorted(
            set(bus_counts) | set(raw_counts),
            key=lambda e: (-max(bus_counts[e] / bus_total, raw_counts[e] / raw_total), e),
        )
        rows = [
            [
                e,
                f"{100 * bus_counts[e] / bus_total:.0f} %",
                f"{100 * raw_counts[e] / raw_total:.0f} %",
            ]
            for e in events[:WAIT_ROWS]
        ]
        out += [
            markdown_table([f"{label}: wait event", "bus", "raw"], rows),
            "",
            f"({sum(bus_counts.values()):,} bus samples, {sum(raw_counts.values()):,} raw.)",
            "",
        ]
    return out


def render(report: Report) -> str:
    f = report.facts
    s = report.sizes
    settings = ", ".join(f"{k}={f[k]}" for k in SETTINGS_SHOWN if k in f)
    return "\n".join(
        [
            f"Run {f['date']}, `python -m bench.bus_throughput` (total {report.wall:.0f} s).",
            "",
            f"- Machine: {f['cores']} cores ({f['cpu']}), {f['memory']} RAM, Linux {f['kernel']};"
            " client and server share the cores.",
            f"- PostgreSQL {f['server_version']} (LocalCluster, appliance defaults, local Unix"
            f" socket): {settings}.",
            f"- Code measured: {f['code']}. Python {f['python']}, psycopg {f['psycopg']}.",
            f"- Each figure is the median of {s.repeats} repeats with fresh data (TRUNCATE +"
            " CHECKPOINT before each; claim tables are pre-filled, ANALYZEd and CHECKPOINTed"
            " untimed). Sizes per repeat: single enqueue"
            f" {s.single:,}; batch enqueue {s.batch_total:,}; batched claim {s.claim_batched:,};"
            f" one-at-a-time claim {s.claim_one:,}.",
            "- Bus rows go through the real `Bus` API (tenant transaction as `appliance_app` under"
            " RLS, idempotency keys, transition-log trigger, NOTIFY, durable commit; claims commit"
            " with synchronous_commit=off as the product does, completions durably). Raw rows use"
            " a `jobs(id bigserial, payload jsonb, status text, locked_by text)` table with a"
            " partial index on pending, autocommit, default (durable) commits, in another"
            " database of the same server.",
            "- CPU columns: CPU microseconds per message in the median run; client = this Python"
            " process (the Bus, psycopg, asyncio), server = all PostgreSQL processes (backends,"
            " WAL writer, checkpointer). With 2 cores, client + server CPU close to 2 x the"
            " wall us/msg means the box is CPU-bound. `others' CPU` = cores' worth of CPU that"
            " other processes on the box used during that run (this machine is shared; 0.00 ="
            f" quiet). Load average (1/5/15 min) at start {f['loadavg_start']}, at end"
            f" {f['loadavg']}.",
            "",
            *_load_warning(report),
            _main_table(report),
            "",
            "### Targets",
            "",
            _targets_table(report),
            "",
            "### Diagnostics (not product figures)",
            "",
            "Rows marked OFF ran through the same Bus API in scratch databases of the same server:"
            " `log triggers OFF` = `ALTER TABLE agent_messages DISABLE TRIGGER"
            " agent_messages_insert_trg` and `..._update_trg` (this also removes the NOTIFY and"
            " whatever else those triggers do); `NOTIFY OFF` = `ALTER DATABASE .. SET"
            " appliance.notify = 'off'` (transitions still logged). In the auto_explain table,"
            " `RLS OFF` = `ALTER TABLE agent_messages DISABLE ROW LEVEL SECURITY` for that case"
            " only. They exist to show where the time goes; the bus never runs like that."
            f" Single-enqueue diagnostics move {s.diag_single:,} messages per repeat, shallow"
            f" claims {s.diag_claim:,}, the others the product sizes. auto_explain adds its own"
            " overhead (timing every node), so its milliseconds are larger than in the runs"
            " above; compare them with each other.",
            "",
            _diag_table(report),
            "",
            _explain_table(report),
            "",
            *_waits_section(report),
            "### Where the time goes (computed from the figures above)",
            "",
            *_reading(report),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    parser.add_argument("--plans", action="store_true", help="also list every explained statement")
    parser.add_argument("--port", type=int, default=PORT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sizes = QUICK if args.quick else FULL

    with temp_cluster(args.port, {"max_connections": "200"}) as cluster:
        report = asyncio.run(run_all(cluster.conninfo(), postmaster_pid(cluster), sizes))

    text = render(report)
    print()
    print("## bus_throughput")
    print()
    print(text)
    if args.plans:
        for e in report.explained:
            print(f"\n-- {e.name} (last run)")
            for st in e.runs[-1] if e.runs else []:
                print(f"   {st.ms:8.3f} ms  {st.label}")
    if args.quick:
        print("\n(--quick: sizes too small to be figures; RESULTS.md not written)")
    elif not args.no_write:
        write_section("bus_throughput", text)
        print("\nwritten to bench/RESULTS.md, section `## bus_throughput`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
