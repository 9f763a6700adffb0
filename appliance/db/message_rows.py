"""Envelope rows as the domain's read model: a row of `agent_messages` (any column order, any
columns added by later migrations) turned into a `Message`.

The claim path builds a message per row of every claim, on the runner's single event loop, so
it reads the statement's column layout once per result and then picks values by position
(`message_rows`), rather than building a dict per row and sorting its keys out.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from psycopg.rows import RowMaker

from appliance.domain.envelope import Lane, Message, MessageStatus

# The Message fields a row fills, in the dataclass's order (extra is built from the rest).
MESSAGE_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(Message) if f.name != "extra"
)
_FIELD_SET = frozenset(MESSAGE_FIELDS)
_LANE_AT = MESSAGE_FIELDS.index("lane")
_STATUS_AT = MESSAGE_FIELDS.index("status")
# Enum lookups by value without Enum.__call__ (a dict hit instead of a method call per row).
_LANES = {lane.value: lane for lane in Lane}
_STATUSES = {status.value: status for status in MessageStatus}
# Built positionally from a row's values in MESSAGE_FIELDS order (typed loosely for that).
_new_message: Callable[..., Message] = Message


def row_to_message(row: dict[str, Any]) -> Message:
    """A database row (a fresh dict, consumed) as the domain's read model; unknown columns go to
    `extra`."""
    extra = {k: row.pop(k) for k in row.keys() - _FIELD_SET}
    row["lane"] = Lane(row["lane"])
    row["status"] = MessageStatus(row["status"])
    return Message(**row, extra=extra)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each Message field, each extra column and the one trailing value sit in a row."""

    fields: tuple[int, ...]
    extra: tuple[tuple[str, int], ...]
    trailer: int | None


@functools.lru_cache(maxsize=32)
def _layout(raw: tuple[bytes, ...], trailer: str | None) -> _Layout:
    names = tuple(name.decode() for name in raw)
    missing = [name for name in MESSAGE_FIELDS if name not in names]
    if missing:
        raise ValueError(f"an envelope row lacks the columns {missing}")
    at = {name: i for i, name in enumerate(names)}
    return _Layout(
        fields=tuple(at[name] for name in MESSAGE_FIELDS),
        extra=tuple(
            (name, i) for i, name in enumerate(names) if name not in _FIELD_SET and name != trailer
        ),
        trailer=at.get(trailer) if trailer is not None else None,
    )


def _names(cursor: Any) -> tuple[bytes, ...]:
    """The result's column names as the server sent them (the layout cache's key, so a repeated
    statement costs no decoding)."""
    result = cursor.pgresult
    if result is None or not result.nfields:
        return ()
    return tuple(result.fname(i) for i in range(result.nfields))


def message_rows(trailer: str) -> Any:
    """A psycopg row factory: each row as (Message or None, value of column `trailer`).

    The message is None for a row whose `id` is NULL (a claim's row that carries only the
    trailer). The layout is read from the result's column names, once per result."""

    def factory(cursor: Any) -> RowMaker[tuple[Message | None, Any]]:
        names = _names(cursor)
        if not names:
            return lambda values: (None, None)  # no result set: nothing is ever made
        layout = _layout(names, trailer)
        fields, extra, last = layout.fields, layout.extra, layout.trailer
        id_at = fields[0]

        def make(values: Sequence[Any]) -> tuple[Message | None, Any]:
            found = values[last] if last is not None else None
            if values[id_at] is None:
                return None, found
            picked = [values[i] for i in fields]
            picked[_LANE_AT] = _LANES[picked[_LANE_AT]]
            picked[_STATUS_AT] = _STATUSES[picked[_STATUS_AT]]
            return _new_message(*picked, extra={name: values[i] for name, i in extra}), found

        return make

    return factory
