"""Bus throughput against a raw-SQL job queue, on the same PostgreSQL in the same run.

What it measures (messages per second, median of 3 repeats, fresh data for every repeat):

1. single enqueue: `bus.enqueue(...)` one message per call, sequentially and from 8 concurrent
   tasks (the full envelope: validation, idempotency key, RLS tenant transaction, transition-log
   trigger, NOTIFY doorbell, durable commit);
2. batch enqueue: `bus.enqueue_many` in batches of 1,000 (request building is timed apart);
3. claim + complete of pre-enqueued no-op messages: batches of 10 (`claim(limit=10)` then
   `complete_many`) with 1 and 4 concurrent workers, and one at a time (`limit=1` +
   `complete`);
4. the raw baseline for each of those, in a separate database of the same server: a minimal
   `jobs` table driven with plain async psycopg (single INSERT, unnest batch INSERT,
   `FOR UPDATE SKIP LOCKED` claim of 10 then `UPDATE ... WHERE id = ANY(...)`).

Diagnostic rows (clearly labelled, not product figures) follow: a bare round trip, the raw insert
wrapped in the bus's transaction shape, the bus with its log triggers disabled (scratch database),
and EXPLAIN (ANALYZE, BUFFERS) timings of the named queries.

It starts its own PostgreSQL (LocalCluster, default durability: fsync on) in a temporary folder
on port 55433, and removes it at the end. The table is printed and written to the
`## bus_throughput` section of bench/RESULTS.md.

Run from the repository root:

    .venv/bin/python -m bench.bus_throughput            # the full run (about 3-4 minutes)
    .venv/bin/python -m bench.bus_throughput --quick    # small sizes, a smoke test
    .venv/bin/python -m bench.bus_throughput --no-write # do not touch bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import re
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

from appliance.bus.core import Bus, BusConfig
from appliance.db.database import SEARCH_PATH_OPTION, Database, Endpoints
from appliance.db.message_store import PgMessageStore, _enqueue_params
from appliance.db.migrate import migrate
from appliance.db.queries import q
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.envelope import EnqueueRequest
from appliance.domain.ports import Completion
from bench.harness import (
    Measurement,
    Meter,
    Sample,
    create_database,
    fmt_rate,
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
# Scratch databases for the diagnostics, each with one part of the envelope switched off.
DIAG_SETUP: dict[str, tuple[str, ...]] = {
    "bench_diag_no_triggers": (
        "ALTER TABLE appliance.agent_messages DISABLE TRIGGER agent_messages_insert_trg",
        "ALTER TABLE appliance.agent_messages DISABLE TRIGGER agent_messages_update_trg",
    ),
    "bench_diag_no_notify": ("ALTER DATABASE bench_diag_no_notify SET appliance.notify = 'off'",),
    "bench_diag_no_rls": (
        "ALTER TABLE appliance.agent_messages DISABLE ROW LEVEL SECURITY",
        "ALTER TABLE appliance.idempotency_keys DISABLE ROW LEVEL SECURITY",
    ),
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
    rtt: int
    repeats: int = 3


FULL = Sizes(
    single=5_000,
    batch_total=50_000,
    claim_batched=20_000,
    claim_one=2_000,
    diag_single=2_000,
    rtt=5_000,
)
QUICK = Sizes(
    single=400, batch_total=4_000, claim_batched=2_000, claim_one=200, diag_single=200, rtt=500
)

_serial = itertools.count()


def _fresh_tag() -> str:
    """A prefix that keeps every repeat's idempotency keys new."""
    return f"r{next(_serial)}-{time.monotonic_ns()}"


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

    def __init__(self, admin: str, server_pid: int | None) -> None:
        self.admin = admin
        self.server_pid = server_pid
        self.db = Database(Endpoints.from_admin(admin), min_size=8, max_size=10)
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
        tag = _fresh_tag()
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
        tag = _fresh_tag()
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

    async def claim_complete(self, n: int, workers: int, limit: int) -> Sample:
        await self.reset()
        await self.prefill(n)
        bus = self.bus

        async def worker(name: str) -> int:
            done = 0
            while True:
                batch = await bus.claim(name, limit=limit)
                if not batch:
                    return done
                if limit == 1:
                    await bus.complete(batch[0].lease)
                else:
                    await bus.complete_many([Completion(m.lease) for m in batch])
                done += len(batch)

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


