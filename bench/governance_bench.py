"""Governance benchmarks: what admission control (reserve before a model call, settle after)
costs, against baselines measured on the same PostgreSQL in the same run.

What it measures (fsync on, the appliance's default server settings):

1. cost of admission: one `PgSpendStore.reserve` + one `PgSpendStore.settle` (the two statements
   a governed model call adds), timed pair by pair, sequentially, on one pool of the system role
   (as the runner uses it; each statement borrows a connection, as the store does). Baseline:
   two `SELECT 1` round trips on the same pool, each on a borrowed connection. Reference (for
   reading the ratio, not a target): two durable single-row UPDATEs, i.e. two commits that wait
   for the WAL flush, as reserve and settle do. The three kinds run interleaved in blocks, the
   order rotating block by block, after an untimed warm-up of each; the cap is far above what
   the run reserves, so nothing is refused;
2. effect on the runner's throughput: an in-process `Runner` (product `RunnerConfig` defaults,
   LISTEN doorbell, no maintenance jobs) drains N pre-enqueued messages of a fresh database
   (cloned from a migrated template for every run), with governance (`Governor` on
   `PgSpendStore`, the monthly cap set far above the run) and without (`governor=None`); runs
   alternate, the side that goes first alternating too; rate = messages / (last finished_at -
   first claimed_at), by the database clock. Two rows:
   a. a one-stage pipeline whose handler makes one `ctx.infer("classify", <short prompt>,
      max_tokens=1)` on the real mechanical model (SmolLM2-135M of the dev profile, 1 worker,
      1 thread by default (`--threads`, see DEFAULT_THREADS), the real `Meter` with the
      labelled CPU estimate, as the governed-runner test wires it; the same warmed pool serves
      both sides): governance adds a reservation and a settlement per call;
   b. a one-stage no-op pipeline with a run budget (`RunBudget(steps=4)`), no model: governed,
      every stage reserves one step of its run (`run_budget_reserve`); ungoverned, nothing;
3. admission under contention: 50 reservations released together by an `asyncio.Barrier`, on
   a pool of 50 system-role connections (all open before the first round), for a tenant whose
   cap fits exactly K=20 of them (a new tenant each round; an untimed warm-up round first);
   latency = one reservation as its caller sees it (barrier passed -> `reserve` returned).
   Every round checks that exactly K were admitted, and that the ledger and the month's
   `reserved` agree; overshoot (admitted beyond the cap) must be 0.

The machine may be shared: `others' CPU` is the cores' worth of CPU other processes used during
the median run or block (0.00 = a quiet box). The figures are printed and written to the
`## governance` section of bench/RESULTS.md (not with --quick or --no-write), and as JSON with
`--json PATH`.

It starts its own PostgreSQL (LocalCluster, default durability: fsync on) in a temporary folder
on port 55437 and removes it at the end.

Run from the repository root (the models must be fetched: `appliance models fetch`):

    .venv/bin/python -m bench.governance_bench            # the full run (about 1-2 minutes)
    .venv/bin/python -m bench.governance_bench --quick    # small sizes, a smoke test
    .venv/bin/python -m bench.governance_bench --json /tmp/governance_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from appliance.bus.core import Bus, BusConfig
from appliance.bus.governor import Governor, GovernorConfig
from appliance.bus.runner import Runner, RunnerConfig
from appliance.db.database import Database, Endpoints
from appliance.db.listener import PgDoorbell
from appliance.db.migrate import migrate
from appliance.db.runner_store import PgRunnerStore
from appliance.db.spend_store import PgSpendStore
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.budget import Refusal, RunBudget
from appliance.domain.cost import Pricing, Tariff
from appliance.domain.envelope import Lane, LeaseRef
from appliance.domain.inference import (
    CallControl,
    InferenceRequest,
    InferenceResult,
    ModelInfo,
    Tier,
)
from appliance.domain.pipeline import Pipeline, Registry, Stage, StageContext, StageResult
from appliance.inference.pool import InferencePool
from appliance.metering.meter import Meter as EnergyMeter
from appliance.metering.sources import EstimateSource, ThreadCpu, process_cpu_seconds
from bench.harness import (
    Measurement,
    Meter,
    Sample,
    code_version,
    create_database,
    fmt_rate,
    fmt_share,
    fresh_tag,
    machine_facts,
    markdown_table,
    percentile,
    postmaster_pid,
    server_facts,
    temp_cluster,
    write_section,
)
from tests.inference.models import spec

PORT = 55437
TEMPLATE = "bench_gov_template"
TENANT = "bench"
HUGE_CAP = Decimal("1000000000")
# The model's threads. 1 (the default of tests/inference/models.py, as the governed-runner test
# runs it): with 2 OpenMP threads on a 2-core box shared with other work, a call slows from ~50 ms
# to seconds whenever another process takes a core (measured here), and that noise swamps the
# figure; --threads 2 measures that layout anyway.
DEFAULT_THREADS = 1
SETTINGS_SHOWN = (
    "fsync",
    "synchronous_commit",
    "full_page_writes",
    "shared_buffers",
    "max_connections",
)
# As the governed-runner test prices calls: 1,000 J per token at 1 EUR/kWh.
PRICING = Pricing(
    tariff=Tariff(price_per_kwh=Decimal("1.0")),
    default_joules_per_token=Decimal("1000"),
    safety_factor=Decimal("1.0"),
)
CONTENTION_AMOUNT = Decimal("0.001")
WRITE_TABLE = (
    "DROP TABLE IF EXISTS public.bench_rtt",
    "CREATE TABLE public.bench_rtt (id int PRIMARY KEY, n bigint NOT NULL DEFAULT 0)",
    "INSERT INTO public.bench_rtt (id) VALUES (1)",
    "GRANT SELECT, UPDATE ON public.bench_rtt TO appliance_system",
)


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does."""

    pairs: int  # (1): timed pairs per kind
    block: int  # (1): pairs per interleaved block
    warmup: int  # (1): untimed pairs per kind first
    repeats: int  # (2): runs per side and row
    model_n: int  # (2a): messages per run
    steps_n: int  # (2b): messages per run
    rounds: int  # (3): timed rounds
    contenders: int  # (3): reservations per round (and pool size)
    fits: int  # (3): how many the cap fits


