"""The PostgreSQL server the tests use: a container where Docker answers, else our own cluster.

One server per test session; one migrated template database; a fresh clone per test.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from appliance.db.cluster import LocalCluster
from appliance.db.database import Endpoints
from appliance.db.migrate import migrate

TEMPLATE = "appliance_template"
_counter = itertools.count()


@dataclass
class PgTestServer:
    """A running server: how to reach it as admin, and how to clone fresh databases."""

    admin: str  # conninfo of the admin user, database `postgres`
    kind: str
    cluster: LocalCluster | None = None

    def endpoints(self, dbname: str) -> Endpoints:
        return Endpoints.from_admin(psycopg.conninfo.make_conninfo(self.admin, dbname=dbname))

    def create_template(self) -> None:
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(TEMPLATE)))
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(TEMPLATE)))
        migrate(self.endpoints(TEMPLATE).admin)

    def clone(self, prefix: str = "t") -> str:
        name = f"{prefix}_{os.getpid()}_{next(_counter)}"
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY FILE_COPY").format(
                    sql.Identifier(name), sql.Identifier(TEMPLATE)
                )
            )
        return name

    def create_empty(self, prefix: str = "e") -> str:
        name = f"{prefix}_{os.getpid()}_{next(_counter)}"
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return name

    def drop(self, name: str) -> None:
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def _docker_answers() -> bool:
    if os.environ.get("APPLIANCE_TEST_NO_DOCKER"):
        return False
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


@contextlib.contextmanager
def session_server() -> Iterator[PgTestServer]:
    """Start the session's server and stop it afterwards."""
    if _docker_answers():
        from testcontainers.postgres import PostgresContainer

        with PostgresContainer("postgres:15", driver=None) as container:
            admin = (
                f"host={container.get_container_host_ip()} "
                f"port={container.get_exposed_port(5432)} user={container.username} "
                f"password={container.password} dbname=postgres"
            )
            yield PgTestServer(admin=admin, kind="testcontainers")
        return
    state = Path(tempfile.mkdtemp(prefix="appliance-test-"))
    state.chmod(0o755)  # the server runs as another user when tests run as root
    cluster = LocalCluster(
        state,
        port=5432,
        extra_conf={
            # Test data is disposable: skip the flushes, so tests measure logic, not the disk.
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
        },
    )
    cluster.start()
    try:
        yield PgTestServer(admin=cluster.conninfo(), kind="local", cluster=cluster)
    finally:
        cluster.stop()
        with contextlib.suppress(OSError):
            import shutil

            shutil.rmtree(state, ignore_errors=True)
