"""Pipeline declarations: one description of a pipeline's stage graph, used by code and by SQL.

A pipeline is a set of stages; each stage names its handler, lane, task kind and limits, and the
next stage per outcome. The runner registers the handlers from the same declaration that it
writes into `pipeline_stages` / `stage_routes`, so the two cannot drift.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from appliance.domain.envelope import NAME_RE, JSONValue, Lane, Message
from appliance.domain.errors import ConfigurationError

DEFAULT_OUTCOME = "ok"


@dataclass(frozen=True)
class StageResult:
    """What a handler hands back: a JSON result and the outcome that picks the next stage."""

    result: JSONValue = None
    outcome: str = DEFAULT_OUTCOME


class StageContext:
    """What a handler sees: its message, tenant, cancellation, deadline, and how to finish."""

    def __init__(
        self,
        message: Message,
        *,
        deadline: datetime | None,
        cancelled: asyncio.Event,
        clock: Callable[[], datetime],
    ) -> None:
        self.message = message
        self.tenant = message.tenant
        self.deadline = deadline
        self._cancelled = cancelled
        self._clock = clock
        self.cancel_reason: str | None = None

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


@dataclass(frozen=True)
class Pipeline:
    """A named stage graph; the first stage is its entry point."""

    name: str
    stages: tuple[Stage, ...]

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
        for pipeline in pipelines or []:
            self.add(pipeline)

    def add(self, pipeline: Pipeline) -> None:
        if pipeline.name in self._pipelines:
            raise ConfigurationError(f"pipeline {pipeline.name} registered twice")
        self._pipelines[pipeline.name] = pipeline

    @property
    def pipelines(self) -> list[Pipeline]:
        return list(self._pipelines.values())

    def stage(self, pipeline: str, stage: str) -> Stage | None:
        found = self._pipelines.get(pipeline)
        if found is None:
            return None
        try:
            return found.stage(stage)
        except KeyError:
            return None
