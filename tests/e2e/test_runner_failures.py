"""Runner failure drills with real runner processes against real PostgreSQL: a doorbell whose
connection keeps being killed, NOTIFY switched off, immediate server restarts under load, a
SIGKILL storm, and lane isolation under a batch backfill. Leases are 2 s (see runners.py)."""

from __future__ import annotations

import asyncio
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from appliance.bus.core import Bus
from appliance.db.database import Database, Endpoints
from appliance.db.runner_store import PgRunnerStore
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.envelope import Lane
from tests.e2e.runners import RunnerProcs, counts, query, runners, wait_until
from tests.pgserver import PgTestServer

LEASE = 2.0
pytestmark = pytest.mark.slow

# The doorbell's idle backend shows the last statement it ran: its LISTEN, or the health check.
DOORBELL_BACKENDS = (
    "SELECT pid FROM pg_stat_activity"
    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    " AND backend_type = 'client backend'"
    " AND (query LIKE 'LISTEN%' OR query LIKE '%pg_listening_channels()%')"
)
KILL_DOORBELLS = f"SELECT pg_terminate_backend(pid) AS killed FROM ({DOORBELL_BACKENDS}) AS d"


# -- helpers --------------------------------------------------------------------------------------


async def _enqueue_async(
    ends: Endpoints,
    pipeline: str,
    n: int,
    *,
    prefix: str,
    context: dict[str, object] | None = None,
    lane: Lane = Lane.INTERACTIVE,
    over: float = 0.0,
    tenant: str = "acme",
    max_attempts: int | None = None,
) -> list[int]:
    """Enqueue `n` messages of `pipeline`.run with distinct source ids: in batches of 1,000 up
    front, or (with `over` > 0) one at a time, evenly spread over `over` seconds."""
    db = Database(ends, max_size=2)
    await db.open()
    try:
        await PgTenantStore(db).add(tenant)
        bus = Bus(PgRunnerStore(db))

        def request(i: int) -> Any:
            return bus.request(
                tenant=tenant,
                pipeline=pipeline,
                stage="run",
                source="e2e",
                source_id=f"{prefix}{i}",
                directive="run",
                context=context or {},
                lane=lane,
                max_attempts=max_attempts,
            )

        ids: list[int] = []
        if over <= 0:
            for start in range(0, n, 1000):
                batch = [request(i) for i in range(start, min(n, start + 1000))]
                ids.extend(r.id for r in await bus.enqueue_many(batch))
            return ids
        began = time.monotonic()
        for i in range(n):
            delay = began + i * over / n - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            (result,) = await bus.enqueue_many([request(i)])
            assert result.new
            ids.append(result.id)
        return ids
    finally:
        await db.close()


def enqueue(ends: Endpoints, pipeline: str, n: int, **kw: Any) -> list[int]:
    return asyncio.run(_enqueue_async(ends, pipeline, n, **kw))


def admin_exec(admin: str, statement: str | sql.Composed) -> None:
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(statement)


def doorbells(admin: str) -> list[int]:
    return [int(r["pid"]) for r in query(admin, DOORBELL_BACKENDS)]  # type: ignore[call-overload]


def assert_done_once(admin: str, expected: int) -> None:
    """`expected` messages, each done, each with exactly one `done` transition in the log."""
    rows = query(
        admin,
        "SELECT m.id, m.status::text AS status,"
        " (SELECT count(*) FROM message_transitions t"
        "  WHERE t.message_id = m.id AND t.to_status = 'done') AS dones"
        " FROM agent_messages m",
    )
    assert len(rows) == expected
    bad = [r for r in rows if r["status"] != "done" or r["dones"] != 1]
    assert not bad, bad[:5]


