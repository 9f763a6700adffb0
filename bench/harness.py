"""Shared helpers for the benchmarks: a throw-away PostgreSQL, timing with CPU accounting, medians,
machine facts, and writing one section of bench/RESULTS.md.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import psutil
import psycopg
from psycopg import sql

from appliance.db.cluster import LocalCluster

RESULTS_PATH = Path(__file__).resolve().parent / "RESULTS.md"
RESULTS_INTRO = (
    "# Benchmark results\n\n"
    "Figures written by the scripts in `bench/` (each script owns one `## <name>` section and "
    "rewrites only that one). Every script starts its own PostgreSQL with the appliance's "
    "default settings (fsync on) in a temporary directory, measures, and removes it again.\n"
)


# -- small shared helpers ------------------------------------------------------------------------

_serial = itertools.count()


def fresh_tag() -> str:
    """A prefix that keeps every repeat's idempotency keys new."""
    return f"r{next(_serial)}-{time.monotonic_ns()}"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# -- a throw-away server --------------------------------------------------------------------------


@contextlib.contextmanager
def temp_cluster(
    port: int, extra_conf: Mapping[str, str] | None = None, prefix: str = "appliance-bench-"
) -> Iterator[LocalCluster]:
    """A fresh LocalCluster in a temporary state dir; stopped and removed on the way out."""
    state = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        state.chmod(0o755)  # the server runs as the `postgres` user when we run as root
        cluster = LocalCluster(state, port=port, extra_conf=dict(extra_conf or {}))
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
            # A fallback folder under /var/tmp is used when state is unreachable for postgres.
            for folder in {cluster.data_dir.parent.parent, cluster.socket_dir.parent}:
                if folder != state and folder.name.startswith("appliance-"):
                    shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(state, ignore_errors=True)


def create_database(admin: str, name: str) -> str:
    """(Re)create database `name`; returns the admin conninfo of it."""
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return psycopg.conninfo.make_conninfo(admin, dbname=name)


def server_facts(admin: str, names: Sequence[str]) -> dict[str, str]:
    """`SHOW` of the given settings, plus the server's version string."""
    facts: dict[str, str] = {}
    with psycopg.connect(admin, autocommit=True) as conn:
        row = conn.execute("SHOW server_version").fetchone()
        facts["server_version"] = str(row[0]) if row else "?"
        for name in names:
            row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            facts[name] = str(row[0]) if row else "?"
    return facts


def postmaster_pid(cluster: LocalCluster) -> int | None:
    """The server's pid, read from postmaster.pid (None when it cannot be read)."""
    try:
        first = (cluster.data_dir / "postmaster.pid").read_text().splitlines()[0]
        return int(first.strip())
    except (OSError, ValueError, IndexError):
        return None


# -- timing ---------------------------------------------------------------------------------------


def _server_cpu(pid: int | None) -> dict[int, float] | None:
    """User + system CPU seconds of the postmaster and each live child (backends, WAL writer)."""
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    times: dict[int, float] = {}
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            times[proc.pid] = t.user + t.system
    return times


def _cpu_delta(before: dict[int, float] | None, after: dict[int, float] | None) -> float | None:
    """CPU spent between two snapshots by the processes alive at the end (a process that exited
    in between, such as a closed connection's backend, would otherwise subtract its past)."""
    if before is None or after is None:
        return None
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


@dataclass
class Sample:
    """One timed run: how many items, wall seconds, and where the CPU went."""

    n: int
    wall: float
    client_cpu: float
    server_cpu: float | None
    # CPU seconds the rest of the machine (other processes) used meanwhile, and hypervisor steal.
    other_cpu: float | None = None
    steal: float = 0.0

    @property
    def rate(self) -> float:
        return self.n / self.wall if self.wall > 0 else float("nan")

    @property
    def other_share(self) -> float | None:
        """Cores' worth of CPU other processes used during this run (0.0 = a quiet box)."""
        if self.other_cpu is None or self.wall <= 0:
            return None
        return self.other_cpu / self.wall


def _machine_cpu() -> tuple[float, float]:
    """System-wide busy CPU seconds (all cores) and steal seconds, since boot."""
    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return busy, getattr(t, "steal", 0.0)


