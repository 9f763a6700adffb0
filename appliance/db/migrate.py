"""Forward-only migrations: numbered files applied in order under an advisory lock, checksummed."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

from appliance.db.queries import sql_dir
from appliance.domain.errors import MigrationError

log = logging.getLogger("appliance.db.migrate")

_FILE = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9_]+)\.sql$")
# One key for every migrator of every box: two concurrent `migrate` runs serialise on it.
MIGRATION_LOCK_KEY = 0x6170706C_6D696772  # "applmigr"
# How long a migration waits for a lock on a table in use (a DROP INDEX or ALTER TABLE needs the
# table to itself). Waiting longer would hold every runner's statements on that table behind
# the migration's queued lock: the bus would stall instead of the migration failing.
LOCK_TIMEOUT = timedelta(seconds=10)
# How long a migrate run waits for another one to finish before it names the holder.
LOCK_WAIT = timedelta(minutes=5)


@dataclass(frozen=True)
class Migration:
    """One numbered file: version, name, text and the sha256 that pins it once applied."""

    version: int
    name: str
    path: Path
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def discover(directory: Path | None = None) -> list[Migration]:
    """The migration files in version order; gaps, duplicates and stray names are errors."""
    folder = (directory or sql_dir()) / "migrations"
    found: list[Migration] = []
    for path in sorted(folder.iterdir()):
        if path.suffix != ".sql":
            if path.name[:1].isdigit():
                # Numbered like a migration but not one (0022_x.SQL, 0022_x.sql.bak): refused
                # rather than skipped, so that a migration is never silently left out.
                raise MigrationError(
                    f"{path.name}: migration files are named NNNN_lowercase_name.sql"
                )
            continue
        match = _FILE.match(path.name)
        if not match:
            raise MigrationError(f"{path.name}: migration files are named NNNN_lowercase_name.sql")
        # utf-8-sig: a byte order mark an editor wrote is dropped (psql ignores one; sent to
        # the server it is a syntax error), and the locale plays no part.
        text = path.read_text(encoding="utf-8-sig")
        found.append(Migration(int(match["version"]), match["name"], path, text))
    for expected, migration in enumerate(found, start=1):
        if migration.version != expected:
            raise MigrationError(
                f"{migration.path.name}: expected version {expected:04d} (versions are 1, 2, ... "
                "without gaps or repeats)"
            )
    return found


def schema_problem(conninfo: str, directory: Path | None = None, timeout_s: int = 5) -> str | None:
    """What is wrong between the database's schema and this code's migrations, read as the
    role of `conninfo` (the machinery's), or None when they match: a database not migrated,
    or migrated by older or newer code. Its own connection, as a command's first check."""
    latest = len(discover(directory))  # versions run 1..n without gaps (discover checks)
    migrate_hint = "run `appliance db migrate`"
    try:
        # Timeouts: a lock held on schema_migrations (a migration under way, a backup) kept
        # every command and runner start waiting on this first check, without a word.
        waits = f"-c statement_timeout={timeout_s}s -c lock_timeout={timeout_s}s"
        with psycopg.connect(
            conninfo, connect_timeout=timeout_s, autocommit=True, options=waits
        ) as conn:
            row = conn.execute("SELECT max(version) FROM appliance.schema_migrations").fetchone()
    except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
        return (
            f"the database has no appliance schema (this code needs migration {latest:04d}): "
            + migrate_hint
        )
    except psycopg.errors.InsufficientPrivilege:
        # The grant this reads by came with migration 0042: a database older than that.
        return f"the database's schema is older than this code's ({latest:04d}): " + migrate_hint
    except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled):
        return (
            f"the schema version could not be read within {timeout_s} s: another session holds"
            " appliance.schema_migrations locked (a migration under way?); try again"
        )
    at = int(row[0]) if row is not None and row[0] is not None else 0
    if at < latest:
        return (
            f"the database's schema is at migration {at:04d}, this code needs {latest:04d}: "
            + migrate_hint
        )
    if at > latest:
        return (
            f"the database's schema is at migration {at:04d}, newer than this code's"
            f" {latest:04d}: run the appliance version that migrated it (or upgrade this one)"
        )
    return None


@dataclass(frozen=True)
class MigrateReport:
    """What a migrate run found and did."""

    applied: list[int]
    already: list[int]


def _take_lock(conn: psycopg.Connection[dict[str, object]], wait: timedelta) -> None:
    """The migration lock, waited for up to `wait`: another migrate run finishes in seconds,
    so one that holds it longer is stuck (or a session left it taken), and is named."""
    deadline = time.monotonic() + wait.total_seconds()
    while True:
        row = conn.execute(
            "SELECT pg_try_advisory_lock(%s) AS taken", (MIGRATION_LOCK_KEY,)
        ).fetchone()
        if row and row["taken"]:
            return
        if time.monotonic() >= deadline:
            holder = conn.execute(
                "SELECT a.pid, a.application_name, a.state, now() - a.backend_start AS age"
                " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
                # Advisory locks are per database: the same key in another database is not it.
                " AND l.database = (SELECT oid FROM pg_database"
                " WHERE datname = current_database())"
                " AND (l.classid::bigint << 32) | l.objid::bigint = %s",
                (MIGRATION_LOCK_KEY,),
            ).fetchone()
            who = (
                f"server process {holder['pid']} ({holder['application_name'] or 'no name'},"
                f" {holder['state']}, connected {holder['age']})"
                if holder
                else "another session"
            )
            raise MigrationError(
                f"another migration has held the migration lock for over {wait} ({who}):"
                " wait for it to finish, or end that session"
            )
        time.sleep(0.2)


