"""Stopping a generation at the energy its reservation paid for.

The bus reserves a call's worst case against the monthly cap before it starts, as joules at the
dearest price of the day. The estimate behind it (joules per token, from calibration) can be
wrong: a stale figure, a slower machine, a thermally throttled CPU. Without a stop, such a call
would settle above its hold, and the month's spend could pass the cap by the difference. The
guard reads the call's metered energy between tokens and stops the generation while what is
used, plus a margin for the stretch to the next check and the call's end, still fits.

Pure logic: the pool passes it a reading function and the time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("appliance.inference")

# A reading samples the meter (every registered thread's CPU time, the energy counters):
# about a millisecond, so not after every token of a fast model.
CHECK_EVERY = 0.05
# The margin kept is this many times the energy of the longest stretch between two checks.
MARGIN_STRETCHES = 2.0


class EnergyGuard:
    """Tells a generation to stop before its metered energy passes `limit` joules.

    `read()` returns the joules charged to the call so far. Checked at most every `every`
    seconds; it says stop once the energy used plus MARGIN_STRETCHES stretches would reach the
    limit. A stretch is the most energy seen between two checks, and at least the call's
    average power so far times `every` (the first check has no stretch of its own yet: the
    prompt's evaluation sets the pace). A reading that fails ends the checks (the call is then
    charged whatever the meter says at its end, or its whole reservation).
    """

    def __init__(
        self, limit: float, read: Callable[[], float], started: float, every: float = CHECK_EVERY
    ) -> None:
        if limit <= 0:
            raise ValueError(f"energy guard: the limit must be > 0 J, not {limit}")
        self.limit = limit
        self._read = read
        self._started = started
        self._every = every
        self._next = started  # the first token after the prompt is checked
        self._last: tuple[float, float] | None = None  # (time, joules) of the last reading
        self._stretch = 0.0
        self.used = 0.0
        self.stopped = False
        self._broken = False

    def stop(self, now: float) -> bool:
        """True when the generation must stop now (and at every later ask)."""
        if self.stopped:
            return True
        if self._broken or now < self._next:
            return False
        try:
            used = self._read()
        except Exception:
            log.exception("energy guard: the meter could not be read; the call runs unchecked")
            self._broken = True
            return False
        if self._last is not None:
            self._stretch = max(self._stretch, used - self._last[1])
        elapsed = now - self._started
        pace = used / elapsed * self._every if elapsed > 0 else 0.0
        self._last = (now, used)
        self.used = used
        self._next = now + self._every
        if used + MARGIN_STRETCHES * max(self._stretch, pace) >= self.limit:
            self.stopped = True
        return self.stopped
