"""Tests of the local PostgreSQL manager against real PostgreSQL binaries (no server needed)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from appliance.db.cluster import ADMIN_USER, MARKER, LocalCluster, find_bindir
from appliance.domain.errors import ClusterError

try:
    BINDIR: Path | None = find_bindir()
except ClusterError:
    BINDIR = None

pytestmark = pytest.mark.skipif(BINDIR is None, reason="PostgreSQL server binaries not installed")

IS_ROOT = os.geteuid() == 0
# Unix-socket "ports" only name files in a private folder, but keep clear of other test runs and
# of any real server anyway.
PORT = 55000 + os.getpid() % 4000


def _fast_cluster(state_dir: Path) -> LocalCluster:
    return LocalCluster(state_dir, port=PORT, extra_conf={"fsync": "off"})


@pytest.fixture
def reachable_dir() -> Iterator[Path]:
    """A fresh folder under /tmp the postgres user can pass through.

    Not tmp_path: pytest's /tmp/pytest-of-<user> is mode 0700, which would force the fallback.
    """
    path = Path(tempfile.mkdtemp(prefix="appliance-cluster-test-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def cluster(reachable_dir: Path) -> Iterator[LocalCluster]:
    c = _fast_cluster(reachable_dir / "state")
    try:
        yield c
    finally:
        c.stop()


def _query(c: LocalCluster, query: str, dbname: str = "postgres") -> object:
    with psycopg.connect(c.conninfo(dbname=dbname)) as conn:
        row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _gone(pid: int) -> bool:
    """Dead or a zombie (PID 1 here may never reap the orphaned server processes)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _start_then_kill_postmaster(cluster: LocalCluster) -> int:
    """Start the cluster, SIGKILL its postmaster and wait for all its processes to end; its
    pid."""
    cluster.start()
    pid = cluster.status().pid
    assert pid is not None
    children = _children(pid)
    assert children, "a running postmaster has background workers"

    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    # Children notice their postmaster died and exit on their own; wait so none still holds
    # the shared memory when the next postmaster starts.
    while not all(_gone(p) for p in [pid, *children]):
        assert time.monotonic() < deadline, "postgres processes did not exit after SIGKILL"
        time.sleep(0.05)
    return pid


def test_start_stop_restart(cluster: LocalCluster) -> None:
    assert not cluster.initialized()
    assert not cluster.status().running

    cluster.start()

    status = cluster.status()
    assert status.running
    assert status.initialized
    assert status.pid is not None
    assert status.port == PORT
    assert BINDIR is not None
    assert status.version is not None
    assert status.version.startswith(BINDIR.parent.name)  # "15.x" from /usr/lib/postgresql/15/bin
    # /tmp is reachable: no fallback, everything under the state dir.
    assert cluster.data_dir == cluster.state_dir.resolve() / "pg" / "data"
    assert cluster.socket_dir == cluster.state_dir.resolve() / "run"
    assert cluster.log_file.is_file()
    assert _query(cluster, "SELECT 1") == 1
    assert _query(cluster, "SELECT current_user") == ADMIN_USER
    assert _query(cluster, "SHOW data_checksums") == "on"
    assert _query(cluster, "SHOW listen_addresses") == ""
    assert _query(cluster, "SHOW fsync") == "off"
    assert _query(cluster, "SHOW jit") == "off"
    assert _query(cluster, "SHOW server_encoding") == "UTF8"
    # Full-page images compressed with lz4 where the server is built with it, else pglz.
    lz4 = _query(cluster, "SELECT 'lz4' = ANY(enumvals) FROM pg_settings"
                 " WHERE name = 'wal_compression'")  # fmt: skip
    assert _query(cluster, "SHOW wal_compression") == ("lz4" if lz4 else "pglz")
    assert (cluster.data_dir / MARKER).is_file()
    if IS_ROOT:
        postgres_uid = pwd.getpwnam("postgres").pw_uid
        assert cluster.data_dir.stat().st_uid == postgres_uid
        assert cluster.socket_dir.stat().st_uid == postgres_uid

    cluster.start()  # already running: a no-op
    assert cluster.status().pid == status.pid

    cluster.stop()
    assert not cluster.status().running
    assert not (cluster.data_dir / "postmaster.pid").exists()
    cluster.stop()  # not running: a no-op

    assert cluster.init() is False
    cluster.start()
    assert cluster.status().running
    assert _query(cluster, "SELECT 1") == 1