class RawTarget:
    """The minimal job queue: one table, plain async psycopg, autocommit, default durability."""

    def __init__(self, admin: str, server_pid: int | None) -> None:
        self.admin = admin
        self.server_pid = server_pid
        self.conns: list[psycopg.AsyncConnection[Any]] = []

    async def open(self, count: int = 8) -> None:
        await self.sql(*RAW_SCHEMA)
        for _ in range(count):
            self.conns.append(await psycopg.AsyncConnection.connect(self.admin, autocommit=True))

    async def close(self) -> None:
        for conn in self.conns:
            await conn.close()

    async def sql(self, *statements: str) -> None:
        async with await psycopg.AsyncConnection.connect(self.admin, autocommit=True) as conn:
            for statement in statements:
                await conn.execute(statement)

    async def reset(self) -> None:
        await self.sql("TRUNCATE jobs", "CHECKPOINT")

    def meter(self, n: int) -> Meter:
        return Meter(self.server_pid, n)

    async def single(self, n: int, tasks: int) -> Sample:
        await self.reset()

        async def run(conn: psycopg.AsyncConnection[Any], part: int) -> None:
            for i in range(part, n, tasks):
                await (await conn.execute(RAW_INSERT, (_payload(i),))).fetchone()

        with self.meter(n) as m:
            await asyncio.gather(*(run(self.conns[p], p) for p in range(tasks)))
        assert m.sample is not None
        return m.sample

    async def single_bus_shape(self, n: int) -> Sample:
        """Diagnostic: the raw insert in the round trips of bus.enqueue (BEGIN, tenant, ..)."""
        await self.reset()
        conn = self.conns[0]
        with self.meter(n) as m:
            for i in range(n):
                async with conn.transaction():
                    await conn.execute(q("tenant_set"), {"tenant": TENANT})
                    await (await conn.execute(RAW_INSERT, (_payload(i),))).fetchone()
        assert m.sample is not None
        return m.sample

    async def batch(self, total: int) -> Sample:
        await self.reset()
        payloads = [_payload(i) for i in range(total)]
        conn = self.conns[0]
        with self.meter(total) as m:
            for start in range(0, total, BATCH):
                cur = await conn.execute(RAW_INSERT_MANY, (payloads[start : start + BATCH],))
                await cur.fetchall()
        assert m.sample is not None
        return m.sample

    async def claim_complete(self, n: int, workers: int, limit: int) -> Sample:
        await self.reset()
        await self.sql(
            "INSERT INTO jobs (payload) SELECT jsonb_build_object('i', g)"
            f" FROM generate_series(1, {int(n)}) AS g",
            "ANALYZE jobs",
            "CHECKPOINT",
        )

        async def worker(conn: psycopg.AsyncConnection[Any], name: str) -> int:
            done = 0
            while True:
                cur = await conn.execute(RAW_CLAIM, {"limit": limit, "worker": name})
                ids = [row[0] for row in await cur.fetchall()]
                if not ids:
                    return done
                await conn.execute(RAW_DONE, (ids,))
                done += len(ids)

        with self.meter(n) as m:
            counts = await asyncio.gather(*(worker(self.conns[i], f"w{i}") for i in range(workers)))
        assert sum(counts) == n, f"claimed {sum(counts)} of {n}"
        assert m.sample is not None
        return m.sample


# -- EXPLAIN diagnostics --------------------------------------------------------------------------

_EXEC = re.compile(r"Execution Time: ([\d.]+) ms")
_PLAN = re.compile(r"Planning Time: ([\d.]+) ms")
_TRIG = re.compile(r"^Trigger (?:for constraint )?(\S+)(?: on \S+)?: time=([\d.]+) calls=(\d+)")
_NODE = re.compile(
    r"->\s+(Insert on \S+|Seq Scan on agent_messages|Index Scan using \S+ on agent_messages|"
    r"Update on agent_messages|Sort)\b.*?actual time=[\d.]+\.\.([\d.]+) rows=(\d+)"
)


