"""Settings reach the parts that enqueue: the bus, and the runner for the work it spawns."""

from __future__ import annotations

from datetime import timedelta

from appliance.runtime import bus_config, runner_config
from appliance.settings import BusSettings, Settings


def test_spawned_work_follows_the_same_bus_rules_as_enqueued_work() -> None:
    settings = Settings(bus=BusSettings(idempotency_retention_days=3, max_attempts=7))
    bus, runner = bus_config(settings), runner_config(settings)
    assert bus.idempotency_retention == runner.idempotency_retention == timedelta(days=3)
    assert bus.max_attempts == runner.max_attempts == 7
