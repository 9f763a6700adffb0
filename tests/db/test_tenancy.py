"""Row-level security: a tenant sees and touches only its own rows; no tenant means no rows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from appliance.bus.core import Bus
from appliance.db.database import RUNTIME_OPTIONS, Database, Endpoints
from appliance.db.message_store import enqueue_params
from appliance.db.queries import q
from appliance.db.runner_store import PgRunnerStore
from appliance.domain.envelope import Lane, MessageStatus
from appliance.domain.ports import Redrive
from tests.db.plans import PENDING_INDEX, read_by

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
TABLES = ("agent_messages", "idempotency_keys", "message_transitions")


async def _seed(bus: Bus) -> dict[str, list[int]]:
    ids: dict[str, list[int]] = {}
    for tenant in ("acme", "globex"):
        results = await bus.enqueue_many(
            [
                bus.request(
                    tenant=tenant,
                    pipeline="demo",
                    stage="intake",
                    source="t",
                    source_id=str(i),
                    directive="work",
                    lane=Lane.BATCH if i % 2 else Lane.INTERACTIVE,
                )
                for i in range(5)
            ],
            now=T0,
        )
        ids[tenant] = [r.id for r in results]
    # Give globex some history: one done, one dead.
    claimed = await bus.claim("w", tenant="globex", limit=2, now=T0)
    await bus.complete(claimed[0].lease, {"ok": True}, now=T0)
    await bus.store.fail(claimed[1].lease, error="x", retry_delay=timedelta(0), actor="w", now=T0)
    return ids


async def _dead(bus: Bus, tenant: str) -> int:
    """A message of `tenant` that failed its only attempt (dead: redrive's to move)."""
    (res,) = await bus.enqueue_many(
        [
            bus.request(
                tenant=tenant, pipeline="demo", stage="intake", source="t", source_id="dies",
                directive="work", max_attempts=1, priority=1000,
            )
        ],
        now=T0,
    )  # fmt: skip
    (claimed,) = await bus.claim("w", tenant=tenant, limit=1, now=T0)
    assert claimed.id == res.id
    await bus.store.fail(claimed.lease, error="x", retry_delay=timedelta(0), actor="w", now=T0)
    got = await bus.get(tenant, res.id)
    assert got is not None and got.status is MessageStatus.DEAD
    return res.id


async def _count(conn: Any, table: str) -> int:
    row = await (await conn.execute(f"SELECT count(*) AS n FROM {table}")).fetchone()
    assert row is not None
    return int(row["n"])


async def test_tenant_sees_and_touches_only_its_rows(bus: Bus, db: Database) -> None:
    ids = await _seed(bus)
    theirs = ids["globex"]
    # Every read path of the API, as acme, on globex's ids.
    for mid in theirs:
        assert await bus.get("acme", mid) is None
        assert await bus.store.transitions("acme", mid) == []  # type: ignore[attr-defined]
        assert not await bus.cancel("acme", mid)
    dead = await _dead(bus, "globex")
    assert await bus.redrive("acme", [*theirs, dead]) == Redrive([], [])
    assert await bus.redrive("acme") == Redrive([], [])
    still = await bus.get("globex", dead)
    assert still is not None and still.status is MessageStatus.DEAD
    # A tenant-scoped claim only ever leases the tenant's own work.
    got = await bus.claim("w", tenant="acme", limit=100, now=T0)
    assert {m.tenant for m in got} == {"acme"}
    assert len(got) == 5
    # Raw SQL as the app role: counts, updates and inserts across the boundary.
    async with db.tenant_tx("acme") as conn:
        assert await _count(conn, "agent_messages") == 5
        assert await _count(conn, "idempotency_keys") == 5
        assert await _count(conn, "message_transitions") == 10  # enqueued + claimed
    # Envelope rows are not the tenant role's to update at all, not even its own (migration
    # 0035): cancel and redrive are functions held to its tenant. With the grant, it could
    # finish its running work without a lease, or move it to another lane.
    for where in (theirs, ids["acme"]):
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="agent_messages"):
            async with db.tenant_tx("acme") as conn:
                await conn.execute(
                    "UPDATE agent_messages SET priority = 7 WHERE id = ANY(%s)", (where,)
                )
    # Writing a row for another tenant is refused, not silently dropped.
    request = bus.request(
        tenant="globex", pipeline="demo", stage="x", source="t", source_id="evil", directive="d"
    )
    params = {**enqueue_params([request], timedelta(days=1), None), "scope": "acme"}
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
        async with db.tenant_tx("acme") as conn:
            await conn.execute(q("message_enqueue_tenant"), params)
    # Nor straight into the tables (migration 0036): a message under a key another holds, a
    # key pointed elsewhere, would undo the enqueue's rules.
    for statement in (
        "INSERT INTO agent_messages (id, tenant, pipeline, stage, source, source_id,"
        " idempotency_key, directive, not_before, created_at, updated_at)"
        " VALUES (nextval('agent_messages_id_seq'), 'acme', 'p', 's', 'x', '1', 'k', 'd',"
        " now(), now(), now())",
        "UPDATE idempotency_keys SET expires_at = now() - interval '1 day'",
        "INSERT INTO idempotency_keys (tenant, key, message_id, created_at, expires_at)"
        " VALUES ('acme', 'k', 1, now(), now())",
        "SELECT * FROM enqueue_requests(NULL, interval '1 day', '[]'::jsonb, 5, 'acme')",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
            async with db.tenant_tx("acme") as conn:
                await conn.execute(statement)
    # globex's rows are untouched.
    async with db.system_conn() as conn:
        row = await (
            await conn.execute(
                "SELECT count(*) FILTER (WHERE priority = 7) AS p, count(*) AS n"
                " FROM agent_messages WHERE tenant = 'globex'"
            )
        ).fetchone()
    assert row is not None and row["p"] == 0 and row["n"] == 6  # 5 seeded + the dead one


async def test_no_tenant_set_sees_nothing_and_writes_nothing(bus: Bus, db: Database) -> None:
    ids = await _seed(bus)
    dead = await _dead(bus, "acme")
    async with db.app_pool.connection() as conn:
        for table in TABLES:
            assert await _count(conn, table) == 0
        # The tenant's writes, with no tenant set: nothing changes.
        for mid in ids["acme"]:
            cur = await conn.execute("SELECT * FROM cancel_message(%s, 'x', 'x', NULL)", (mid,))
            assert await cur.fetchall() == []
        cur = await conn.execute("SELECT * FROM redrive_messages(NULL, 'x', NULL, true)")
        assert await cur.fetchall() == []
        cur = await conn.execute(
            "SELECT * FROM redrive_messages(ARRAY[%s]::bigint[], 'x', NULL, true)", (dead,)
        )
        assert await cur.fetchall() == []
        # Nor can it enqueue, naming no tenant for its enqueue or another one than its own.
        request = bus.request(
            tenant="acme", pipeline="demo", stage="x", source="t", source_id="no-tenant",
            directive="d",
        )  # fmt: skip
        params = enqueue_params([request], timedelta(days=1), None)
        for scope in (None, "", "globex"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
                async with conn.transaction():
                    await conn.execute(q("message_enqueue_tenant"), {**params, "scope": scope})
        # Empty (a reset SET LOCAL leaves '') is the same as unset: fail closed.
        async with conn.transaction():
            await conn.execute("SELECT set_config('appliance.tenant', '', true)")
            assert await _count(conn, "agent_messages") == 0
    got = await bus.get("acme", dead)
    assert got is not None and got.status is MessageStatus.DEAD


async def test_tenant_setting_does_not_leak_to_the_next_pool_user(bus: Bus, db: Database) -> None:
    await _seed(bus)
    async with db.tenant_tx("acme") as conn:
        assert await _count(conn, "agent_messages") == 5
    # The same pool (one connection may serve both), no tenant set this time.
    for _ in range(3):
        async with db.app_pool.connection() as conn:
            assert await _count(conn, "agent_messages") == 0


async def test_runtime_roles_cannot_forge_the_log(bus: Bus, db: Database) -> None:
    await _seed(bus)
    for make in (lambda: db.tenant_tx("acme"), db.system_tx):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            async with make() as conn:
                await conn.execute(
                    "INSERT INTO message_transitions"
                    " (tenant, message_id, to_status, reason, actor, attempt, at)"
                    " VALUES ('acme', 1, 'done', 'forged', 'x', 0, now())"
                )
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            async with make() as conn:
                await conn.execute("DELETE FROM agent_messages")


async def test_messages_always_belong_to_a_known_tenant(
    bus: Bus, db: Database, fresh_db: Endpoints
) -> None:
    # The envelope's referential check, both sides (migration 0007): an insert naming an
    # unknown tenant fails whoever sends it, and a tenant with messages cannot go or be renamed.
    await _seed(bus)
    async with db.system_conn() as conn:
        with pytest.raises(psycopg.errors.ForeignKeyViolation, match="unknown tenant nobody"):
            await conn.execute(
                "INSERT INTO agent_messages (id, tenant, pipeline, stage, source, source_id,"
                " idempotency_key, directive, not_before, created_at, updated_at)"
                " VALUES (nextval('agent_messages_id_seq'), 'nobody', 'p', 's', 'x', '1', 'k',"
                " 'd', now(), now(), now())"
            )
        # Rows of several tenants are checked one by one (one tenant's by key: migration 0045).
        with pytest.raises(psycopg.errors.ForeignKeyViolation, match="unknown tenant nobody"):
            await conn.execute(
                "INSERT INTO agent_messages (id, tenant, pipeline, stage, source, source_id,"
                " idempotency_key, directive, not_before, created_at, updated_at)"
                " SELECT nextval('agent_messages_id_seq'), t, 'p', 's', 'x', t, 'k' || t,"
                " 'd', now(), now(), now() FROM unnest(ARRAY['acme', 'nobody', 'globex']) AS t"
            )
        row = await (
            await conn.execute("SELECT count(*) AS n FROM agent_messages WHERE source = 'x'")
        ).fetchone()
        assert row is not None and row["n"] == 0
    with psycopg.connect(fresh_db.admin, autocommit=True) as admin:
        admin.execute("SET search_path = appliance, pg_catalog")
        for statement in (
            "DELETE FROM tenants WHERE name = 'acme'",
            "UPDATE tenants SET name = 'acme2' WHERE name = 'acme'",
        ):
            with pytest.raises(psycopg.errors.ForeignKeyViolation, match="still has messages"):
                admin.execute(statement)
        admin.execute("INSERT INTO tenants (name) VALUES ('idle')")
        admin.execute("DELETE FROM tenants WHERE name = 'idle'")  # no messages: allowed
        names = [r[0] for r in admin.execute("SELECT name FROM tenants ORDER BY name")]
    assert names == ["acme", "globex"]


async def test_no_role_can_insert_work_past_the_envelope_rules(
    bus: Bus, db: Database, fresh_db: Endpoints
) -> None:
    """A message enters pending, unattempted and unleased, with an id the sequence gave out:
    a row inserted running would end up lifting its tenant's concurrency limit, and an id ahead
    of the sequence would fail the enqueue (of any tenant) that later draws it."""
    await _seed(bus)
    columns = (
        "INSERT INTO agent_messages (id, tenant, pipeline, stage, source, source_id,"
        " idempotency_key, directive, not_before, created_at, updated_at, status,"
        " lease_token, lease_expires_at, attempts) VALUES ({id}, 'acme', 'p', 's', 'x', %s,"
        " 'k' || %s, 'd', now(), now(), now(), %s, %s, %s, %s)"
    )
    nxt = "nextval('agent_messages_id_seq')"

    async def insert(id_: str, *values: object, draw: bool = True) -> None:
        # As the machinery: the only runtime role that may insert (migration 0036).
        async with db.system_tx() as conn:
            if draw:
                await conn.execute(f"SELECT {nxt}")  # currval needs a value drawn
            await conn.execute(columns.format(id=id_), values)

    for sid, id_, status, token, expires, attempts in (
        ("run", nxt, "running", 1, "2030-01-01T00:00:00Z", 1),
        ("tried", nxt, "pending", None, None, 2),
        ("ahead", "currval('agent_messages_id_seq') + 5", "pending", None, None, 0),
    ):
        with pytest.raises(psycopg.errors.CheckViolation, match="must enter the envelope pending"):
            await insert(id_, sid, sid, status, token, expires, attempts)
    # A restarted sequence (is_called false): its last_value is the next id, not yet given out.
    with psycopg.connect(fresh_db.admin, autocommit=True) as admin:
        restarted = admin.execute(
            "SELECT setval('appliance.agent_messages_id_seq',"
            " (SELECT last_value + 100 FROM appliance.agent_messages_id_seq), false)"
        ).fetchone()
    assert restarted is not None
    with pytest.raises(psycopg.errors.CheckViolation, match="must enter the envelope pending"):
        await insert(str(restarted[0]), "next", "next", "pending", None, None, 0, draw=False)
    async with db.tenant_tx("acme") as conn:
        row = await (
            await conn.execute("SELECT count(*) AS n FROM agent_messages WHERE source = 'x'")
        ).fetchone()
    assert row == {"n": 0}
    # The rules hold for what enqueue writes: the next enqueues all succeed.
    more = await bus.enqueue_many(
        [bus.request(tenant="globex", pipeline="demo", stage="intake", source="t2",
                     source_id=str(i), directive="w") for i in range(5)]
    )  # fmt: skip
    assert all(r.new for r in more)


async def test_a_message_id_or_tenant_never_changes(bus: Bus, db: Database) -> None:
    """An UPDATE changing the id paired no old row in the update trigger, so a forbidden status
    change (cancelled -> done) went through unchecked and unlogged."""
    ids = await _seed(bus)
    assert await bus.cancel("acme", ids["acme"][0])
    for change in (
        "id = nextval('agent_messages_id_seq'), status = 'done'",
        "tenant = 'globex'",
    ):
        with pytest.raises(psycopg.errors.CheckViolation, match="id and tenant cannot change"):
            async with db.system_conn() as conn:
                await conn.execute(
                    f"UPDATE agent_messages SET {change} WHERE id = %s", (ids["acme"][0],)
                )
    got = await bus.get("acme", ids["acme"][0])
    assert got is not None and got.status is MessageStatus.CANCELLED


async def test_model_calls_are_shown_only_to_their_tenant(bus: Bus, db: Database) -> None:
    ids = await _seed(bus)
    store = PgRunnerStore(db)
    theirs = ids["globex"][0]
    async with db.system_conn() as conn:
        await conn.execute(
            "INSERT INTO inference_calls (tenant, message_id, pipeline, stage, kind, tier,"
            " min_tier, route_reason, model, model_sha256, status, at) VALUES ('globex', %s,"
            " 'demo', 'intake', 'classify', 'mechanical', 'mechanical', 'pinned', 'private.gguf',"
            " 'ab', 'ok', now())",
            (theirs,),
        )
    assert [c["model"] for c in await store.calls_of("globex", theirs)] == ["private.gguf"]
    assert await store.calls_of("acme", theirs) == []


async def test_a_tenant_with_history_cannot_be_removed_or_renamed(
    bus: Bus, db: Database, fresh_db: Endpoints
) -> None:
    """Its archive and keys would pass to the next tenant registered under its name: that one
    would read the old messages, and a duplicate would be answered with one of them."""
    ids = await _seed(bus)
    later = T0 + timedelta(days=30)
    async with db.system_conn() as conn:
        for mid in ids["acme"]:
            await conn.execute(
                "UPDATE agent_messages SET status = 'cancelled', finished_at = %s WHERE id = %s",
                (T0, mid),
            )
    await PgRunnerStore(db).archive(retention=timedelta(days=7), now=later)
    async with db.system_conn() as conn:
        row = await (
            await conn.execute("SELECT count(*) AS n FROM agent_messages WHERE tenant = 'acme'")
        ).fetchone()
    assert row == {"n": 0}  # nothing hot left: only history
    with psycopg.connect(fresh_db.admin, autocommit=True) as admin:
        admin.execute("SET search_path = appliance, pg_catalog")
        for statement in (
            "DELETE FROM tenants WHERE name = 'acme'",
            "UPDATE tenants SET name = 'acme2' WHERE name = 'acme'",
        ):
            with pytest.raises(psycopg.errors.ForeignKeyViolation, match="still has history"):
                admin.execute(statement)


async def test_a_tenant_claim_reads_none_of_another_tenants_backlog(
    bus: Bus, db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim for one tenant seeks that tenant's work in the pending index: another tenant's
    backlog, however long, is not read (it was, by the count of work left behind)."""
    for tenant, n in (("acme", 3), ("globex", 3000)):
        await bus.enqueue_many(
            [
                bus.request(tenant=tenant, pipeline="demo", stage="intake", source="t",
                            source_id=str(i), directive="work")
                for i in range(n)
            ],
            now=T0,
        )  # fmt: skip
    got, read = await read_by(
        db,
        lambda: bus.claim("w", tenant="acme", limit=10, now=T0),
        stat="tuples_returned", relation=PENDING_INDEX, monkeypatch=monkeypatch,
    )  # fmt: skip
    assert sorted(m.source_id for m in got) == ["0", "1", "2"]
    assert read <= 20, read


async def _shadow_the_log(conn: Any) -> None:
    """Temporary tables named like the log and the life cycle: every move allowed, and a log
    that would swallow a forged one."""
    await conn.execute(
        "CREATE TEMPORARY TABLE message_transitions (LIKE appliance.message_transitions)"
    )
    await conn.execute("ALTER TABLE message_transitions ALTER id DROP NOT NULL")
    await conn.execute(
        "CREATE TEMPORARY TABLE message_status_transitions AS"
        " SELECT a AS from_status, b AS to_status"
        " FROM unnest(enum_range(NULL::message_status)) a,"
        " unnest(enum_range(NULL::message_status)) b"
    )
    await conn.execute(
        "GRANT ALL ON message_transitions, message_status_transitions TO appliance_owner"
    )


async def test_temporary_tables_cannot_stand_in_for_the_appliances_own(
    bus: Bus, db: Database
) -> None:
    """A temporary table named like one the log trigger reads or writes is not used by it: the
    life cycle's rules and the real transition log still apply (migration 0022)."""
    ids = await _seed(bus)
    mine = ids["acme"][0]
    # A connection of its own: the temporary tables must not outlive the test in a pooled one.
    async with await psycopg.AsyncConnection.connect(
        db.endpoints.app, options=RUNTIME_OPTIONS, autocommit=True, row_factory=dict_row
    ) as conn:
        await _shadow_the_log(conn)
        # Session-wide: this connection is the test's own.
        await conn.execute("SELECT set_config('appliance.tenant', 'acme', false)")
        # The tenant's cancel runs as the owner (migration 0035), and so does the trigger it
        # fires: neither may read the shadows.
        await conn.execute(
            "SELECT * FROM appliance.cancel_message(%s, 'by hand', 'x', NULL)", (mine,)
        )
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await conn.execute(
                "UPDATE appliance.agent_messages SET status = 'done',"
                " status_reason = 'forged' WHERE id = %s",
                (mine,),
            )
        shadow = await (
            await conn.execute("SELECT count(*) AS n FROM pg_temp.message_transitions")
        ).fetchone()
        assert shadow is not None and shadow["n"] == 0
    # The machinery's role may update envelope rows: with the same shadows, the trigger still
    # checks its move against the real life cycle.
    async with await psycopg.AsyncConnection.connect(
        db.endpoints.system, options=RUNTIME_OPTIONS, autocommit=True, row_factory=dict_row
    ) as conn:
        await _shadow_the_log(conn)
        with pytest.raises(psycopg.errors.CheckViolation, match="cancelled -> done"):
            await conn.execute(
                "UPDATE appliance.agent_messages SET status = 'done',"
                " status_reason = 'forged' WHERE id = %s",
                (mine,),
            )
    log = await bus.store.transitions("acme", mine)  # type: ignore[attr-defined]
    assert [(t["from_status"], t["to_status"]) for t in log] == [
        (None, "pending"),
        ("pending", "cancelled"),
    ]


async def test_every_fixed_search_path_searches_temporary_tables_last(db: Database) -> None:
    # Guards functions that later migrations define: one that fixes its search_path without
    # pg_temp last would search the caller's temporary tables first.
    async with db.system_conn() as conn:
        rows = await (
            await conn.execute(
                "SELECT p.oid::regprocedure::text AS f, p.prosecdef,"
                " (SELECT c FROM unnest(p.proconfig) c WHERE c LIKE 'search\\_path=%%') AS path"
                " FROM pg_proc p WHERE p.pronamespace = 'appliance'::regnamespace"
            )
        ).fetchall()
    assert rows
    wrong = [
        (r["f"], r["path"])
        for r in rows
        if (r["prosecdef"] and r["path"] is None)
        or (r["path"] is not None and not r["path"].endswith("pg_temp"))
    ]
    assert wrong == []


async def test_no_function_that_runs_as_its_owner_is_open_to_everyone(db: Database) -> None:
    # Guards functions that later migrations define: PostgreSQL lets PUBLIC execute a new
    # function unless its migration revokes that, and one running as the owner passes every
    # row-level security policy. Trigger functions run only as triggers.
    async with db.system_conn() as conn:
        rows = await (
            await conn.execute(
                "SELECT p.oid::regprocedure::text AS f FROM pg_proc p"
                " WHERE p.pronamespace = 'appliance'::regnamespace AND p.prosecdef"
                " AND p.prorettype <> 'trigger'::regtype"
                " AND EXISTS (SELECT FROM aclexplode(coalesce(p.proacl,"
                "             acldefault('f', p.proowner))) a"
                "             WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')"
            )
        ).fetchall()
    assert [r["f"] for r in rows] == []


async def test_a_tenant_reads_no_other_tenants_counters_caps_or_name(
    bus: Bus, db: Database
) -> None:
    await _seed(bus)
    for table in (
        "tenant_runtime",
        "tenant_released",
        "tenant_released_shards",
        "tenant_running",
        "spend_caps",
        "spend_months",
        "spend_alerts",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            async with db.tenant_tx("acme") as conn:
                await conn.execute(f"SELECT * FROM {table}")
    async with db.tenant_tx("acme") as conn:
        names = await (await conn.execute("SELECT name FROM tenants")).fetchall()
        assert [r["name"] for r in names] == ["acme"]
    async with db.app_pool.connection() as conn:
        assert await _count(conn, "tenants") == 0
    # The machinery still sees them all.
    async with db.system_conn() as conn:
        assert await _count(conn, "tenants") == 2
        assert await _count(conn, "tenant_runtime") == 2


async def test_a_display_name_is_bounded_and_named_when_wrong(db: Database) -> None:
    from appliance.db.tenant_store import PgTenantStore
    from appliance.domain.errors import InvalidInput

    tenants = PgTenantStore(db)
    for bad, why in (
        ("", "must be 1-200 characters"),
        ("x" * 201, "must be 1-200 characters"),
        ("a\x00b", "contains a NUL character"),
        ("a\udcffb", "contains a lone surrogate"),
    ):
        with pytest.raises(InvalidInput, match=f"display_name: {why}"):
            await tenants.add("initech", display_name=bad)
    assert not await tenants.exists("initech")
    assert await tenants.add("initech", display_name="Initech, Inc.")


async def test_the_tenant_enqueue_is_held_to_its_transactions_tenant(
    bus: Bus, db: Database
) -> None:
    """Its function runs as the owner (migration 0036): it checks what row-level security
    checked, and what the owner's rights would otherwise let through."""
    theirs = bus.request(
        tenant="globex", pipeline="demo", stage="x", source="t", source_id="1", directive="d"
    )
    mine = bus.request(
        tenant="acme", pipeline="demo", stage="x", source="t", source_id="1", directive="d"
    )
    scoped = {**enqueue_params([theirs], timedelta(days=1), None), "scope": "globex"}
    # Scoped to another tenant than the transaction's: refused (it would move the transaction).
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="transaction of tenant acme"):
        async with db.tenant_tx("acme") as conn:
            await conn.execute(q("message_enqueue_tenant"), scoped)
    # Keys born expired would be taken over by the next enqueue of the same key.
    for retention in (timedelta(0), timedelta(days=-1)):
        unkept = {**enqueue_params([mine], retention, None), "scope": "acme"}
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="retention"):
            async with db.tenant_tx("acme") as conn:
                await conn.execute(q("message_enqueue_tenant"), unkept)
    # Ids and lease tokens are not the tenant role's to draw.
    for sequence in ("agent_messages_id_seq", "agent_messages_lease_token_seq"):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            async with db.tenant_tx("acme") as conn:
                await conn.execute("SELECT nextval(%s)", (sequence,))
    async with db.system_conn() as conn:
        row = await (await conn.execute("SELECT count(*) AS n FROM agent_messages")).fetchone()
    assert row == {"n": 0}


async def test_the_tenant_functions_take_no_infinite_clock(bus: Bus, db: Database) -> None:
    """Written as given, an infinite time stopped the machinery of every tenant (migration
    0037): a message cancelled at -infinity failed every archive round, one enqueued then every
    status report."""
    mid = (
        await bus.enqueue(
            tenant="acme", pipeline="demo", stage="x", source="t", source_id="1", directive="d"
        )
    ).id
    dead = await _dead(bus, "acme")
    req = bus.request(
        tenant="acme", pipeline="demo", stage="x", source="t", source_id="2", directive="d"
    )
    for clock in ("-infinity", "infinity"):
        calls = [
            ("SELECT * FROM cancel_message(%s, 'r', 'a', %s::timestamptz)", (mid, clock)),
            ("SELECT * FROM redrive_messages(ARRAY[%s]::bigint[], 'a', %s::timestamptz, false)",
             (dead, clock)),
            ("SELECT * FROM enqueue_tenant_requests(%s::timestamptz, '1 day', %s::jsonb, 5,"
             " 'acme')", (clock, enqueue_params([req], timedelta(days=1), None)["requests"])),
        ]  # fmt: skip
        for statement, args in calls:
            with pytest.raises(psycopg.errors.InvalidParameterValue, match="not a finite time"):
                async with db.tenant_tx("acme") as conn:
                    await conn.execute(statement, args)
    got = await bus.get("acme", mid)
    assert got is not None and got.status is MessageStatus.PENDING
    redriven = await bus.get("acme", dead)
    assert redriven is not None and redriven.status is MessageStatus.DEAD


async def test_only_the_machinery_takes_advisory_locks(db: Database) -> None:
    """Holding the machinery's lock keys, the tenant role stalled every enqueue and switched
    the archive, key purge and history prune off (bootstrap.sql)."""
    for take in (
        "SELECT pg_advisory_lock(hashtext('appliance'), hashtext('stage_tiers'))",
        "SELECT pg_advisory_lock_shared(1)",
        "SELECT pg_try_advisory_lock(hashtext('appliance.archive'))",
        "SELECT pg_advisory_xact_lock(1)",
        "SELECT pg_try_advisory_xact_lock_shared(1, 2)",
    ):
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            async with db.tenant_tx("acme") as conn:
                await conn.execute(take)
    async with db.system_conn() as conn:
        row = await (await conn.execute("SELECT pg_try_advisory_xact_lock(1) AS got")).fetchone()
    assert row == {"got": True}
