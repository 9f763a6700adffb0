"""Pipelines for end-to-end runner tests, loaded by real runner processes with
`appliance runner --pipeline-module tests.e2e.fixture_pipelines`."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta

from appliance.domain.envelope import Lane
from appliance.domain.pipeline import Pipeline, Stage, StageContext, StageResult


def _num(ctx: StageContext, key: str, default: float = 0.0) -> float:
    context = ctx.message.context
    if isinstance(context, dict) and key in context:
        return float(context[key])
    return default


async def work(ctx: StageContext) -> StageResult:
    """Sleeps `sleep` seconds (cooperatively), then passes its context on."""
    delay = _num(ctx, "sleep")
    if delay > 0:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await ctx.wait_cancelled()
    return ctx.finish(ctx.message.context)


async def slow(ctx: StageContext) -> StageResult:
    """Sleeps `sleep` seconds and ignores the cooperative signal (a task cancel still stops it)."""
    await asyncio.sleep(_num(ctx, "sleep"))
    return ctx.finish(ctx.message.context)


async def wedged(ctx: StageContext) -> StageResult:
    """Never returns and swallows cancellation: the runner stays alive and keeps heartbeating."""
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            continue


async def boom(ctx: StageContext) -> StageResult:
    raise RuntimeError("handler exploded on purpose")


PIPELINES = [
    Pipeline(
        "chain",
        (
            Stage("one", work, next={"ok": "two"}),
            Stage("two", work, next={"ok": "three"}),
            Stage("three", work),
        ),
    ),
    Pipeline("work", (Stage("run", work, max_runtime=timedelta(seconds=60)),)),
    Pipeline("slow", (Stage("run", slow),)),
    Pipeline("bulk", (Stage("run", work, lane=Lane.BATCH),)),
    Pipeline("stuck", (Stage("run", wedged, max_runtime=timedelta(seconds=3), max_attempts=1),)),
    Pipeline("boom", (Stage("run", boom, max_attempts=2),)),
]
