"""Crontab schedules fire on the days a crontab line means (Sunday is 0 or 7)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from appliance.domain.errors import ConfigurationError
from appliance.domain.schedule import Schedule
from appliance.scheduler import schedule_trigger

SATURDAY = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def _next_days(cron: str, n: int = 5) -> list[str]:
    trigger = schedule_trigger(Schedule("s", "acme", "p", "a", "k", cron=cron))
    out, t = [], SATURDAY
    for _ in range(n):
        t = trigger.get_next_fire_time(None, t)
        out.append(t.strftime("%a"))
        t = t.replace(microsecond=1)
    return out


@pytest.mark.parametrize(
    ("cron", "days"),
    [
        # Read from Monday, "1-5" ran Tuesday to Saturday and "0" on Mondays.
        ("0 9 * * 1-5", ["Mon", "Tue", "Wed", "Thu", "Fri"]),
        ("0 0 * * 0", ["Sun", "Sun", "Sun", "Sun", "Sun"]),
        ("0 0 * * 7", ["Sun", "Sun", "Sun", "Sun", "Sun"]),
        ("0 0 * * 5-7", ["Sun", "Fri", "Sat", "Sun", "Fri"]),
        ("0 0 * * */2", ["Sun", "Tue", "Thu", "Sat", "Sun"]),
        ("0 0 * * 1,3", ["Mon", "Wed", "Mon", "Wed", "Mon"]),
        ("0 0 * * sun", ["Sun", "Sun", "Sun", "Sun", "Sun"]),
        ("0 0 * * *", ["Sun", "Mon", "Tue", "Wed", "Thu"]),
    ],
)
def test_weekday_numbers_count_from_sunday(cron: str, days: list[str]) -> None:
    assert _next_days(cron) == days


def test_a_weekday_outside_the_week_is_named() -> None:
    with pytest.raises(ConfigurationError, match="day-of-week '8' is outside 0-7"):
        schedule_trigger(Schedule("s", "acme", "p", "a", "k", cron="0 0 * * 8"))
