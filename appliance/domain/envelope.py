"""The envelope: one unit of agent work, its lanes and life-cycle states, and input validation."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from enum import StrEnum
from typing import Any

from appliance.domain.errors import InvalidInput

JSONValue = Any  # JSON-compatible: dict, list, str, int, float, bool, None

DEFAULT_CONTEXT_MAX_BYTES = 1024 * 1024
# \Z, not $: "$" also matches before a final newline, so "ok\n" would pass as a name.
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}\Z")
KEY_MAX_CHARS = 512
SOURCE_ID_MAX_CHARS = 512
DIRECTIVE_MAX_CHARS = 64 * 1024
# Far beyond any chain a runner lets run (RunnerConfig.max_hops, 1,000 by default), and far
# below the column's 32-bit limit: a stage hand-off stores hops + 1, and at 2**31 - 1 that
# overflowed, failing the message's completion on every attempt until it went dead.
HOPS_MAX = 1_000_000


class Lane(StrEnum):
    """Claim classes, in strict claim order: interactive work is never starved by the others."""

    INTERACTIVE = "interactive"
    SYSTEM = "system"
    BATCH = "batch"


class MessageStatus(StrEnum):
    """The life cycle of a message (ARCHITECTURE.md); enum `message_status` in SQL mirrors it."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    DEAD = "dead"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    AWAITING_APPROVAL = "awaiting_approval"
    HELD_BUDGET = "held_budget"
    WAITING_CAPABILITY = "waiting_capability"


TERMINAL = frozenset({MessageStatus.DONE, MessageStatus.CANCELLED, MessageStatus.EXPIRED})
WAITING = frozenset(
    {
        MessageStatus.AWAITING_APPROVAL,
        MessageStatus.HELD_BUDGET,
        MessageStatus.WAITING_CAPABILITY,
    }
)

_S = MessageStatus
# The only status changes the database accepts (migration 0002 holds the same table, and a test
# keeps the two equal). Dead is not terminal: an operator may re-drive it.
LEGAL_TRANSITIONS: frozenset[tuple[MessageStatus, MessageStatus]] = frozenset(
    {
        (_S.PENDING, _S.RUNNING),
        (_S.PENDING, _S.CANCELLED),
        (_S.PENDING, _S.EXPIRED),
        (_S.PENDING, _S.DEAD),
        (_S.RUNNING, _S.DONE),
        (_S.RUNNING, _S.PENDING),
        (_S.RUNNING, _S.DEAD),
        (_S.RUNNING, _S.CANCELLED),
        (_S.RUNNING, _S.EXPIRED),
        (_S.DEAD, _S.PENDING),
        (_S.DEAD, _S.CANCELLED),
    }
    | {(_S.PENDING, w) for w in WAITING}
    | {(_S.RUNNING, w) for w in WAITING}
    | {(w, t) for w in WAITING for t in (_S.PENDING, _S.CANCELLED, _S.EXPIRED, _S.DEAD)}
)


# The prefix of the keys the bus derives; an explicit key may not take it (see build).
DERIVED_KEY_PREFIX = "k1:"


def idempotency_key(source: str, source_id: str, stage: str) -> str:
    """The deterministic key of (source, source id, stage): same inputs, same key, on every box.

    Length-prefixed parts, so no choice of characters can make two triples collide; SQL's
    `idempotency_key()` (used by stage hand-off) computes the same text, and a test holds them
    equal.
    """
    raw = "|".join(f"{len(part)}:{part}" for part in (source, source_id, stage))
    return DERIVED_KEY_PREFIX + hashlib.sha256(raw.encode()).hexdigest()


def _check_text(field_name: str, value: object) -> None:
    """Text where text is due: a number or None from Python callers is named here, not met
    as an AttributeError further on."""
    if not isinstance(value, str):
        raise InvalidInput(field_name, f"must be text, got {type(value).__name__}")


def check_name(field_name: str, value: str) -> str:
    """A name (tenant, pipeline, stage, source, outcome), or an error naming the field."""
    _check_text(field_name, value)
    if not NAME_RE.match(value):
        raise InvalidInput(
            field_name,
            f"{value!r} is not a valid name (lowercase letters, digits, '_', '-', '.'; "
            "1-63 characters, starting with a letter or digit)",
        )
    return value


