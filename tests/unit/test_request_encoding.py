"""Enqueue requests as enqueue_requests' JSON rows: every field survives, contexts spliced."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from typing import Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.db.message_store import _requests_json
from appliance.domain.envelope import EnqueueRequest, Lane
from appliance.domain.errors import InvalidInput

SURROGATES: tuple[Literal["Cs"]] = ("Cs",)
# Text as callers send it: anything but NUL and lone surrogates (both refused at build),
# including quotes, backslashes, the six characters `\u0000`, and characters beyond ASCII.
TEXT = st.text(
    st.characters(blacklist_characters="\x00", blacklist_categories=SURROGATES),
    min_size=1,
    max_size=20,
) | st.sampled_from(["\\u0000", '"\\u0000"', '"', "\\", "é ✓ 𝄞"])
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)


@given(st.lists(st.tuples(TEXT, TEXT.filter(str.strip), JSON), min_size=1, max_size=6))
def test_every_field_survives_and_contexts_are_spliced(rows: list[tuple[str, str, object]]) -> None:
    now = datetime(2026, 11, 1, tzinfo=UTC)
    requests = [
        EnqueueRequest.build(
            tenant="acme",
            pipeline="p",
            stage="s",
            source="t",
            source_id=f"{i}-{sid}",
            directive=directive,
            context=context,
            lane=Lane.BATCH if i % 2 else None,
            deadline=now + timedelta(hours=1),
            now=now,
        )
        for i, (sid, directive, context) in enumerate(rows)
    ]
    decoded = json.loads(_requests_json(requests))
    assert len(decoded) == len(requests)
    for row, r in zip(decoded, requests, strict=True):
        assert row[:7] == [
            r.tenant,
            r.pipeline,
            r.stage,
            r.source,
            r.source_id,
            r.idempotency_key,
            r.directive,
        ]
        assert row[9] == (r.lane.value if r.lane else None)
        assert row[13] == r.deadline.isoformat() if r.deadline else row[13] is None
        assert row[15] == json.loads(r.context_json)


def test_a_nul_that_slipped_past_validation_is_refused_not_spliced() -> None:
    good = EnqueueRequest.build(
        tenant="acme", pipeline="p", stage="s", source="t", source_id="1", directive="d"
    )
    bad = dataclasses.replace(good, directive="\x00")
    with pytest.raises(InvalidInput, match="NUL"):
        _requests_json([good, bad])