def pickup_latencies(admin: str, pipeline: str) -> dict[int, float]:
    """Seconds from enqueue to the first claim, by message id (the first claim: a reclaimed
    message's claimed_at is its last one)."""
    rows = query(
        admin,
        "SELECT m.id, extract(epoch FROM min(t.at) - m.created_at)::float8 AS s"
        " FROM agent_messages m JOIN message_transitions t"
        "   ON t.message_id = m.id AND t.to_status = 'running'"
        " WHERE m.pipeline = %s GROUP BY m.id, m.created_at",
        (pipeline,),
    )
    return {int(r["id"]): float(r["s"]) for r in rows}  # type: ignore[call-overload, arg-type]


def summary(latencies: list[float]) -> str:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"n={len(ordered)} median={statistics.median(ordered):.3f}s p99={p99:.3f}s "
        f"max={ordered[-1]:.3f}s"
    )


def wait_registered(admin: str, n: int = 1) -> None:
    wait_until(
        lambda: len(query(admin, "SELECT id FROM runners WHERE stopped_at IS NULL")) >= n,
        30,
        what=f"{n} runner(s) to register",
    )


def busiest(
    conn: psycopg.Connection[Any], procs: RunnerProcs, alive: list[str], within: float
) -> str:
    """The first runner seen holding running messages within `within` seconds (the oldest when
    none is): a kill should strand leases, and 5 ms handlers hold them only briefly."""
    names = {procs.worker_id(name): name for name in alive}
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        row = conn.execute(
            "SELECT claimed_by, count(*) AS n FROM appliance.agent_messages"
            " WHERE status = 'running' AND claimed_by = ANY(%s)"
            " GROUP BY 1 ORDER BY 2 DESC LIMIT 1",
            (list(names),),
        ).fetchone()
        if row is not None:
            return names[str(row[0])]
        time.sleep(0.01)
    return alive[0]


class DoorbellKiller:
    """Terminates every doorbell backend of the database every `every` seconds, in a thread."""

    def __init__(self, admin: str, every: float) -> None:
        self.admin = admin
        self.every = every
        self.kills: list[int] = []
        self.error: BaseException | None = None
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="doorbell-killer", daemon=True)

    def _run(self) -> None:
        try:
            with psycopg.connect(self.admin, autocommit=True) as conn:
                while not self._halt.wait(self.every):
                    rows = conn.execute(KILL_DOORBELLS).fetchall()
                    self.kills.append(sum(1 for (killed,) in rows if killed))
        except BaseException as exc:  # raised in the test by __exit__
            self.error = exc

    def __enter__(self) -> DoorbellKiller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self._thread.join(timeout=10)
        if self.error is not None:
            raise self.error


@pytest.fixture
def procs(fresh_db: Endpoints, tmp_path: Path) -> Iterator[RunnerProcs]:
    with runners(fresh_db.admin, tmp_path) as started:
        yield started


# -- the drills -----------------------------------------------------------------------------------


def test_doorbell_killed_repeatedly_loses_nothing(fresh_db: Endpoints, procs: RunnerProcs) -> None:
    admin = fresh_db.admin
    poll = 3.0
    procs.start("a", APPLIANCE_RUNNER__POLL_INTERVAL_SECONDS=str(poll))
    wait_registered(admin)
    wait_until(lambda: len(doorbells(admin)) == 1, 30, what="the doorbell to LISTEN")
    with DoorbellKiller(admin, every=2.0) as killer:
        enqueue(fresh_db, "work", 200, prefix="k", over=10.0)
    wait_until(lambda: counts(admin) == {"done": 200}, 30, what="200 done", every=0.5)
    assert_done_once(admin, 200)
    # The kills really happened, each time to a doorbell that had come back since the last one.
    assert len(killer.kills) >= 4, killer.kills
    assert all(k == 1 for k in killer.kills), killer.kills
    lost = (procs.logdir / "a.log").read_text().count("doorbell connection lost")
    assert lost == sum(killer.kills), procs.logs()
    wait_until(lambda: len(doorbells(admin)) == 1, 10, what="the doorbell to come back")
    latencies = list(pickup_latencies(admin, "work").values())
    print(f"doorbell killed {sum(killer.kills)}x: pickup {summary(latencies)}")
    assert max(latencies) <= poll + 2.0, summary(latencies)
    # Between kills the doorbell works: most pick-ups are rung, not polled.
    assert statistics.median(latencies) < 0.5, summary(latencies)
    assert procs.procs["a"].poll() is None


