"""Claim-ahead: how many messages a runner may lease beyond its free slots, and holding them.

Under a backlog of quick stages a runner's slots empty faster than one claim returns: with
every slot waiting on the next claim, the claim's round trip bounds throughput, and each claim
pays its fixed cost (tenant round-robin, limits, the transition log) for only as many messages
as there are free slots. Leasing a few more than that keeps the slots busy while the next claim
is in flight and spreads that fixed cost over more messages.

What is held this way is leased work that is not running, so it is kept small and brief:
- at most `limit` messages in the whole runner;
- no more than the lane's slots finish within `window` claim round trips, judged from the
  measured time a slot stays busy and the measured claim round trip: slow stages (model work,
  handlers that wait on anything) get no claim-ahead at all;
- each held message has a time by which it must have started (the runner sets it well inside
  its lease and its run deadline, which both count from the claim); the runner gives back
  (without counting an attempt) whatever reaches it still held, and all of it when it stops.
Held messages count as running against their tenant's limit: they are leased.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator
from dataclasses import dataclass

from appliance.domain.envelope import Lane, Message
from appliance.domain.errors import ConfigurationError

# Weight of the newest observation in the moving averages: about the last ten count.
SMOOTHING = 0.2


@dataclass(frozen=True)
class Held:
    message: Message
    due: float  # monotonic seconds: start it before this, or give it back


class ClaimAhead:
    """The messages a runner holds leased beyond its free slots, first in first out per lane."""

    def __init__(self, limit: int, window: float = 2.0) -> None:
        if limit < 0:
            raise ConfigurationError(f"claim_ahead must be 0 or more, got {limit}")
        if window <= 0:
            raise ConfigurationError(f"claim-ahead window must be positive, got {window}")
        self.limit = limit
        self.window = window
        self._held: dict[Lane, collections.deque[Held]] = {
            lane: collections.deque() for lane in Lane
        }
        self._busy: dict[Lane, float | None] = {lane: None for lane in Lane}
        self._claim: float | None = None

    def __len__(self) -> int:
        return sum(len(q) for q in self._held.values())

    def held(self, lane: Lane) -> int:
        return len(self._held[lane])

    def messages(self) -> Iterator[Message]:
        """Every held message, lane by lane."""
        return (h.message for q in self._held.values() for h in q)

    # -- measurements ------------------------------------------------------------------------

    def observe_claim(self, seconds: float) -> None:
        """A claim's round trip."""
        self._claim = _smooth(self._claim, seconds)

    def observe_busy(self, lane: Lane, seconds: float) -> None:
        """How long a slot of `lane` stayed busy with one message (start to handler return)."""
        self._busy[lane] = _smooth(self._busy[lane], seconds)

    def allowance(self, lane: Lane, slots: int) -> int:
        """How many more messages of `lane` a claim may take beyond its free slots, given the
        `slots` the lane may use in all."""
        busy, claim = self._busy[lane], self._claim
        if self.limit == 0 or busy is None or claim is None or slots <= 0:
            return 0  # nothing measured yet: no claim-ahead until the runner has seen work run
        room = self.limit - len(self)
        if room <= 0:
            return 0
        # The lane's slots finish slots / busy messages a second; hold what they finish within
        # `window` claim round trips, so a held message waits about that long, no longer.
        by_rate = math.floor(self.window * slots * claim / max(busy, 1e-6))
        return max(0, min(room, by_rate))

    # -- holding -------------------------------------------------------------------------------

    def hold(self, message: Message, due: float) -> None:
        self._held[message.lane].append(Held(message, due))

    def pop(self, lane: Lane) -> Held | None:
        """The lane's longest-held message, taken out."""
        queue = self._held[lane]
        return queue.popleft() if queue else None

    def next_due(self) -> float | None:
        """The earliest time by which a held message must have started."""
        return min((h.due for q in self._held.values() for h in q), default=None)

    def take_due(self, now: float) -> list[Message]:
        """Remove and return every held message whose time to start has come."""
        taken: list[Message] = []
        for lane, queue in self._held.items():
            if any(h.due <= now for h in queue):
                taken += [h.message for h in queue if h.due <= now]
                self._held[lane] = collections.deque(h for h in queue if h.due > now)
        return taken

    def take_all(self) -> list[Message]:
        return self.take_due(math.inf)


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)