@dataclass
class Explained:
    """Median timings (ms) of EXPLAIN ANALYZE runs of one named query, and the last plan."""

    name: str
    runs: list[dict[str, float]] = field(default_factory=list)
    plan: list[str] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)

    def add(self, lines: list[str]) -> None:
        text = "\n".join(lines)
        found: dict[str, float] = {}
        if m := _EXEC.search(text):
            found["execution"] = float(m[1])
        if m := _PLAN.search(text):
            found["planning"] = float(m[1])
        for line in lines:
            if trig := _TRIG.match(line.strip()):
                found[f"trigger {trig[1]} (x{trig[3]})"] = float(trig[2])
            elif node := _NODE.search(line):
                key = f"node {node[1]}"
                if key not in found:  # the outermost node of that kind
                    found[key] = float(node[2])
                    self.notes[key] = node[3]
        self.runs.append(found)
        self.plan = lines

    def median(self, key: str) -> float | None:
        values = [r[key] for r in self.runs if key in r]
        return statistics.median(values) if values else None

    def measured(self) -> list[str]:
        seen: dict[str, None] = {}
        for r in self.runs:
            for k in r:
                seen.setdefault(k)
        return list(seen)

    def parts(self) -> str:
        """The triggers and the main plan nodes, with their median times."""
        out: list[str] = []
        for key in self.measured():
            value = self.median(key)
            if value is None or not key.startswith(("trigger ", "node ")):
                continue
            label = key.split(" ", 1)[1]
            if key in self.notes:
                label += f" (rows={self.notes[key]})"
            out.append(f"{label} {value:.2f}")
        return "; ".join(out) or "-"


async def _explain(conn: Any, name: str, params: dict[str, Any]) -> list[str]:
    cur = await conn.execute("EXPLAIN (ANALYZE, BUFFERS) " + q(name), params)
    return [next(iter(row.values())) for row in await cur.fetchall()]


async def _connect(conninfo: str) -> psycopg.AsyncConnection[Any]:
    """One dedicated connection configured like the runtime pools' connections."""
    return await psycopg.AsyncConnection.connect(
        conninfo, options=SEARCH_PATH_OPTION, row_factory=dict_row, autocommit=True
    )


async def explain_named(
    target: BusTarget, repeats: int, depth: int, label: str = "", enqueue: bool = True
) -> list[Explained]:
    """EXPLAIN (ANALYZE, BUFFERS) of enqueue (1 and 1,000 rows), claim (10), complete (10).

    The statements run for real, on one connection per role (the first round is a discarded
    warm-up: it compiles the PL/pgSQL triggers in that backend), as the product runs them:
    enqueue as appliance_app in a tenant transaction, claim and complete as appliance_system.
    Enqueue runs against `depth` pending messages, with new keys every time; the claim table is
    then refilled to exactly `depth` pending messages.
    """
    retention = target.bus.config.idempotency_retention
    names = ["message_claim limit 10", "message_complete x10"]
    if enqueue:
        names = ["message_enqueue x1", f"message_enqueue x{BATCH}", *names]
    results = {n: Explained(f"{n} ({depth:,} pending{label})") for n in names}
    endpoints = target.db.endpoints
    app, system = await _connect(endpoints.app), await _connect(endpoints.system)
    try:
        await target.reset()
        await target.prefill(depth)
        for round_ in range(repeats + 1):
            for size in (1, BATCH) if enqueue else ():
                params = _enqueue_params(target.requests(size), retention, None)
                async with app.transaction():
                    await app.execute(q("tenant_set"), {"tenant": TENANT})
                    plan = await _explain(app, "message_enqueue", params)
                if round_:
                    results[f"message_enqueue x{size}"].add(plan)
        if enqueue:
            await target.reset()
            await target.prefill(depth)
        claim_params = {
            "worker": "explain",
            "lanes": ["interactive", "system", "batch"],
            "limit": 10,
            "lease": timedelta(seconds=30),
            "tenant": None,
            "now": None,
        }
        for round_ in range(repeats + 1):
            async with system.transaction():
                await system.execute("SET LOCAL synchronous_commit = off")
                claimed = await _explain(system, "message_claim", claim_params)
            cur = await system.execute(
                "SELECT id, lease_token FROM agent_messages WHERE claimed_by = 'explain'"
                " AND status = 'running' LIMIT 10"
            )
            leased = await cur.fetchall()
            done_params = {
                "id": [r["id"] for r in leased],
                "token": [r["lease_token"] for r in leased],
                "result": [None] * len(leased),
                "actor": "worker",
                "now": None,
            }
            completed = await _explain(system, "message_complete", done_params)
            if round_:
                results["message_claim limit 10"].add(claimed)
                results["message_complete x10"].add(completed)
    finally:
        await app.close()
        await system.close()
    return list(results.values())


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


def _m(name: str) -> Measurement:
    return Measurement(name)


