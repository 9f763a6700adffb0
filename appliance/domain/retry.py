"""Retry policy: exponential backoff with full jitter, capped; pure so tests can pin the random."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta

from appliance.domain.errors import InvalidInput

RETRY_CAP_MAX = timedelta(days=7)


@dataclass(frozen=True)
class RetryPolicy:
    """Delay before attempt n+1: uniform in [base*2^(n-1)/2, base*2^(n-1)], never above `cap`.

    Half-jitter keeps a floor (a failing dependency gets some rest) while spreading retries of
    messages that failed together, so they do not return as one thundering herd.
    """

    base: timedelta = timedelta(seconds=2)
    cap: timedelta = timedelta(minutes=10)

    def __post_init__(self) -> None:
        if self.base <= timedelta(0):
            raise InvalidInput("retry.base", "must be positive")
        if self.cap < self.base:
            raise InvalidInput("retry.cap", "must be at least retry.base")
        # As the settings hold it (retry_cap_seconds): a delay of years would put a retry's
        # not-before past what the database stores, and the failure could not be recorded.
        if self.cap > RETRY_CAP_MAX:
            raise InvalidInput("retry.cap", f"must be at most {RETRY_CAP_MAX} (7 days)")

    def delay(self, attempts: int, rng: random.Random | None = None) -> timedelta:
        """The wait after `attempts` failed attempts (attempts >= 1)."""
        exponent = min(max(attempts, 1) - 1, 32)
        # In float seconds, capped before it becomes a timedelta: base * 2**32 overflows one
        # for any base above about 5.6 hours, and the failure could then never be recorded.
        ceiling = min(self.base.total_seconds() * 2.0**exponent, self.cap.total_seconds())
        fraction = 0.5 + 0.5 * (rng or random).random()
        return timedelta(seconds=ceiling * fraction)
