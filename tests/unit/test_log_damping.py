"""Repeated failure logs are damped: one per interval and kind, then a count."""

from __future__ import annotations

import logging

import pytest

from appliance.log_damping import RepeatDamper


def _failure(log: logging.Logger, template: str = "claim failed; retrying") -> None:
    try:
        raise ConnectionError("server closed the connection")
    except ConnectionError:
        log.exception(template)


def test_a_repeated_failure_is_shown_once_an_interval_then_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    damper = RepeatDamper(60, clock=lambda: now[0])
    log = logging.getLogger("appliance.test.damping")
    caplog.handler.addFilter(damper)
    try:
        with caplog.at_level(logging.WARNING, logger=log.name):
            for _ in range(50):  # a few a second while the database is down
                _failure(log)
                now[0] += 0.4
            _failure(log, "heartbeat failed")  # another place: its own first record
            log.warning("handler %s failed: %s", "p.s", "boom")  # no exception: never held
            log.warning("handler %s failed: %s", "p.s", "boom")
            now[0] = 61.0
            _failure(log)
    finally:
        caplog.handler.removeFilter(damper)
    shown = [r.getMessage() for r in caplog.records]
    assert shown == [
        "claim failed; retrying",
        "heartbeat failed",
        "handler p.s failed: boom",
        "handler p.s failed: boom",
        "claim failed; retrying (49 more like this in the last 60 s not shown)",
    ]
