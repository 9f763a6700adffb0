"""Stopping a generation at the energy its reservation paid for.

The bus reserves a call's worst case against the monthly cap before it starts, as joules at the
dearest price of the day. The estimate behind it (joules per token, from calibration) can be
wrong: a stale figure, a slower machine, a thermally throttled CPU. Without a stop, such a call
would settle above its hold, and the month's spend could pass the cap by the difference. The
guard reads the call's metered energy between tokens and stops the generation while what is
used, plus a margin for the tokens until the next reading, still fits.

Pure logic: the pool passes it a reading function, the time and the tokens generated so far.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("appliance.inference")

# A reading samples the meter (every registered thread's CPU time, the energy counters): about
# 0.1 ms, so not after every token of a fast model.
CHECK_EVERY = 0.05
# A meter that fails this many readings in a row stops the generation (it cannot be guarded).
FAILED_READS_TO_STOP = 3
# The margin kept is this many times the energy the tokens until the next reading are expected
# to use (the largest energy per token seen, times the most tokens that fit before it).
MARGIN = 2.0


class EnergyGuard:
    """Tells a generation to stop before its metered energy passes `limit` joules.

    Asked between tokens (`stop(now, tokens)`, `tokens` generated so far, each one evaluated);
    `read()` returns the joules charged to the call so far.

    - The first ask follows the prompt's evaluation. Evaluating the next token is a forward pass
      over one token, which costs no more than the pass over the prompt just measured, nor
      (with `paid_tokens`, the tokens the hold paid for) much more than the hold paid a token:
      the guard stops if the smaller of the prompt's energy and MARGIN times that would reach
      the limit, and reads again at the next token. (A hold priced too low can so pass by at
      most that first token's difference.)
    - Later, it reads at most every `every` seconds, and stops once the energy used plus MARGIN
      times the expected cost of the tokens before the next reading would reach the limit: the
      largest energy per token seen, times one token plus as many as the fastest stretch seen
      generates in `every` seconds. Slow tokens and fast ones are both covered.

    A reading that fails is tried again at the next ask; FAILED_READS_TO_STOP in a row stop
    the generation: unguarded, a call whose meter reads again at its end would be charged its
    metered energy, past its hold (ending the checks at the first failure did that). The
    guard works at its meter's resolution: a prompt that evaluates faster than the meter ticks
    reads as 0 J, and then its first token is unguarded.
    """

    def __init__(
        self,
        limit: float,
        read: Callable[[], float],
        started: float,
        every: float = CHECK_EVERY,
        *,
        paid_tokens: int | None = None,
    ) -> None:
        if limit <= 0:
            raise ValueError(f"energy guard: the limit must be > 0 J, not {limit}")
        self.limit = limit
        # What the hold paid for each token (its prompt's and its answer's): a bound on the
        # next token's pass at the first reading, tighter than a long prompt's whole pass.
        self._paid_per_token = limit / paid_tokens if paid_tokens else None
        self._read = read
        self._every = every
        self._next = started
        self._last: tuple[float, float, int] | None = None  # (time, joules, tokens) last read
        self._per_token = 0.0  # the most joules per token seen between two readings
        self._rate = 0.0  # the most tokens per second seen between two readings
        self.used = 0.0
        self.stopped = False
        self._failed_reads = 0

    def stop(self, now: float, tokens: int) -> bool:
        """True when the generation must stop now (and at every later ask)."""
        if self.stopped:
            return True
        if now < self._next and not self._failed_reads:
            return False
        try:
            used = self._read()
        except Exception:
            self._failed_reads += 1
            if self._failed_reads >= FAILED_READS_TO_STOP:
                log.exception(
                    "energy guard: the meter failed %d readings in a row; the generation stops"
                    " (it cannot be held to its reservation)",
                    self._failed_reads,
                )
                self.stopped = True
                return True
            log.warning("energy guard: a meter reading failed; trying again at the next token")
            return False
        self._failed_reads = 0
        if self._last is None:
            # After the prompt: the next token's pass costs at most what the prompt's did, and
            # (unless the figure behind the hold is wrong) about what the hold paid a token.
            ahead = used
            if self._paid_per_token is not None:
                ahead = min(ahead, MARGIN * self._paid_per_token)
            self._next = now  # read again at the next token: one token's cost, measured
        else:
            at, before, counted = self._last
            if tokens > counted:
                self._per_token = max(self._per_token, (used - before) / (tokens - counted))
                if now > at:
                    self._rate = max(self._rate, (tokens - counted) / (now - at))
            ahead = MARGIN * self._per_token * (1 + self._rate * self._every)
            self._next = now + self._every
        self._last = (now, used, tokens)
        self.used = used
        if used + ahead >= self.limit:
            self.stopped = True
        return self.stopped
