"""Capacity by lane: slots reserved for interactive work, a small share for system work.

Batch work may use only the shared slots, so a backfill can never occupy what is kept for
interactive work; system work has its own reserved share and may borrow shared slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.domain.envelope import Lane
from appliance.domain.errors import ConfigurationError


@dataclass
class LaneSlots:
    """Counts running work per lane and says how much more each lane may start."""

    total: int
    reserved_interactive: int
    reserved_system: int
    running: dict[Lane, int] = field(default_factory=lambda: {lane: 0 for lane in Lane})

    def __post_init__(self) -> None:
        if self.total < 1:
            raise ConfigurationError("runner concurrency must be at least 1")
        if self.reserved_interactive < 0 or self.reserved_system < 0:
            raise ConfigurationError("reserved slots cannot be negative")
        if self.reserved_interactive + self.reserved_system > self.total:
            raise ConfigurationError(
                f"reserved slots ({self.reserved_interactive} interactive + "
                f"{self.reserved_system} system) exceed the concurrency {self.total}"
            )

    @property
    def shared(self) -> int:
        return self.total - self.reserved_interactive - self.reserved_system

    def free(self, lane: Lane) -> int:
        """How many more messages of `lane` may start now."""
        # Called several times per message on the runner's loop: plain arithmetic, no calls.
        running = self.running
        own_i = self.reserved_interactive - running[Lane.INTERACTIVE]
        own_s = self.reserved_system - running[Lane.SYSTEM]
        # Interactive and system work beyond its own reserve uses shared slots, as batch does.
        used = running[Lane.BATCH] + (-own_i if own_i < 0 else 0) + (-own_s if own_s < 0 else 0)
        shared_free = self.total - self.reserved_interactive - self.reserved_system - used
        if shared_free < 0:
            shared_free = 0
        if lane is Lane.INTERACTIVE:
            return shared_free + (own_i if own_i > 0 else 0)
        if lane is Lane.SYSTEM:
            return shared_free + (own_s if own_s > 0 else 0)
        return shared_free

    def capacity(self, lane: Lane) -> int:
        """How many messages of `lane` may run at once when nothing else runs."""
        if lane is Lane.INTERACTIVE:
            return self.total - self.reserved_system
        if lane is Lane.SYSTEM:
            return self.total - self.reserved_interactive
        return self.shared

    def own_free(self, lane: Lane) -> int:
        """How many of the slots reserved for `lane` are free (shared ones not counted)."""
        reserved = {Lane.INTERACTIVE: self.reserved_interactive, Lane.SYSTEM: self.reserved_system}
        return max(0, reserved.get(lane, 0) - self.running[lane])

    def take(self, lane: Lane, n: int = 1) -> None:
        if n > self.free(lane):
            raise RuntimeError(f"no free {lane.value} slot")  # a runner bug, never input
        self.running[lane] += n

    def give(self, lane: Lane, n: int = 1) -> None:
        self.running[lane] = max(0, self.running[lane] - n)

    @property
    def busy(self) -> int:
        return sum(self.running.values())
