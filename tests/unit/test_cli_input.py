"""Operator input read by the CLI and the settings: refused with the field named."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from pydantic import ValidationError

from appliance import cli
from appliance.cli_spend import _amount
from appliance.domain.errors import InvalidInput
from appliance.settings import SpendSettings


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("-1", "is not an amount"),
        ("NaN", "is not an amount"),
        ("Infinity", "is not an amount"),
        ("1e309", "is not an amount"),
        ("1_000", "is not an amount"),  # Python's Decimal takes it; an operator did not mean it
        ("0.1.2", "is not an amount"),
        ("0.0000000001", "more than 9 decimal places"),  # finer than the ledger's step
        ("1" + "0" * 15, "over the limit"),
    ],
)
def test_a_cap_amount_is_plain_decimal_at_the_ledgers_precision(text: str, needle: str) -> None:
    with pytest.raises(InvalidInput) as info:
        _amount(text)
    assert info.value.field == "amount" and needle in str(info.value)


def test_plain_amounts_are_taken_exactly() -> None:
    assert _amount("12.50") == Decimal("12.50")
    assert _amount(" 0.000000001 ") == Decimal("0.000000001")
    assert _amount("7") == 7


@pytest.mark.parametrize("fractions", [[-1], [0], [Decimal("1.5")]])
def test_alert_fractions_lie_within_the_cap(fractions: list[object]) -> None:
    with pytest.raises(ValidationError, match="alert_fractions"):
        SpendSettings(alert_fractions=fractions)  # type: ignore[arg-type]


def test_the_status_text_keeps_dotted_pipeline_and_stage_names_apart() -> None:
    from datetime import UTC, datetime

    from appliance.cli import status_text
    from appliance.domain.envelope import Lane, MessageStatus
    from appliance.domain.ports import BusStatus, LaneCounts

    lanes = {lane: LaneCounts({s: 0 for s in MessageStatus}, None, None) for lane in Lane}
    stages = {"a.b": {"c": {"pending": 1}}, "a": {"b.c": {"done": 2}}}
    text = status_text(BusStatus(datetime(2026, 12, 1, tzinfo=UTC), lanes, 1, stages=stages))
    # Names may hold dots but never a slash: each pair reads one way only.
    assert "a.b/c " in text and "a/b.c " in text
    assert "a.b.c" not in text


def test_db_psql_passes_psql_options_with_or_without_a_double_dash() -> None:
    assert cli.parse(["db", "psql", "-Atc", "SELECT 1"]).psql_args == ["-Atc", "SELECT 1"]
    args = cli.parse(["db", "psql", "--role", "app", "-X", "-c", "SELECT 1", "-A"])
    assert args.role == "app" and args.psql_args == ["-X", "-c", "SELECT 1", "-A"]
    assert cli.parse(["db", "psql", "--", "-A"]).psql_args == ["--", "-A"]


def test_db_psql_role_is_ours_wherever_it_stands_before_a_double_dash() -> None:
    args = cli.parse(["db", "psql", "-Atc", "SELECT 1", "--role", "app"])
    assert args.role == "app" and args.psql_args == ["-Atc", "SELECT 1"]
    args = cli.parse(["db", "psql", "-X", "--role=system", "-c", "SELECT 1"])
    assert args.role == "system" and args.psql_args == ["-X", "-c", "SELECT 1"]
    # After `--` everything is psql's, as it was given.
    args = cli.parse(["db", "psql", "--", "-c", "SELECT 1", "--role", "app"])
    assert args.role == "admin" and args.psql_args == ["--", "-c", "SELECT 1", "--role", "app"]


@pytest.mark.parametrize(
    "tail", [["--role"], ["--role", "owner"], ["--role=root"]], ids=["missing", "bad", "bad="]
)
def test_db_psql_role_after_psql_options_is_checked(
    tail: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parse(["db", "psql", "-Atc", "SELECT 1", *tail])
    assert exc.value.code == 2
    assert "--role" in capsys.readouterr().err


def test_options_no_command_knows_are_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parse(["status", "-Atc", "SELECT 1"])
    assert exc.value.code == 2


def test_the_status_json_names_each_runners_process_and_no_dead_listener() -> None:
    from datetime import UTC, datetime

    from appliance.domain.envelope import Lane, MessageStatus
    from appliance.domain.ports import BusStatus, LaneCounts, RunnerInfo

    def runner(rid: str, alive: bool) -> RunnerInfo:
        return RunnerInfo(rid, "box", 41, 1.0, alive, True, None, 0, 0, 0, 0, {})

    lanes = {lane: LaneCounts({s: 0 for s in MessageStatus}, None, None) for lane in Lane}
    st = BusStatus(datetime(2026, 12, 1, tzinfo=UTC), lanes, 1, [runner("up", True),
                   runner("gone", False)])  # fmt: skip
    shown = {r["id"]: r for r in cli.status_json(st)["runners"]}
    assert shown["up"]["host"] == "box" and shown["up"]["pid"] == 41
    assert shown["up"]["listener_connected"] is True
    # Its last report said it listened; dead, it listens to nothing.
    assert shown["gone"]["listener_connected"] is False


def test_the_status_text_names_slots_held_by_handlers_given_up_on() -> None:
    from datetime import UTC, datetime

    from appliance.domain.envelope import Lane, MessageStatus
    from appliance.domain.ports import BusStatus, LaneCounts, RunnerInfo

    def runner(rid: str, held: int) -> RunnerInfo:
        stats = {"concurrency": 8, "abandoned_running": {"interactive": held, "batch": 1}}
        return RunnerInfo(rid, "box", 41, 1.0, True, True, None, 0, 0, 0, 0, stats)

    lanes = {lane: LaneCounts({s: 0 for s in MessageStatus}, None, None) for lane in Lane}
    st = BusStatus(datetime(2026, 12, 1, tzinfo=UTC), lanes, 1, [runner("wedged", 2)])
    text = cli.status_text(st)
    assert "runner wedged: 3 of 8 slots held by handlers that ignore cancellation" in text
    quiet = RunnerInfo("quiet", "box", 42, 1.0, True, True, None, 0, 0, 0, 0, {})
    st = BusStatus(datetime(2026, 12, 1, tzinfo=UTC), lanes, 1, [quiet])
    assert "ignore cancellation" not in cli.status_text(st)


@pytest.mark.parametrize(
    "argv",
    [
        ["bus", "cancel", "--tenant", "acme", "99999999999999999999"],  # past bigint
        ["bus", "show", "--tenant", "acme", "0"],
        ["bus", "redrive", "--tenant", "acme", "1", "-5"],
        ["demo", "--count", "-1"],
        ["demo", "--every", "0"],
        ["demo", "--timeout", "inf"],
        ["runner", "--concurrency", "0"],
        ["runner", "--concurrency", "5000"],
    ],
)
def test_ids_counts_and_intervals_are_checked_as_they_are_read(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parse(argv)
    assert exc.value.code == 2


def test_a_context_comes_from_a_file_or_standard_input_and_a_bare_at_is_refused(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    path = tmp_path / "c.json"
    path.write_text('{"a": 1}')
    assert cli._read_context(f"@{path}", 100) == {"a": 1}
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b'{"b": [2]}')))
    assert cli._read_context("@-", 100) == {"b": [2]}
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"x" * 401)))
    with pytest.raises(InvalidInput, match="standard input is over 400 bytes, 4 times the limit"):
        cli._read_context("@-", 100)
    # The limit is the context's compact JSON, as the API measures it, not the file's bytes.
    indented = json.dumps({"k": ["v" * 80]}, indent=8) + "\n"
    assert len(indented.encode()) > 100 > len(json.dumps({"k": ["v" * 80]}, separators=(",", ":")))
    path.write_text(indented)
    assert cli._read_context(f"@{path}", 100) == {"k": ["v" * 80]}
    path.write_text(json.dumps({"k": "v" * 100}))
    with pytest.raises(InvalidInput, match=r"is 1\d\d bytes, over the limit of 100 bytes"):
        cli._read_context(f"@{path}", 100)
    with pytest.raises(InvalidInput, match="names no file"):
        cli._read_context("@", 100)