def test_notify_off_the_fallback_poll_alone_picks_everything_up(
    fresh_db: Endpoints, procs: RunnerProcs
) -> None:
    admin = fresh_db.admin
    poll = 1.0
    dbname = psycopg.conninfo.conninfo_to_dict(admin)["dbname"]
    assert isinstance(dbname, str)
    # New sessions (the runner's, the enqueuer's) start with the trigger's NOTIFY off; the
    # database is dropped after the test.
    admin_exec(
        admin,
        sql.SQL("ALTER DATABASE {} SET appliance.notify = 'off'").format(sql.Identifier(dbname)),
    )
    heard: list[psycopg.Notify] = []
    with psycopg.connect(admin, autocommit=True) as ear:
        ear.add_notify_handler(heard.append)
        ear.execute("LISTEN appliance_work")
        procs.start(
            "a",
            APPLIANCE_RUNNER__POLL_INTERVAL_SECONDS=str(poll),
            APPLIANCE_RUNNER__LISTEN="false",
        )
        wait_registered(admin)
        enqueue(fresh_db, "work", 100, prefix="p", over=4.0)
        wait_until(lambda: counts(admin) == {"done": 100}, 20, what="100 done")
        ear.execute("SELECT 1")  # reads whatever notifications arrived meanwhile
    assert heard == []
    assert_done_once(admin, 100)
    latencies = list(pickup_latencies(admin, "work").values())
    print(f"notify off: pickup {summary(latencies)}")
    assert max(latencies) <= poll * 1.2 + 0.8, summary(latencies)
    assert procs.procs["a"].poll() is None


def test_immediate_server_restarts_under_load(
    pg_server: PgTestServer, fresh_db: Endpoints, procs: RunnerProcs
) -> None:
    cluster = pg_server.cluster
    if cluster is None:
        pytest.skip("the server is a container: no pg_ctl to crash it with")
    admin = fresh_db.admin
    n = 3000
    # Long enough to still be under way at the third crash (about 8 s of work here).
    enqueue(fresh_db, "work", n, prefix="c", context={"sleep": 0.03})
    admin_exec(admin, "CHECKPOINT")  # the test cluster commits asynchronously: keep the input
    a, b = procs.start("a"), procs.start("b")
    wait_until(lambda: counts(admin).get("done", 0) >= 100, 30, what="work under way")
    for i in range(3):
        if i:
            time.sleep(2.5)
        now = counts(admin)
        assert now.get("pending", 0) + now.get("running", 0) > 0, f"load ran out: {now}"
        began = time.monotonic()
        cluster.crash_restart()
        print(f"crash {i + 1} at {now}: back after {time.monotonic() - began:.1f}s")
    assert procs.procs[a].poll() is None, procs.logs()
    assert procs.procs[b].poll() is None, procs.logs()
    wait_until(lambda: counts(admin) == {"done": n}, 60, what=f"{n} done", every=0.5)
    assert_done_once(admin, n)
    wait_until(lambda: len(doorbells(admin)) == 2, 30, what="both doorbells to come back")
    reclaims = query(
        admin, "SELECT count(*) AS n FROM message_transitions WHERE reason = 'lease_expired'"
    )[0]["n"]
    print(f"all {n} done once; {reclaims} leases reclaimed after the crashes")
    for name in (a, b):
        procs.signal(name, signal.SIGTERM)
        assert procs.wait(name, timeout=20) == 0, procs.logs()


