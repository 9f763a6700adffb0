"""Migrations: from empty equals sql/schema.sql, concurrent runs are safe, changed files refused."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

from appliance.db.cluster import find_bindir
from appliance.db.database import Endpoints
from appliance.db.migrate import discover, migrate, schema_problem
from appliance.db.queries import sql_dir
from appliance.db.schema_dump import dump_schema
from appliance.domain.errors import MigrationError
from tests.pgserver import PgTestServer

SCHEMA = sql_dir() / "schema.sql"


@pytest.fixture
def empty_db(pg_server: PgTestServer) -> Iterator[str]:
    name = pg_server.create_empty()
    try:
        yield pg_server.endpoints(name).admin
    finally:
        pg_server.drop(name)


def _applied(conninfo: str) -> list[tuple[int, str]]:
    with psycopg.connect(conninfo) as conn:
        rows = conn.execute(
            "SELECT version, checksum FROM appliance.schema_migrations ORDER BY version"
        ).fetchall()
    return [(r[0], r[1]) for r in rows]


def _migrated_copy(conninfo: str, tmp_path: Path) -> tuple[Path, list[tuple[int, str]]]:
    """A copy of sql/ to add migrations to, with the database migrated by it: (copy, applied)."""
    copy = tmp_path / "sql"
    shutil.copytree(sql_dir(), copy)
    migrate(conninfo, copy)
    return copy, _applied(conninfo)


def test_migrating_from_empty_equals_schema_snapshot(empty_db: str) -> None:
    report = migrate(empty_db)
    assert report.applied == [m.version for m in discover()]
    dumped = dump_schema(find_bindir() / "pg_dump", empty_db)
    if os.environ.get("APPLIANCE_UPDATE_SCHEMA") == "1":
        SCHEMA.write_text(dumped)
    assert dumped == SCHEMA.read_text(), (
        "sql/schema.sql is out of date: regenerate it with "
        "APPLIANCE_UPDATE_SCHEMA=1 pytest tests/db/test_migrations.py"
    )


def test_migrate_is_idempotent(empty_db: str) -> None:
    migrate(empty_db)
    again = migrate(empty_db)
    assert again.applied == []
    assert again.already == [m.version for m in discover()]


def test_two_concurrent_migrations_are_safe(empty_db: str) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run() -> None:
        try:
            barrier.wait()
            migrate(empty_db)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [v for v, _ in _applied(empty_db)] == [m.version for m in discover()]


def test_changed_applied_file_is_refused_and_nothing_changes(empty_db: str, tmp_path: Path) -> None:
    copy = tmp_path / "sql"
    shutil.copytree(sql_dir(), copy)
    migrations = sorted((copy / "migrations").glob("*.sql"))
    # Apply all but the last, then change an applied file and add nothing else.
    last = migrations[-1]
    held = last.read_text()
    last.unlink()
    migrate(empty_db, copy)
    before = _applied(empty_db)
    last.write_text(held)
    first = migrations[0]
    first.write_text(first.read_text() + "\n-- an edit after the fact\n")
    with pytest.raises(MigrationError, match="was changed after it was applied"):
        migrate(empty_db, copy)
    assert _applied(empty_db) == before  # the pending last migration was not applied either


def test_database_newer_than_code_is_refused(empty_db: str, tmp_path: Path) -> None:
    migrate(empty_db)
    copy = tmp_path / "sql"
    shutil.copytree(sql_dir(), copy)
    sorted((copy / "migrations").glob("*.sql"))[-1].unlink()
    with pytest.raises(MigrationError, match="newer than the code"):
        migrate(empty_db, copy)


def test_a_schema_other_than_the_codes_is_named_with_what_to_run(
    empty_db: str, tmp_path: Path
) -> None:
    """A command or a runner started against a database not migrated, or migrated by older or
    newer code, failed later on a relation or a function it did not find."""
    system = Endpoints.from_admin(empty_db).system
    latest = len(discover())
    assert schema_problem(system) == (
        f"the database has no appliance schema (this code needs migration {latest:04d}): run"
        " `appliance db migrate`"
    )
    migrate(empty_db)
    assert schema_problem(system) is None
    # Code that has one migration more than the database.
    newer = tmp_path / "newer"
    shutil.copytree(sql_dir(), newer)
    (newer / "migrations" / f"{latest + 1:04d}_later.sql").write_text("SELECT 1;\n")
    assert schema_problem(system, newer) == (
        f"the database's schema is at migration {latest:04d}, this code needs"
        f" {latest + 1:04d}: run `appliance db migrate`"
    )
    # Code that has one fewer.
    older = tmp_path / "older"
    shutil.copytree(sql_dir(), older)
    sorted((older / "migrations").glob("*.sql"))[-1].unlink()
    assert schema_problem(system, older) == (
        f"the database's schema is at migration {latest:04d}, newer than this code's"
        f" {latest - 1:04d}: run the appliance version that migrated it (or upgrade this one)"
    )


def test_a_schema_from_before_the_machinery_could_read_its_version(
    empty_db: str, tmp_path: Path
) -> None:
    copy = tmp_path / "sql"
    shutil.copytree(sql_dir(), copy)
    for path in sorted((copy / "migrations").glob("*.sql"))[41:]:
        path.unlink()  # up to 0041: before the grant of migration 0042
    migrate(empty_db, copy)
    problem = schema_problem(Endpoints.from_admin(empty_db).system)
    assert problem is not None and "older than this code's" in problem


def test_misnamed_or_gapped_files_are_errors(tmp_path: Path) -> None:
    (tmp_path / "migrations").mkdir()
    (tmp_path / "migrations" / "0001_a.sql").write_text("SELECT 1;")
    (tmp_path / "migrations" / "0003_c.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError, match="expected version 0002"):
        discover(tmp_path)
    (tmp_path / "migrations" / "0003_c.sql").rename(tmp_path / "migrations" / "2_c.sql")
    with pytest.raises(MigrationError, match="NNNN_lowercase_name"):
        discover(tmp_path)


def test_runtime_roles_own_nothing(empty_db: str) -> None:
    migrate(empty_db)
    with psycopg.connect(empty_db) as conn:
        owned = conn.execute(
            "SELECT c.relname, pg_get_userbyid(c.relowner) FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'appliance'"
            " AND pg_get_userbyid(c.relowner) <> 'appliance_owner'"
        ).fetchall()
        assert owned == []
        flags = conn.execute(
            "SELECT rolname, rolsuper, rolbypassrls, rolcreaterole, rolcreatedb FROM pg_roles"
            " WHERE rolname IN ('appliance_app', 'appliance_system') ORDER BY rolname"
        ).fetchall()
    # The machinery role bypasses row-level security (it serves every tenant, and under RLS
    # its claim could not use its index); it is still no superuser and owns nothing.
    assert flags == [
        ("appliance_app", False, False, False, False),
        ("appliance_system", False, True, False, False),
    ]


def test_a_migration_waiting_for_a_table_in_use_is_rolled_back_and_named(
    empty_db: str, tmp_path: Path
) -> None:
    # A migration that needs a table to itself while a long transaction reads it must fail fast
    # (its queued lock would otherwise stall every statement on the table behind it).
    copy, before = _migrated_copy(empty_db, tmp_path)
    extra = copy / "migrations" / f"{len(before) + 1:04d}_needs_the_table.sql"
    extra.write_text("ALTER TABLE agent_messages ADD COLUMN scratch integer;\n")
    with psycopg.connect(empty_db) as reader:
        reader.execute("SELECT count(*) FROM appliance.agent_messages")  # holds ACCESS SHARE
        with pytest.raises(MigrationError, match=r"needs_the_table\.sql waited more than"):
            migrate(empty_db, copy, lock_timeout=timedelta(milliseconds=200))
    assert _applied(empty_db) == before
    migrate(empty_db, copy)  # once the table is free, it applies
    assert len(_applied(empty_db)) == len(before) + 1


def test_a_failing_migration_is_rolled_back_whole_and_named(empty_db: str, tmp_path: Path) -> None:
    copy, before = _migrated_copy(empty_db, tmp_path)
    extra = copy / "migrations" / f"{len(before) + 1:04d}_half_done.sql"
    extra.write_text(
        "CREATE TABLE half_one (x integer);\n"
        "ALTER TABLE tenants ADD COLUMN scratch integer;\n"
        "SELEC oops;\n"
    )
    with pytest.raises(MigrationError) as caught:
        migrate(empty_db, copy)
    # The error names the file and PostgreSQL's reason, not a driver traceback.
    assert "half_done.sql failed and was rolled back" in str(caught.value)
    assert 'syntax error at or near "SELEC"' in str(caught.value)
    assert _applied(empty_db) == before
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT to_regclass('appliance.half_one')").fetchone() == (None,)
        columns = conn.execute(
            "SELECT count(*) FROM information_schema.columns"
            " WHERE table_schema = 'appliance' AND table_name = 'tenants'"
            " AND column_name = 'scratch'"
        ).fetchone()
        assert columns == (0,)


def test_a_migration_that_ends_its_own_transaction_is_refused_loudly(
    empty_db: str, tmp_path: Path
) -> None:
    """A COMMIT in a file committed what came before it, ran the rest in autocommit as the
    admin role outside the schema, and the file was recorded as applied."""
    copy, before = _migrated_copy(empty_db, tmp_path)
    extra = copy / "migrations" / f"{len(before) + 1:04d}_commits.sql"
    extra.write_text(
        "CREATE TABLE first_half (x integer);\nCOMMIT;\nCREATE TABLE rest (y integer);\n"
    )
    with pytest.raises(MigrationError, match=r"commits\.sql ended its own transaction \(a COMMIT"):
        migrate(empty_db, copy)
    assert _applied(empty_db) == before  # not recorded as applied


def test_a_byte_order_mark_is_not_sent_to_the_server(empty_db: str, tmp_path: Path) -> None:
    copy = tmp_path / "sql"
    shutil.copytree(sql_dir(), copy)
    extra = copy / "migrations" / f"{len(discover(copy)) + 1:04d}_from_an_editor.sql"
    extra.write_bytes("\ufeffCREATE TABLE edited (x integer);\n".encode())
    migrate(empty_db, copy)
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT to_regclass('appliance.edited')").fetchone() is not None


def test_the_schema_check_does_not_wait_behind_a_lock_on_the_version_table(
    empty_db: str,
) -> None:
    """Every migrate run took an exclusive lock on schema_migrations (an owner change to the
    same owner), and every command's first check waited behind it without a word."""
    migrate(empty_db)
    with psycopg.connect(empty_db) as reader:  # a backup reading the table, say
        reader.execute("SELECT count(*) FROM appliance.schema_migrations").fetchone()
        migrate(empty_db)  # nothing to apply: it no longer waits behind the reader
    with psycopg.connect(empty_db, autocommit=True) as locker:
        locker.execute("BEGIN")
        locker.execute("LOCK appliance.schema_migrations IN ACCESS EXCLUSIVE MODE")
        problem = schema_problem(empty_db, timeout_s=1)
        locker.execute("ROLLBACK")
    assert problem is not None and "could not be read within 1 s" in problem
    assert schema_problem(empty_db) is None


