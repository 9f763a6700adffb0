"""Pure domain logic: validation, idempotency keys, retry policy, named-query parsing."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.db.queries import DRIVER_CACHED_QUERY_BYTES, load, parse
from appliance.domain.envelope import (
    LEGAL_TRANSITIONS,
    TERMINAL,
    EnqueueRequest,
    Lane,
    Message,
    MessageStatus,
    decode_context,
    differences,
    encode_json,
    idempotency_key,
    parse_lane,
)
from appliance.domain.errors import ConfigurationError, InvalidInput
from appliance.domain.retry import RetryPolicy


def build(**kw: object) -> EnqueueRequest:
    fields: dict[str, object] = {
        "tenant": "acme",
        "pipeline": "demo",
        "stage": "intake",
        "source": "mail",
        "source_id": "1",
        "directive": "x",
    }
    fields.update(kw)
    return EnqueueRequest.build(**fields)  # type: ignore[arg-type]


def test_key_is_deterministic_and_derived_from_source_id_stage() -> None:
    a = build()
    assert a.idempotency_key == build(directive="other", lane="batch").idempotency_key
    assert a.idempotency_key != build(stage="review").idempotency_key
    assert a.idempotency_key == idempotency_key("mail", "1", "intake")
    assert build(key="mine").idempotency_key == "mine"


def test_an_explicit_key_cannot_take_another_stages_derived_key() -> None:
    # Given the key of the next stage of its run, it took that stage's key: the stage's
    # hand-off was then answered "duplicate" and the run ended there, unseen.
    with pytest.raises(InvalidInput, match="idempotency_key: must not start with 'k1:'"):
        build(key=idempotency_key("mail", "1", "enrich"))
    own = idempotency_key("mail", "1", "intake")
    assert build(key=own).idempotency_key == own  # its own derived key, said aloud: harmless


_tricky = st.text(alphabet="ab1:|", max_size=6)


@given(st.tuples(_tricky, _tricky, _tricky), st.tuples(_tricky, _tricky, _tricky))
def test_distinct_triples_have_distinct_keys(one: tuple[str, ...], two: tuple[str, ...]) -> None:
    # Separator and digit characters inside the parts must not let two triples share a key.
    assert (idempotency_key(*one) == idempotency_key(*two)) == (one == two)


def test_lane_defaults_to_the_stage_and_unknown_lane_is_named() -> None:
    assert build().lane is None  # the declared stage's lane, else interactive (in SQL)
    assert build(lane="batch").lane is Lane.BATCH
    with pytest.raises(InvalidInput, match=r"unknown lane 'fast'.*interactive, system, batch"):
        parse_lane("fast")


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("kw", "field", "needle"),
    [
        ({"directive": ""}, "directive", "must not be empty"),
        ({"directive": "x" * 70_000}, "directive", "over the limit of 65536"),
        ({"context": {"x": "y" * 2048}, "context_max_bytes": 1024}, "context", "limit of 1024"),
        ({"context": float("nan")}, "context", "not JSON-serialisable"),
        ({"context": "\x00"}, "context", "NUL"),
        ({"directive": "a\x00b"}, "directive", "NUL"),
        ({"source_id": "1\x00"}, "source_id", "NUL"),
        # A lone surrogate (JSON's "\ud800" decodes to one) has no UTF-8 form: refused by name,
        # never a UnicodeEncodeError from the key's hash or the driver.
        ({"source_id": "2-\ud800"}, "source_id", "lone surrogate"),
        ({"directive": "do \udfff"}, "directive", "lone surrogate"),
        ({"key": "k\ud800"}, "idempotency_key", "lone surrogate"),
        ({"to_agent": "\ud83d"}, "to_agent", "lone surrogate"),
        ({"context": {"a": ["é", "\ud800"]}}, "context", "lone surrogate"),
        ({"context": {"\udc00": 1}}, "context", "lone surrogate"),
        # Keys that become the same text: jsonb would keep one and drop the other silently.
        ({"context": {1: "a", "1": "b"}}, "context", "both '1'"),
        ({"context": [{"x": {True: 1, "true": 2}}]}, "context", "both 'true'"),
        ({"context": {"n": {None: 1, "null": 2}}}, "context", "both 'null'"),
        ({"source_id": ""}, "source_id", "1-512"),
        # Python callers' non-text values, named rather than met as AttributeError.
        ({"directive": 7}, "directive", "must be text, got int"),
        ({"source_id": None}, "source_id", "must be text, got NoneType"),
        ({"tenant": 1}, "tenant", "must be text, got int"),
        ({"to_agent": b"x"}, "to_agent", "must be text, got bytes"),
        ({"pipeline": "Has Spaces"}, "pipeline", "not a valid name"),
        ({"stage": "intake\n"}, "stage", "not a valid name"),  # "$" let a final newline by
        ({"max_attempts": 0}, "max_attempts", "outside 1..100"),
        # Types the database would refuse with its own error, named here instead.
        ({"priority": 1.5}, "priority", "whole number"),
        ({"priority": "5"}, "priority", "whole number"),
        ({"priority": True}, "priority", "whole number"),
        ({"max_attempts": 2.0}, "max_attempts", "whole number"),
        ({"hops": 1_000_001}, "hops", "outside 0..1000000"),
        ({"context": _nested(5000)}, "context", "nested too deeply"),
        ({"deadline": datetime(2030, 1, 1)}, "deadline", "time zone"),
        # Beyond what an offset can move within range (year 9999 late, or year 1 early).
        (
            {"deadline": datetime.max.replace(tzinfo=timezone(-timedelta(hours=23)))},
            "deadline",
            "out of range",
        ),
        (
            {"not_before": datetime.min.replace(tzinfo=timezone(timedelta(hours=14)))},
            "not_before",
            "out of range",
        ),
        (
            {
                "deadline": datetime(2030, 1, 1, tzinfo=UTC),
                "not_before": datetime(2030, 2, 1, tzinfo=UTC),
            },
            "deadline",
            "later than not_before",
        ),
    ],
)
def test_bad_input_names_field_and_limit(kw: dict[str, object], field: str, needle: str) -> None:
    with pytest.raises(InvalidInput) as info:
        build(**kw)
    assert info.value.field == field
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (b"\xff\xfe{}", "not UTF-8 text (byte 0"),
        ('"\udcff"', "lone surrogate"),  # a non-UTF-8 command-line byte, as Python passes it
        ("1" * 5000, "not usable JSON"),  # over the parser's 4,300-digit integer limit
        ("[" * 5000 + "]" * 5000, "nested too deeply"),
        ("{not json", "not valid JSON"),
        ('"' + "é" * 600 + '"', "1202 bytes, over the limit of 1000 bytes"),  # bytes, not chars
        ("x" * 4001, "4001 bytes of text, over 4 times the limit of 1000 bytes"),  # unparsed
        # Numbers a float would change are refused, not silently rounded on the way in.
        ('{"amount": 12345678901234567890.25}', "12345678901234567890.25 cannot be kept"),
        ('{"rate": 0.10000000000000000000001}', "send it as a string"),
        ('{"x": 1e400}', "1e400 is out of range"),
        ('{"x": NaN}', "NaN is not a JSON value"),
        ("[-Infinity]", "-Infinity is not a JSON value"),
    ],
)
def test_context_text_that_cannot_be_read_is_named_never_a_traceback(
    text: str | bytes, needle: str
) -> None:
    with pytest.raises(InvalidInput) as info:
        decode_context(text, 1000 if needle.endswith("1000 bytes") else 1 << 20)
    assert info.value.field == "context"
    assert needle in str(info.value)
    assert decode_context('{"a": [1, "é"]}'.encode(), 1000) == {"a": [1, "é"]}
    # The limit is on the compact JSON, as a request measures it: white space is not counted.
    assert decode_context('{\n    "a":   [1,\n  2]\n}\n', 12) == {"a": [1, 2]}
    exact = decode_context(
        "[0.1, 1e5, 2.50, -0.0, 1.7976931348623157e308, 12345678901234567890]", 1000
    )
    assert exact == [0.1, 100000.0, 2.5, -0.0, 1.7976931348623157e308, 12345678901234567890]


def test_keys_that_differ_once_written_are_kept() -> None:
    r = build(context={1: "a", "2": "b", 1.5: "c", False: "d", "x": {None: 1}})
    assert r.context_json == '{"1":"a","2":"b","1.5":"c","false":"d","x":{"null":1}}'


def test_times_are_kept_in_utc_whatever_offset_they_came_with() -> None:
    # PostgreSQL refuses offsets of 16 hours and more and fractions of a second, which Python
    # accepts: the instant is kept, written in UTC.
    odd = timezone(timedelta(hours=20, microseconds=5))
    deadline = datetime(2030, 1, 2, 3, 4, 5, tzinfo=odd)
    r = build(deadline=deadline, not_before=deadline - timedelta(hours=1))
    assert r.deadline == deadline and r.deadline is not None
    assert r.deadline.utcoffset() == timedelta(0)
    assert r.not_before is not None and r.not_before.utcoffset() == timedelta(0)


def test_deadline_in_the_past_is_refused_relative_to_now() -> None:
    now = datetime(2026, 11, 1, tzinfo=UTC)
    with pytest.raises(InvalidInput, match="not in the future"):
        build(deadline=now - timedelta(seconds=1), now=now)
    assert build(deadline=now + timedelta(seconds=1), now=now).deadline is not None


def test_terminal_states_have_no_way_out() -> None:
    assert all(src not in TERMINAL for src, _ in LEGAL_TRANSITIONS)
    assert all((s, s) not in LEGAL_TRANSITIONS for s in MessageStatus)


@given(st.integers(min_value=1, max_value=60), st.integers(min_value=0, max_value=2**32))
def test_retry_delay_within_half_jitter_band_and_capped(attempts: int, seed: int) -> None:
    policy = RetryPolicy(base=timedelta(seconds=2), cap=timedelta(minutes=10))
    delay = policy.delay(attempts, random.Random(seed))
    ceiling = min(timedelta(seconds=2) * 2 ** min(attempts - 1, 32), timedelta(minutes=10))
    assert ceiling / 2 <= delay <= ceiling


@given(st.integers(min_value=1, max_value=100), st.integers(min_value=0, max_value=2**32))
def test_retry_delay_of_a_long_base_never_overflows(attempts: int, seed: int) -> None:
    # base * 2**32 is past what a timedelta holds for any base over ~5.6 hours: the delay must
    # still come back (capped), or a failure could never be recorded.
    week = timedelta(days=7)
    policy = RetryPolicy(base=timedelta(hours=6), cap=week)
    delay = policy.delay(attempts, random.Random(seed))
    ceiling = min(timedelta(hours=6) * 2 ** min(attempts - 1, 20), week)
    assert ceiling / 2 <= delay <= ceiling


def test_retry_policy_validates() -> None:
    with pytest.raises(InvalidInput, match=r"retry\.cap"):
        RetryPolicy(base=timedelta(seconds=10), cap=timedelta(seconds=1))
    # A cap of years would put a retry past the dates the database stores (settings hold it
    # to 7 days; a policy built in code is held alike).
    assert RetryPolicy(base=timedelta(hours=1), cap=timedelta(days=7)).cap == timedelta(days=7)
    with pytest.raises(InvalidInput, match=r"retry\.cap: must be at most 7 days"):
        RetryPolicy(base=timedelta(hours=1), cap=timedelta(days=7, seconds=1))


def test_named_query_parser() -> None:
    text = (
        "-- header comment\n\n-- name: a_b :one\n-- Does a thing.\nSELECT 1;\n\n"
        "-- name: c :many\n-- Lists.\nSELECT 2\n-- inner comment\nFROM x;\n"
    )
    queries = parse(text, "t.sql")
    assert queries["a_b"].sql == "SELECT 1" and queries["a_b"].kind == "one"
    # Sent compacted: whole-line comments and indentation go, the statement stays.
    assert queries["c"].doc == "Lists." and queries["c"].sql == "SELECT 2\nFROM x"
    text = (
        "-- name: d :one\n-- Indented.\n  SELECT 'a -- b', 'c' -- gone\n\n    -- gone\n"
        "  FROM y -- gone, with an apostrophe's\n"
    )
    assert parse(text, "t.sql")["d"].sql == "SELECT 'a -- b', 'c'\nFROM y"
    with pytest.raises(ConfigurationError, match=r"query e: .*literal"):
        parse("-- name: e :one\n-- Spans.\nSELECT 'a\n  b'", "t.sql")
    with pytest.raises(ConfigurationError, match="description"):
        parse("-- name: x :one\nSELECT 1;", "t.sql")
    with pytest.raises(ConfigurationError, match="defined twice"):
        parse("-- name: x :one\n-- d\nSELECT 1;\n-- name: x :one\n-- d\nSELECT 2;", "t.sql")
    # A mistyped header was the query above's comment, and its statement appended to that one.
    with pytest.raises(ConfigurationError, match=r"'-- name: y: one' is not a query header"):
        parse("-- name: x :one\n-- d\nSELECT 1;\n-- name: y: one\n-- d\nDELETE FROM t;", "t.sql")
    # A block comment could hide a `--` (and what follows it) from the compaction.
    with pytest.raises(ConfigurationError, match=r"query z: .*/\* comment \*/"):
        parse("-- name: z :one\n-- d\nSELECT /* a -- b */ 1, 2;", "t.sql")


def test_every_shipped_query_is_short_enough_for_the_drivers_parse_cache() -> None:
    # Longer texts are re-parsed on every execution (psycopg's MAX_CACHED_STATEMENT_LENGTH).
    for query in load().values():
        assert len(query.sql.encode()) <= DRIVER_CACHED_QUERY_BYTES, query.name


def test_every_shipped_query_has_a_description_and_no_string_formatting() -> None:
    for query in load().values():
        assert query.doc
        assert "{" not in query.sql.replace("'{", "")  # no str.format placeholders


def test_the_text_of_a_nul_escape_is_not_a_nul() -> None:
    # The six characters `\u0000` are ordinary text (jsonb stores them); only a real NUL, however
    # many backslashes stand before it, is refused.
    for fine in ({"\\u0000": "\\\\u0000"}, ["a\\u0000b"]):
        assert json.loads(encode_json(fine, "context")) == fine
    for bad in ("\x00", "\\\x00", {"k": ["\\\\\x00"]}):
        with pytest.raises(InvalidInput, match="NUL"):
            encode_json(bad, "context")


def test_a_duplicate_names_what_it_asked_for_differently() -> None:
    at = datetime(2026, 11, 1, tzinfo=UTC)
    asked = EnqueueRequest.build(
        tenant="acme", pipeline="p", stage="s", source="src", source_id="1", directive="d",
        context={"n": 1.0, "k": [1, 2]},
    )  # fmt: skip
    stored = Message(
        id=1, tenant="acme", pipeline="p", stage="s", source="src", source_id="1",
        idempotency_key=asked.idempotency_key, directive="d", context={"k": [1, 2], "n": 1},
        from_agent=None, to_agent=None, lane=Lane.BATCH, priority=0,
        status=MessageStatus.DONE, attempts=1, max_attempts=3, not_before=at, deadline=None,
        lease_token=None, lease_expires_at=None, result=None, error=None, created_at=at,
        updated_at=at,
    )  # fmt: skip
    # The same content (keys in another order, 1.0 as jsonb keeps it); lane, attempts and
    # priority left to the defaults, and the times the bus moves, are not compared.
    assert differences(asked, stored) == []
    moved = replace(stored, priority=2, not_before=at + timedelta(hours=1), deadline=at)
    assert differences(asked, moved) == []
    other = EnqueueRequest.build(
        tenant="acme", pipeline="p", stage="s", source="src", source_id="1", directive="e",
        context={"n": 2}, lane="interactive", priority=3, max_attempts=3,
    )  # fmt: skip
    assert differences(other, stored) == ["directive", "context", "lane", "priority"]
    # Times asked for: a deadline always (one asked for and not had is named), a not-before
    # while the message is unattempted (a retry's backoff moves it).
    timed = EnqueueRequest.build(
        tenant="acme", pipeline="p", stage="s", source="src", source_id="1", directive="d",
        context={"n": 1.0, "k": [1, 2]}, deadline=at + timedelta(days=1),
        not_before=at + timedelta(hours=2),
    )  # fmt: skip
    assert differences(timed, stored) == ["deadline"]  # attempted: its not-before moved
    fresh = replace(stored, attempts=0, status=MessageStatus.PENDING)
    assert differences(timed, fresh) == ["deadline", "not_before"]
    assert timed.not_before is not None
    kept = replace(fresh, deadline=timed.deadline, not_before=timed.not_before)
    assert differences(timed, kept) == []
