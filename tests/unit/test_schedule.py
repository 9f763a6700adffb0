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


@pytest.mark.parametrize(
    ("cron", "needle"),
    [
        # crontab: the 1st, the 15th and every Monday; APScheduler: only a Monday 1st or 15th.
        ("0 0 1,15 * 1", "restricts both the day of the month and the day of the week"),
        # Its numbers were read from Monday, its names as names: Tuesday and Saturday.
        ("0 9 * * 1,sat", "mixes numbers and names"),
        ("0 9 * * mon-5", "mixes numbers and names"),
        ("@daily", "is not a crontab line"),
    ],
)
def test_a_crontab_line_read_otherwise_than_crontab_reads_it_is_refused(
    cron: str, needle: str
) -> None:
    with pytest.raises(ConfigurationError, match=needle):
        schedule_trigger(Schedule("s", "acme", "p", "a", "k", cron=cron))
    assert _next_days("0 9 * * mon-fri") == ["Mon", "Tue", "Wed", "Thu", "Fri"]