def test_a_numbered_file_that_is_not_a_migration_is_refused(tmp_path: Path) -> None:
    # Skipped, it would be a migration silently left out.
    (tmp_path / "migrations").mkdir()
    (tmp_path / "migrations" / "0001_a.sql").write_text("SELECT 1;")
    (tmp_path / "migrations" / "0002_b.SQL").write_text("SELECT 1;")
    with pytest.raises(MigrationError, match=r"0002_b\.SQL: migration files are named"):
        discover(tmp_path)
    (tmp_path / "migrations" / "0002_b.SQL").rename(tmp_path / "migrations" / "README.md")
    assert [m.name for m in discover(tmp_path)] == ["a"]


def test_a_migration_lock_held_too_long_is_named_not_waited_for_forever(empty_db: str) -> None:
    from appliance.db.migrate import MIGRATION_LOCK_KEY

    with psycopg.connect(empty_db, autocommit=True) as holder:
        holder.execute("SET application_name = 'stuck-migrator'")
        holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        with pytest.raises(MigrationError, match=r"held the migration lock .*stuck-migrator"):
            migrate(empty_db, lock_wait=timedelta(milliseconds=300))
    with psycopg.connect(empty_db) as conn:  # nothing was done, not even the bootstrap
        assert conn.execute("SELECT to_regnamespace('appliance')").fetchone() == (None,)
    migrate(empty_db)  # it applies once the lock is free
    assert _applied(empty_db) != []