async def run_all(admin: str, server_pid: int | None, sizes: Sizes) -> Report:
    t0 = time.perf_counter()
    s = sizes
    load_start = machine_facts()["loadavg"]
    migrate(create_database(admin, BUS_DB))
    raw_admin = create_database(admin, RAW_DB)
    diag_admins: dict[str, str] = {}
    for name, statements in DIAG_SETUP.items():
        diag_admins[name] = create_database(admin, name)
        migrate(diag_admins[name])
        with psycopg.connect(diag_admins[name], autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)  # before the pools connect: ALTER DATABASE SET needs it

    bus = BusTarget(psycopg.conninfo.make_conninfo(admin, dbname=BUS_DB), server_pid)
    raw = RawTarget(raw_admin, server_pid)
    no_trg, no_notify, no_rls = (BusTarget(diag_admins[n], server_pid) for n in DIAG_SETUP)
    targets = [bus, no_trg, no_notify, no_rls]
    for target in targets:
        await target.open()
    await raw.open()
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
        ]
        build = Measurement("bus.request() building (client only)")
        single_seq, single_c8, batch, cc_w1, cc_w4, one_w1 = rows

        def pair(row: Row, bus_step: Step, raw_step: Step) -> list[tuple[Measurement, Step]]:
            assert row.raw is not None
            return [(row.bus, bus_step), (row.raw, raw_step)]

        steps: list[tuple[Measurement, Step]] = [
            *pair(single_seq, lambda: bus.single(s.single, 1), lambda: raw.single(s.single, 1)),
            *pair(single_c8, lambda: bus.single(s.single, 8), lambda: raw.single(s.single, 8)),
            *pair(batch, lambda: bus.batch(s.batch_total, build), lambda: raw.batch(s.batch_total)),
            *pair(
                cc_w1,
                lambda: bus.claim_complete(s.claim_batched, 1, 10),
                lambda: raw.claim_complete(s.claim_batched, 1, 10),
            ),
            *pair(
                cc_w4,
                lambda: bus.claim_complete(s.claim_batched, 4, 10),
                lambda: raw.claim_complete(s.claim_batched, 4, 10),
            ),
            *pair(
                one_w1,
                lambda: bus.claim_complete(s.claim_one, 1, 1),
                lambda: raw.claim_complete(s.claim_one, 1, 1),
            ),
        ]
        print("measuring (product figures):", flush=True)
        await _repeat(steps, s.repeats)

        print("measuring (diagnostics):", flush=True)
        throwaway = Measurement("unused")
        n1, nb, nc = s.diag_single, s.batch_total, s.claim_batched
        diag_plan: list[tuple[Row, Step]] = [
            (
                Row("round trip: SELECT 1 on a bus pool connection", _m("SELECT 1")),
                lambda: bus.round_trip(s.rtt),
            ),
            (
                Row(
                    "raw INSERT in bus.enqueue's transaction shape (BEGIN; set_config; INSERT;"
                    " COMMIT), sequential",
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
                    "bus enqueue, sequential, NOTIFY OFF (appliance.notify=off)",
                    _m("no notify: enqueue x1"),
                ),
                lambda: no_notify.single(n1, 1),
            ),
            (
                Row(
                    "bus enqueue, 8 tasks, NOTIFY OFF (appliance.notify=off)",
                    _m("no notify: enqueue x8"),
                ),
                lambda: no_notify.single(n1, 8),
            ),
            (
                Row(
                    "bus enqueue_many, 2 concurrent tasks (full envelope)",
                    _m("bus enqueue_many x2 tasks"),
                ),
                lambda: bus.batch(nb, throwaway, tasks=2),
            ),
            (
                Row("bus enqueue_many, log triggers OFF", _m("no triggers: enqueue_many")),
                lambda: no_trg.batch(nb, throwaway),
            ),
            (
                Row("bus enqueue_many, RLS OFF", _m("no RLS: enqueue_many")),
                lambda: no_rls.batch(nb, throwaway),
            ),
            (
                Row("bus claim(10) + complete_many, 1 worker, RLS OFF", _m("no RLS: claim10 x1")),
                lambda: no_rls.claim_complete(nc, 1, 10),
            ),
            (
                Row("bus claim(10) + complete_many, 4 workers, RLS OFF", _m("no RLS: claim10 x4")),
                lambda: no_rls.claim_complete(nc, 4, 10),
            ),
        ]
        diagnostics = [row for row, _ in diag_plan]
        await _repeat([(row.bus, step) for row, step in diag_plan], s.repeats)

        print("EXPLAIN (ANALYZE, BUFFERS) of the named queries ...", flush=True)
        explained = await explain_named(bus, 5, nc)
        explained += await explain_named(bus, 5, 100, enqueue=False)
        explained += await explain_named(no_rls, 5, nc, label=", RLS OFF", enqueue=False)
    finally:
        await raw.close()
        for target in targets:
            await target.close()

    facts = {**machine_facts(), **server_facts(admin, SETTINGS_SHOWN)}
    facts["loadavg_start"] = load_start
    return Report(sizes, rows, build, diagnostics, explained, facts, time.perf_counter() - t0)


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


