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

    def _shared_used(self) -> int:
        over_i = max(0, self.running[Lane.INTERACTIVE] - self.reserved_interactive)
        over_s = max(0, self.running[Lane.SYSTEM] - self.reserved_system)
        return over_i + over_s + self.running[Lane.BATCH]

    def free(self, lane: Lane) -> int:
        """How many more messages of `lane` may start now."""
        shared_free = max(0, self.shared - self._shared_used())
        if lane is Lane.INTERACTIVE:
            own = max(0, self.reserved_interactive - self.running[Lane.INTERACTIVE])
            return own + shared_free
        if lane is Lane.SYSTEM:
            own = max(0, self.reserved_system - self.running[Lane.SYSTEM])
            return own + shared_free
        return shared_free

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
