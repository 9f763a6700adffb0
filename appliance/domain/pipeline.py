"""Pipeline declarations: one description of a pipeline's stage graph, used by code and by SQL.

A pipeline is a set of stages; each stage names its handler, lane, task kind and limits, and the
next stage per outcome. The runner registers the handlers from the same declaration that it
writes into `pipeline_stages` / `stage_routes`, so the two cannot drift.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, ValidationError

from appliance.domain.budget import RunBudget
from appliance.domain.envelope import (
    DEFAULT_CONTEXT_MAX_BYTES,
    NAME_RE,
    JSONValue,
    Lane,
    Message,
    encode_context,
)
from appliance.domain.errors import ConfigurationError, InvalidInput
from appliance.domain.inference import (
    ChatMessage,
    InferenceRequest,
    InferenceResult,
    OutputInvalid,
    Tier,
    as_messages,
    min_tier,
)

DEFAULT_OUTCOME = "ok"


@dataclass(frozen=True)
class StageResult:
    """What a handler hands back: a JSON result and the outcome that picks the next stage."""

    result: JSONValue = None
    outcome: str = DEFAULT_OUTCOME


# The runner's side of ctx.infer: routes, bounds and records the call; `parse` (when given)
# turns the output into data inside the recorded call, so invalid output is recorded as such.
Inferrer = Callable[[InferenceRequest, Callable[[str], Any] | None], Awaitable[InferenceResult]]


@dataclass(frozen=True)
class Spawn:
    """Follow-up work a handler asked for (enqueued when its stage completes)."""

    stage: str
    key: str
    context: JSONValue
    directive: str | None


class StageContext:
    """What a handler sees: its message, tenant, cancellation, deadline, models, how to finish."""

    def __init__(
        self,
        message: Message,
        *,
        deadline: datetime | None,
        cancelled: asyncio.Event,
        clock: Callable[[], datetime],
        inferrer: Inferrer | None = None,
        writer: Callable[[int], Awaitable[None]] | None = None,
        context_max_bytes: int = DEFAULT_CONTEXT_MAX_BYTES,
    ) -> None:
        self.message = message
        self.context_max_bytes = context_max_bytes
        self.tenant = message.tenant
        self.deadline = deadline
        self._cancelled = cancelled
        self._clock = clock
        self._inferrer = inferrer
        self._writer = writer
        self.cancel_reason: str | None = None
        self.spawned: list[Spawn] = []

    def spawn(
        self,
        stage: str,
        key: str,
        *,
        context: JSONValue = None,
        directive: str | None = None,
    ) -> None:
        """Enqueue follow-up work of this run when this stage completes.

        The new message belongs to the same run (same source and source id), so it draws on
        the same run budget, one hop further from the run's start: fan-out cannot escape the
        budget, and the hop limit stops a message that keeps re-enqueueing itself. `key` names
        it within the run: it is enqueued before the completion is recorded, keyed (run, stage,
        key), so a retried attempt enqueues nothing twice. Stages it reaches through the stage
        graph are keyed per run like any hand-off: a stage reached from several spawned
        messages is entered once (fan-in).
        """
        if not NAME_RE.match(stage):
            raise InvalidInput("stage", f"{stage!r} is not a valid stage name")
        if not key or len(key) > 200:
            raise InvalidInput("key", "must be 1-200 characters")
        # Checked here, where the handler can still act on it: found only at completion, it
        # failed the attempt, and a retry ran the handler (and its side effects) again.
        encode_context(context, self.context_max_bytes)
        if directive is not None and not directive.strip():
            raise InvalidInput("directive", "must not be empty")
        self.spawned.append(Spawn(stage, key, context, directive))

    async def reserve_write(self, count: int = 1) -> None:
        """Reserve `count` external writes against the run's budget before doing them
        (BudgetExhausted when they do not fit: the write must not happen)."""
        if count < 1:
            raise InvalidInput("count", "must be >= 1")
        if self._writer is not None:
            await self._writer(count)

    async def infer(
        self,
        kind: str,
        prompt: str | None = None,
        *,
        messages: Sequence[Mapping[str, str] | ChatMessage] = (),
        schema: type[BaseModel] | Mapping[str, Any] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        stop: Sequence[str] = (),
    ) -> InferenceResult:
        """Ask a model: the runner routes `kind` to a tier (never a weaker one than the kind
        needs), bounds the call by this stage's deadline and cancellation, and records it.

        With `schema` (a pydantic model or a JSON schema), the output is constrained by a grammar
        and parsed: `result.data` holds the parsed value, and output that does not parse raises
        OutputInvalid. Model output is data: nothing it says changes the message by itself.
        """
        if self._inferrer is None:
            raise ConfigurationError("this runner has no inference pool (inference.enabled)")
        json_schema: Mapping[str, Any] | None
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            json_schema = schema.model_json_schema()
        else:
            json_schema = schema
        request = InferenceRequest(
            kind=kind,
            prompt=prompt,
            messages=as_messages(messages),
            json_schema=json_schema,
            max_tokens=max_tokens,
            temperature=temperature,
            stop=tuple(stop),
        )
        if schema is None:
            return await self._inferrer(request, None)
        expected = schema
        return await self._inferrer(request, lambda text: parse_output(text, expected))

    @property
    def cancelled(self) -> bool:
        """True once the message was cancelled, its lease lost, or the runner is stopping."""
        return self._cancelled.is_set()

    async def wait_cancelled(self) -> None:
        """Return when cancellation arrives (for handlers that wait on something else too)."""
        await self._cancelled.wait()

    def remaining(self) -> timedelta | None:
        """Time left before the stage's deadline (None: no deadline)."""
        if self.deadline is None:
            return None
        return max(self.deadline - self._clock(), timedelta(0))

    def finish(self, result: JSONValue = None, outcome: str = DEFAULT_OUTCOME) -> StageResult:
        """The value a handler returns to complete its stage."""
        if not NAME_RE.match(outcome):
            raise ConfigurationError(f"outcome {outcome!r} is not a valid name")
        return StageResult(result, outcome)