def parse_lane(value: str | Lane) -> Lane:
    """A lane from text, or an error listing the lanes that exist."""
    try:
        return Lane(value)
    except ValueError:
        allowed = ", ".join(lane.value for lane in Lane)
        raise InvalidInput("lane", f"unknown lane {value!r} (one of: {allowed})") from None


def parse_status(value: str | MessageStatus) -> MessageStatus:
    """A status from text, or an error listing the statuses that exist."""
    try:
        return MessageStatus(value)
    except ValueError:
        allowed = ", ".join(s.value for s in MessageStatus)
        raise InvalidInput("status", f"unknown status {value!r} (one of: {allowed})") from None


# A NUL character as the encoder writes it: a `\u0000` escape whose backslash is not itself
# escaped (an even run of backslashes, escaped ones, may precede it). `\\u0000` is the six
# characters `\u0000` in the text, which jsonb stores fine.
_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
# Compact JSON as jsonb receives it: no spaces, UTF-8 as is, no NaN or Infinity (jsonb has none).
COMPACT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _json_key(key: object) -> str:
    """The text JSON writes for an object key (as the encoder converts non-string keys)."""
    if isinstance(key, str):
        return str.__str__(key)
    if key is True or key is False or key is None:
        return json.dumps(key)
    if isinstance(key, int):
        return int.__repr__(key)
    if isinstance(key, float):
        return float.__repr__(key)
    return repr(key)  # refused by the encoder anyway


_CONTAINERS = (dict, list, tuple)


def _clashing_key(value: object) -> str | None:
    """A key written twice in one object once non-string keys become text ({1: .., "1": ..}):
    jsonb would keep only the last, silently dropping the other. Walks containers only (this
    runs for every result a handler returns)."""
    stack = [value]
    push = stack.append
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            plain = True
            for k, v in item.items():
                if type(k) is not str:
                    plain = False
                if isinstance(v, _CONTAINERS):
                    push(v)
            if not plain:
                seen: set[str] = set()
                for k in item:
                    text = _json_key(k)
                    if text in seen:
                        return text
                    seen.add(text)
        elif isinstance(item, (list, tuple)):  # never a string: not walked by the character
            for v in item:
                if isinstance(v, _CONTAINERS):
                    push(v)
    return None


def encode_json(value: JSONValue, field_name: str) -> str:
    """Compact JSON text that jsonb can store, or an error naming the field."""
    if value is None:
        return "null"  # the most common result: no encoder needed
    try:
        text = COMPACT_JSON.encode(value)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(field_name, f"is not JSON-serialisable: {exc}") from None
    except RecursionError:
        raise InvalidInput(field_name, "is nested too deeply to encode as JSON") from None
    clash = _clashing_key(value) if "{" in text else None  # no object, no keys
    if clash is not None:
        raise InvalidInput(
            field_name, f"has two keys that are both {clash!r} once written as JSON text"
        )
    if "\\u0000" in text and _ESCAPED_NUL.search(text):
        # PostgreSQL jsonb cannot hold NUL characters; say so here rather than fail at insert.
        raise InvalidInput(
            field_name, "contains a NUL character (\\u0000), which jsonb cannot store"
        )
    if not text.isascii():
        _check_unicode(field_name, text)
    return text


def storable_text(text: str, limit: int = 8000) -> str:
    """Free text the bus writes on its own account (an exception's message as a failure's error,
    a reason): cut to `limit` characters, with what PostgreSQL text cannot hold (NUL, a lone
    surrogate) written as an escape, so recording a failure never fails on its message."""
    text = text[:limit]
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        text = text.encode("utf-8", "backslashreplace").decode()
    return text


def check_free_text(field_name: str, value: object, limit: int) -> str:
    """Free text a person gives (a cancel's reason, a tenant's display name): 1 to `limit`
    characters that PostgreSQL text can hold, or an error naming the field."""
    _check_text(field_name, value)
    assert isinstance(value, str)
    if not 0 < len(value) <= limit:
        raise InvalidInput(field_name, f"must be 1-{limit} characters, got {len(value)}")
    if "\x00" in value:
        raise InvalidInput(field_name, "contains a NUL character, which text cannot store")
    if not value.isascii():
        _check_unicode(field_name, value)
    return value


