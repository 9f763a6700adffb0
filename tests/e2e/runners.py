"""Real runner processes for end-to-end tests: start, signal, wait, and read the bus back."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import psycopg
from psycopg.rows import dict_row

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RunnerProcs:
    """Runner processes against one database, each with its own log file."""

    admin: str
    logdir: Path
    env_extra: Mapping[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _n: int = 0

    def env(self, **overrides: str) -> dict[str, str]:
        keep = {"APPLIANCE_MODEL_CACHE"}
        clean = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_") or k in keep}
        return {
            **clean,
            "APPLIANCE_DATABASE_URL": self.admin,
            # Bus tests run without models (faster starts, all cores for the bus); the model
            # tests turn inference on.
            "APPLIANCE_INFERENCE__ENABLED": "false",
            "APPLIANCE_RUNNER__PIPELINES": "[]",
            "APPLIANCE_RUNNER__PIPELINE_MODULES": '["tests.e2e.fixture_pipelines"]',
            "APPLIANCE_BUS__LEASE_SECONDS": "2",
            "APPLIANCE_BUS__RETRY_BASE_SECONDS": "0.2",
            "APPLIANCE_RUNNER__POLL_INTERVAL_SECONDS": "5",
            "APPLIANCE_RUNNER__DRAIN_TIMEOUT_SECONDS": "3",
            "APPLIANCE_RUNNER__CANCEL_GRACE_SECONDS": "1",
            "PYTHONPATH": str(ROOT),
            **self.env_extra,
            **overrides,
        }

    def start(self, name: str | None = None, *args: str, **env: str) -> str:
        self._n += 1
        name = name or f"r{self._n}"
        log = (self.logdir / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "appliance.cli", "-v", "runner", *args],
            env=self.env(**env),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        return name

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def worker_id(self, name: str) -> str:
        import socket

        return f"{socket.gethostname()}:{self.pid(name)}"

    def signal(self, name: str, sig: int) -> None:
        self.procs[name].send_signal(sig)

    def wait(self, name: str, timeout: float = 30.0) -> int:
        return self.procs[name].wait(timeout=timeout)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.logdir.glob("*.log"))
        )


@contextlib.contextmanager
def runners(admin: str, logdir: Path, **env_extra: str) -> Iterator[RunnerProcs]:
    procs = RunnerProcs(admin=admin, logdir=logdir, env_extra=env_extra)
    try:
        yield procs
    finally:
        procs.stop_all()


def query(admin: str, sql: str, params: object = None) -> list[dict[str, object]]:
    """Read the bus as the admin (sees every tenant)."""
    with psycopg.connect(admin, autocommit=True, row_factory=dict_row) as conn:
        conn.execute("SET search_path = appliance, pg_catalog")
        return list(conn.execute(sql, cast(Any, params)).fetchall())


def wait_until(check: object, timeout: float, every: float = 0.1, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what or check}")


def counts(admin: str) -> dict[str, int]:
    rows = query(admin, "SELECT status::text AS s, count(*) AS n FROM agent_messages GROUP BY 1")
    return {str(r["s"]): int(r["n"]) for r in rows}  # type: ignore[call-overload]
