"""Damping of repeated failure logs: one record per failure and interval, then a count.

While the database is unreachable, every periodic step of a runner (claims, heartbeats,
acknowledgements, reports) fails on each try and logs the failure with its traceback: a few
records a second, tens of lines each, into a log nothing rotates, for as long as the outage
lasts. A failure logged with an exception is shown once per interval for each place it is
logged from and kind of exception; the next one shown after the interval says how many were
left out. Records without an exception (a handler's failure, which names its message) are
never held back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

Key = tuple[str, int, object, str]


class RepeatDamper(logging.Filter):
    """A handler filter: of the records with an exception that share a logger, a level, a
    message template and an exception type, one per `interval_s`."""

    def __init__(
        self, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.clock = clock
        self._shown_at: dict[Key, float] = {}
        self._held: dict[Key, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or record.exc_info[0] is None:
            return True
        key: Key = (record.name, record.levelno, record.msg, record.exc_info[0].__qualname__)
        now = self.clock()
        shown = self._shown_at.get(key)
        if shown is not None and now - shown < self.interval_s:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        self._shown_at[key] = now
        held = self._held.pop(key, 0)
        if held:
            # Said in the record's own words: the count goes after its message.
            record.msg = (
                f"{record.msg} ({held} more like this in the last {self.interval_s:g} s not shown)"
            )
        if len(self._shown_at) > 1000:  # a bounded memory of what was shown
            cutoff = now - self.interval_s
            self._shown_at = {k: t for k, t in self._shown_at.items() if t >= cutoff}
            self._held = {k: n for k, n in self._held.items() if k in self._shown_at}
        return True