def test_conf_changes_apply_on_restart(reachable_dir: Path) -> None:
    c = _fast_cluster(reachable_dir / "state")
    try:
        c.start()
        c.stop()
        c = LocalCluster(
            reachable_dir / "state",
            port=PORT,
            extra_conf={"fsync": "off", "work_mem": "8MB", "application_name": "it's"},
        )
        c.start()
        assert _query(c, "SHOW work_mem") == "8MB"
        assert _query(c, "SHOW application_name") == "it's"
    finally:
        c.stop()


def test_recovers_from_killed_postmaster(cluster: LocalCluster) -> None:
    pid = _start_then_kill_postmaster(cluster)
    assert (cluster.data_dir / "postmaster.pid").exists()  # the crash left it behind
    assert not cluster.status().running

    cluster.start()

    status = cluster.status()
    assert status.running
    assert status.pid != pid
    assert _query(cluster, "SELECT 1") == 1


def test_a_start_names_the_processes_a_killed_postmaster_left_running(
    cluster: LocalCluster,
) -> None:
    cluster.start()
    pid = cluster.status().pid
    assert pid is not None
    # A backend busy in a query that never checks for its postmaster's death.
    conn = psycopg.connect(cluster.conninfo(dbname="postgres"), autocommit=True)
    busy = conn.info.backend_pid

    def query() -> None:
        with contextlib.suppress(psycopg.Error):  # ends when the process is killed
            conn.execute("SELECT count(*) FROM generate_series(1, 10000000000)")

    runner = threading.Thread(target=query, daemon=True)
    runner.start()
    try:
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while cluster.orphans() != [busy]:  # the idle children end; the busy one runs on
            assert time.monotonic() < deadline, cluster.orphans()
            time.sleep(0.1)
        assert not cluster.status().running
        cluster.orphan_wait_s = 0.5
        with pytest.raises(ClusterError, match=f"processes {busy} still run") as refused:
            cluster.start()
        assert f"kill {busy}" in str(refused.value)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(busy, signal.SIGKILL)
        runner.join(10)
        conn.close()
    cluster.start()  # once it is gone (killed), the start goes through
    assert _query(cluster, "SELECT 1") == 1


def test_a_start_names_a_server_that_runs_without_its_pid_file(cluster: LocalCluster) -> None:
    # Its children are not a dead server's leftovers: the postmaster is named, not them.
    cluster.start()
    pid = cluster.status().pid
    assert pid is not None
    pid_file = cluster.data_dir / "postmaster.pid"
    kept = pid_file.read_bytes()
    pid_file.unlink()
    try:
        assert not cluster.status().running and cluster.orphans() == []
        with pytest.raises(ClusterError, match=rf"a server \(pid {pid}\) runs on .* without"):
            cluster.start()
    finally:
        pid_file.write_bytes(kept)
    assert cluster.status().pid == pid


def test_refuses_foreign_data_dir(reachable_dir: Path) -> None:
    c = _fast_cluster(reachable_dir / "state")
    c.data_dir.mkdir(parents=True)
    (c.data_dir / "PG_VERSION").write_text("15\n")

    with pytest.raises(ClusterError, match="not created by the appliance"):
        c.start()
    with pytest.raises(ClusterError, match="not created by the appliance"):
        c.init()
    with pytest.raises(ClusterError, match="not created by the appliance"):
        c.stop()
    assert c.foreign()  # what `appliance db status` reports, instead of "not initialised"
    assert sorted(p.name for p in c.data_dir.iterdir()) == ["PG_VERSION"]


def test_refuses_a_state_dir_that_is_another_clusters_data_dir(reachable_dir: Path) -> None:
    # Its own cluster would nest inside: pg/, run/, log/ and a lock file in someone's PGDATA.
    theirs = reachable_dir / "pgdata"
    theirs.mkdir()
    (theirs / "PG_VERSION").write_text("15\n")
    c = _fast_cluster(theirs)
    for step in (c.start, c.init, c.stop):
        with pytest.raises(ClusterError, match="is a PostgreSQL data directory"):
            step()
    assert c.foreign()
    assert sorted(p.name for p in theirs.iterdir()) == ["PG_VERSION"]