def _check_unicode(field_name: str, text: str) -> None:
    """Refuse a lone surrogate (a Python string may hold one; a JSON escape of one decodes to
    one): it has no UTF-8 form, so neither the database nor an idempotency key can take it."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidInput(
            field_name,
            f"contains a lone surrogate ({text[exc.start]!r} at {exc.start}), which is not "
            "valid Unicode text",
        ) from None


def _check_int(field_name: str, value: object, low: int, high: int) -> None:
    """A whole number within low..high; a float, a numeric string or a bool is refused here
    rather than by the database's type check, with the field named."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(field_name, f"must be a whole number, got {value!r}")
    if not low <= value <= high:
        raise InvalidInput(field_name, f"{value} is outside {low}..{high}")


def utc_moment(field_name: str, moment: datetime | None) -> datetime | None:
    """A moment with a time zone, as UTC: PostgreSQL refuses offsets Python accepts (16 hours
    and more, fractions of a second), and that refusal would come from the database, after
    validation, failing every request sent in the same statement."""
    if moment is None:
        return None
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise InvalidInput(field_name, "must carry a time zone (ISO 8601 with offset)")
    try:
        return moment.astimezone(UTC)
    except OverflowError:
        raise InvalidInput(field_name, f"{moment.isoformat()} is out of range") from None


def encode_context(context: JSONValue, max_bytes: int) -> str:
    """The context as compact JSON text, refusing what is not JSON or is over the size limit."""
    text = encode_json(context, "context")
    size = bytes_over(text, max_bytes)
    if size is not None:
        raise InvalidInput("context", f"is {size} bytes, over the limit of {max_bytes} bytes")
    return text


def bytes_over(text: str, limit: int) -> int | None:
    """The UTF-8 size of `text` when it is over `limit` bytes, else None. UTF-8 takes at most
    4 bytes a character, so most texts need no encoding to tell."""
    if len(text) * 4 <= limit:
        return None
    size = len(text.encode())
    return size if size > limit else None


def _exact_float(text: str) -> float:
    """A JSON number with a fraction or exponent, as the float it becomes: refused when that
    float is not the number written (jsonb would keep the digits; the float would not, and
    the context would silently change on its way in)."""
    value = float(text)
    if not math.isfinite(value):
        raise InvalidInput("context", f"the number {text} is out of range for a 64-bit float")
    if Decimal(repr(value)) != Decimal(text):
        raise InvalidInput(
            "context",
            f"the number {text} cannot be kept exactly (it would become {value!r}); "
            "send it as a string",
        )
    return value


def _no_constant(text: str) -> Any:
    raise InvalidInput("context", f"{text} is not a JSON value")


# How much longer than the context limit a context's text may be before it is parsed: the
# limit is on its compact JSON (as a request measures it), and text written by hand or by a
# tool carries white space (indentation, line ends) the compact form drops. Longer text is
# refused unparsed.
CONTEXT_TEXT_SLACK = 4