def _lock_timeout(conn: psycopg.Connection[dict[str, object]], wait: timedelta) -> None:
    """The longest this transaction waits for a lock (SET LOCAL: until it ends)."""
    conn.execute(
        "SELECT set_config('lock_timeout', %s, true)", (f"{int(wait.total_seconds() * 1000)}ms",)
    )


def _still_one_transaction(conn: psycopg.Connection[dict[str, object]], m: Migration) -> None:
    """A COMMIT or ROLLBACK in a file ends the transaction it runs in: what came before is
    committed (or undone), and the rest ran in autocommit as the admin role, outside the
    schema, without the lock timeout; recording it as applied would hide all that."""
    row = conn.execute("SELECT current_user AS who").fetchone()
    if conn.info.transaction_status != TransactionStatus.INTRANS or (
        row is None or row["who"] != "appliance_owner"
    ):
        raise MigrationError(
            f"migration {m.path.name} ended its own transaction (a COMMIT, ROLLBACK or END in"
            " the file): what it ran before that may be committed and the rest ran outside it;"
            " it is not recorded as applied. Check the schema by hand, and write migrations"
            " without transaction control (each file runs in one transaction)"
        )


def migrate(
    admin_conninfo: str,
    directory: Path | None = None,
    *,
    lock_timeout: timedelta = LOCK_TIMEOUT,
    lock_wait: timedelta = LOCK_WAIT,
) -> MigrateReport:
    """Apply pending migrations.

    Idempotent; safe when several run at once; refuses (changing nothing) when an applied file's
    checksum changed or the database is ahead of the code. A migration that waits longer than
    `lock_timeout` for a table in use is rolled back and reported (the ones before it stay).
    """
    base = directory or sql_dir()
    migrations = discover(base)
    bootstrap = (base / "bootstrap.sql").read_text(encoding="utf-8-sig")
    with psycopg.connect(admin_conninfo, autocommit=True, row_factory=dict_row) as conn:
        _take_lock(conn, lock_wait)
        try:
            with conn.transaction():
                # A table another session holds (a backup's read of schema_migrations) must
                # not keep this waiting for ever: named, like a migration's own waits.
                _lock_timeout(conn, lock_timeout)
                conn.execute(bootstrap)
            rows = conn.execute(
                "SELECT version, name, checksum FROM appliance.schema_migrations ORDER BY version"
            ).fetchall()
            applied = {r["version"]: r for r in rows}
            by_version = {m.version: m for m in migrations}
            # Verify everything before changing anything.
            for version, row in applied.items():
                migration = by_version.get(version)
                if migration is None:
                    raise MigrationError(
                        f"the database has migration {version:04d} ({row['name']}) that this code "
                        "does not know: it is newer than the code; upgrade the appliance"
                    )
                if migration.checksum != row["checksum"]:
                    raise MigrationError(
                        f"migration {migration.path.name} was changed after it was applied "
                        f"(applied checksum {row['checksum']}, file now {migration.checksum}); "
                        "migrations are forward-only: restore the file and add a new migration"
                    )
            done: list[int] = []
            for migration in migrations:
                if migration.version in applied:
                    continue
                log.info("applying migration %s", migration.path.name)
                try:
                    with conn.transaction():
                        conn.execute("SET LOCAL ROLE appliance_owner")
                        conn.execute("SET LOCAL search_path = appliance, pg_catalog")
                        _lock_timeout(conn, lock_timeout)
                        conn.execute(migration.sql)
                        _still_one_transaction(conn, migration)
                        conn.execute(
                            "INSERT INTO appliance.schema_migrations (version, name, checksum)"
                            " VALUES (%s, %s, %s)",
                            (migration.version, migration.name, migration.checksum),
                        )
                except psycopg.errors.LockNotAvailable as exc:
                    applied_now = ", ".join(f"{v:04d}" for v in done) or "none"
                    raise MigrationError(
                        f"migration {migration.path.name} waited more than {lock_timeout} for a"
                        f" table in use ({exc.diag.message_primary}) and was rolled back; applied"
                        f" by this run: {applied_now}. Stop the runners (or end the long"
                        " transaction holding the table) and migrate again"
                    ) from None
                except psycopg.Error as exc:
                    applied_now = ", ".join(f"{v:04d}" for v in done) or "none"
                    diag = exc.diag
                    where = (
                        f" (at character {diag.statement_position})"
                        if diag.statement_position
                        else ""
                    )
                    raise MigrationError(
                        f"migration {migration.path.name} failed and was rolled back, nothing of"
                        f" it applied: {diag.message_primary or exc}{where}"
                        f"{'; ' + diag.context.strip() if diag.context else ''}; applied by"
                        f" this run: {applied_now}"
                    ) from None
                done.append(migration.version)
            return MigrateReport(applied=done, already=sorted(applied))
        finally:
            # Not over the error that ended the run: a connection lost in a migration has no
            # lock left to release (the server released it), and its own error says why.
            if not conn.closed:
                with contextlib.suppress(psycopg.Error):
                    conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
