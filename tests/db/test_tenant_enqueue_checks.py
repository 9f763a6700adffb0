"""Times Python cannot read never enter the envelope, whoever enqueues, and the schema's
functions are closed to PUBLIC (migration 0040)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from appliance.bus.core import Bus
from appliance.db.database import Database, Endpoints
from appliance.db.message_store import enqueue_params
from appliance.domain.envelope import HOPS_MAX

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
ENQUEUE = (
    "SELECT * FROM enqueue_tenant_requests(%s::timestamptz, %s::interval, %s::jsonb, %s, 'acme')"
)
# Positions in enqueue_requests' row layout.
PIPELINE, STAGE, SOURCE, SOURCE_ID, KEY, DIRECTIVE, FROM_AGENT, TO_AGENT = range(1, 9)
LANE, PRIORITY, MAX_ATTEMPTS, NOT_BEFORE, DEADLINE, HOPS, CONTEXT = range(9, 16)


def _row(bus: Bus, source_id: str = "1") -> list[Any]:
    """One valid request of tenant acme, as the Python sends it."""
    request = bus.request(
        tenant="acme", pipeline="demo", stage="x", source="t", source_id=source_id,
        directive="d", now=T0,
    )  # fmt: skip
    rows = json.loads(enqueue_params([request], timedelta(days=1), T0)["requests"])
    assert isinstance(rows, list)
    row = rows[0]
    assert isinstance(row, list)
    return row


async def _written(db: Database) -> tuple[int, int]:
    """Messages and keys in the tables (as the machinery: every tenant's)."""
    async with db.system_conn() as conn:
        row = await (
            await conn.execute(
                "SELECT (SELECT count(*) FROM agent_messages) AS m,"
                " (SELECT count(*) FROM idempotency_keys) AS k"
            )
        ).fetchone()
    assert row is not None
    return int(row["m"]), int(row["k"])


async def _enqueue(
    db: Database,
    rows: Any,
    *,
    now: datetime | None = T0,
    retention: str = "1 day",
    default_max_attempts: int = 5,
) -> list[dict[str, Any]]:
    async with db.tenant_tx("acme") as conn:
        cur = await conn.execute(ENQUEUE, (now, retention, json.dumps(rows), default_max_attempts))
        return await cur.fetchall()


# Finite, but past what Python reads back (as the runner reads every claimed row), or infinite.
UNREADABLE: list[tuple[int, str, str]] = [
    (DEADLINE, "10000-01-01T00:00:00+00:00", "agent_messages_deadline_readable"),
    (DEADLINE, "9999-12-31T23:00:00-02:00", "agent_messages_deadline_readable"),
    (DEADLINE, "infinity", "agent_messages_deadline_readable"),
    (NOT_BEFORE, "-infinity", "agent_messages_not_before_readable"),
    (NOT_BEFORE, "0001-01-01T00:30:00+01:00", "agent_messages_not_before_readable"),
]


@pytest.mark.parametrize(
    ("position", "value", "constraint"), UNREADABLE, ids=[u[1] for u in UNREADABLE]
)
async def test_a_time_python_cannot_read_never_enters_the_envelope(
    bus: Bus, db: Database, position: int, value: str, constraint: str
) -> None:
    """One such row failed every claim of its lane, for every tenant, at every re-claim."""
    good = _row(bus, "0")
    bad = _row(bus, "1")
    bad[position] = value
    with pytest.raises(psycopg.errors.CheckViolation, match=constraint):
        await _enqueue(db, [good, bad])
    assert await _written(db) == (0, 0)
    # Nor through the machinery's own enqueue (hand-offs, schedules, spawned work).
    with pytest.raises(psycopg.errors.CheckViolation, match=constraint):
        async with db.system_conn() as conn:
            await conn.execute(
                "SELECT * FROM enqueue_requests(%s::timestamptz, '1 day', %s::jsonb)",
                (T0, json.dumps([bad])),
            )
    assert await _written(db) == (0, 0)


@pytest.mark.parametrize("clock", ["10000-01-01T00:00:00+00:00", "9950-06-01T00:00:00+00:00"])
async def test_a_tenant_clock_past_what_python_reads_is_refused(
    bus: Bus, db: Database, clock: str
) -> None:
    """The clock becomes the row's created_at and updated_at (and a lease or a backoff is
    added to it): held to the years 1-9899."""
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="out of range"):
        async with db.tenant_tx("acme") as conn:
            await conn.execute(ENQUEUE, (clock, "1 day", json.dumps([_row(bus)]), 5))
    assert await _written(db) == (0, 0)