def decode_context(text: str | bytes, max_bytes: int) -> JSONValue:
    """Context given as JSON text or UTF-8 bytes (CLI, API): parsed, or an error naming the
    field. Every way the text can be unreadable is that error, never a traceback. The limit
    is on the context's compact JSON, as `EnqueueRequest.build` measures it."""
    size = len(text) if isinstance(text, bytes) else len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes * CONTEXT_TEXT_SLACK:
        raise InvalidInput(
            "context",
            f"is {size} bytes of text, over {CONTEXT_TEXT_SLACK} times the limit of {max_bytes}"
            " bytes (on its compact JSON)",
        )
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(
                "context", f"is not UTF-8 text (byte {exc.start}: {exc.reason})"
            ) from None
    if not text.isascii():
        _check_unicode("context", text)
    try:
        value: JSONValue = json.loads(text, parse_float=_exact_float, parse_constant=_no_constant)
    except InvalidInput:
        raise
    except json.JSONDecodeError as exc:
        raise InvalidInput("context", f"is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput("context", "is nested too deeply to parse as JSON") from None
    except ValueError as exc:
        # The parser's own limits, for example an integer of more than 4,300 digits.
        raise InvalidInput("context", f"is not usable JSON: {exc}") from None
    encode_context(value, max_bytes)  # over the limit once compact: refused here, named so
    return value


@dataclass(frozen=True)
class EnqueueRequest:
    """A validated request to put one unit of work on the bus (construct with `build`)."""

    tenant: str
    pipeline: str
    stage: str
    source: str
    source_id: str
    directive: str
    idempotency_key: str
    context_json: str
    # None: the declared stage's lane, else interactive (the default for anything unclassified).
    lane: Lane | None = None
    priority: int = 0
    from_agent: str | None = None
    to_agent: str | None = None
    # None: the declared stage's max attempts, else the bus default.
    max_attempts: int | None = None
    not_before: datetime | None = None
    deadline: datetime | None = None
    hops: int = 0

    @classmethod
    def build(
        cls,
        *,
        tenant: str,
        pipeline: str,
        stage: str,
        source: str,
        source_id: str,
        directive: str,
        context: JSONValue = None,
        lane: str | Lane | None = None,
        priority: int = 0,
        from_agent: str | None = None,
        to_agent: str | None = None,
        max_attempts: int | None = None,
        not_before: datetime | None = None,
        deadline: datetime | None = None,
        key: str | None = None,
        context_max_bytes: int = DEFAULT_CONTEXT_MAX_BYTES,
        now: datetime | None = None,
        hops: int = 0,
    ) -> EnqueueRequest:
        """Validate every field before anything touches the database; errors name the field."""
        check_name("tenant", tenant)
        check_name("pipeline", pipeline)
        check_name("stage", stage)
        check_name("source", source)
        texts = (
            ("source_id", source_id),
            ("directive", directive),
            ("idempotency_key", key),
            ("from_agent", from_agent),
            ("to_agent", to_agent),
        )
        for name, text in texts:
            if text is not None or name in ("source_id", "directive"):
                _check_text(name, text)
        if not source_id or len(source_id) > SOURCE_ID_MAX_CHARS:
            raise InvalidInput("source_id", f"must be 1-{SOURCE_ID_MAX_CHARS} characters")
        if not directive or not directive.strip():
            raise InvalidInput("directive", "must not be empty")
        if len(directive) > DIRECTIVE_MAX_CHARS:
            raise InvalidInput(
                "directive",
                f"is {len(directive)} characters, over the limit of {DIRECTIVE_MAX_CHARS}",
            )
        if key is not None and not (0 < len(key) <= KEY_MAX_CHARS):
            raise InvalidInput("idempotency_key", f"must be 1-{KEY_MAX_CHARS} characters")
        if (
            key is not None
            and key.startswith(DERIVED_KEY_PREFIX)
            and key != idempotency_key(source, source_id, stage)
        ):
            # Derived keys are the bus's own (stage hand-offs use them): one given for another
            # (source, source id, stage) would take that stage's key and swallow its hand-off.
            raise InvalidInput(
                "idempotency_key",
                f"must not start with {DERIVED_KEY_PREFIX!r}: such keys are derived from "
                "(source, source id, stage) by the bus",
            )
        _check_int("priority", priority, -1000, 1000)
        _check_int("hops", hops, 0, HOPS_MAX)
        if max_attempts is not None:
            _check_int("max_attempts", max_attempts, 1, 100)
        for name, agent in (("from_agent", from_agent), ("to_agent", to_agent)):
            if agent is not None and not (0 < len(agent) <= 200):
                raise InvalidInput(name, "must be 1-200 characters")
        for name, text in texts:
            if text is None:
                continue
            if "\x00" in text:
                raise InvalidInput(name, "contains a NUL character, which PostgreSQL cannot store")
            if not text.isascii():
                _check_unicode(name, text)
        now = utc_moment("now", now)
        not_before = utc_moment("not_before", not_before)
        deadline = utc_moment("deadline", deadline)
        if deadline is not None:
            if now is not None and deadline <= now:
                raise InvalidInput("deadline", f"{deadline.isoformat()} is not in the future")
            if not_before is not None and deadline <= not_before:
                raise InvalidInput("deadline", "must be later than not_before")
        return cls(
            tenant=tenant,
            pipeline=pipeline,
            stage=stage,
            source=source,
            source_id=source_id,
            directive=directive,
            idempotency_key=key if key is not None else idempotency_key(source, source_id, stage),
            context_json=encode_context(context, context_max_bytes),
            lane=parse_lane(lane) if lane is not None else None,
            priority=priority,
            from_agent=from_agent,
            to_agent=to_agent,
            max_attempts=max_attempts,
            not_before=not_before,
            deadline=deadline,
            hops=hops,
        )


@dataclass(frozen=True)
class EnqueueResult:
    """The message a request maps to, and whether this call created it (False: a duplicate)."""

    id: int
    new: bool


@dataclass(frozen=True)
class LeaseRef:
    """What fences every write of a worker: the message, its current lease token."""

    message_id: int
    lease_token: int


@dataclass(frozen=True)
class Message:
    """A message as stored (a read model: changing it changes nothing)."""

    id: int
    tenant: str
    pipeline: str
    stage: str
    source: str
    source_id: str
    idempotency_key: str
    directive: str
    context: JSONValue
    from_agent: str | None
    to_agent: str | None
    lane: Lane
    status: MessageStatus
    priority: int
    attempts: int
    max_attempts: int
    lease_token: int | None
    lease_expires_at: datetime | None
    not_before: datetime
    deadline: datetime | None
    result: JSONValue
    error: str | None
    created_at: datetime
    updated_at: datetime
    claimed_by: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hops(self) -> int:
        """Hand-offs since its run's first message (a column later migrations added)."""
        return int(self.extra.get("hops") or 0)

    @property
    def lease(self) -> LeaseRef:
        """The lease this message was claimed under (only meaningful while running)."""
        if self.lease_token is None:
            raise ValueError(f"message {self.id} holds no lease")
        return LeaseRef(self.id, self.lease_token)


def differences(request: EnqueueRequest, stored: Message) -> list[str]:
    """The fields in which a request that came back a duplicate differs from the message its
    key already names (what the caller asked for but did not get: a duplicate changes nothing).

    Its content is compared always; lane, priority, attempts, agents and times only when the
    request sets them (left unset, they are defaults, not asked for). A deadline the bus has
    since removed (a redrive that clears it) is named too: the caller asked for one it does not
    have. A not-before only while the message is unattempted: a retry's backoff moves it.
    """
    asked: list[tuple[str, object, object]] = [
        ("pipeline", request.pipeline, stored.pipeline),
        ("stage", request.stage, stored.stage),
        ("source", request.source, stored.source),
        ("source_id", request.source_id, stored.source_id),
        ("directive", request.directive, stored.directive),
        ("context", json.loads(request.context_json), stored.context),
    ]
    if request.lane is not None:
        asked.append(("lane", request.lane, stored.lane))
    if request.priority != 0:
        asked.append(("priority", request.priority, stored.priority))
    if request.max_attempts is not None:
        asked.append(("max_attempts", request.max_attempts, stored.max_attempts))
    if request.from_agent is not None:
        asked.append(("from_agent", request.from_agent, stored.from_agent))
    if request.to_agent is not None:
        asked.append(("to_agent", request.to_agent, stored.to_agent))
    if request.deadline is not None:
        asked.append(("deadline", request.deadline, stored.deadline))
    if request.not_before is not None and stored.attempts == 0:
        asked.append(("not_before", request.not_before, stored.not_before))
    return [name for name, wanted, kept in asked if wanted != kept]


def lease_duration_ok(lease: timedelta) -> timedelta:
    """Refuse leases under a second (cannot be heartbeated) or over a day (they hide loss)."""
    if not timedelta(seconds=1) <= lease <= timedelta(days=1):
        raise InvalidInput("lease", f"{lease} is outside 1 s .. 1 day")
    return lease