def _explain_table(report: Report) -> str:
    header = [
        "named query, EXPLAIN (ANALYZE, BUFFERS), median of 5",
        "planning ms",
        "execution ms",
        "parts, ms (inclusive node times)",
    ]
    rows: list[list[str]] = []
    for e in report.explained:
        planning, execution = e.median("planning"), e.median("execution")
        rows.append(
            [
                e.name,
                f"{planning:.2f}" if planning is not None else "-",
                f"{execution:.2f}" if execution is not None else "-",
                e.parts(),
            ]
        )
    return markdown_table(header, rows)


def _targets(report: Report) -> list[tuple[str, str, bool]]:
    single_seq, single_c8, batch, cc_w1, cc_w4, _ = report.rows
    out: list[tuple[str, str, bool]] = []
    b = batch.bus.median
    out.append(
        (f"batch enqueue >= {TARGET_BATCH:,.0f} msgs/s", f"{fmt_rate(b)} msgs/s", b >= TARGET_BATCH)
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
            f" {single_seq.raw.us_per_item:,.0f} us, and the same INSERT in bus.enqueue's four"
            f" statements (BEGIN, set_config, INSERT, COMMIT) {shape.us_per_item:,.0f} us."
        )
    by_name = {
        e.name.split(" (")[0] + ("/rls-off" if "RLS OFF" in e.name else ""): e
        for e in report.explained
        if "100 pending" not in e.name
    }
    claim, claim_off = (
        by_name.get("message_claim limit 10"),
        by_name.get("message_claim limit 10/rls-off"),
    )
    if claim and claim_off:
        seq = [k for k in claim.measured() if "Seq Scan on agent_messages" in k]
        plan = (
            f"a Seq Scan of all pending rows + Sort (rows={claim.notes.get(seq[0], '?')})"
            if seq
            else "an index scan"
        )
        out.append(
            f"- claim(10) under RLS as appliance_system: {plan},"
            f" {claim.median('execution') or 0:.2f} ms per claim at"
            f" {report.sizes.claim_batched:,} pending; with RLS OFF"
            f" {claim_off.median('execution') or 0:.2f} ms. Throughput with RLS OFF:"
            f" {fmt_rate(diag['no RLS: claim10 x1'].median)} (1 worker),"
            f" {fmt_rate(diag['no RLS: claim10 x4'].median)} (4 workers) msgs/s."
        )
    enq = by_name.get(f"message_enqueue x{BATCH}")
    if enq:
        execution = enq.median("execution") or 0.0
        out.append(
            f"- message_enqueue of {BATCH:,} rows: {execution:.1f} ms server execution under"
            f" EXPLAIN ({enq.parts()})."
        )
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
            f"- Python {f['python']}, psycopg {f['psycopg']}.",
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
            " agent_messages_insert_trg` (and `..._update_trg`; this also removes the NOTIFY);"
            " `NOTIFY OFF` = `ALTER DATABASE .. SET appliance.notify = 'off'` (transitions still"
            " logged); `RLS OFF` = `ALTER TABLE agent_messages / idempotency_keys DISABLE ROW"
            " LEVEL SECURITY`. They exist only to show where the time goes; the bus never runs"
            " like that. Single-enqueue diagnostics move"
            f" {s.diag_single:,} messages per repeat, the others the product sizes.",
            "",
            _diag_table(report),
            "",
            _explain_table(report),
            "",
            "### Where the time goes (computed from the figures above)",
            "",
            *_reading(report),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    parser.add_argument("--plans", action="store_true", help="also print the EXPLAIN plans")
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
            print(f"\n-- {e.name} (last run)\n" + "\n".join(e.plan))
    if args.quick:
        print("\n(--quick: sizes too small to be figures; RESULTS.md not written)")
    elif not args.no_write:
        write_section("bus_throughput", text)
        print("\nwritten to bench/RESULTS.md, section `## bus_throughput`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
