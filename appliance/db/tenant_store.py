"""Tenants in PostgreSQL: registration and listing (the TenantStore port)."""

from __future__ import annotations

from appliance.db.database import Database
from appliance.db.queries import q
from appliance.domain.envelope import NAME_RE, check_free_text
from appliance.domain.errors import InvalidInput

DISPLAY_NAME_MAX_CHARS = 200


class PgTenantStore:
    """Tenants are registered by the bus machinery role and read by everyone."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def add(self, name: str, *, display_name: str | None = None) -> bool:
        """Register a tenant; False when it already existed."""
        if not NAME_RE.match(name):
            raise InvalidInput(
                "tenant",
                f"{name!r} is not a valid tenant name (lowercase letters, digits, '_', '-', '.';"
                " 1-63 characters, starting with a letter or digit)",
            )
        if display_name is not None:
            check_free_text("display_name", display_name, DISPLAY_NAME_MAX_CHARS)
        async with self.db.system_conn() as conn:
            cur = await conn.execute(q("tenant_add"), {"name": name, "display_name": display_name})
            return await cur.fetchone() is not None

    async def list(self) -> list[str]:
        async with self.db.system_conn() as conn:
            rows = await (await conn.execute(q("tenant_list"))).fetchall()
        return [r["name"] for r in rows]

    async def exists(self, name: str) -> bool:
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("tenant_exists"), {"name": name})).fetchone()
        return bool(row and row["present"])