FULL = Sizes(
    pairs=2_000,
    block=100,
    warmup=100,
    repeats=3,
    model_n=60,
    steps_n=2_000,
    rounds=40,
    contenders=50,
    fits=20,
)
QUICK = Sizes(
    pairs=400,
    block=50,
    warmup=50,
    repeats=1,
    model_n=20,
    steps_n=500,
    rounds=10,
    contenders=50,
    fits=20,
)


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


async def until(check: Callable[[], bool], timeout: float, every: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(every)


# -- the server and its databases -----------------------------------------------------------------


class Server:
    """One throw-away PostgreSQL: a migrated template, and a fresh clone of it per run."""

    def __init__(self, admin: str, server_pid: int | None) -> None:
        self.admin = admin
        self.server_pid = server_pid
        self._names = itertools.count()

    async def prepare(self) -> None:
        """The template: migrated, the tenant registered, the appliance cap far above any run."""
        admin = create_database(self.admin, TEMPLATE)
        migrate(admin)
        db = Database(Endpoints.from_admin(admin), min_size=1, max_size=2)
        await db.open()
        try:
            await PgTenantStore(db).add(TENANT)
            await PgSpendStore(db).set_cap("appliance", HUGE_CAP)
        finally:
            await db.close()
        await admin_sql(admin, *WRITE_TABLE)

    @contextlib.asynccontextmanager
    async def fresh(self, what: str, *, min_size: int, max_size: int) -> AsyncIterator[Database]:
        """A new database cloned from the template (dropped on the way out), its pools open."""
        name = f"bench_gov_{what}_{next(self._names)}"
        async with await psycopg.AsyncConnection.connect(self.admin, autocommit=True) as conn:
            await conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY FILE_COPY").format(
                    sql.Identifier(name), sql.Identifier(TEMPLATE)
                )
            )
        ends = Endpoints.from_admin(psycopg.conninfo.make_conninfo(self.admin, dbname=name))
        db = Database(ends, min_size=min_size, max_size=max_size)
        try:
            await db.open()
            try:
                yield db
            finally:
                await db.close()
        finally:
            async with await psycopg.AsyncConnection.connect(self.admin, autocommit=True) as conn:
                await conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )


async def admin_sql(conninfo: str, *statements: str) -> list[dict[str, Any]]:
    """Run statements as the admin; the rows of the last one."""
    rows: list[dict[str, Any]] = []
    async with await psycopg.AsyncConnection.connect(
        conninfo, autocommit=True, row_factory=dict_row
    ) as conn:
        for statement in statements:
            cur = await conn.execute(statement)
            rows = list(await cur.fetchall()) if cur.description else []
    return rows


# -- 1. the cost of admission ---------------------------------------------------------------------


@dataclass
class PairKind:
    """Per-pair timings of one kind of statement pair, and its blocks' CPU samples."""

    name: str
    label: str
    block: int
    us: list[float] = field(default_factory=list)
    first_us: list[float] = field(default_factory=list)
    second_us: list[float] = field(default_factory=list)
    blocks: list[Sample] = field(default_factory=list)

    @property
    def p50(self) -> float:
        return percentile(self.us, 0.5)

    @property
    def p99(self) -> float:
        return percentile(self.us, 0.99)

    def cpu_us(self) -> tuple[float | None, float | None]:
        """Client and server CPU microseconds per pair, over all blocks."""
        n = sum(s.n for s in self.blocks)
        if not n:
            return None, None
        client = sum(s.client_cpu for s in self.blocks) * 1e6 / n
        servers = [s.server_cpu for s in self.blocks if s.server_cpu is not None]
        server = sum(servers) * 1e6 / n if len(servers) == len(self.blocks) else None
        return client, server

    def other_share(self) -> float | None:
        shares = [s.other_share for s in self.blocks if s.other_share is not None]
        return statistics.median(shares) if shares else None

    def block_medians(self) -> str:
        """Spread of the per-block medians (min-max), in us."""
        b = self.block
        per = [statistics.median(self.us[i : i + b]) for i in range(0, len(self.us), b)]
        return f"{min(per):,.0f}-{max(per):,.0f}" if per else "-"


async def leases(db: Database, tenant: str, n: int) -> list[LeaseRef]:
    """n messages of `tenant`, enqueued and claimed (an hour's lease): a hold is taken only
    under a live lease, as the runner takes it."""
    store = PgRunnerStore(db)
    bus = Bus(store, BusConfig())
    tag = fresh_tag()
    for start in range(0, n, 1_000):
        await bus.enqueue_many(
            [
                bus.request(tenant=tenant, pipeline="model", stage="classify", source="bench",
                            source_id=f"{tag}-{i}", directive="hold")
                for i in range(start, min(n, start + 1_000))
            ]
        )  # fmt: skip
    held: list[LeaseRef] = []
    while len(held) < n:
        found = await store.claim_lane(
            worker="bench", lane=Lane.INTERACTIVE, limit=min(500, n - len(held)),
            lease=timedelta(hours=1), tenant_limit=n, now=None,
        )  # fmt: skip
        if not found.messages:
            raise RuntimeError(f"claimed {len(held)} of {n} messages to hold leases with")
        held += [m.lease for m in found.messages]
    return held