async def test_what_the_python_sends_still_goes_through(bus: Bus, db: Database) -> None:
    """Every field at its limit, as EnqueueRequest.build lets it through."""
    request = bus.request(
        tenant="acme", pipeline="p" * 63, stage="s.t-a_g0", source="0", source_id="i" * 512,
        directive=" d\u3000" + "d" * 65533, context={"n": [1, 2.5, "x" * 1000]},
        lane="batch", priority=-1000, from_agent="a" * 200, to_agent="b",
        max_attempts=100, not_before=T0 + timedelta(microseconds=1),
        deadline=datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC), key="k" * 512,
        hops=HOPS_MAX, now=T0,
    )  # fmt: skip
    derived = bus.request(
        tenant="acme", pipeline="demo", stage="x", source="t", source_id="2", directive="d",
        priority=1000, max_attempts=1, now=T0,
    )  # fmt: skip
    results = await bus.enqueue_many([request, derived], now=T0)
    assert [r.new for r in results] == [True, True]
    # Times with any offset PostgreSQL reads, nulls for the defaults.
    row = _row(bus, "3")
    row[NOT_BEFORE] = "2026-11-01T13:00Z"
    row[DEADLINE] = "2026-11-01 14:30:00.5-0130"
    row[PRIORITY] = row[HOPS] = row[LANE] = None
    assert [r["new"] for r in await _enqueue(db, [row])] == [True]
    assert await _written(db) == (3, 3)
    # And read back into Python: the latest deadline it holds.
    got = await bus.get("acme", results[0].id)
    assert got is not None
    assert got.deadline == datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)


async def test_no_function_of_the_schema_is_open_to_public(db: Database) -> None:
    """PUBLIC could execute the functions that run as their caller (each would still meet
    the tables' grants and policies): only the runtime roles that call one may now."""
    async with db.system_conn() as conn:
        rows = await (
            await conn.execute(
                "SELECT p.oid::regprocedure::text AS f FROM pg_proc p"
                " WHERE p.pronamespace = 'appliance'::regnamespace"
                " AND has_function_privilege('public', p.oid, 'EXECUTE')"
            )
        ).fetchall()
    assert [r["f"] for r in rows] == []


# What each runtime role calls by name (named queries, row-level security's policies) or
# through the functions it calls as itself (spend_settle -> spend_alert_check).
CALLED = {
    "appliance_app": [
        "current_tenant()",
        "idempotency_key(text,text,text)",
        "clock(timestamp with time zone)",
        "enqueue_tenant_requests(timestamp with time zone,interval,jsonb,integer,text)",
        "cancel_message(bigint,text,text,timestamp with time zone)",
        "redrive_messages(bigint[],text,timestamp with time zone,boolean)",
    ],
    "appliance_system": [
        "current_tenant()",
        "clock(timestamp with time zone)",
        "claimable(timestamp with time zone,text,text,text[],timestamp with time zone)",
        "enqueue_requests(timestamp with time zone,interval,jsonb,integer,text)",
        "spend_month(timestamp with time zone)",
        "spend_alert_check(date,text,timestamp with time zone)",
        "spend_settle(bigint,numeric,double precision,text,text,text,timestamp with time zone)",
        "spend_platform_month(timestamp with time zone)",
        "run_budget_adjust(text,text,text,jsonb)",
    ],
}


async def test_the_runtime_roles_still_execute_what_they_call(db: Database) -> None:
    async with db.system_conn() as conn:
        for role, functions in CALLED.items():
            for f in functions:
                row = await (
                    await conn.execute(
                        "SELECT has_function_privilege(%s, %s::regprocedure, 'EXECUTE') AS ok",
                        (role, f),
                    )
                ).fetchone()
                assert row == {"ok": True}, (role, f)


async def test_the_spend_machinery_raises_alerts_as_the_system_role(db: Database) -> None:
    """spend_platform_month calls spend_alert_check as its caller, which PUBLIC's grant used to
    cover."""
    async with db.system_conn() as conn:
        await conn.execute("UPDATE spend_config SET amortisation_monthly = 1")
        row = await (
            await conn.execute("SELECT spend_platform_month(%s) AS charged", (T0,))
        ).fetchone()
    assert row is not None and row["charged"] == 1


def test_functions_the_owner_creates_start_closed(fresh_db: Endpoints) -> None:
    """A migration that forgets its REVOKE no longer opens a function to PUBLIC."""
    with psycopg.connect(fresh_db.admin, autocommit=True) as conn:
        with conn.transaction(force_rollback=True):
            conn.execute("SET LOCAL ROLE appliance_owner")
            conn.execute(
                "CREATE FUNCTION appliance.later_one() RETURNS int LANGUAGE sql AS 'SELECT 1'"
            )
            row = conn.execute(
                "SELECT has_function_privilege('public', 'appliance.later_one()', 'EXECUTE')"
            ).fetchone()
    assert row == (False,)