def test_sigkill_storm_every_stalled_lease_is_reclaimed(
    fresh_db: Endpoints, procs: RunnerProcs
) -> None:
    admin = fresh_db.admin
    n = 10_000
    # A message reclaimed after a kill goes back to the queue after a short backoff (retry base
    # 0.2 s here), where the next busiest runner (the next victim) is likely to take it: a few
    # are killed five times in a long storm. Running out of attempts is not what this test is
    # about, so allow plenty.
    enqueue(fresh_db, "work", n, prefix="s", context={"sleep": 0.04}, max_attempts=50)
    env = {"APPLIANCE_RUNNER__TENANT_LIMIT": "64"}  # one tenant may use all four runners
    alive = [procs.start(None, **env) for _ in range(4)]
    wait_until(lambda: counts(admin).get("running", 0) > 0, 30, what="work under way")
    kills: list[tuple[str, datetime, list[tuple[int, int]]]] = []
    began = time.monotonic()
    with psycopg.connect(admin, autocommit=True) as watch:
        while counts(admin).get("done", 0) < n:
            assert time.monotonic() - began < 120, (
                f"not done after 120 s: {counts(admin)}; dead: "
                + str(query(admin, "SELECT id, attempts, max_attempts, status_reason, error "
                                   "FROM agent_messages WHERE status = 'dead' LIMIT 5"))
            )  # fmt: skip
            time.sleep(2.0)
            victim = busiest(watch, procs, alive, within=1.0)
            alive.remove(victim)
            killed_at = watch.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
            procs.signal(victim, signal.SIGKILL)
            procs.wait(victim)
            alive.append(procs.start(None, **env))
            time.sleep(0.2)  # statements the victim had in flight finish on the server
            held = watch.execute(
                "SELECT id, lease_token FROM appliance.agent_messages"
                " WHERE status = 'running' AND claimed_by = %s",
                (procs.worker_id(victim),),
            ).fetchall()
            kills.append((victim, killed_at, [(int(i), int(t)) for i, t in held]))
    assert_done_once(admin, n)
    assert len(kills) >= 5, f"only {len(kills)} kills: the storm was too short"
    stalled = [(killed_at, mid, token) for _, killed_at, held in kills for mid, token in held]
    stranding = [victim for victim, _, held in kills if held]
    assert len(stranding) >= 3, f"only {len(stranding)} of {len(kills)} kills stranded leases"
    rows = query(
        admin,
        "SELECT s.id, s.token, s.killed_at,"
        " extract(epoch FROM min(t.at) - s.killed_at)::float8 AS after"
        " FROM unnest(%s::timestamptz[], %s::bigint[], %s::bigint[]) AS s(killed_at, id, token)"
        " LEFT JOIN message_transitions t ON t.message_id = s.id AND t.lease_token = s.token"
        "  AND (t.reason = 'lease_expired' OR t.to_status = 'done')"
        " GROUP BY s.id, s.token, s.killed_at",
        ([k for k, _, _ in stalled], [m for _, m, _ in stalled], [t for _, _, t in stalled]),
    )
    assert len(rows) == len(stalled)
    missing = [r for r in rows if r["after"] is None]
    assert not missing, missing[:5]
    after = [float(r["after"]) for r in rows]  # type: ignore[arg-type]
    print(f"{len(kills)} kills, {len(stalled)} stalled leases: reclaimed after {summary(after)}")
    assert max(after) <= LEASE + 5, summary(after)


