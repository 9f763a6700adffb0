"""Same-run A/B of a server-side change: the bus as it is (A) against the bus with a change (B).

This box's speed drifts by a fifth or more within minutes, so two bench runs made one after the
other cannot show a change of a few percent. This tool measures both sides in the same
throw-away server, in two databases migrated alike, in many short pairs whose order flips every
pair (A B, B A, ...), and reports the median of the pairs' ratios (B / A) of messages a second
and of the server's CPU per message, with their interquartile range. A change whose range
straddles 1.00 was not measured as a gain.

Database B gets the change before any pair runs:
- `--sql FILE` (repeatable): SQL run in it as the superuser (search_path appliance), such as a
  candidate `CREATE OR REPLACE FUNCTION` of a trigger;
- `--setting NAME=VALUE` (repeatable): `ALTER DATABASE .. SET`, for the sessions of B only (a
  server setting that sessions may set, such as wal_compression).

Workloads (the real Bus API, as bench/bus_throughput.py drives it): `claim1` and `claim4`
(claim(10) + complete_many with 1 or 4 workers, over a pre-filled queue), `batch` (enqueue_many
of 1,000), `single` (sequential enqueue).

    .venv/bin/python -m bench.ab --workload claim1 --sql candidate.sql --pairs 21
    .venv/bin/python -m bench.ab --workload claim4 --setting wal_compression=lz4

Nothing is written to bench/RESULTS.md: a finding is reported where the change is made.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from appliance.db.migrate import migrate
from bench.bus_throughput import BusTarget
from bench.harness import (
    Measurement,
    Sample,
    create_database,
    percentile,
    postmaster_pid,
    temp_cluster,
)

WORKLOADS = ("claim1", "claim4", "batch", "single")


@dataclass(frozen=True)
class Pair:
    """One pair of runs: A's and B's samples."""

    a: Sample
    b: Sample

    @property
    def rate(self) -> float:
        return self.b.rate / self.a.rate

    @property
    def server(self) -> float | None:
        if self.a.server_cpu is None or self.b.server_cpu is None or not self.a.server_cpu:
            return None
        return (self.b.server_cpu / self.b.n) / (self.a.server_cpu / self.a.n)


def setting(text: str) -> tuple[str, str]:
    """NAME=VALUE of --setting, checked."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not name.strip().replace("_", "").replace(".", "").isalnum():
        raise argparse.ArgumentTypeError(f"--setting wants NAME=VALUE, got {text!r}")
    return name.strip(), value.strip()


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    return percentile(values, 0.25), percentile(values, 0.5), percentile(values, 0.75)


async def run_one(target: BusTarget, workload: str, n: int) -> Sample:
    if workload == "claim1":
        return await target.claim_complete(n, 1, 10)
    if workload == "claim4":
        return await target.claim_complete(n, 4, 10)
    if workload == "batch":
        return await target.batch(n, Measurement("request building"))
    return await target.single(n, 1)


def change_b(admin_b: str, sql_files: Sequence[Path], settings: Sequence[tuple[str, str]]) -> None:
    with psycopg.connect(admin_b, autocommit=True) as conn:
        dbname = conn.info.dbname
        for name, value in settings:
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                    sql.Identifier(dbname),
                    sql.SQL(".").join(sql.Identifier(part) for part in name.split(".")),
                    sql.Literal(value),
                )
            )
        for path in sql_files:
            conn.execute("SET search_path TO appliance, pg_catalog")
            conn.execute(path.read_text(encoding="utf-8").encode())


async def measure(
    admin: str,
    server_pid: int | None,
    args: argparse.Namespace,
) -> list[Pair]:
    admin_a = create_database(admin, "bench_ab_a")
    admin_b = create_database(admin, "bench_ab_b")
    migrate(admin_a)
    migrate(admin_b)
    change_b(admin_b, args.sql, args.setting)  # before the pools connect: settings apply
    a, b = BusTarget(admin_a, server_pid), BusTarget(admin_b, server_pid)
    await a.open()
    await b.open()
    pairs: list[Pair] = []
    try:
        await run_one(a, args.workload, args.messages)  # warm both: caches, plans, files
        await run_one(b, args.workload, args.messages)
        for i in range(args.pairs):
            first, second = (a, b) if i % 2 == 0 else (b, a)
            done = {id(first): await run_one(first, args.workload, args.messages)}
            done[id(second)] = await run_one(second, args.workload, args.messages)
            pair = Pair(done[id(a)], done[id(b)])
            pairs.append(pair)
            server = f"{pair.server:.3f}" if pair.server is not None else "-"
            print(
                f"pair {i + 1:2d}: A {pair.a.rate:9,.0f}/s  B {pair.b.rate:9,.0f}/s"
                f"  rate B/A {pair.rate:.3f}  server CPU/msg B/A {server}",
                flush=True,
            )
    finally:
        await a.close()
        await b.close()
    return pairs


def report(pairs: Sequence[Pair]) -> str:
    lo, mid, hi = quartiles([p.rate for p in pairs])
    lines = [
        f"messages/s B/A: median {mid:.3f} (interquartile {lo:.3f}-{hi:.3f}, {len(pairs)} pairs)"
    ]
    servers = [p.server for p in pairs if p.server is not None]
    if servers:
        lo, mid, hi = quartiles(servers)
        lines.append(
            f"server CPU per message B/A: median {mid:.3f} (interquartile {lo:.3f}-{hi:.3f})"
        )
    clients = [(p.b.client_cpu / p.b.n) / (p.a.client_cpu / p.a.n) for p in pairs if p.a.client_cpu]
    if clients:
        lines.append(f"client CPU per message B/A: median {statistics.median(clients):.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workload", choices=WORKLOADS, default="claim1")
    parser.add_argument("--sql", type=Path, action="append", default=[], metavar="FILE")
    parser.add_argument("--setting", type=setting, action="append", default=[])
    parser.add_argument("--messages", type=int, default=None, help="per run (default by workload)")
    parser.add_argument("--pairs", type=int, default=21)
    parser.add_argument("--port", type=int, default=55434)
    args = parser.parse_args(argv)
    if not args.sql and not args.setting:
        parser.error("nothing to compare: give --sql FILE or --setting NAME=VALUE")
    for path in args.sql:
        if not path.is_file():
            parser.error(f"--sql {path}: no such file")
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if args.messages is None:
        args.messages = {"batch": 50_000, "single": 1_000}.get(args.workload, 5_000)
    elif args.messages < 10:
        parser.error("--messages must be at least 10")
    with temp_cluster(args.port, {"max_connections": "200"}) as cluster:
        pairs = asyncio.run(measure(cluster.conninfo(), postmaster_pid(cluster), args))
    print(report(pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
