"""The demo pipeline: three deterministic stages (intake -> enrich -> publish) that show work
flowing through the bus. Used by tests and by `./scripts/run --demo`."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from datetime import timedelta
from typing import Any

from appliance.domain.envelope import Lane
from appliance.domain.pipeline import Pipeline, Stage, StageContext, StageResult


def _payload(ctx: StageContext) -> dict[str, Any]:
    context = ctx.message.context
    return context if isinstance(context, dict) else {"value": context}


async def _pause(ctx: StageContext, payload: dict[str, Any]) -> None:
    # An optional, bounded pause so a demo is visible in `appliance status`; stops on cancel.
    delay = min(float(payload.get("delay_ms", 0)) / 1000.0, 30.0)
    if delay > 0:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await ctx.wait_cancelled()


async def intake(ctx: StageContext) -> StageResult:
    """Normalise the request: the words of the directive and a stable fingerprint."""
    payload = _payload(ctx)
    await _pause(ctx, payload)
    text = str(payload.get("text", ctx.message.directive))
    words = text.split()
    fingerprint = hashlib.sha256(text.encode()).hexdigest()[:12]
    outcome = "empty" if not words else "ok"
    result = {**payload, "text": text, "words": len(words), "fingerprint": fingerprint}
    return ctx.finish(result, outcome)


async def enrich(ctx: StageContext) -> StageResult:
    """Derive fields deterministically from what intake produced."""
    payload = _payload(ctx)
    await _pause(ctx, payload)
    words = int(payload.get("words", 0))
    size = "short" if words < 5 else "medium" if words < 20 else "long"
    return ctx.finish({**payload, "size": size, "score": words * 7 % 100})


async def publish(ctx: StageContext) -> StageResult:
    """The end of the line: a one-line summary."""
    payload = _payload(ctx)
    await _pause(ctx, payload)
    summary = (
        f"{payload.get('fingerprint', '?')}: {payload.get('words', 0)} words, "
        f"{payload.get('size', '?')}, score {payload.get('score', 0)}"
    )
    return ctx.finish({"summary": summary})


DEMO = Pipeline(
    "demo",
    (
        Stage(
            "intake",
            intake,
            lane=Lane.INTERACTIVE,
            task_kind="extract",
            directive="demo: normalise the request",
            next={"ok": "enrich"},
            max_runtime=timedelta(seconds=60),
        ),
        Stage(
            "enrich",
            enrich,
            lane=Lane.BATCH,
            task_kind="score",
            directive="demo: derive fields",
            next={"ok": "publish"},
            max_runtime=timedelta(seconds=60),
        ),
        Stage(
            "publish",
            publish,
            lane=Lane.INTERACTIVE,
            task_kind="format",
            directive="demo: summarise",
            max_runtime=timedelta(seconds=60),
        ),
    ),
)
