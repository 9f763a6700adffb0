"""Named SQL queries: parsed once from sql/queries/*.sql, executed only with bound parameters."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from appliance.domain.errors import ConfigurationError

Kind = Literal["one", "many", "exec"]
_HEADER = re.compile(r"^-- name: (?P<name>[a-z_][a-z0-9_]*) :(?P<kind>one|many|exec)\s*$")
_HEADER_LIKE = re.compile(r"^\s*--\s*name\b", re.IGNORECASE)


def sql_dir() -> Path:
    """Where sql/ lives: APPLIANCE_SQL_DIR (an installed image), else the checkout's sql/."""
    override = os.environ.get("APPLIANCE_SQL_DIR")
    path = Path(override) if override else Path(__file__).resolve().parents[2] / "sql"
    if not (path / "migrations").is_dir():
        raise ConfigurationError(
            f"SQL directory {path} has no migrations/ (set APPLIANCE_SQL_DIR to the sql/ folder)"
        )
    return path


@dataclass(frozen=True)
class Query:
    """One named statement: its name, what it returns, what it does, and its text."""

    name: str
    kind: Kind
    doc: str
    sql: str


# psycopg caches the parsing of a statement's placeholders only for texts up to this length; a
# longer one (the commented claim) was re-parsed on every call, costing more client CPU than the
# round trip. A test keeps every named query under it.
DRIVER_CACHED_QUERY_BYTES = 4096


def _strip_trailing_comment(line: str) -> str:
    # The first `--` outside a literal (an even number of quotes before it) starts a comment.
    start = 0
    while (at := line.find("--", start)) >= 0:
        if line.count("'", 0, at) % 2 == 0:
            return line[:at].rstrip()
        start = at + 2
    return line


def compact(sql: str) -> str:
    """The statement as sent: comments, indentation and blank lines dropped.

    Stripping is safe only while no literal spans lines, so a line with an odd number of
    quotes, or a dollar quote, is refused.
    """
    kept = [_strip_trailing_comment(line.strip()) for line in sql.splitlines()]
    kept = [line for line in kept if line]
    for line in kept:
        if "/*" in line:
            # A block comment could hide a `--` or a line break from the stripping above.
            raise ConfigurationError(f"a named query may not hold a /* comment */: {line!r}")
        if line.count("'") % 2 or "$$" in line:
            raise ConfigurationError(
                f"a named query line may not open a literal it does not close: {line!r} "
                "(keep string literals on one line)"
            )
    return "\n".join(kept)


def parse(text: str, origin: str) -> dict[str, Query]:
    """Split a file into its named queries; each starts at a `-- name: x :kind` header."""
    queries: dict[str, Query] = {}
    current: tuple[str, Kind] | None = None
    doc: list[str] = []
    body: list[str] = []

    def flush() -> None:
        if current is None:
            return
        try:
            sql = compact("\n".join(body)).rstrip(";").strip()
        except ConfigurationError as exc:
            raise ConfigurationError(f"{origin}: query {current[0]}: {exc}") from None
        if not sql:
            raise ConfigurationError(f"{origin}: query {current[0]} has no SQL")
        if not doc:
            raise ConfigurationError(f"{origin}: query {current[0]} lacks its one-line description")
        if current[0] in queries:
            raise ConfigurationError(f"{origin}: query {current[0]} is defined twice")
        queries[current[0]] = Query(current[0], current[1], " ".join(doc), sql)

    for line in text.splitlines():
        header = _HEADER.match(line)
        if header is None and _HEADER_LIKE.match(line):
            # A mistyped header was read as a comment of the query above, and its statement
            # appended to that query's (two statements sent as one, the second one lost).
            raise ConfigurationError(
                f"{origin}: {line.strip()!r} is not a query header"
                " (`-- name: lowercase_name :one|:many|:exec`)"
            )
        if header:
            flush()
            current = (header["name"], header["kind"])  # type: ignore[assignment]
            doc, body = [], []
        elif current is not None and not body and line.startswith("-- "):
            doc.append(line[3:].strip())
        elif current is not None:
            body.append(line)
    flush()
    return queries


@cache
def load(directory: Path | None = None) -> dict[str, Query]:
    """Every named query of sql/queries, loaded once per process."""
    folder = (directory or sql_dir()) / "queries"
    merged: dict[str, Query] = {}
    for path in sorted(folder.glob("*.sql")):
        for name, query in parse(path.read_text(encoding="utf-8"), str(path)).items():
            if name in merged:
                raise ConfigurationError(f"{path}: query {name} is also defined elsewhere")
            merged[name] = query
    return merged


def q(name: str) -> str:
    """The SQL of a named query (KeyError names a query that does not exist)."""
    return load()[name].sql
