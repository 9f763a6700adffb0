"""Real runner processes under one configured id: the second one refuses to start, naming the
live one, and exits non-zero; a stopped runner's id is free at once."""

from __future__ import annotations

import signal
from pathlib import Path

from appliance.db.database import Endpoints
from tests.e2e.runners import query, runners, wait_until


def _holds(admin: str, runner_id: str, pid: int) -> bool:
    rows = query(
        admin,
        "SELECT pid FROM runners WHERE id = %s AND stopped_at IS NULL",
        (runner_id,),
    )
    return [r["pid"] for r in rows] == [pid]


def test_a_second_runner_under_a_live_runners_id_exits_naming_it(
    fresh_db: Endpoints, tmp_path: Path
) -> None:
    with runners(fresh_db.admin, tmp_path, APPLIANCE_RUNNER__ID="box-a") as procs:
        first = procs.start("first")
        wait_until(lambda: _holds(fresh_db.admin, "box-a", procs.pid(first)), 30, what="first")
        second = procs.start("second")
        # It waits for the holder's next report (every 5 s), then refuses: exit 2, one line.
        assert procs.wait(second, timeout=60) == 2, procs.logs()
        log = (tmp_path / "second.log").read_text()
        assert "error: runner id 'box-a' is held by a live runner" in log, log
        assert f"pid {procs.pid(first)}" in log and "Traceback" not in log
        # The first serves on, its registration untouched.
        assert procs.procs[first].poll() is None
        assert _holds(fresh_db.admin, "box-a", procs.pid(first))
        # Stopped, it gives the id up: the next runner under it starts at once.
        procs.signal(first, signal.SIGTERM)
        assert procs.wait(first, timeout=30) == 0
        third = procs.start("third")
        wait_until(lambda: _holds(fresh_db.admin, "box-a", procs.pid(third)), 30, what="third")
