"""Capacity by lane: slots reserved for interactive work, a small share for system work.

Batch work may use only the shared slots, so a backfill can never occupy what is kept for
interactive work; system work has its own reserved share and may borrow shared slots.

A handler given up on (it ignored cancellation) runs on until it ends, and its task uses what
the concurrency promises (CPU, the model pool, memory) as much as a running one: it holds a
slot until then, so running plus abandoned never exceeds the total. Abandoned handlers hold
shared slots first, whatever their lane, so that the reserves stay for live work as long as
the shared slots can carry the wedge; those the shared slots cannot hold take their own lane's
reserve (the system lane's before the interactive lane's where both lanes' handlers wedge:
interactive work is what the reservation protects first). A lane's reserve is thus eaten only
by its own lane's abandoned handlers: a wedged batch stage never takes a reserved slot, and a
wedged system stage never takes one kept for interactive work. (An abandoned handler first
took a slot as running work and only then was given up on, so its own lane's reserve always
has the room: see `_reserves_left`.)
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
    # Handlers given up on that still run, by the lane of their message (see the module's text).
    # Kept by abandon() and abandoned_ended() alone: the total is their sum, kept beside them
    # for free(), which runs several times per message.
    abandoned: dict[Lane, int] = field(
        default_factory=lambda: {lane: 0 for lane in Lane}, init=False
    )
    abandoned_total: int = field(default=0, init=False)

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
        # Called several times per message on the runner's loop: plain arithmetic, no calls
        # (one only while handlers given up on run on).
        running = self.running
        own_i = self.reserved_interactive - running[Lane.INTERACTIVE]
        own_s = self.reserved_system - running[Lane.SYSTEM]
        # Interactive and system work beyond its own reserve uses shared slots, as batch does;
        # so do abandoned handlers, as far as the shared slots go.
        used = running[Lane.BATCH] + (-own_i if own_i < 0 else 0) + (-own_s if own_s < 0 else 0)
        shared_free = self.total - self.reserved_interactive - self.reserved_system - used
        abandoned = self.abandoned_total
        if abandoned:
            shared_free -= abandoned
            if shared_free < 0:
                # The abandoned handlers the shared slots cannot hold (never more than there
                # are) take reserved slots.
                short = -shared_free if -shared_free < abandoned else abandoned
                own_i, own_s = self._reserves_left(short, own_i, own_s)
                shared_free = 0
        elif shared_free < 0:
            shared_free = 0
        if lane is Lane.INTERACTIVE:
            return shared_free + (own_i if own_i > 0 else 0)
        if lane is Lane.SYSTEM:
            return shared_free + (own_s if own_s > 0 else 0)
        return shared_free

    def _reserves_left(self, short: int, own_i: int, own_s: int) -> tuple[int, int]:
        """The free reserved slots of each lane once the `short` abandoned handlers that the
        shared slots cannot hold have taken theirs: each from its own lane's reserve, the
        system lane's first."""
        room_i = own_i if own_i > 0 else 0
        room_s = own_s if own_s > 0 else 0
        from_s = min(short, self.abandoned[Lane.SYSTEM], room_s)
        from_i = min(short - from_s, self.abandoned[Lane.INTERACTIVE], room_i)
        # Never left over by the runner (a handler is given up on only after it took its slot
        # as running work, so its lane's reserve has the room its move to the shared slots
        # left there); were it, the total would still hold: from whatever room is left.
        left = short - from_s - from_i
        more_s = min(left, room_s - from_s)
        more_i = min(left - more_s, room_i - from_i)
        return room_i - from_i - more_i, room_s - from_s - more_s

    def capacity(self, lane: Lane) -> int:
        """How many messages of `lane` may run at once when nothing else runs."""
        if lane is Lane.INTERACTIVE:
            return self.total - self.reserved_system
        if lane is Lane.SYSTEM:
            return self.total - self.reserved_interactive
        return self.shared

    def own_free(self, lane: Lane) -> int:
        """How many of the slots reserved for `lane` are free (shared ones not counted, nor
        those that abandoned handlers hold)."""
        reserved = {Lane.INTERACTIVE: self.reserved_interactive, Lane.SYSTEM: self.reserved_system}
        own = max(0, reserved.get(lane, 0) - self.running[lane])
        # Whatever the shared slots have left, what this lane may start beyond it is its own.
        return min(own, self.free(lane))

    def take(self, lane: Lane, n: int = 1) -> None:
        if n > self.free(lane):
            raise RuntimeError(f"no free {lane.value} slot")  # a runner bug, never input
        self.running[lane] += n

    def give(self, lane: Lane, n: int = 1) -> None:
        self.running[lane] = max(0, self.running[lane] - n)

    def abandon(self, lane: Lane) -> None:
        """A running handler of `lane` was given up on: its task runs on and keeps a slot
        (shared first: see the module's text) until `abandoned_ended`."""
        if self.running[lane] > 0:
            self.running[lane] -= 1
        self.abandoned[lane] += 1
        self.abandoned_total += 1

    def abandoned_ended(self, lane: Lane) -> None:
        """An abandoned handler's task ended: its slot is free."""
        if self.abandoned[lane] > 0:
            self.abandoned[lane] -= 1
            self.abandoned_total -= 1

    @property
    def busy(self) -> int:
        return sum(self.running.values())