def test_leases_ended_before_the_counter_shards_stay_counted(empty_db: str, tmp_path: Path) -> None:
    # Migration 0043 splits each tenant's one count of ended leases into 8 shards: a database
    # upgraded with leases running keeps their count (claimed - released) exactly.
    copy = tmp_path / "sql"
    shutil.copytree(sql_dir(), copy)
    for path in (copy / "migrations").glob("*.sql"):
        if int(path.name[:4]) >= 43:
            path.unlink()
    migrate(empty_db, copy)
    with psycopg.connect(empty_db) as conn:
        conn.execute("INSERT INTO appliance.tenants (name) VALUES ('acme'), ('globex')")
        conn.execute("UPDATE appliance.tenant_runtime SET claimed = 7 WHERE tenant = 'acme'")
        conn.execute("UPDATE appliance.tenant_released SET released = 5 WHERE tenant = 'acme'")
    migrate(empty_db)
    with psycopg.connect(empty_db) as conn:
        running = conn.execute(
            "SELECT tenant, running FROM appliance.tenant_running ORDER BY tenant"
        ).fetchall()
        shards = conn.execute(
            "SELECT tenant, count(*), sum(released) FROM appliance.tenant_released_shards"
            " GROUP BY tenant ORDER BY tenant"
        ).fetchall()
        conn.execute("INSERT INTO appliance.tenants (name) VALUES ('later')")
        added = conn.execute(
            "SELECT count(*) FROM appliance.tenant_released_shards WHERE tenant = 'later'"
        ).fetchone()
    assert running == [("acme", 2), ("globex", 0)]
    assert shards == [("acme", 8, 5), ("globex", 8, 0)]
    assert added == (8,)
