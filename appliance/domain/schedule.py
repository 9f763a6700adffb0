"""Declared schedules: periodic work that is enqueued, idempotently, instead of private timers.

The idempotency key of a firing includes its scheduled time, so a restart, a late runner or a
second runner firing the same slot creates no new work.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from appliance.domain.envelope import NAME_RE, JSONValue, Lane
from appliance.domain.errors import ConfigurationError


@dataclass(frozen=True)
class Schedule:
    """Enqueue (pipeline, stage) for `tenant` every `every`, or on a crontab line (UTC)."""

    name: str
    tenant: str
    pipeline: str
    stage: str
    directive: str
    every: timedelta | None = None
    cron: str | None = None
    lane: Lane = Lane.SYSTEM
    context: JSONValue = None

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise ConfigurationError(f"schedule name {self.name!r} is not a valid name")
        if (self.every is None) == (self.cron is None):
            raise ConfigurationError(f"schedule {self.name}: give exactly one of every= or cron=")
        if self.every is not None and self.every < timedelta(seconds=1):
            raise ConfigurationError(f"schedule {self.name}: every= must be at least 1 s")

    def source_id(self, fire_time: datetime) -> str:
        """The firing's identity: the schedule's name and its scheduled time (UTC, ISO)."""
        if fire_time.tzinfo is None:
            raise ConfigurationError("a fire time must carry a time zone")
        return f"{self.name}@{fire_time.isoformat(timespec='seconds')}"
