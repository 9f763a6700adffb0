"""Pipelines for the governance end-to-end tests, loaded by real runner processes with
`--pipeline-module tests.e2e.governed_pipelines`: a runaway loop that calls the model and
re-enqueues itself, the same loop with a hop limit, steady work for a second tenant, and a
long generation to kill runners in the middle of."""

from __future__ import annotations

from datetime import timedelta

from appliance.domain.budget import RunBudget
from appliance.domain.pipeline import Pipeline, Stage, StageContext, StageResult

RAMBLE = "Here is a very long story about a dragon, told in great detail. Once upon a time,"


async def runaway(ctx: StageContext) -> StageResult:
    """The ungoverned polling loop of the story: one model call, then itself again."""
    answer = await ctx.infer("classify", "Is the queue empty? Answer:", max_tokens=4)
    ctx.spawn(ctx.message.stage, f"hop-{ctx.message.hops + 1}")
    return ctx.finish({"said": answer.text, "hop": ctx.message.hops})


async def steady(ctx: StageContext) -> StageResult:
    answer = await ctx.infer("classify", f"Ticket {ctx.message.source_id}. Label:", max_tokens=4)
    return ctx.finish({"said": answer.text})


async def long_call(ctx: StageContext) -> StageResult:
    answer = await ctx.infer("extract", RAMBLE, max_tokens=400)
    return ctx.finish({"tokens": answer.completion_tokens})


def _stage(name: str, handler: object, runtime: float = 120) -> Stage:
    return Stage(
        name,
        handler,  # type: ignore[arg-type]
        task_kind="classify" if name != "long" else "extract",
        uses_model=True,
        max_runtime=timedelta(seconds=runtime),
    )


PIPELINES = [
    Pipeline("runaway", (_stage("loop", runaway),)),
    Pipeline("hopper", (_stage("loop", runaway),), budget=RunBudget(max_hops=5)),
    Pipeline("steady", (_stage("run", steady),)),
    Pipeline("long", (_stage("long", long_call),)),
]
