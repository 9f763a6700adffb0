"""Reading the plans runtime connections keep: named queries prepared as the driver prepares
them (generic plans, plan_cache_mode=force_generic_plan) and run under EXPLAIN ANALYZE, the
plans of statements inside functions (auto_explain), what a plan read of a table, and the data
set-ups that show a plan kept from statistics that no longer hold."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, Literal, TypeVar

import psycopg

from appliance.bus.core import Bus
from appliance.db.database import Database
from appliance.db.queries import q
from appliance.db.runner_store import PgRunnerStore
from appliance.domain.envelope import Lane, LeaseRef

T = TypeVar("T")
PENDING_INDEX = "appliance.agent_messages_lane_tier_tenant_priority_not_before_id_idx"
# Per-transaction statistics of one relation, by what they count.
_XACT_STATS = {
    "blocks_fetched": "SELECT pg_stat_get_xact_blocks_fetched(%s::regclass) AS n",
    "tuples_returned": "SELECT pg_stat_get_xact_tuples_returned(%s::regclass) AS n",
}

# The claim statement's parameter types (PREPARE needs them).
CLAIM_TYPES = {
    "worker": "text",
    "lane": "lane",
    "limit": "integer",
    "lease": "interval",
    "tenant_limit": "integer",
    "tenant": "text",
    "backlog_limit": "integer",
    "max_runtime": "interval",
    "open_tiers": "text[]",
    "now": "timestamptz",
    "finished_ids": "bigint[]",
    "finished_tokens": "bigint[]",
    "skip": "text[]",
}


def claim_values(**overrides: Any) -> dict[str, Any]:
    """Arguments of the claim statement as text literals (a claim of 10 with no tier blocked
    but model work's, no tenant limit in the way), with `overrides`."""
    values: dict[str, Any] = {
        "worker": "w",
        "lane": "interactive",
        "limit": 10,
        "lease": "60 seconds",
        "tenant_limit": 10**6,
        "tenant": None,
        "backlog_limit": 11,
        "max_runtime": "10 minutes",
        "open_tiers": '{""}',
        "now": None,
        "finished_ids": "{}",
        "finished_tokens": "{}",
        "skip": None,
    }
    values.update(overrides)
    return values


def positional(statement: str) -> tuple[str, list[str]]:
    """A named statement with $1, $2, ... for its %(name)s parameters (for PREPARE), and the
    parameter names in that order."""
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", statement)))
    return re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m[1]) + 1}", statement), names


async def prepare(aconn: psycopg.AsyncConnection[Any], name: str, types: Mapping[str, str]) -> str:
    """PREPARE named query `name` under its own name, its parameters typed by `types`; returns
    the EXECUTE text, with a %(param)s::type placeholder per parameter for a client cursor
    (EXECUTE's arguments cannot take protocol parameters whose type the server must infer)."""
    numbered, names = positional(q(name))
    await aconn.execute(f"PREPARE {name} ({', '.join(types[n] for n in names)}) AS {numbered}")
    return f"EXECUTE {name}(" + ", ".join(f"%({n})s::{types[n]}" for n in names) + ")"


async def explain(
    cur: psycopg.AsyncClientCursor[dict[str, Any]], call: str, values: Mapping[str, Any]
) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of `call` (which runs, and commits when autocommit is on)."""
    await cur.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {call}", values)
    row = await cur.fetchone()
    assert row is not None
    plan: dict[str, Any] = row["QUERY PLAN"][0]
    return plan


def plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = [node]
    for child in node.get("Plans", []):
        found.extend(plan_nodes(child))
    return found


def hot_reads(plan: dict[str, Any], relation: str = "agent_messages") -> int:
    """Rows of `relation` a plan read: returned, and read then filtered out or rechecked."""
    return sum(
        (
            int(n.get("Actual Rows", 0))
            + int(n.get("Rows Removed by Filter", 0))
            + int(n.get("Rows Removed by Index Recheck", 0))
        )
        * int(n.get("Actual Loops", 1))
        for n in plan_nodes(plan["Plan"])
        if n.get("Relation Name") == relation
    )


def check_bounded_plan(plan: dict[str, Any]) -> None:
    all_nodes = plan_nodes(plan["Plan"])
    seq = [
        n
        for n in all_nodes
        if n["Node Type"] == "Seq Scan" and n.get("Relation Name") == "agent_messages"
    ]
    assert seq == [], "the statement scanned the hot table sequentially"
    reads = hot_reads(plan)
    assert reads <= 100, reads
    assert (
        int(plan["Plan"]["Shared Hit Blocks"]) + int(plan["Plan"].get("Shared Read Blocks", 0))
        < 2000
    )


def rows_written(plan: dict[str, Any]) -> int:
    """Rows the plan's INSERT/UPDATE/DELETE wrote (and returned)."""
    return sum(
        int(n["Actual Rows"]) for n in plan_nodes(plan["Plan"]) if n["Node Type"] == "ModifyTable"
    )