async def admission_cost(server: Server, sizes: Sizes) -> list[PairKind]:
    """reserve + settle vs SELECT 1 twice vs two durable UPDATEs, interleaved in blocks."""
    async with server.fresh("admit", min_size=2, max_size=4) as db:
        spend = PgSpendStore(db)
        model = spec(Tier.MECHANICAL).model
        prompt = "Ticket: order 1: I was charged twice\nLabel:"
        estimate = PRICING.worst_case(model, len(prompt.encode()) + 2, 1, 1024)
        charge = PRICING.tariff.cost(25.0, datetime.now(UTC))
        calls = sizes.warmup + max(1, sizes.pairs // sizes.block) * sizes.block
        held = iter(await leases(db, TENANT, calls))

        async def admission() -> tuple[float, float]:
            t0 = time.perf_counter()
            hold = await spend.reserve(
                tenant=TENANT,
                lane=Lane.INTERACTIVE,
                amount=estimate.amount,
                lease=next(held),
                pipeline="model",
                stage="classify",
                kind="classify",
                model=model,
                tier=Tier.MECHANICAL.value,
            )
            t1 = time.perf_counter()
            if isinstance(hold, Refusal):
                raise RuntimeError(f"the cap refused a reservation: {hold.reason()}")
            charged = await spend.settle(
                hold, amount=charge, energy_joules=25.0, provenance="estimated"
            )
            t2 = time.perf_counter()
            if charged is None:
                raise RuntimeError(f"hold {hold} did not settle")
            return t1 - t0, t2 - t1

        async def select_one() -> tuple[float, float]:
            t0 = time.perf_counter()
            async with db.system_conn() as conn:
                await (await conn.execute("SELECT 1")).fetchone()
            t1 = time.perf_counter()
            async with db.system_conn() as conn:
                await (await conn.execute("SELECT 1")).fetchone()
            return t1 - t0, time.perf_counter() - t1

        update = "UPDATE public.bench_rtt SET n = n + 1 WHERE id = 1"

        async def durable_write() -> tuple[float, float]:
            t0 = time.perf_counter()
            async with db.system_conn() as conn:
                await conn.execute(update)
            t1 = time.perf_counter()
            async with db.system_conn() as conn:
                await conn.execute(update)
            return t1 - t0, time.perf_counter() - t1

        kinds: list[tuple[PairKind, Callable[[], Awaitable[tuple[float, float]]]]] = [
            (
                PairKind(
                    "admission",
                    "reserve + settle (PgSpendStore: spend_reserve, spend_settle)",
                    sizes.block,
                ),
                admission,
            ),
            (PairKind("select1", "baseline: `SELECT 1` twice", sizes.block), select_one),
            (
                PairKind(
                    "write",
                    "reference: 2 durable single-row UPDATEs (2 WAL flushes)",
                    sizes.block,
                ),
                durable_write,
            ),
        ]
        for _kind, fn in kinds:
            for _ in range(sizes.warmup):
                await fn()
        blocks = max(1, sizes.pairs // sizes.block)
        for b in range(blocks):
            order = kinds[b % len(kinds) :] + kinds[: b % len(kinds)]
            for kind, fn in order:
                with Meter(server.server_pid, sizes.block) as m:
                    for _ in range(sizes.block):
                        first, second = await fn()
                        kind.first_us.append(first * 1e6)
                        kind.second_us.append(second * 1e6)
                        kind.us.append((first + second) * 1e6)
                assert m.sample is not None
                kind.blocks.append(m.sample)
        # The ledger agrees: every hold settled, nothing left reserved.
        (row,) = await admin_sql(
            db.endpoints.admin,
            "SELECT count(*) FILTER (WHERE status = 'settled') AS settled, count(*) AS holds,"
            " (SELECT reserved FROM appliance.spend_months WHERE scope = 'appliance') AS reserved"
            " FROM appliance.spend_ledger",
        )
        expected = sizes.warmup + blocks * sizes.block
        assert row["settled"] == row["holds"] == expected, f"ledger: {row}, expected {expected}"
        assert row["reserved"] == 0, f"left reserved: {row['reserved']}"
        return [k for k, _ in kinds]


# -- 2. the runner's throughput -------------------------------------------------------------------


async def classify(ctx: StageContext) -> StageResult:
    answer = await ctx.infer("classify", f"Ticket: {ctx.message.directive}\nLabel:", max_tokens=1)
    return ctx.finish({"text": answer.text})


async def noop(ctx: StageContext) -> StageResult:
    return ctx.finish()


MODEL_PIPES = [
    Pipeline("model", (Stage("classify", classify, task_kind="classify", uses_model=True),))
]
STEP_PIPES = [Pipeline("steps", (Stage("noop", noop),), budget=RunBudget(steps=4))]


class RunView:
    """The shared pool as one runner sees it. The pool keeps its subscribers for good and calls
    them after every call; a finished runner's callback would then keep trying to resume work in
    its closed database (and log it) during later runs. This view stops forwarding at close."""

    def __init__(self, pool: InferencePool) -> None:
        self.pool = pool
        self.callbacks: list[Callable[[], None]] = []
        self.live = True
        pool.subscribe(self._fire)

    def _fire(self) -> None:
        if self.live:
            for callback in list(self.callbacks):
                callback()

    def close(self) -> None:
        self.live = False
        self.callbacks.clear()

    def available(self) -> frozenset[Tier]:
        return self.pool.available()

    def room(self, tier: Tier) -> int:
        return self.pool.room(tier)

    def capacity(self, tier: Tier) -> int:
        return self.pool.capacity(tier)

    def describe(self, tier: Tier) -> ModelInfo | None:
        return self.pool.describe(tier)

    def subscribe(self, callback: Callable[[], None]) -> None:
        self.callbacks.append(callback)

    async def infer(
        self, request: InferenceRequest, tier: Tier, control: CallControl | None = None
    ) -> InferenceResult:
        return await self.pool.infer(request, tier, control)

    def stats(self) -> dict[str, Any]:
        return self.pool.stats()


@dataclass
class RunFigures:
    """One drain: its sample, and what the database says about it."""

    sample: Sample
    call_s: float | None = None  # median model call (pool's total_seconds), model rows only
    busy: float | None = None  # sum of the model calls' seconds / the drain's span


async def drain(
    server: Server,
    pipes: list[Pipeline],
    n: int,
    *,
    governed: bool,
    pool: InferencePool | None,
) -> RunFigures:
    """Prefill n messages into a fresh database, let one runner drain them."""
    async with server.fresh("run", min_size=2, max_size=12) as db:
        store = PgRunnerStore(db)
        bus = Bus(store, BusConfig())
        await store.sync_pipelines(pipes)
        pipe = pipes[0]
        stage = pipe.stages[0].name
        tag = fresh_tag()
        requests = [
            bus.request(
                tenant=TENANT,
                pipeline=pipe.name,
                stage=stage,
                source="bench",
                source_id=f"{tag}-{i}",
                directive=f"order {i}: I was charged twice",
                context={"i": i},
            )
            for i in range(n)
        ]
        for start in range(0, n, 1_000):
            await bus.enqueue_many(requests[start : start + 1_000])
        await admin_sql(db.endpoints.admin, "ANALYZE appliance.agent_messages", "CHECKPOINT")
        governor = None
        if governed:
            governor = Governor(PgSpendStore(db), GovernorConfig(PRICING), actor="bench")
        config = RunnerConfig(worker_id=f"bench-gov-{os.getpid()}-{tag}")
        view = RunView(pool) if pool is not None else None
        runner = Runner(
            store,
            Registry(pipes),
            config,
            doorbell=PgDoorbell(db.endpoints.system),
            inference=view,
            governor=governor,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(runner.run(stop), name="bench-runner")
        try:
            with Meter(server.server_pid, n) as m:
                done = await until(lambda: runner.stats.completed >= n, 120 + n * 0.5, 0.005)
        finally:
            stop.set()
            await asyncio.wait_for(task, 60)
            if view is not None:
                view.close()
        if not done:
            raise RuntimeError(
                f"drain stalled at {runner.stats.completed} of {n} (stats {runner.stats})"
            )
        admin = db.endpoints.admin
        (row,) = await admin_sql(
            admin,
            "SELECT count(*) FILTER (WHERE status = 'done') AS done,"
            " extract(epoch FROM max(finished_at) - min(claimed_at))::float8 AS span,"
            " count(*) FILTER (WHERE attempts > 1) AS retried FROM appliance.agent_messages",
        )
        assert row["done"] == n, f"done {row['done']} of {n}"
        assert row["retried"] == 0, f"{row['retried']} messages ran twice"
        (spent,) = await admin_sql(
            admin,
            "SELECT count(*) AS holds, count(*) FILTER (WHERE status = 'settled') AS settled,"
            " (SELECT count(*) FROM appliance.run_budgets) AS runs,"
            " (SELECT count(*) FROM appliance.run_budgets"
            "   WHERE (used ->> 'steps')::numeric = 1) AS one_step"
            " FROM appliance.spend_ledger",
        )
        call_s = busy = None
        if pool is not None:
            (calls,) = await admin_sql(
                admin,
                "SELECT count(*) FILTER (WHERE status = 'ok') AS ok,"
                " percentile_cont(0.5) WITHIN GROUP (ORDER BY total_seconds) AS call_s,"
                " sum(total_seconds) AS call_sum FROM appliance.inference_calls",
            )
            assert calls["ok"] == n, f"{calls['ok']} model calls ok of {n}"
            call_s = float(calls["call_s"])
            busy = float(calls["call_sum"]) / float(row["span"])
            want = n if governed else 0
            assert spent["holds"] == spent["settled"] == want, f"ledger: {spent}, want {want}"
        else:
            want = n if governed else 0
            assert spent["runs"] == spent["one_step"] == want, f"run budgets: {spent}, want {want}"
            assert spent["holds"] == 0, f"ledger: {spent}"
        assert m.sample is not None
        s = m.sample
        sample = Sample(n, float(row["span"]), s.client_cpu, s.server_cpu, s.other_cpu, s.steal)
        return RunFigures(sample, call_s, busy)


@dataclass
class Pair:
    """One row of (2): the governed and ungoverned repeats."""

    label: str
    n: int
    ungoverned: Measurement
    governed: Measurement
    # Per side (False: ungoverned, True: governed), per run: median model call s, model busy.
    call_s: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})
    busy: dict[bool, list[float]] = field(default_factory=lambda: {False: [], True: []})

    def all_calls_ms(self) -> float:
        values = self.call_s[False] + self.call_s[True]
        return statistics.median(values) * 1000 if values else float("nan")

    @property
    def ratio(self) -> float:
        return _ratio(self.governed.median, self.ungoverned.median)

    @property
    def added_ms(self) -> float:
        """Wall milliseconds per message governance adds (from the median rates)."""
        return (1 / self.governed.median - 1 / self.ungoverned.median) * 1000


def energy_meter() -> EnergyMeter:
    """The estimate source on this machine (no counters here), as the governed-runner test."""
    return EnergyMeter(
        EstimateSource(10.0, 15.0, process_cpu_seconds, time.monotonic()),
        ThreadCpu(),
        {"cpu": 10.0},
    )


async def runner_throughput(server: Server, sizes: Sizes, threads: int) -> list[Pair]:
    model_row = Pair(
        f"model call per message (classify, max_tokens=1), {sizes.model_n} messages",
        sizes.model_n,
        Measurement("model, ungoverned"),
        Measurement("model, governed"),
    )
    steps_row = Pair(
        f"no-op with a run step budget, {sizes.steps_n:,} messages",
        sizes.steps_n,
        Measurement("steps, ungoverned"),
        Measurement("steps, governed"),
    )
    pool = InferencePool(
        [spec(Tier.MECHANICAL, workers=1, n_threads=threads)],
        cores=max(threads, os.cpu_count() or 1),
        meter=energy_meter(),
    )
    print("runner throughput: loading the mechanical model ...", flush=True)
    await pool.start()
    try:
        if Tier.MECHANICAL not in pool.available():
            raise RuntimeError(f"the mechanical tier did not come up: {pool.stats()}")
        for i in range(3):  # warm the model (both sides use this pool)
            await pool.infer(
                InferenceRequest("classify", prompt=f"Ticket: warm-up {i}\nLabel:", max_tokens=1),
                Tier.MECHANICAL,
            )
        # One small untimed drain of each, governed (it exercises every path), first.
        await drain(server, MODEL_PIPES, 5, governed=True, pool=pool)
        await drain(server, STEP_PIPES, 50, governed=True, pool=None)
        for rep in range(sizes.repeats):
            sides = (False, True) if rep % 2 == 0 else (True, False)
            for governed in sides:
                out = await drain(server, MODEL_PIPES, sizes.model_n, governed=governed, pool=pool)
                (model_row.governed if governed else model_row.ungoverned).add(out.sample)
                if out.call_s is not None and out.busy is not None:
                    model_row.call_s[governed].append(out.call_s)
                    model_row.busy[governed].append(out.busy)
            print(
                f"  repeat {rep + 1}/{sizes.repeats}, model: ungoverned"
                f" {model_row.ungoverned.samples[-1].rate:.1f}, governed"
                f" {model_row.governed.samples[-1].rate:.1f} msgs/s (model call p50"
                f" {model_row.call_s[False][-1] * 1000:.0f} /"
                f" {model_row.call_s[True][-1] * 1000:.0f} ms)",
                flush=True,
            )
        for rep in range(sizes.repeats):
            sides = (False, True) if rep % 2 == 0 else (True, False)
            for governed in sides:
                out = await drain(server, STEP_PIPES, sizes.steps_n, governed=governed, pool=None)
                (steps_row.governed if governed else steps_row.ungoverned).add(out.sample)
            print(
                f"  repeat {rep + 1}/{sizes.repeats}, no-op with step budget: ungoverned"
                f" {fmt_rate(steps_row.ungoverned.samples[-1].rate)}, governed"
                f" {fmt_rate(steps_row.governed.samples[-1].rate)} msgs/s",
                flush=True,
            )
    finally:
        await pool.close()
    return [model_row, steps_row]


# -- 3. admission under contention ----------------------------------------------------------------


@dataclass
class Contention:
    contenders: int
    fits: int
    rounds: int = 0
    ms: list[float] = field(default_factory=list)  # every timed reservation
    admitted_ms: list[float] = field(default_factory=list)
    refused_ms: list[float] = field(default_factory=list)
    makespan_ms: list[float] = field(default_factory=list)  # per round
    admitted: list[int] = field(default_factory=list)  # per round
    overshoot: int = 0  # the worst round: admitted beyond the cap
    mismatches: list[str] = field(default_factory=list)
    sample: Sample | None = None


async def contention(server: Server, sizes: Sizes) -> Contention:
    c, k = sizes.contenders, sizes.fits
    out = Contention(c, k)
    async with server.fresh("contend", min_size=c, max_size=c) as db:
        spend = PgSpendStore(db)
        tenants = PgTenantStore(db)
        names = [f"c{r:03d}" for r in range(sizes.rounds + 1)]
        held: dict[str, list[LeaseRef]] = {}
        for name in names:
            await tenants.add(name)
            await spend.set_cap(f"tenant:{name}", CONTENTION_AMOUNT * k)
            held[name] = await leases(db, name, c)

        async def one_round(tenant: str) -> list[tuple[float, float, bool]]:
            barrier = asyncio.Barrier(c)

            async def one(i: int) -> tuple[float, float, bool]:
                await barrier.wait()
                t0 = time.perf_counter()
                hold = await spend.reserve(
                    tenant=tenant,
                    lane=Lane.INTERACTIVE,
                    amount=CONTENTION_AMOUNT,
                    lease=held[tenant][i],
                    pipeline="model",
                    stage="classify",
                    kind="classify",
                    model="bench",
                    tier=Tier.MECHANICAL.value,
                )
                return t0, time.perf_counter(), not isinstance(hold, Refusal)

            return list(await asyncio.gather(*(one(i) for i in range(c))))

        await one_round(names[0])  # warm-up: every connection plans the functions once
        with Meter(server.server_pid, sizes.rounds * c) as m:
            for name in names[1:]:
                results = await one_round(name)
                admitted = sum(1 for _, _, ok in results if ok)
                for t0, t1, ok in results:
                    ms = (t1 - t0) * 1000
                    out.ms.append(ms)
                    (out.admitted_ms if ok else out.refused_ms).append(ms)
                out.makespan_ms.append(
                    (max(t1 for _, t1, _ in results) - min(t0 for t0, _, _ in results)) * 1000
                )
                out.admitted.append(admitted)
                out.overshoot = max(out.overshoot, admitted - k)
                (row,) = await admin_sql(
                    db.endpoints.admin,
                    "SELECT (SELECT count(*) FROM appliance.spend_ledger"
                    f"         WHERE tenant = '{name}' AND status = 'reserved') AS holds,"
                    " (SELECT reserved FROM appliance.spend_months"
                    f"   WHERE scope = 'tenant:{name}') AS reserved",
                )
                if admitted != k or row["holds"] != admitted:
                    out.mismatches.append(
                        f"{name}: admitted {admitted}, ledger {row['holds']}, expected {k}"
                    )
                if row["reserved"] != CONTENTION_AMOUNT * admitted:
                    out.mismatches.append(f"{name}: reserved {row['reserved']} for {admitted}")
                if row["reserved"] > CONTENTION_AMOUNT * k:
                    out.overshoot = max(out.overshoot, 1)
                out.rounds += 1
        out.sample = m.sample
    return out


# -- the run --------------------------------------------------------------------------------------


@dataclass
class Report:
    sizes: Sizes
    pairs: list[PairKind]
    rows: list[Pair]
    contention: Contention
    facts: dict[str, str]
    wall: float
    threads: int


async def run_all(admin: str, server_pid: int | None, sizes: Sizes, threads: int) -> Report:
    t0 = time.perf_counter()
    load_start = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    server = Server(admin, server_pid)
    await server.prepare()
    print(f"admission cost: {sizes.pairs:,} pairs of each kind, interleaved ...", flush=True)
    pairs = await admission_cost(server, sizes)
    print(
        "  median us/pair: " + ", ".join(f"{k.name} {k.p50:,.0f}" for k in pairs),
        flush=True,
    )
    rows = await runner_throughput(server, sizes, threads)
    print(
        f"contention: {sizes.contenders} reservations at once, cap fits {sizes.fits},"
        f" {sizes.rounds} rounds ...",
        flush=True,
    )
    cont = await contention(server, sizes)
    print(
        f"  p50/p99/max {percentile(cont.ms, 0.5):.2f}/{percentile(cont.ms, 0.99):.2f}/"
        f"{max(cont.ms):.2f} ms, overshoot {cont.overshoot}",
        flush=True,
    )
    facts = {**machine_facts(), **server_facts(admin, SETTINGS_SHOWN)}
    facts["loadavg_start"] = load_start
    facts["tree"] = code_version()
    return Report(sizes, pairs, rows, cont, facts, time.perf_counter() - t0, threads)


# -- rendering ------------------------------------------------------------------------------------


def _us(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:,.0f}"


def _admission_table(r: Report) -> str:
    base = next(k for k in r.pairs if k.name == "select1")
    rows = []
    for k in r.pairs:
        client, server = k.cpu_us()
        rows.append(
            [
                k.label,
                _us(k.p50),
                _us(k.p99),
                f"{_ratio(k.p50, base.p50):.2f}",
                f"{_us(percentile(k.first_us, 0.5))} + {_us(percentile(k.second_us, 0.5))}",
                k.block_medians(),
                f"{_us(client)} / {_us(server)}",
                fmt_share(k.other_share()),
            ]
        )
    return markdown_table(
        [
            "statement pair, sequential, system-role pool",
            "us/pair p50",
            "us/pair p99",
            "p50 / SELECT 1 x2",
            "p50 us: 1st + 2nd",
            "block p50s (min-max)",
            "CPU us/pair client / server",
            "others' CPU, cores",
        ],
        rows,
    )


def _ms_list(values: Sequence[float]) -> str:
    return ", ".join(f"{v * 1000:.1f}" for v in values) + " ms" if values else "-"


def _calls_cell(p: Pair, governed: bool) -> tuple[str, str]:
    calls, busy = p.call_s[governed], p.busy[governed]
    if not calls:
        return "-", "-"
    return (
        f"{statistics.median(calls) * 1000:.1f} ({', '.join(f'{c * 1000:.0f}' for c in calls)})",
        f"{statistics.median(busy) * 100:.0f} %",
    )


def _throughput_table(r: Report) -> str:
    rows = []
    for p in r.rows:
        for m, governed in ((p.ungoverned, False), (p.governed, True)):
            side = "governed" if governed else "ungoverned (governor=None)"
            calls, busy = _calls_cell(p, governed)
            rows.append(
                [
                    f"{p.label}: {side}",
                    f"{m.median:,.1f}" if m.median < 100 else fmt_rate(m.median),
                    " / ".join(
                        f"{s.rate:,.1f}" if s.rate < 100 else fmt_rate(s.rate) for s in m.samples
                    ),
                    f"{1000 / m.median:.2f}",
                    f"{_ratio(m.median, p.ungoverned.median):.3f}",
                    calls,
                    busy,
                    fmt_share(m.other_share),
                ]
            )
    return markdown_table(
        [
            "runner drain",
            "msgs/s (median)",
            "runs",
            "ms/msg",
            "/ ungoverned",
            "model call ms p50 (runs)",
            "model busy / span",
            "others' CPU, cores",
        ],
        rows,
    )


def _contention_table(c: Contention) -> str:
    rows = [
        [
            "all reservations",
            f"{len(c.ms):,}",
            f"{percentile(c.ms, 0.5):.2f}",
            f"{percentile(c.ms, 0.99):.2f}",
            f"{max(c.ms):.2f}",
        ],
        [
            "admitted",
            f"{len(c.admitted_ms):,}",
            f"{percentile(c.admitted_ms, 0.5):.2f}",
            f"{percentile(c.admitted_ms, 0.99):.2f}",
            f"{max(c.admitted_ms):.2f}" if c.admitted_ms else "-",
        ],
        [
            "refused (cap full)",
            f"{len(c.refused_ms):,}",
            f"{percentile(c.refused_ms, 0.5):.2f}",
            f"{percentile(c.refused_ms, 0.99):.2f}",
            f"{max(c.refused_ms):.2f}" if c.refused_ms else "-",
        ],
        [
            "round: first release -> last return",
            f"{len(c.makespan_ms)}",
            f"{percentile(c.makespan_ms, 0.5):.2f}",
            f"{percentile(c.makespan_ms, 0.99):.2f}",
            f"{max(c.makespan_ms):.2f}",
        ],
    ]
    return markdown_table(
        [
            f"{c.contenders} reservations at once, cap fits {c.fits}",
            "samples",
            "p50 ms",
            "p99 ms",
            "max ms",
        ],
        rows,
    )


def _targets(r: Report) -> list[tuple[str, str, str]]:
    adm = next(k for k in r.pairs if k.name == "admission")
    base = next(k for k in r.pairs if k.name == "select1")
    model, steps = r.rows
    c = r.contention
    call_ms = model.all_calls_ms()
    ok = c.overshoot == 0 and not c.mismatches
    return [
        (
            "(1) admission cost, reserve + settle (no target in the issue)",
            f"{adm.p50:,.0f} us p50, {adm.p99:,.0f} us p99;"
            f" {_ratio(adm.p50, base.p50):.1f} x two SELECT 1 ({base.p50:,.0f} us)",
            "reported",
        ),
        (
            "(2) runner throughput, one model call per message: governed / ungoverned"
            " (governance should cost little relative to a model call)",
            f"{model.ratio:.3f} x ({model.governed.median:,.1f} vs"
            f" {model.ungoverned.median:,.1f} msgs/s); {model.added_ms:+.2f} ms per message"
            f" vs a model call of {call_ms:.1f} ms (median)",
            "reported",
        ),
        (
            "(2) runner throughput, no-op stage reserving a run step: governed / ungoverned",
            f"{steps.ratio:.3f} x ({fmt_rate(steps.governed.median)} vs"
            f" {fmt_rate(steps.ungoverned.median)} msgs/s); {steps.added_ms:+.3f} ms per message",
            "reported",
        ),
        (
            f"(3) one reservation, {c.contenders} at once (no target in the issue)",
            f"p50 {percentile(c.ms, 0.5):.2f} / p99 {percentile(c.ms, 0.99):.2f} /"
            f" max {max(c.ms):.2f} ms",
            "reported",
        ),
        (
            f"(3) cap overshoot under contention: exactly {c.fits} of {c.contenders} admitted"
            " every round, overshoot 0",
            f"overshoot {c.overshoot} in {c.rounds} rounds; admitted per round"
            f" {min(c.admitted)}-{max(c.admitted)}; {len(c.mismatches)} mismatches",
            "met" if ok else "**MISSED**",
        ),
    ]


def render(r: Report) -> str:
    f = r.facts
    s = r.sizes
    settings = ", ".join(f"{k}={f[k]}" for k in SETTINGS_SHOWN if k in f)
    model, _ = r.rows
    c = r.contention
    call_ms = model.all_calls_ms()
    targets = markdown_table(
        ["target", "measured (median)", "verdict"], [list(t) for t in _targets(r)]
    )
    lines = [
        f"Run {f['date']}, `python -m bench.governance_bench` (total {r.wall:.0f} s), code:"
        f" {f['tree']}.",
        "",
        f"- Machine: {f['cores']} cores ({f['cpu']}), {f['memory']} RAM, Linux {f['kernel']};"
        " client, runner, model and server share the cores, and the box is shared with other"
        f" test runs: load average (1/5/15 min) {f['loadavg_start']} at start, {f['loadavg']}"
        " at end; `others' CPU` = cores' worth of CPU other processes used (median block/run).",
        f"- PostgreSQL {f['server_version']} (LocalCluster, appliance defaults, Unix socket):"
        f" {settings}. Python {f['python']}, psycopg {f['psycopg']}.",
        f"- (1) {s.pairs:,} pairs of each kind after {s.warmup} untimed, in blocks of"
        f" {s.block} interleaved (order rotating per block), one at a time on a `Database` pool"
        " of the system role; each statement borrows a pooled connection, as the store does."
        " Amounts: the worst case of a classify call (max_tokens=1) at 1,000 J/token, 1 EUR/kWh;"
        " settled to 25 J. Appliance cap 1e9: never refused.",
        f"- (2) fresh database per run (cloned from a migrated template); {s.repeats} runs per"
        " side, alternating (the side going first alternates); `Runner` with `RunnerConfig`"
        " defaults, PgDoorbell, no maintenance jobs; rate = messages / (last finished_at -"
        f" first claimed_at). Model row: SmolLM2-135M (dev profile), 1 worker x {r.threads}"
        f" thread(s), n_ctx 1024, the real `Meter` (labelled CPU estimate), one warmed pool for"
        " both sides; governed = `Governor(PgSpendStore, Pricing)`, cap 1e9. No-op row: no"
        " model; the pipeline has `RunBudget(steps=4)`; governed, each stage reserves one step."
        " `model busy / span` = the model calls' total seconds / the drain's span: near 100 %,"
        " the model is the bottleneck, and a slower rate means slower calls.",
        f"- (3) {c.contenders} tasks wait on an `asyncio.Barrier`, then each calls"
        f" `PgSpendStore.reserve` (pool of {c.contenders} system-role connections, all open),"
        f" amount {CONTENTION_AMOUNT}, a new tenant per round with cap {c.fits} x amount;"
        f" {c.rounds} timed rounds after one untimed. Every reservation locks the appliance"
        " row and the tenant row (scope order), so they queue on the appliance row.",
        "",
        "### Cost of admission",
        "",
        _admission_table(r),
        "",
        "### Runner throughput, governed vs ungoverned",
        "",
        _throughput_table(r),
        "",
        f"Median model call (pool's total_seconds, all model runs): {call_ms:.1f} ms"
        f" (ungoverned runs {_ms_list(model.call_s[False])}, governed"
        f" {_ms_list(model.call_s[True])});"
        f" governance adds {model.added_ms:+.2f} ms per message in the model row"
        f" ({_ratio(model.added_ms, call_ms) * 100:+.1f} % of a call).",
        "",
        "### Admission under contention",
        "",
        _contention_table(c),
        "",
        f"Admitted per round: {', '.join(str(a) for a in c.admitted)} (cap fits {c.fits});"
        f" others' CPU during the rounds: {fmt_share(c.sample.other_share if c.sample else None)}"
        " cores.",
    ]
    if c.mismatches:
        lines += ["", "Mismatches: " + "; ".join(c.mismatches)]
    lines += ["", "### Targets", "", targets]
    return "\n".join(lines)


def to_json(r: Report) -> dict[str, Any]:
    def measurement(m: Measurement) -> dict[str, Any]:
        return {
            "median_msgs_per_s": m.median,
            "runs_msgs_per_s": [x.rate for x in m.samples],
            "others_cpu_cores": m.other_share,
        }

    c = r.contention
    return {
        "facts": r.facts,
        "sizes": r.sizes.__dict__,
        "wall_s": r.wall,
        "model_threads": r.threads,
        "admission": {
            k.name: {
                "label": k.label,
                "p50_us": k.p50,
                "p99_us": k.p99,
                "first_p50_us": percentile(k.first_us, 0.5),
                "second_p50_us": percentile(k.second_us, 0.5),
                "cpu_us_client_server": k.cpu_us(),
                "others_cpu_cores": k.other_share(),
                "pairs": len(k.us),
            }
            for k in r.pairs
        },
        "admission_ratio_p50": _ratio(r.pairs[0].p50, r.pairs[1].p50),
        "throughput": [
            {
                "label": p.label,
                "n": p.n,
                "ungoverned": measurement(p.ungoverned),
                "governed": measurement(p.governed),
                "ratio_governed_ungoverned": p.ratio,
                "added_ms_per_message": p.added_ms,
                "model_call_median_s_per_run": {
                    "ungoverned": p.call_s[False],
                    "governed": p.call_s[True],
                },
                "model_busy_share_per_run": {
                    "ungoverned": p.busy[False],
                    "governed": p.busy[True],
                },
            }
            for p in r.rows
        ],
        "contention": {
            "contenders": c.contenders,
            "fits": c.fits,
            "rounds": c.rounds,
            "p50_ms": percentile(c.ms, 0.5),
            "p99_ms": percentile(c.ms, 0.99),
            "max_ms": max(c.ms),
            "admitted_p50_ms": percentile(c.admitted_ms, 0.5),
            "refused_p50_ms": percentile(c.refused_ms, 0.5),
            "round_makespan_p50_ms": percentile(c.makespan_ms, 0.5),
            "admitted_per_round": c.admitted,
            "overshoot": c.overshoot,
            "mismatches": c.mismatches,
            "others_cpu_cores": c.sample.other_share if c.sample else None,
        },
        "targets": [
            {"target": t, "measured": got, "verdict": verdict} for t, got, verdict in _targets(r)
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    parser.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help=f"the model worker's threads (default {DEFAULT_THREADS}; see DEFAULT_THREADS)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sizes = QUICK if args.quick else FULL

    with temp_cluster(args.port, {"max_connections": "200"}) as cluster:
        report = asyncio.run(
            run_all(cluster.conninfo(), postmaster_pid(cluster), sizes, args.threads)
        )

    text = render(report)
    print()
    print("## governance")
    print()
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(to_json(report), out, indent=2, default=str)
        print(f"\nJSON written to {args.json}")
    if args.quick:
        print("\n(--quick: sizes too small to be figures; RESULTS.md not written)")
    elif not args.no_write:
        write_section("governance", text)
        print("\nwritten to bench/RESULTS.md, section `## governance`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