def parse_output(text: str, schema: type[BaseModel] | Mapping[str, Any]) -> Any:
    """Model output parsed into the expected shape, or OutputInvalid naming what is wrong."""
    try:
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            return schema.model_validate_json(text)
        return json.loads(text)
    except (ValidationError, ValueError) as exc:
        raise OutputInvalid(f"model output does not match the schema: {exc}") from exc


Handler = Callable[[StageContext], Awaitable[StageResult]]


@dataclass(frozen=True)
class Stage:
    """One stage: its handler, where it runs, its limits, and the next stage per outcome."""

    name: str
    handler: Handler
    lane: Lane = Lane.INTERACTIVE
    task_kind: str = "format"
    directive: str = ""
    next: Mapping[str, str] = field(default_factory=dict)
    max_runtime: timedelta = timedelta(minutes=10)
    max_attempts: int = 5
    # The stage calls a model (ctx.infer) for its task kind: the runner claims it only when the
    # tier that kind needs has room, and parks it in waiting_capability while no such tier is up.
    uses_model: bool = False
    # A verification or cleanup stage: it may use its run budget's verification reserve.
    verification: bool = False

    @property
    def tier(self) -> Tier | None:
        """The weakest tier this stage's model work may run on (None: no model work)."""
        return min_tier(self.task_kind) if self.uses_model else None


@dataclass(frozen=True)
class Pipeline:
    """A named stage graph; the first stage is its entry point."""

    name: str
    stages: tuple[Stage, ...]
    # The budget of each run (source, source id) of this pipeline; None: only the monthly cap.
    budget: RunBudget | None = None

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise ConfigurationError(f"pipeline name {self.name!r} is not a valid name")
        if not self.stages:
            raise ConfigurationError(f"pipeline {self.name} has no stages")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"pipeline {self.name} repeats a stage name")
        for stage in self.stages:
            if not NAME_RE.match(stage.name):
                raise ConfigurationError(f"{self.name}.{stage.name}: not a valid stage name")
            for outcome, target in stage.next.items():
                if not NAME_RE.match(outcome):
                    raise ConfigurationError(f"{self.name}.{stage.name}: bad outcome {outcome!r}")
                if target not in names:
                    raise ConfigurationError(
                        f"{self.name}.{stage.name}: outcome {outcome!r} leads to unknown stage "
                        f"{target!r}"
                    )
            if stage.max_runtime <= timedelta(0):
                raise ConfigurationError(f"{self.name}.{stage.name}: max_runtime must be > 0")

    @property
    def entry(self) -> Stage:
        return self.stages[0]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"{self.name}.{name}")

    def rows(self) -> list[dict[str, Any]]:
        """The stage graph as rows for the database (stages with their routes)."""
        return [
            {
                "pipeline": self.name,
                "stage": s.name,
                "lane": s.lane.value,
                "task_kind": s.task_kind,
                "tier": s.tier.value if s.tier is not None else None,
                "handler": f"{getattr(s.handler, '__module__', '?')}."
                f"{getattr(s.handler, '__qualname__', repr(s.handler))}",
                "directive": s.directive or f"{self.name}: {s.name}",
                "max_runtime": s.max_runtime,
                "max_attempts": s.max_attempts,
                "routes": dict(s.next),
            }
            for s in self.stages
        ]


class Registry:
    """The pipelines a runner serves: handlers by (pipeline, stage)."""

    def __init__(self, pipelines: list[Pipeline] | None = None) -> None:
        self._pipelines: dict[str, Pipeline] = {}
        self._served: frozenset[tuple[str, str]] = frozenset()
        for pipeline in pipelines or []:
            self.add(pipeline)

    def add(self, pipeline: Pipeline) -> None:
        if pipeline.name in self._pipelines:
            raise ConfigurationError(f"pipeline {pipeline.name} registered twice")
        self._pipelines[pipeline.name] = pipeline
        self._served = self._served | {(pipeline.name, s.name) for s in pipeline.stages}

    @property
    def served(self) -> frozenset[tuple[str, str]]:
        """Every (pipeline, stage) with a handler here (what a runner says it serves)."""
        return self._served

    @property
    def pipelines(self) -> list[Pipeline]:
        return list(self._pipelines.values())

    def pipeline(self, name: str) -> Pipeline | None:
        return self._pipelines.get(name)

    def stage(self, pipeline: str, stage: str) -> Stage | None:
        found = self._pipelines.get(pipeline)
        if found is None:
            return None
        try:
            return found.stage(stage)
        except KeyError:
            return None