def reads_index(plan: dict[str, Any], index: str) -> bool:
    return any(n.get("Index Name") == index for n in plan_nodes(plan["Plan"]))


# Runtime connections' settings, then auto_explain's (superuser-only, hence the admin session).
_EXPLAINED_SESSION = (
    "LOAD 'auto_explain'",
    "SET auto_explain.log_min_duration = 0",
    "SET auto_explain.log_analyze = on",
    "SET auto_explain.log_buffers = on",
    "SET auto_explain.log_nested_statements = on",
    "SET auto_explain.log_format = json",
    "SET client_min_messages = log",
    "SET plan_cache_mode = force_generic_plan",
    "SET search_path = appliance, pg_catalog",
    "SET ROLE appliance_system",
)


@contextlib.asynccontextmanager
async def explained_session(
    admin: str,
) -> AsyncIterator[tuple[psycopg.AsyncConnection[Any], list[dict[str, Any]]]]:
    """A session as the runtime's system role, with its plan settings, that collects the plan
    (with ANALYZE) of every statement it runs, those inside functions included, as they end."""
    plans: list[dict[str, Any]] = []

    def on_notice(diag: psycopg.errors.Diagnostic) -> None:
        text = diag.message_primary or ""
        if "plan:" in text:
            plans.append(json.loads(text.split("plan:", 1)[1]))

    async with await psycopg.AsyncConnection.connect(admin, autocommit=True) as conn:
        conn.add_notice_handler(on_notice)
        for setting in _EXPLAINED_SESSION:
            await conn.execute(setting)
        yield conn, plans


def plans_of(plans: list[dict[str, Any]], fragment: str) -> list[dict[str, Any]]:
    """The collected plans whose statement text contains `fragment`."""
    return [p for p in plans if fragment in p["Query Text"]]


async def backlog(db: Database, n: int, *, tenant: str = "acme") -> None:
    """`n` pending messages, then ANALYZE: the statistics say that they all wait."""
    bus = Bus(PgRunnerStore(db))
    for start in range(0, n, 1000):
        await bus.enqueue_many(
            [
                bus.request(
                    tenant=tenant,
                    pipeline="p",
                    stage="s",
                    source="test",
                    source_id=f"m{i}",
                    directive="work",
                )
                for i in range(start, min(n, start + 1000))
            ]
        )
    await admin_sql(db, "ANALYZE appliance.agent_messages")


async def take(rstore: PgRunnerStore, n: int) -> list[LeaseRef]:
    """Claim `n` messages (kept running): their leases."""
    leases: list[LeaseRef] = []
    while len(leases) < n:
        claim = await rstore.claim_lane(
            worker="w",
            lane=Lane.INTERACTIVE,
            limit=min(100, n - len(leases)),
            lease=timedelta(seconds=60),
            tenant_limit=10**6,
        )
        assert claim.messages, "the backlog ran out"
        leases.extend(m.lease for m in claim.messages)
    return leases


async def admin_sql(db: Database, *statements: str) -> None:
    """Statements as the superuser (test set-up that no runtime role may do), autocommit."""
    async with await psycopg.AsyncConnection.connect(db.endpoints.admin, autocommit=True) as conn:
        for statement in statements:
            await conn.execute(statement)


async def read_by(
    db: Database,
    call: Callable[[], Awaitable[T]],
    *,
    stat: Literal["blocks_fetched", "tuples_returned"],
    relation: str,
    monkeypatch: Any,
) -> tuple[T, int]:
    """What `call` returns, and how much of `relation` its system-role statements read (pages
    fetched, or index entries / rows returned): they run on one connection, in one transaction
    that is rolled back, where the per-transaction statistics count them. The counter also holds
    what the backend has not reported yet, so it is read before and after."""
    async with db.system_pool.connection() as conn, conn.transaction(force_rollback=True):

        @contextlib.asynccontextmanager
        async def this_connection() -> AsyncIterator[Any]:
            yield conn

        monkeypatch.setattr(db, "system_conn", this_connection)
        try:
            count = _XACT_STATS[stat]
            before = await (await conn.execute(count, (relation,))).fetchone()
            result = await call()
            after = await (await conn.execute(count, (relation,))).fetchone()
        finally:
            monkeypatch.undo()
    assert before is not None and after is not None
    return result, int(after["n"] - before["n"])