def test_interactive_work_is_not_held_up_by_a_batch_backfill(
    fresh_db: Endpoints, procs: RunnerProcs
) -> None:
    admin = fresh_db.admin
    enqueue(fresh_db, "bulk", 10_000, prefix="b", context={"sleep": 0.05}, lane=Lane.BATCH)
    name = procs.start(
        "a", APPLIANCE_RUNNER__CONCURRENCY="4", APPLIANCE_RUNNER__RESERVED_INTERACTIVE="1"
    )
    wait_until(
        lambda: counts(admin).get("running", 0) >= 2 and counts(admin).get("done", 0) >= 20,
        30,
        what="the backfill under way",
    )
    enqueue(fresh_db, "work", 20, prefix="i", over=6.0)
    wait_until(
        lambda: query(
            admin,
            "SELECT 1 FROM agent_messages WHERE pipeline = 'work' AND status = 'done'"
            " HAVING count(*) = 20",
        ),
        10,
        what="20 interactive done",
    )
    procs.signal(name, signal.SIGTERM)
    assert procs.wait(name, timeout=20) == 0, procs.logs()
    latencies = pickup_latencies(admin, "work")
    assert len(latencies) == 20
    # Batch work kept being claimed while the interactive messages came and went...
    window = query(
        admin,
        "SELECT min(created_at) AS lo, max(claimed_at) AS hi FROM agent_messages"
        " WHERE pipeline = 'work'",
    )[0]
    batch_claims = query(
        admin,
        "SELECT count(*) AS n, count(DISTINCT t.at) AS rounds FROM message_transitions t"
        " JOIN agent_messages m ON m.id = t.message_id"
        " WHERE m.pipeline = 'bulk' AND t.to_status = 'running' AND t.at BETWEEN %s AND %s",
        (window["lo"], window["hi"]),
    )[0]
    # ...and between an interactive message's arrival and its claim, batch claims at most ran
    # the round that was already under way (strict lane order claims interactive first).
    raced = query(
        admin,
        "SELECT i.id, count(DISTINCT t.at) AS rounds FROM agent_messages i"
        " JOIN message_transitions ti ON ti.message_id = i.id AND ti.to_status = 'running'"
        " JOIN message_transitions t ON t.to_status = 'running'"
        "  AND t.at > i.created_at AND t.at < ti.at"
        " JOIN agent_messages b ON b.id = t.message_id AND b.pipeline = 'bulk'"
        " WHERE i.pipeline = 'work' GROUP BY i.id",
    )
    values = list(latencies.values())
    print(
        f"interactive pickup under backfill: {summary(values)}; batch claims in the window:"
        f" {batch_claims['n']} in {batch_claims['rounds']} rounds; batch rounds that beat an"
        f" interactive claim: {sorted(int(r['rounds']) for r in raced)}"  # type: ignore[call-overload]
    )
    assert int(batch_claims["n"]) >= 20, batch_claims  # type: ignore[call-overload]
    assert all(int(r["rounds"]) <= 2 for r in raced), raced  # type: ignore[call-overload]
    ordered = sorted(values)
    assert ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] < 0.5, summary(values)


def test_a_stop_while_the_database_does_not_answer_ends_in_bounded_time(
    fresh_db: Endpoints, procs: RunnerProcs
) -> None:
    # The runtime roles may not connect (as when the server is gone) and their connections are
    # cut. A stop used to wait out a pool timeout at every step (claim, release, acknowledge,
    # report): 70-100 s, past a service manager's patience.
    admin = fresh_db.admin
    enqueue(fresh_db, "slow", 2, prefix="s", context={"sleep": 60})
    name = procs.start()
    wait_until(lambda: counts(admin).get("running") == 2, 20, what="2 running")
    roles = ("appliance_app", "appliance_system")
    try:
        for role in roles:
            admin_exec(
                admin, sql.SQL("ALTER ROLE {} CONNECTION LIMIT 0").format(sql.Identifier(role))
            )
        admin_exec(
            admin,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE usename IN ('appliance_app', 'appliance_system')",
        )
        time.sleep(1.0)
        began = time.monotonic()
        procs.signal(name, signal.SIGTERM)
        assert procs.wait(name, timeout=60) == 0, procs.logs()
        took = time.monotonic() - began
    finally:
        for role in roles:
            admin_exec(
                admin, sql.SQL("ALTER ROLE {} CONNECTION LIMIT -1").format(sql.Identifier(role))
            )
    print(f"stopped in {took:.1f} s with the database unreachable")
    # Drain timeout 3 s, then at most 5 s for the loop's step, 10 s for the drain's database
    # steps, 5 s for side tasks and 5 s for the last writes.
    assert took < 3 + 5 + 10 + 5 + 5 + 3
