"""Reading the plans runtime connections keep: named queries prepared as the driver prepares
them (generic plans, plan_cache_mode=force_generic_plan), run under EXPLAIN ANALYZE, and what a
plan read of the hot table."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import psycopg

from appliance.db.queries import q


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


def hot_reads(plan: dict[str, Any]) -> int:
    """Rows of agent_messages a plan read: returned, and read then filtered out or rechecked."""
    return sum(
        (
            int(n.get("Actual Rows", 0))
            + int(n.get("Rows Removed by Filter", 0))
            + int(n.get("Rows Removed by Index Recheck", 0))
        )
        * int(n.get("Actual Loops", 1))
        for n in plan_nodes(plan["Plan"])
        if n.get("Relation Name") == "agent_messages"
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