@pytest.mark.skipif(not IS_ROOT, reason="the traversal fallback only applies when run as root")
def test_fallback_when_parent_blocks_postgres_user(
    reachable_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    locked = reachable_dir / "locked"
    locked.mkdir(mode=0o700)
    locked.chmod(0o700)
    state = locked / "state"
    digest = hashlib.sha256(str(state.resolve()).encode()).hexdigest()[:12]
    fallback = Path("/var/tmp") / f"appliance-{digest}"
    c = _fast_cluster(state)
    try:
        assert c.data_dir == fallback / "pg" / "data"
        assert c.socket_dir == fallback / "run"

        with caplog.at_level(logging.INFO, logger="appliance.db.cluster"):
            c.start()

        assert c.status().running
        assert _query(c, "SELECT 1") == 1
        assert f"{locked} blocks the postgres user" in caplog.text
        assert str(fallback / "pg") in caplog.text
        assert (fallback / "pg" / "data" / MARKER).is_file()
        assert (state / "pg").is_symlink()
        assert (state / "pg").resolve() == fallback / "pg"
        assert (state / "run").is_symlink()
        assert (state / "run").resolve() == fallback / "run"
        assert (state / "pg" / "data" / MARKER).is_file()

        # A second manager for the same state dir finds the same cluster through the links.
        again = _fast_cluster(state)
        assert again.data_dir == c.data_dir
        assert again.status().running
    finally:
        c.stop()
        shutil.rmtree(fallback, ignore_errors=True)
    assert not c.status().running


@pytest.mark.skipif(not IS_ROOT, reason="the traversal fallback only applies when run as root")
def test_a_vanished_fallback_is_refused_never_replaced_by_an_empty_cluster(
    reachable_dir: Path,
) -> None:
    """The fallback under /var/tmp may be aged away while state/pg still links to it: a start
    must say so, not make a new empty cluster there (in a folder anyone may have made since)."""
    locked = reachable_dir / "locked"
    locked.mkdir(mode=0o700)
    locked.chmod(0o700)
    state = locked / "state"
    c = _fast_cluster(state)
    fallback = c.data_dir.parent.parent
    try:
        c.start()
        c.stop()
        shutil.rmtree(fallback)
        (fallback).mkdir(mode=0o777)  # planted by someone else meanwhile
        fallback.chmod(0o777)
        with pytest.raises(ClusterError, match=r"linked from .*/pg is gone: restore it"):
            _fast_cluster(state).start()
        assert list(fallback.iterdir()) == []  # nothing made in the planted folder
        # Links into the fallback are checked as the fresh fallback is: a planted folder that
        # holds a pg folder too is refused, never used.
        (fallback / "pg").mkdir()
        with pytest.raises(ClusterError, match="is not a private folder of this user"):
            _fast_cluster(state).start()
    finally:
        shutil.rmtree(fallback, ignore_errors=True)


@pytest.mark.skipif(not IS_ROOT, reason="the traversal fallback only applies when run as root")
def test_error_names_folder_when_fallback_blocked_too(
    reachable_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    locked = reachable_dir / "locked"
    locked.mkdir(mode=0o700)
    locked.chmod(0o700)
    blocked_fallback_root = reachable_dir / "vartmp"
    blocked_fallback_root.mkdir(mode=0o700)
    blocked_fallback_root.chmod(0o700)
    monkeypatch.setattr("appliance.db.cluster._FALLBACK_ROOT", blocked_fallback_root)

    with pytest.raises(ClusterError) as err:
        _fast_cluster(locked / "state")
    assert f"{locked} blocks the postgres user" in str(err.value)
    assert f"blocked too, by {blocked_fallback_root} " in str(err.value)


def test_running_cluster_on_other_port_is_reported(cluster: LocalCluster) -> None:
    cluster.start()
    other = LocalCluster(cluster.state_dir, port=PORT + 1, extra_conf={"fsync": "off"})
    with pytest.raises(ClusterError, match=f"already running on port {PORT}"):
        other.start(timeout=5)
    assert cluster.status().running


def test_turning_tcp_on_while_running_says_to_stop_first(cluster: LocalCluster) -> None:
    cluster.start()
    tcp = LocalCluster(cluster.state_dir, port=PORT, listen_addresses="127.0.0.1")
    with pytest.raises(ClusterError, match=r"listening on TCP \(none\), not 127.0.0.1: stop"):
        tcp.start(timeout=5)
    _fast_cluster(cluster.state_dir).start(timeout=5)  # the same settings: running, fine


def test_a_running_cluster_that_bound_a_later_address_is_not_refused(reachable_dir: Path) -> None:
    # 192.0.2.1 (a documentation address) cannot be bound here: the server warns, listens on
    # 127.0.0.1 and names that one in its pid file. The same settings must start (find it
    # running) again.
    tcp = "192.0.2.1, 127.0.0.1"
    c = LocalCluster(reachable_dir / "state", port=PORT, listen_addresses=tcp)
    try:
        c.start()
        LocalCluster(reachable_dir / "state", port=PORT, listen_addresses=tcp).start(timeout=5)
        with pytest.raises(ClusterError, match=r"listening on TCP 127.0.0.1, not \(none\)"):
            _fast_cluster(reachable_dir / "state").start(timeout=5)
    finally:
        c.stop()


def test_long_socket_path_falls_back(reachable_dir: Path) -> None:
    state = reachable_dir / ("s" * 80) / "state"
    c = LocalCluster(state, port=PORT)
    digest = hashlib.sha256(str(state.resolve()).encode()).hexdigest()[:12]
    assert c.socket_dir == Path("/var/tmp") / f"appliance-{digest}" / "run"
    assert c.data_dir == state.resolve() / "pg" / "data"
    assert f"host={c.socket_dir} " in c.conninfo()


def test_a_socket_path_too_long_in_bytes_falls_back(reachable_dir: Path) -> None:
    # Under 100 characters, over 100 bytes: the kernel's limit is in bytes.
    state = reachable_dir / ("é" * 30) / "state"
    assert len(str(state)) < 80 < len(os.fsencode(state))
    c = LocalCluster(state, port=PORT)
    assert c.socket_dir.is_relative_to(Path("/var/tmp"))


def test_a_cluster_runs_on_the_binaries_of_the_version_that_made_it(
    reachable_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With 15 and a newer major installed, the search finds the newer one first; a cluster
    # made by 15 must still run on 15's binaries (the newer cannot read its data).
    assert BINDIR is not None
    root = reachable_dir / "lib"
    for version in ("15", "99"):
        (root / version / "bin").mkdir(parents=True)
        for name in ("initdb", "pg_ctl", "postgres"):
            (root / version / "bin" / name).symlink_to(BINDIR / name)
    monkeypatch.setattr("appliance.db.cluster._DEBIAN_ROOT", root)
    monkeypatch.setattr("appliance.db.cluster.find_bindir", lambda override=None: root / "99/bin")
    c = LocalCluster(reachable_dir / "state", port=PORT)
    assert c._bin("pg_ctl") == root / "99/bin/pg_ctl"  # no cluster yet: the newest
    c.data_dir.mkdir(parents=True)
    (c.data_dir / "PG_VERSION").write_text("15\n")
    again = LocalCluster(reachable_dir / "state", port=PORT)
    assert again._bin("pg_ctl") == root / "15/bin/pg_ctl"


@pytest.mark.parametrize("built_with_lz4", [True, False])
def test_wal_compression_is_lz4_only_where_the_server_has_it(
    reachable_dir: Path, built_with_lz4: bool
) -> None:
    # A server built without lz4 refuses the value (and would not start with it in its
    # configuration): the probe's answer decides, and pglz ("on") is the fallback.
    fake = reachable_dir / "bin"
    fake.mkdir()
    for name in ("initdb", "pg_ctl"):
        (fake / name).write_text("#!/bin/sh\nexit 0\n")
    answer = (
        "echo lz4"
        if built_with_lz4
        else 'echo \'FATAL:  invalid value for parameter "wal_compression": "lz4"\' >&2; exit 1'
    )
    asked = reachable_dir / "asked"
    asked.touch(mode=0o666)
    asked.chmod(0o666)  # the server's user (when we are root) runs the probe
    (fake / "postgres").write_text(f'#!/bin/sh\necho "$*" >> {asked}\n{answer}\n')
    for name in ("initdb", "pg_ctl", "postgres"):
        (fake / name).chmod(0o755)
    c = LocalCluster(reachable_dir / "state", port=PORT, bindir=fake)
    expected = "lz4" if built_with_lz4 else "on"
    assert c._wal_compression(reachable_dir) == expected
    assert c._wal_compression(reachable_dir) == expected
    # Asked once (then remembered), with the value to check, starting nothing.
    assert asked.read_text().splitlines() == [
        f"-D {reachable_dir} -C wal_compression -c wal_compression=lz4"
    ]


def test_stop_of_a_state_dir_that_does_not_exist_says_so_and_makes_nothing(
    reachable_dir: Path,
) -> None:
    typo = reachable_dir / "stat"
    _fast_cluster(typo).stop()
    assert not typo.exists()


def test_find_bindir(reachable_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert find_bindir() == Path("/usr/lib/postgresql/15/bin")
    assert find_bindir(BINDIR) == BINDIR
    # Relative to the current folder, made absolute: the tools run from /.
    assert BINDIR is not None
    monkeypatch.chdir(BINDIR.parent)
    assert find_bindir(BINDIR.name) == BINDIR
    with pytest.raises(ClusterError, match=str(reachable_dir)) as err:
        find_bindir(reachable_dir)
    assert "initdb" in str(err.value)


def test_find_bindir_reports_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr("appliance.db.cluster._DEBIAN_ROOT", Path("/nonexistent"))
    with pytest.raises(ClusterError, match=r"apt-get install -y postgresql"):
        find_bindir()


def test_ensure_database(cluster: LocalCluster) -> None:
    cluster.start()
    assert cluster.ensure_database("appliance_test") is True
    assert cluster.ensure_database("appliance_test") is False
    assert _query(cluster, "SELECT current_database()", dbname="appliance_test") == (
        "appliance_test"
    )
    owner = _query(
        cluster,
        "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = 'appliance_test'",
    )
    assert owner == ADMIN_USER
    for bad in ("Bad", "1abc", "a-b", 'x"; DROP DATABASE postgres; --', "", "a" * 64):
        with pytest.raises((ClusterError, ValueError)):
            cluster.ensure_database(bad)


def test_ensure_database_at_once_from_two_processes(cluster: LocalCluster) -> None:
    # As two `appliance db start` do: the loser of the server's racy name check gets a unique
    # violation of the catalog, which is "created meanwhile", not an error.
    cluster.start()
    for round_ in range(6):
        name = f"raced_{round_}"
        barrier = threading.Barrier(2)
        answers: list[object] = []

        def create(
            name: str = name,
            barrier: threading.Barrier = barrier,
            answers: list[object] = answers,
        ) -> None:
            other = _fast_cluster(cluster.state_dir)
            barrier.wait()
            try:
                answers.append(other.ensure_database(name))
            except BaseException as exc:  # reported below
                answers.append(exc)

        threads = [threading.Thread(target=create) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(answers, key=str) == [False, True], answers


def test_ensure_database_needs_running_cluster(reachable_dir: Path) -> None:
    c = _fast_cluster(reachable_dir / "state")
    with pytest.raises(ClusterError, match="start the cluster first"):
        c.ensure_database("appliance_test")


def test_psql_argv_reaches_cluster(cluster: LocalCluster) -> None:
    cluster.start()
    out = subprocess.run(
        [*cluster.psql_argv(), "-XAtc", "SELECT 40 + 2"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert out.stdout.strip() == "42"


def test_two_starts_at_once_both_succeed_on_one_cluster(reachable_dir: Path) -> None:
    # Separate instances, as two `appliance db start` processes have: without the lock, one
    # failed on initdb's scratch folder or on the other's half-written pid file.
    state = reachable_dir / "state"
    errors: list[BaseException] = []

    def start() -> None:
        try:
            _fast_cluster(state).start()
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert errors == []
        assert _query(_fast_cluster(state), "SELECT 1") == 1
    finally:
        _fast_cluster(state).stop()


@pytest.mark.skipif(not IS_ROOT, reason="the layout only falls back when run as root")
def test_a_layout_planned_from_half_made_folders_is_planned_again_under_the_lock(
    cluster: LocalCluster,
) -> None:
    # What a second `db start` saw while the first was still handing its folders to the
    # server's user: a socket folder the postgres user cannot enter yet. Planned from that, it
    # looked for the socket under /var/tmp and refused the server the first had started.
    cluster.start()
    run = cluster.socket_dir
    st = run.stat()
    os.chown(run, 0, 0)
    run.chmod(0o700)
    try:
        late = _fast_cluster(cluster.state_dir)
    finally:
        os.chown(run, st.st_uid, st.st_gid)
        run.chmod(0o700)
    late.start()  # planned again once it holds the lock: the folders are finished by then
    assert late.socket_dir == cluster.socket_dir
    assert _query(late, "SELECT 1") == 1


@pytest.mark.parametrize("char", [",", '"', "$"])
def test_a_state_dir_postgres_tools_cannot_take_is_refused_up_front(
    reachable_dir: Path, char: str
) -> None:
    state = reachable_dir / f"odd{char}name" / "state"
    with pytest.raises(ClusterError, match=re.escape(f"contains {char!r}")):
        _fast_cluster(state)
    assert not state.exists()


@pytest.mark.skipif(not IS_ROOT, reason="needs root to make a cluster another user owns")
def test_another_os_users_cluster_is_refused_untouched(reachable_dir: Path) -> None:
    # As root, the server runs as `postgres`: a cluster another user created (and runs) is
    # theirs; starting, stopping or reading it would break it for them.
    state = reachable_dir / "state"
    data = state / "pg" / "data"
    data.mkdir(parents=True)
    (data / MARKER).write_text("{}\n")
    nobody = pwd.getpwnam("nobody")
    for path in (state, state / "pg", data, data / MARKER):
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    before = sorted(str(p.relative_to(state)) for p in state.rglob("*"))
    c = _fast_cluster(state)
    for action in (c.start, c.stop, c.status, c.init):
        with pytest.raises(ClusterError, match="belongs to OS user nobody"):
            action()
    assert sorted(str(p.relative_to(state)) for p in state.rglob("*")) == before


def test_an_initdb_in_place_that_was_interrupted_is_done_again(reachable_dir: Path) -> None:
    """A data folder that exists (a mount point) is initialised in place. An appliance killed
    during that initdb left a folder without its marker (initdb, in a session of its own, may
    even finish it): every later start refused it as not the appliance's, for ever."""
    state = reachable_dir / "state"
    data = state / "pg" / "data"
    data.mkdir(parents=True)
    data.chmod(0o777)  # as an empty mount point: the appliance makes it the server user's
    code = (
        "from pathlib import Path; from appliance.db.cluster import LocalCluster; "
        f"LocalCluster(Path({str(state)!r}), port={PORT}).init()"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not any(data.iterdir()):
        assert time.monotonic() < deadline and proc.poll() is None, "initdb never began"
        time.sleep(0.01)
    proc.kill()  # SIGKILL: no clean-up of its own
    proc.wait()
    assert not (data / MARKER).exists()
    c = _fast_cluster(state)
    try:
        refusals: list[str] = []
        while True:  # the orphaned initdb is named while it runs, never raced
            try:
                c.start()
                break
            except ClusterError as exc:
                refusals.append(str(exc))
            assert time.monotonic() < deadline, refusals
            time.sleep(0.1)
        assert all("an earlier initdb" in r and "is still creating" in r for r in refusals)
        assert c.initialized() and c.status().running
        assert not (state / "pg" / ".data.initdb-in-place").exists()
        assert _query(c, "SELECT 1") == 1
    finally:
        c.stop()


def test_a_command_that_outruns_its_timeout_is_ended_with_what_it_started(
    reachable_dir: Path,
) -> None:
    # Only the command itself (runuser, as root) was killed: what it ran went on on its own.
    c = _fast_cluster(reachable_dir / "state")
    box = reachable_dir / "box"
    box.mkdir()
    box.chmod(0o777)  # the server's user writes here when the command runs as that user
    pidfile = box / "child.pid"
    with pytest.raises(ClusterError, match="sleeper did not finish within 1s"):
        c._run(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], timeout=1, what="sleeper")
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while not _gone(pid):
        assert time.monotonic() < deadline, "the command's child outlived its timeout"
        time.sleep(0.05)


def test_a_crash_restart_never_signals_a_process_that_took_a_stale_pid(
    cluster: LocalCluster,
) -> None:
    _start_then_kill_postmaster(cluster)
    # The stale postmaster.pid now names a live process of the server's user, not a server.
    runuser = ["runuser", "-u", "postgres", "--"] if IS_ROOT else []
    bystander = subprocess.Popen([*runuser, "sleep", "60"])
    try:
        time.sleep(0.2)
        sleeper = _children(bystander.pid)[0] if IS_ROOT else bystander.pid
        pidfile = cluster.data_dir / "postmaster.pid"
        lines = pidfile.read_text().splitlines()
        pidfile.write_text("\n".join([str(sleeper), *lines[1:]]) + "\n")
        cluster.crash_restart(timeout=30)
        assert cluster.status().running and cluster.status().pid != sleeper
        assert bystander.poll() is None, "the process that took the stale pid was signalled"
    finally:
        bystander.kill()
        bystander.wait()