@dataclass
class Meter:
    """Times a block: wall clock, this process's CPU, and the server's CPU (if known)."""

    server_pid: int | None = None
    n: int = 0
    sample: Sample | None = field(default=None, init=False)
    _t0: float = field(default=0.0, init=False)
    _c0: float = field(default=0.0, init=False)
    _s0: dict[int, float] | None = field(default=None, init=False)
    _m0: tuple[float, float] = field(default=(0.0, 0.0), init=False)

    def __enter__(self) -> Meter:
        self._s0 = _server_cpu(self.server_pid)
        self._m0 = _machine_cpu()
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        client = time.process_time() - self._c0
        busy, steal = _machine_cpu()
        server = _cpu_delta(self._s0, _server_cpu(self.server_pid))
        other = None
        if server is not None:
            other = max(0.0, busy - self._m0[0] - client - server)
        self.sample = Sample(self.n, wall, client, server, other, steal - self._m0[1])


@dataclass
class Measurement:
    """The repeats of one measurement, summarised by the median rate."""

    name: str
    unit: str = "msgs/s"
    samples: list[Sample] = field(default_factory=list)
    extra: dict[str, float] = field(default_factory=dict)

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)

    @property
    def median(self) -> float:
        return statistics.median(s.rate for s in self.samples) if self.samples else float("nan")

    def _median_sample(self) -> Sample | None:
        if not self.samples:
            return None
        ordered = sorted(self.samples, key=lambda s: s.rate)
        return ordered[len(ordered) // 2]

    @property
    def other_share(self) -> float | None:
        """Other processes' CPU (cores) during the median run."""
        s = self._median_sample()
        return s.other_share if s else None

    @property
    def client_cpu_share(self) -> float | None:
        """Client CPU seconds per wall second of the median run (1.0 = one core busy)."""
        s = self._median_sample()
        return s.client_cpu / s.wall if s and s.wall > 0 else None

    @property
    def server_cpu_share(self) -> float | None:
        s = self._median_sample()
        if s is None or s.server_cpu is None or s.wall <= 0:
            return None
        return s.server_cpu / s.wall

    @property
    def cpu_us_per_item(self) -> tuple[float | None, float | None]:
        """Client and server CPU microseconds per item in the median run."""
        s = self._median_sample()
        if s is None or s.n <= 0:
            return None, None
        server = s.server_cpu * 1e6 / s.n if s.server_cpu is not None else None
        return s.client_cpu * 1e6 / s.n, server

    def cpu_cell(self) -> str:
        client, server = self.cpu_us_per_item
        return " / ".join(
            "-" if v is None else f"{v:,.1f}" if v < 10 else f"{v:,.0f}" for v in (client, server)
        )

    @property
    def us_per_item(self) -> float:
        m = self.median
        return 1e6 / m if m and m == m else float("nan")

    @property
    def spread(self) -> str:
        rates = sorted(s.rate for s in self.samples)
        return f"{fmt_rate(rates[0])}-{fmt_rate(rates[-1])}" if rates else "-"


def fmt_rate(value: float) -> str:
    if value != value:  # NaN
        return "-"
    return f"{value:,.0f}"


def fmt_share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


# -- reporting ------------------------------------------------------------------------------------


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def code_version(root: Path = RESULTS_PATH.parent.parent) -> str:
    """The commit measured, and how many files outside bench/ differ from it (uncommitted)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    dirty = [line for line in status if not line[3:].startswith("bench/")]
    return f"commit {head}" + (f" + {len(dirty)} uncommitted file(s)" if dirty else "")


def machine_facts() -> dict[str, str]:
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for text_line in Path("/proc/cpuinfo").read_text().splitlines():
            if text_line.startswith("model name"):
                cpu = text_line.split(":", 1)[1].strip()
                break
    mem = psutil.virtual_memory().total / 2**30
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": str(os.cpu_count() or "?"),
        "cpu": cpu,
        "memory": f"{mem:.0f} GiB",
        "python": platform.python_version(),
        "psycopg": psycopg.__version__,
        "kernel": platform.release(),
        "loadavg": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def write_section(heading: str, body: str, path: Path = RESULTS_PATH) -> None:
    """Replace the `## heading` section of RESULTS.md with `body` (create the file if missing)."""
    title = f"## {heading}"
    section = f"{title}\n\n{body.strip()}\n"
    text = path.read_text(encoding="utf-8") if path.exists() else RESULTS_INTRO
    pattern = re.compile(rf"^{re.escape(title)}[ \t]*\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section + "\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n", encoding="utf-8")
