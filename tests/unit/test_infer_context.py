"""ctx.infer's contract without a model: requests are validated, output is parsed as data."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

from appliance.domain.envelope import Lane, Message, MessageStatus
from appliance.domain.errors import ConfigurationError, InvalidInput
from appliance.domain.inference import (
    InferenceRequest,
    InferenceResult,
    OutputInvalid,
    Tier,
)
from appliance.domain.pipeline import StageContext, parse_output
from appliance.pipelines.support import TicketLabel


def message() -> Message:
    now = datetime(2026, 11, 1, tzinfo=UTC)
    return Message(
        id=1, tenant="acme", pipeline="support", stage="classify", source="s", source_id="1",
        idempotency_key="k", directive="d", context={"subject": "x"}, from_agent=None,
        to_agent=None, lane=Lane.INTERACTIVE, priority=0, status=MessageStatus.RUNNING,
        attempts=1, max_attempts=5, not_before=now, deadline=None, lease_token=7,
        lease_expires_at=now, claimed_by="w", result=None, error=None,
        created_at=now, updated_at=now,
    )  # fmt: skip


def context(reply: str, seen: list[InferenceRequest] | None = None) -> StageContext:
    async def fake_model(
        request: InferenceRequest, parse: Callable[[str], Any] | None
    ) -> InferenceResult:
        # Stands in for the runner's routed call: these tests are about parsing, not models.
        if seen is not None:
            seen.append(request)
        result = InferenceResult(
            text=reply, model="m", model_sha256="0" * 64, tier=Tier.MECHANICAL,
            prompt_tokens=1, completion_tokens=1, finish_reason="stop", queue_seconds=0,
            ttft_seconds=0, total_seconds=0,
        )  # fmt: skip
        return replace(result, data=parse(reply)) if parse is not None else result

    return StageContext(
        message(),
        deadline=None,
        cancelled=asyncio.Event(),
        clock=lambda: datetime.now(UTC),
        inferrer=fake_model,
    )


async def test_output_is_parsed_into_the_schema() -> None:
    seen: list[InferenceRequest] = []
    result = await context('{"label": "bug"}', seen).infer("classify", "t", schema=TicketLabel)
    assert result.data == TicketLabel(label="bug")
    assert seen[0].json_schema == TicketLabel.model_json_schema()


async def test_output_outside_the_schema_is_refused_as_data() -> None:
    with pytest.raises(OutputInvalid):
        await context('{"label": "delete all tenants"}').infer("classify", "t", schema=TicketLabel)
    with pytest.raises(OutputInvalid):
        parse_output("not json", {"type": "object"})
    assert parse_output('{"a": 1}', {"type": "object"}) == {"a": 1}


async def test_bad_requests_are_named() -> None:
    ctx = context("x")
    with pytest.raises(InvalidInput, match="exactly one of prompt or messages"):
        await ctx.infer("classify")
    with pytest.raises(InvalidInput, match="max_tokens"):
        await ctx.infer("classify", "p", max_tokens=0)
    with pytest.raises(InvalidInput, match="role"):
        await ctx.infer("classify", messages=[{"role": "root", "content": "x"}])
    with pytest.raises(InvalidInput, match=r"messages\[0\]"):
        await ctx.infer("classify", messages=[{"role": "user"}])


async def test_a_runner_without_a_pool_says_so() -> None:
    ctx = StageContext(
        message(), deadline=None, cancelled=asyncio.Event(), clock=lambda: datetime.now(UTC)
    )
    with pytest.raises(ConfigurationError, match="no inference pool"):
        await ctx.infer("classify", "p")
