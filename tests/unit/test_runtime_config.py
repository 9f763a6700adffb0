"""Settings reach the parts that enqueue: the bus, and the runner for the work it spawns."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from appliance import runtime
from appliance.domain.envelope import Lane
from appliance.domain.errors import ClusterError, ConfigurationError
from appliance.runtime import bus_config, runner_config
from appliance.settings import BusSettings, Settings, settings_error_text


def test_spawned_work_follows_the_same_bus_rules_as_enqueued_work() -> None:
    settings = Settings(
        bus=BusSettings(idempotency_retention_days=3, max_attempts=7, context_max_bytes=2048)
    )
    bus, runner = bus_config(settings), runner_config(settings)
    assert bus.idempotency_retention == runner.idempotency_retention == timedelta(days=3)
    assert bus.max_attempts == runner.max_attempts == 7
    assert bus.context_max_bytes == runner.context_max_bytes == 2048


def _serving_schedules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *lines: str) -> Settings:
    """Settings whose runner serves a module declaring SCHEDULES = [*lines]."""
    name = f"schedules_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(
        "from datetime import timedelta\n"
        "from appliance.domain.schedule import Schedule\n"
        f"SCHEDULES = [{', '.join(lines)}]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return Settings(runner={"pipelines": [], "pipeline_modules": [name]})  # type: ignore[arg-type]


def test_a_bad_crontab_line_stops_the_start_not_each_firing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _serving_schedules(
        tmp_path, monkeypatch, "Schedule('weekly', 'acme', 'p', 'a', 'k', cron='0 0 * * 9')"
    )
    with pytest.raises(ConfigurationError, match="day-of-week '9' is outside 0-7"):
        runtime.load_pipelines(settings)


def test_a_schedule_declared_twice_stops_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A firing is keyed by the schedule's name and slot: the second one's were all dropped.
    settings = _serving_schedules(
        tmp_path,
        monkeypatch,
        "Schedule('nightly', 'acme', 'demo', 'intake', 'k', every=timedelta(1))",
        "Schedule('nightly', 'acme', 'other', 'intake', 'k', every=timedelta(1))",
    )
    with pytest.raises(
        ConfigurationError, match="schedule nightly of tenant acme is declared twice"
    ):
        runtime.load_pipelines(settings)


def test_history_retention_is_read_from_the_environment_and_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().runner.history_retention_days == 400
    monkeypatch.setenv("APPLIANCE_RUNNER__HISTORY_RETENTION_DAYS", "none")
    assert Settings().runner.history_retention_days is None  # kept for ever
    monkeypatch.setenv("APPLIANCE_RUNNER__HISTORY_RETENTION_DAYS", "3")
    # Shorter than the archive's 7 days would delete messages as they are archived.
    with pytest.raises(ValidationError, match=r"history_retention_days \(3\) must be at least"):
        Settings()
    monkeypatch.setenv("APPLIANCE_RUNNER__ARCHIVE_RETENTION_DAYS", "2")
    # Shorter than the idempotency keys' 90 days (+ the archive's 2, as late as a key's last
    # extension can come): a duplicate would name a pruned message.
    with pytest.raises(
        ValidationError, match=r"must be at least bus.idempotency_retention_days"
    ) as e:
        Settings()
    assert settings_error_text(e.value) == (
        "settings: runner.history_retention_days (3) must be at least"
        " bus.idempotency_retention_days (90) + runner.archive_retention_days (2): a duplicate"
        " request is answered with the id of the message its key names"
    )
    monkeypatch.setenv("APPLIANCE_BUS__IDEMPOTENCY_RETENTION_DAYS", "1")
    assert Settings().runner.history_retention_days == 3  # 1 + 2
    monkeypatch.setenv("APPLIANCE_BUS__IDEMPOTENCY_RETENTION_DAYS", "1.5")
    with pytest.raises(ValidationError, match=r"\(1.5\) \+ runner.archive_retention_days"):
        Settings()


def test_an_empty_variable_is_unset_not_the_current_folder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("APPLIANCE_PG_BINDIR", "")
    monkeypatch.setenv("APPLIANCE_DATABASE_URL", "")
    settings = Settings()
    assert settings.db.pg_bindir is None and settings.db.url is None


def test_psql_for_an_external_server_needs_no_server_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only the client on PATH; the bindir given lacks the server binaries.
    (tmp_path / "psql").write_text("#!/bin/sh\n")
    (tmp_path / "psql").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("APPLIANCE_PG_BINDIR", str(tmp_path))
    local = Settings()
    with pytest.raises(ClusterError):
        runtime.pg_tool(local, "psql")  # a local cluster: its own server's tools, or an error
    monkeypatch.setenv("APPLIANCE_DATABASE_URL", "postgresql://db.example/appliance")
    assert runtime.pg_tool(Settings(), "psql") == str(tmp_path / "psql")


def test_a_bindir_of_the_server_binaries_alone_takes_psql_from_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # APPLIANCE_PG_BINDIR may name a folder of initdb, pg_ctl and postgres alone: psql was
    # that folder's, which did not exist (a FileNotFoundError trace).
    server = tmp_path / "server"
    client = tmp_path / "client"
    for folder, names in ((server, ("initdb", "pg_ctl", "postgres")), (client, ("psql",))):
        folder.mkdir()
        for name in names:
            (folder / name).write_text("#!/bin/sh\n")
            (folder / name).chmod(0o755)
    monkeypatch.setenv("APPLIANCE_PG_BINDIR", str(server))
    monkeypatch.setenv("PATH", str(client))
    assert runtime.pg_tool(Settings(), "psql") == str(client / "psql")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(
        ClusterError,
        match=r"psql is neither in .* nor on PATH: install the "
        r"PostgreSQL client \(package postgresql-client\)",
    ):
        runtime.pg_tool(Settings(), "psql")


def test_settings_that_break_their_own_rules_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # One lane given keeps the others' limits (they were silently dropped); ages must be > 0.
    monkeypatch.setenv("APPLIANCE_BUS__MAX_QUEUE_AGE_SECONDS__BATCH", "7200")
    ages = Settings().bus.max_queue_age_seconds
    assert ages == {Lane.INTERACTIVE: 3600.0, Lane.SYSTEM: 86400.0, Lane.BATCH: 7200.0}
    monkeypatch.setenv("APPLIANCE_BUS__MAX_QUEUE_AGE_SECONDS__INTERACTIVE", "-5")
    with pytest.raises(ValidationError, match="interactive: -5 s is outside"):
        Settings()
    monkeypatch.delenv("APPLIANCE_BUS__MAX_QUEUE_AGE_SECONDS__INTERACTIVE")
    monkeypatch.setenv("APPLIANCE_DB__POOL_MIN", "20")
    monkeypatch.setenv("APPLIANCE_DB__POOL_MAX", "2")
    with pytest.raises(ValidationError, match=r"pool_min \(20\) must be at most pool_max"):
        Settings()
    monkeypatch.delenv("APPLIANCE_DB__POOL_MIN")
    for name, value in (("RECLAIM_INTERVAL_SECONDS", "inf"), ("POLL_INTERVAL_SECONDS", "2e13")):
        monkeypatch.setenv(f"APPLIANCE_RUNNER__{name}", value)
        with pytest.raises(ValidationError, match=name.lower()):
            Settings()
        monkeypatch.delenv(f"APPLIANCE_RUNNER__{name}")


def test_the_runtime_statement_timeout_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().db.statement_timeout == timedelta(minutes=5)
    monkeypatch.setenv("APPLIANCE_DB__STATEMENT_TIMEOUT_SECONDS", "42.5")
    assert Settings().db.statement_timeout == timedelta(seconds=42.5)
    for bad in ("0", "-1", "inf", "1e9"):
        monkeypatch.setenv("APPLIANCE_DB__STATEMENT_TIMEOUT_SECONDS", bad)
        with pytest.raises(ValidationError, match="statement_timeout_seconds"):
            Settings()


def test_the_context_limit_stays_under_what_one_statement_can_carry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("APPLIANCE_BUS__CONTEXT_MAX_BYTES", str(64 * 2**20))
    assert Settings().bus.context_max_bytes == 64 * 2**20
    monkeypatch.setenv("APPLIANCE_BUS__CONTEXT_MAX_BYTES", str(64 * 2**20 + 1))
    with pytest.raises(ValidationError, match="context_max_bytes"):
        Settings()


def test_the_runner_id_is_read_from_the_environment_and_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os
    import socket

    assert runner_config(Settings()).worker_id == f"{socket.gethostname()}:{os.getpid()}"
    monkeypatch.setenv("APPLIANCE_RUNNER__ID", "box-a")
    assert runner_config(Settings()).worker_id == "box-a"
    monkeypatch.setenv("APPLIANCE_RUNNER__ID", "box a")  # the cockpit and logs split on spaces
    with pytest.raises(ValidationError) as e:
        Settings()
    assert "runner.id" in settings_error_text(e.value)


def test_the_waits_for_a_tier_and_for_a_runner_of_a_stage_are_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = runner_config(Settings())
    assert config.stage_wait == timedelta(days=7) and config.capability_wait == timedelta(hours=1)
    monkeypatch.setenv("APPLIANCE_RUNNER__STAGE_WAIT_SECONDS", "180")
    monkeypatch.setenv("APPLIANCE_RUNNER__CAPABILITY_WAIT_SECONDS", "90")
    config = runner_config(Settings())
    assert config.stage_wait == timedelta(minutes=3)
    assert config.capability_wait == timedelta(seconds=90)
    monkeypatch.setenv("APPLIANCE_RUNNER__STAGE_WAIT_SECONDS", "0")
    with pytest.raises(ValidationError, match="stage_wait_seconds"):
        Settings()
