"""Local PostgreSQL manager: creates, starts, stops and inspects the appliance's embedded cluster.

The appliance ships with its own PostgreSQL cluster living under the state directory. This module
finds the server binaries, runs ``initdb`` once, keeps the appliance's settings in
``appliance.conf`` (rewritten on every start), starts and stops the server with ``pg_ctl``,
recovers from a stale ``postmaster.pid`` left by a crash, and creates databases. It never touches
a data directory it did not create (those lack the ``appliance-cluster.json`` marker).

PostgreSQL refuses to run as root, so when the appliance runs as root the server runs as the
``postgres`` OS user (via ``runuser``); folders that user cannot reach are moved to a private
fallback under ``/var/tmp`` and linked from the state directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import hashlib
import json
import logging
import math
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from appliance.domain.errors import ClusterError

__all__ = [
    "ADMIN_USER",
    "MARKER",
    "ClusterStatus",
    "LocalCluster",
    "find_bindir",
]

ADMIN_USER = "appliance_admin"
MARKER = "appliance-cluster.json"

log = logging.getLogger("appliance.db.cluster")

# The OS user the server runs as when the appliance itself runs as root (initdb/pg_ctl refuse root).
_PG_OS_USER = "postgres"
_DEBIAN_ROOT = Path("/usr/lib/postgresql")
_FALLBACK_ROOT = Path("/var/tmp")
_REQUIRED_BINARIES = ("initdb", "pg_ctl", "postgres")
# sockaddr_un.sun_path is 108 bytes on Linux; stay clearly below it.
_MAX_SOCKET_PATH = 100
_DB_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
# Custom settings (extension.name) contain dots; anything else could inject config lines.
_CONF_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")
_INCLUDE_LINE = "include_if_exists = 'appliance.conf'"
_LOG_TAIL_LINES = 20
_LOG_TAIL_BYTES = 64 * 1024
# Characters a state directory's path may not hold (see LocalCluster.__init__).
_UNSAFE_PATH_CHARS = ',"$`\\\n'
# Held (flock) while a command creates, starts or stops the cluster: two `appliance db start`
# at once would otherwise race initdb's scratch folder and the pid file.
_LOCK_FILE = ".cluster.lock"
# What a PostgreSQL data directory holds: a state directory with one of these is someone's
# cluster, not a place for the appliance's.
_DATA_DIR_SIGNS = ("PG_VERSION", "postmaster.pid")
_LOCK_WAIT_S = 120.0


def find_bindir(override: str | Path | None = None) -> Path:
    """Return the directory holding the PostgreSQL server binaries (initdb, pg_ctl, postgres).

    Looks at ``override`` (the caller passes APPLIANCE_PG_BINDIR), then ``pg_config --bindir``,
    then the Debian layout ``/usr/lib/postgresql/<version>/bin``, newest version first.
    """
    if override is not None and str(override) != "":
        # Absolute: the tools run from / (a relative folder would pass this check from the
        # current one and then not be found).
        path = Path(override).absolute()
        missing = [name for name in _REQUIRED_BINARIES if not _is_executable(path / name)]
        if missing:
            raise ClusterError(
                f"APPLIANCE_PG_BINDIR={path} does not hold the PostgreSQL server binaries "
                f"(missing: {', '.join(missing)}): point it at the folder that contains initdb, "
                "pg_ctl and postgres (e.g. /usr/lib/postgresql/15/bin) or unset it"
            )
        return path

    looked: list[str] = []
    pg_config = shutil.which("pg_config")
    if pg_config is not None:
        looked.append("`pg_config --bindir`")
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            out = None
        # pg_config also comes with the client-only libpq-dev package; its bindir may lack initdb.
        if out is not None and out.returncode == 0 and out.stdout.strip():
            candidate = Path(out.stdout.strip())
            looked[-1] = f"`pg_config --bindir` ({candidate})"
            if _has_server_binaries(candidate):
                return candidate

    looked.append(f"{_DEBIAN_ROOT}/<version>/bin")
    for candidate in _debian_bindirs():
        if _has_server_binaries(candidate):
            return candidate

    raise ClusterError(
        f"PostgreSQL server binaries not found (looked in {', '.join(looked)}): install the "
        "Debian package `postgresql` (apt-get install -y postgresql) or set APPLIANCE_PG_BINDIR"
    )


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _has_server_binaries(path: Path) -> bool:
    return all(_is_executable(path / name) for name in _REQUIRED_BINARIES)


def _debian_bindirs() -> list[Path]:
    """``/usr/lib/postgresql/<ver>/bin`` folders, newest first (numeric: 9.6 < 15 < 16)."""
    try:
        entries = list(_DEBIAN_ROOT.iterdir())
    except OSError:
        return []
    versioned: list[tuple[tuple[int, ...], Path]] = []
    for entry in entries:
        try:
            key = tuple(int(part) for part in entry.name.split("."))
        except ValueError:
            continue
        versioned.append((key, entry / "bin"))
    versioned.sort(reverse=True)
    return [path for _, path in versioned]


@dataclass(frozen=True)
class ClusterStatus:
    """A snapshot of the local cluster, as ``appliance status`` shows it."""

    running: bool
    pid: int | None
    data_dir: Path
    socket_dir: Path
    port: int
    initialized: bool
    version: str | None


@dataclass(frozen=True)
class _OsUser:
    """Who owns the server's files and runs its processes."""

    name: str
    uid: int
    gid: int
    groups: frozenset[int]
    via_runuser: bool  # True when we are root and must drop to this user to run the server


def _server_user() -> _OsUser:
    if os.geteuid() != 0:
        uid = os.geteuid()
        return _OsUser(
            name=str(uid), uid=uid, gid=os.getegid(), groups=frozenset(), via_runuser=False
        )
    try:
        entry = pwd.getpwnam(_PG_OS_USER)
    except KeyError:
        raise ClusterError(
            f"running as root, but there is no `{_PG_OS_USER}` OS user to run PostgreSQL as "
            "(initdb and postgres refuse to run as root): install the Debian package `postgresql` "
            "(it creates the user) or run the appliance as an unprivileged user"
        ) from None
    groups = frozenset(os.getgrouplist(entry.pw_name, entry.pw_gid))
    return _OsUser(
        name=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, groups=groups, via_runuser=True
    )


def _traversable(st: os.stat_result, user: _OsUser) -> bool:
    # POSIX picks exactly one class (owner, then group, then other); ACLs are not considered.
    if st.st_uid == user.uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid in user.groups:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _blocking_dir(target: Path, user: _OsUser) -> Path | None:
    """The first existing folder on the way to ``target`` that ``user`` cannot pass through.

    Folders that do not exist yet are ours to create (mode 0755), so they never block.
    """
    for folder in [*reversed(target.parents), target]:
        try:
            st = folder.stat()
        except FileNotFoundError:
            return None
        except OSError:
            return folder
        if not _traversable(st, user):
            return folder
    return None


def _describe_owner(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return "unreadable"
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"mode {stat.S_IMODE(st.st_mode):04o}, {owner}:{group}"


def _conf_quote(value: str) -> str:
    """Quote a value for postgresql.conf: single quotes doubled, backslashes escaped."""
    if "\n" in value or "\r" in value or "\0" in value:
        raise ClusterError(f"setting value {value!r} contains a line break or NUL: remove it")
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


def _end_group(proc: subprocess.Popen[str]) -> None:
    """Kill a command and everything it started in its session, and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.communicate(timeout=5)


def _orphans_of(procs: list[tuple[int, int, bool]]) -> list[int]:
    """Of (pid, parent pid, is a postmaster) rows, the non-postmasters whose postmaster is not
    among them (it died)."""
    postmasters = {pid for pid, _, pm in procs if pm}
    return [pid for pid, parent, pm in procs if not pm and parent not in postmasters]


class LocalCluster:
    """The appliance's own PostgreSQL cluster under ``state_dir``.

    Layout: ``state_dir/pg/data`` (data directory), ``state_dir/run`` (Unix socket folder),
    ``state_dir/log/postgresql.log``. When the server's OS user cannot reach those, or the socket
    path would be too long, they live under ``/var/tmp/appliance-<hash>`` instead and the state
    directory holds symlinks to them; ``data_dir``, ``socket_dir`` and ``log_file`` are then the
    real (fallback) paths, since the server must not go through the blocked folder.
    """

    def __init__(
        self,
        state_dir: Path,
        *,
        bindir: Path | None = None,
        port: int = 5432,
        listen_addresses: str = "",
        extra_conf: Mapping[str, str] | None = None,
    ) -> None:
        if isinstance(port, bool) or not 1 <= port <= 65535:
            raise ClusterError(f"port {port!r} is out of range: use 1..65535")
        for key in extra_conf or {}:
            if not _CONF_KEY_RE.match(key):
                raise ClusterError(
                    f"extra_conf key {key!r} is not a PostgreSQL setting name: use letters, "
                    "digits and underscores (an optional `prefix.` for extension settings)"
                )
        self.state_dir = Path(state_dir).absolute()
        bad = sorted(set(_UNSAFE_PATH_CHARS) & set(str(self.state_dir.resolve())))
        if bad:
            raise ClusterError(
                f"state directory {self.state_dir} contains {', '.join(map(repr, bad))}, which"
                " PostgreSQL's tools cannot take in a path (libpq reads ',' in a socket folder"
                " as a list of hosts; pg_ctl passes paths through a shell): use another state"
                " directory"
            )
        self.port = port
        self.listen_addresses = listen_addresses
        self.extra_conf: dict[str, str] = dict(extra_conf or {})
        self._bindir_override = bindir
        self._bindir: Path | None = None
        self._lz4: bool | None = None  # whether the server can compress its WAL with lz4
        self._version: str | None = None
        self._user = _server_user()
        self._lock_depth = 0
        self._thread_lock = threading.RLock()

        self._plan_layout()

    # ------------------------------------------------------------------ layout

    def _plan_layout(self) -> None:
        """Where the data, socket and log folders are: in the state dir, or in the fallback
        when the server's user cannot reach them there. Planned again once this command holds
        the cluster lock: another command may have been creating the folders meanwhile, and a
        plan made from its half-made folders (not yet handed to the server's user) would put
        the socket elsewhere than the server that command starts."""
        resolved = self.state_dir.resolve()
        digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
        self._fallback_root = _FALLBACK_ROOT / f"appliance-{digest}"
        # name -> the folder the server really uses; names in _fallen_back are linked from
        # state_dir to the fallback folder.
        self._fallen_back: dict[str, Path] = {}
        self._blocker: Path | None = None
        real: dict[str, Path] = {}
        for name in ("pg", "run", "log"):
            link = self.state_dir / name
            if name == "pg" and link.is_symlink() and not link.exists():
                # The fallback folder holding the cluster is gone (an aged /var/tmp, a new
                # machine with the old state volume): never make an empty cluster in its
                # place, in a folder anyone may have created since.
                raise ClusterError(
                    f"the cluster folder {os.readlink(link)} linked from {link} is gone: "
                    f"restore it, or remove {link} to create a new, empty cluster"
                )
            target = link.resolve()
            reason = self._needs_fallback(name, target)
            if reason is not None:
                target = self._fallback_root / name
                self._fallen_back[name] = target
                log.debug("%s: using %s instead (%s)", self.state_dir / name, target, reason)
            real[name] = target
        if self._fallen_back:
            self._check_fallback_usable()
        # Folders in the fallback, newly or by links made before: checked as private either way.
        self._in_fallback = any(p.is_relative_to(self._fallback_root) for p in real.values())

        self.data_dir: Path = real["pg"] / "data"
        self.socket_dir: Path = real["run"]
        self.log_file: Path = real["log"] / "postgresql.log"

    def _needs_fallback(self, name: str, target: Path) -> str | None:
        """Why ``state_dir/name`` cannot be used in place, or None if it can."""
        if self._user.via_runuser:
            blocker = _blocking_dir(target, self._user)
            if blocker is not None:
                self._blocker = blocker
                return f"the {self._user.name} user cannot pass through {blocker}"
        if name == "run":
            socket_path = f"{target}/.s.PGSQL.{self.port}"
            if len(os.fsencode(socket_path)) >= _MAX_SOCKET_PATH:  # the kernel counts bytes
                return f"socket path {socket_path} is too long for a Unix socket"
        return None

    def _check_fallback_usable(self) -> None:
        blocker = _blocking_dir(self._fallback_root, self._user) if self._user.via_runuser else None
        why = (
            f"{self._blocker} blocks the {self._user.name} user"
            if self._blocker
            else f"the Unix socket path under {self.state_dir} is too long"
        )
        if blocker is not None:
            raise ClusterError(
                f"cannot place the PostgreSQL cluster: {why} and the fallback "
                f"{self._fallback_root} is blocked too, by {blocker} ({_describe_owner(blocker)}): "
                f"run `chmod o+x {self._blocker or blocker}` or use a state directory the "
                f"{self._user.name} user can reach"
            )
        pg_link = self.state_dir / "pg"
        if "pg" in self._fallen_back and pg_link.is_dir() and not pg_link.is_symlink():
            with contextlib.suppress(OSError):
                if any(pg_link.iterdir()):
                    raise ClusterError(
                        f"{pg_link} holds a cluster, but {why}: run `chmod o+x {self._blocker}` "
                        f"(or move {self.state_dir}) so the {self._user.name} user can reach it"
                    )

    def _prepare_dirs(self) -> None:
        """Create the folders the server needs, owned by the server's user, plus fallback links."""
        try:
            _mkdirs(self.state_dir)
            if self._in_fallback:
                _mkdirs(self._fallback_root)
                st = self._fallback_root.lstat()
                # /var/tmp is world-writable: never use a folder someone else planted there.
                if (
                    not stat.S_ISDIR(st.st_mode)
                    or st.st_uid != os.geteuid()
                    or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
                ):
                    raise ClusterError(
                        f"fallback folder {self._fallback_root} is not a private folder of this "
                        f"user ({_describe_owner(self._fallback_root)}): remove it and retry"
                    )
                os.chmod(self._fallback_root, 0o755)
            _mkdirs(self.data_dir.parent)
            self._own_dir(self.socket_dir, 0o700)
            self._own_dir(self.log_file.parent, 0o750)
            for name, target in self._fallen_back.items():
                self._link(self.state_dir / name, target)
        except OSError as exc:
            raise ClusterError(
                f"cannot create the cluster folders under {self.state_dir}: {exc}"
            ) from exc

    def _link(self, link: Path, target: Path) -> None:
        if link.is_symlink():
            if link.resolve() == target:
                return
            link.unlink()
        elif link.is_dir():
            try:
                link.rmdir()
            except OSError:
                log.warning("%s is a folder, not a link: the cluster uses %s", link, target)
                return
        elif link.exists():
            log.warning("%s is in the way: the cluster uses %s", link, target)
            return
        link.symlink_to(target, target_is_directory=True)
        log.info(
            "moved %s to %s (%s)",
            link,
            target,
            f"{self._blocker} blocks the {self._user.name} user"
            if self._blocker is not None
            else "Unix socket path too long",
        )

    def _own_dir(self, path: Path, mode: int) -> None:
        _mkdirs(path.parent)
        path.mkdir(mode=mode, exist_ok=True)
        self._chown(path)
        os.chmod(path, mode)

    def _chown(self, path: Path) -> None:
        if self._user.via_runuser:
            os.chown(path, self._user.uid, self._user.gid, follow_symlinks=False)

    # ------------------------------------------------------------------ binaries and commands

    def _bin(self, name: str) -> Path:
        if self._bindir is None:
            self._bindir = self._cluster_bindir() or find_bindir(self._bindir_override)
        return self._bindir / name

    def _cluster_bindir(self) -> Path | None:
        """The binaries of the major version that made this cluster, when several are
        installed: the newest (the search's first choice) cannot run an older cluster's data."""
        if self._bindir_override is not None and str(self._bindir_override) != "":
            return None  # the operator chose
        try:
            version = (self.data_dir / "PG_VERSION").read_text(encoding="utf-8").strip()
        except OSError:
            return None
        candidate = _DEBIAN_ROOT / version / "bin"
        return candidate if version and _has_server_binaries(candidate) else None

    def _run(
        self, argv: Sequence[str | Path], *, timeout: float, what: str
    ) -> subprocess.CompletedProcess[str]:
        """Run a server command as the server's user; raise ClusterError if it cannot run."""
        cmd = [str(arg) for arg in argv]
        if self._user.via_runuser:
            runuser = shutil.which("runuser")
            if runuser is None:
                raise ClusterError(
                    "running as root needs `runuser` (package util-linux) to start PostgreSQL as "
                    f"the {self._user.name} user: install util-linux or run as an unprivileged user"
                )
            cmd = [runuser, "-u", self._user.name, "--", *cmd]
        # PG* variables (PGDATA, PGPORT, ...) would silently retarget the tools; a C locale keeps
        # the output and the server's startup free of missing-locale warnings.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        try:
            # cwd "/": the server user may not be able to enter our working directory (e.g. /root).
            # A session of its own, so that the whole command (runuser, and the tool it runs as
            # the server's user) can be ended together: killing runuser alone on a timeout or
            # an interrupt left initdb or pg_ctl running on their own, racing the next try (an
            # initdb finishing after us left a data directory without our marker, refused
            # for ever). pg_ctl puts the server it starts in a session of its own, so ending
            # a pg_ctl never ends the server.
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd="/",
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            raise ClusterError(f"{what} could not run ({cmd[0]}): {exc}") from exc
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            _end_group(proc)
            raise ClusterError(
                f"{what} did not finish within {timeout:.0f}s: see {self.log_file}"
            ) from exc
        except BaseException:  # an interrupt (Ctrl-C, or SIGTERM as the CLI maps it)
            _end_group(proc)
            raise
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    # ------------------------------------------------------------------ ownership checks

    def initialized(self) -> bool:
        """Whether the appliance has created this cluster (the marker is in the data dir)."""
        try:
            return (self.data_dir / MARKER).is_file()
        except OSError as exc:
            raise ClusterError(
                f"cannot inspect {self.data_dir}: {exc.strerror} (it belongs to another OS user:"
                f" {_describe_owner(self.state_dir / 'pg')}); run the appliance as that user"
            ) from None

    def _check_owner(self) -> None:
        """Refuse a cluster that another OS user's server owns, before touching anything: run
        as root against a user's cluster, the server would run as `postgres` and could neither
        read its files nor stop it, and the folders and config written on the way would keep
        the real owner from starting it again."""
        data = self.state_dir / "pg" / "data"
        try:
            st = data.stat()
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as exc:
            raise ClusterError(
                f"cannot inspect {data}: {exc.strerror}; the cluster belongs to another OS user"
                f" ({_describe_owner(self.state_dir / 'pg')}): run the appliance as that user"
            ) from None
        # A folder the appliance did not create is refused as foreign (_refuse_foreign) instead.
        if st.st_uid != self._user.uid and os.path.lexists(data / MARKER):
            try:
                owner = pwd.getpwuid(st.st_uid).pw_name
            except KeyError:
                owner = str(st.st_uid)
            raise ClusterError(
                f"the cluster in {data} belongs to OS user {owner} (uid {st.st_uid}), but this"
                f" process would run PostgreSQL as {self._user.name} (uid {self._user.uid}):"
                f" run the appliance as {owner}, or use another state directory"
            )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive use of this cluster by one command (creating, starting or stopping it);
        re-entrant within the process. Waits up to _LOCK_WAIT_S for another command."""
        with self._thread_lock:  # the depth below is this thread's: others wait here
            if self._lock_depth:
                self._lock_depth += 1
                try:
                    yield
                finally:
                    self._lock_depth -= 1
                return
            with self._flocked():
                yield

    @contextlib.contextmanager
    def _flocked(self) -> Iterator[None]:
        path = self.state_dir / _LOCK_FILE
        self._refuse_data_dir_as_state()  # before the lock file lands in someone's cluster
        try:
            _mkdirs(self.state_dir)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            # A state directory this user cannot write: nothing here can be changed anyway,
            # and the steps below say so in their own words.
            log.debug("no lock on %s (%s): going on without it", path, exc)
            fd = -1
        try:
            if fd >= 0:
                deadline = time.monotonic() + _LOCK_WAIT_S
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise ClusterError(
                                f"another appliance command has been creating, starting or"
                                f" stopping the cluster in {self.state_dir} for over"
                                f" {_LOCK_WAIT_S:.0f} s (it holds {path}); wait for it or end it"
                            ) from None
                        time.sleep(0.1)
            self._lock_depth = 1
            self._plan_layout()
            yield
        finally:
            self._lock_depth = 0
            if fd >= 0:
                os.close(fd)  # releases the lock

    def foreign(self) -> bool:
        """Whether the data directory holds something the appliance did not create, or the
        state directory is itself another cluster's data directory (the appliance's own would
        nest inside it)."""
        if self._state_is_a_data_dir():
            return True
        if self.initialized() or not os.path.lexists(self.data_dir):
            return False
        if os.path.lexists(self._in_place_mark):
            return False  # our own initdb into it was interrupted: done again on the next start
        try:
            return not (self.data_dir.is_dir() and not any(self.data_dir.iterdir()))
        except OSError as exc:
            raise ClusterError(f"cannot inspect {self.data_dir}: {exc}") from exc

    def _state_is_a_data_dir(self) -> bool:
        return any(os.path.lexists(self.state_dir / name) for name in _DATA_DIR_SIGNS)

    def _refuse_data_dir_as_state(self) -> None:
        if self._state_is_a_data_dir():
            raise ClusterError(
                f"refusing to use {self.state_dir} as the state directory: it is a PostgreSQL "
                "data directory (it holds PG_VERSION or postmaster.pid); point the appliance "
                "at another state directory"
            )

    def _refuse_foreign(self) -> None:
        self._refuse_data_dir_as_state()
        if self.foreign():
            raise ClusterError(
                f"refusing to touch {self.data_dir}: not created by the appliance (no {MARKER}); "
                "move it away or point the appliance at another state directory"
            )

    # ------------------------------------------------------------------ init

    def init(self) -> bool:
        """Create the cluster with initdb unless it exists; True if it was created now."""
        self._check_owner()
        with self._locked():
            return self._init()

    def _init(self) -> bool:
        self._refuse_foreign()
        if self.initialized():
            return False
        self._prepare_dirs()
        # initdb into a scratch folder, then rename: a crash half way leaves no marker-less data
        # dir behind (which we would then refuse to touch forever).
        # A data folder that exists already (a mount point, or made by hand, empty: foreign()
        # refuses anything else) is initialised in place, and a mark beside it says so until
        # our marker is in it: an initdb in place that was interrupted is ours to do again,
        # not a folder without our marker to refuse for ever.
        in_place = self.data_dir.is_dir()
        work = self.data_dir if in_place else self.data_dir.parent / ".data.initdb"
        try:
            if os.path.lexists(work):
                self._refuse_running_initdb(work)
            if in_place:
                if os.path.lexists(self._in_place_mark):
                    for child in work.iterdir():  # the folder itself may be a mount point
                        if child.is_dir() and not child.is_symlink():
                            shutil.rmtree(child)
                        else:
                            child.unlink()
                self._write_owned(self._in_place_mark, f"{work}\n")
            elif os.path.lexists(work):
                shutil.rmtree(work)  # our own leftover from an interrupted init
            self._own_dir(work, 0o700)
        except OSError as exc:
            raise ClusterError(f"cannot prepare {work} for initdb: {exc}") from exc
        result = self._run(
            [
                self._bin("initdb"),
                "-D",
                work,
                "-U",
                ADMIN_USER,
                "-E",
                "UTF8",
                "--no-locale",
                "--data-checksums",
                # Local trust is deliberate: the socket lives in a private folder (mode 0700,
                # owned by the server user) of the state dir, so only that user and root can
                # reach it. TCP is off by default and needs a SCRAM password when turned on.
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
            ],
            timeout=300,
            what="initdb",
        )
        if result.returncode != 0:
            raise ClusterError(
                f"initdb failed for {self.data_dir} (exit {result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-2000:]}"
            )
        try:
            marker = {
                "created_by": "appliance",
                "cluster_id": str(uuid.uuid4()),
                "created_at": datetime.now(UTC).isoformat(),
            }
            self._write_owned(work / MARKER, json.dumps(marker, indent=2) + "\n")
            self._write_conf(work)
            if in_place:
                self._in_place_mark.unlink()
            else:
                os.rename(work, self.data_dir)
        except OSError as exc:
            raise ClusterError(f"cannot finish creating {self.data_dir}: {exc}") from exc
        log.info("created PostgreSQL cluster in %s", self.data_dir)
        return True

    @property
    def _in_place_mark(self) -> Path:
        return self.data_dir.parent / ".data.initdb-in-place"

    def _refuse_running_initdb(self, work: Path) -> None:
        """An initdb of an earlier, interrupted start may still be writing `work` (it outlives
        an appliance killed with SIGKILL): emptying the folder under it would race it."""
        target = str(work)
        for proc in Path("/proc").iterdir() if Path("/proc/self").exists() else ():
            if not proc.name.isdigit():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode(errors="replace") for a in argv]
            if target in args and any(Path(a).name == "initdb" for a in args):
                raise ClusterError(
                    f"an earlier initdb (pid {proc.name}) is still creating {work}: let it end "
                    f"(or kill {proc.name}) and start again"
                )

    def _write_owned(self, path: Path, text: str) -> None:
        """Atomically write a file the server user owns and can read (mode 0600)."""
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o600)
        self._chown(tmp)
        os.replace(tmp, path)

    def _wal_compression(self, data_dir: Path) -> str:
        """lz4 where the server is built with it, else pglz ("on").

        Every page first written after a checkpoint goes to the WAL whole, compressed. pglz
        took 3-4 % of the server's CPU in a burst of claims after a checkpoint; lz4 compresses
        several times faster (measured here: updating 20,000 rows after a checkpoint, pglz
        +35 % over no compression, lz4 the same as none). Not every build has lz4, and an
        unknown value would stop the server from starting, so the server is asked first
        (`postgres -C` checks a value and exits; it starts nothing)."""
        if self._lz4 is None:
            probe = self._run(
                [
                    self._bin("postgres"),
                    "-D",
                    data_dir,
                    "-C",
                    "wal_compression",
                    "-c",
                    "wal_compression=lz4",
                ],
                timeout=60,
                what="postgres -C wal_compression",
            )
            self._lz4 = probe.returncode == 0 and probe.stdout.strip() == "lz4"
        return "lz4" if self._lz4 else "on"

    def _write_conf(self, data_dir: Path) -> None:
        """Write appliance.conf and make sure postgresql.conf includes it."""
        # A list of folders: double quotes keep commas/spaces in the path from splitting it.
        socket_dirs = '"' + str(self.socket_dir).replace('"', '""') + '"'
        settings: dict[str, str] = {
            "listen_addresses": self.listen_addresses,
            "port": str(self.port),
            "unix_socket_directories": socket_dirs,
            "unix_socket_permissions": "0770",
            # Sized for a small box; the appliance shares it with inference workers.
            "shared_buffers": "128MB",
            "max_connections": "100",
            "work_mem": "4MB",
            "maintenance_work_mem": "64MB",
            "max_wal_size": "1GB",
            "checkpoint_timeout": "15min",
            "wal_compression": self._wal_compression(data_dir),
            # JIT compilation costs more than it saves on the short queue queries we run.
            "jit": "off",
            "random_page_cost": "1.1",
            # A forgotten open transaction would hold locks and block vacuum of the queue tables.
            "idle_in_transaction_session_timeout": "10min",
            "log_min_duration_statement": "1000",
            "timezone": "UTC",
        }
        lines = [
            "# Written by the appliance on every start; edits here are lost.",
            "# Put lasting changes in the appliance configuration (extra settings).",
        ]
        lines += [f"{key} = {_conf_quote(value)}" for key, value in settings.items()]
        if self.extra_conf:
            lines.append("# extra settings (later lines win)")
            lines += [f"{key} = {_conf_quote(value)}" for key, value in self.extra_conf.items()]
        self._write_owned(data_dir / "appliance.conf", "\n".join(lines) + "\n")

        main_conf = data_dir / "postgresql.conf"
        text = main_conf.read_text(encoding="utf-8")
        if _INCLUDE_LINE not in text:
            # Append (not rewrite) so the file keeps the server user as owner.
            with main_conf.open("a", encoding="utf-8") as fh:
                fh.write(f"\n# Appliance-managed settings\n{_INCLUDE_LINE}\n")

    # ------------------------------------------------------------------ running state

    def _read_pidfile(self) -> list[str] | None:
        try:
            return (self.data_dir / "postmaster.pid").read_text(encoding="utf-8").splitlines()
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise ClusterError(f"cannot read {self.data_dir / 'postmaster.pid'}: {exc}") from exc

    def _pidfile_pid(self) -> int | None:
        lines = self._read_pidfile()
        if not lines:
            return None
        try:
            return int(lines[0].strip())
        except ValueError:
            return None

    def _live_pid(self) -> int | None:
        """The postmaster's pid if it is alive and serving our data dir, else None."""
        pid = self._pidfile_pid()
        if pid is None or pid <= 0:
            return None
        return pid if self._is_our_postmaster(pid) else None

    # How long a start waits for a dead postmaster's processes to end.
    orphan_wait_s = 10.0

    def _server_processes(self) -> list[tuple[int, int, bool]]:
        """(pid, parent pid, whether it is a postmaster) of every live server process whose
        working folder is this cluster's data directory."""
        if not Path("/proc/self").exists():
            return []
        try:
            ours = os.stat(self.data_dir)
        except OSError:
            return []
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                here = os.stat(proc / "cwd")
                if (here.st_dev, here.st_ino) != (ours.st_dev, ours.st_ino):
                    continue
                fields = (proc / "stat").read_bytes().rsplit(b")", 1)[-1].split()
                argv0 = (proc / "cmdline").read_bytes().split(b"\0", 1)[0]
            except OSError:
                continue  # gone meanwhile, not ours to read
            if len(fields) < 2 or fields[0] in (b"Z", b"X"):
                continue
            # A postmaster runs under its program's path; its children under a title.
            postmaster = os.path.basename(argv0) in (b"postgres", b"postmaster")
            if postmaster or argv0.startswith(b"postgres: "):
                found.append((int(proc.name), int(fields[1]), postmaster))
        return sorted(found)

    def orphans(self) -> list[int]:
        """Server processes of this cluster still alive without their postmaster (it was
        killed; a backend busy in a long query notices only when the query ends). They hold
        the old server's shared memory, so a new one cannot start until they are gone."""
        return _orphans_of(self._server_processes())

    def _wait_for_orphans(self) -> float:
        """Before a start with no live postmaster: give a dead one's processes a moment to
        end (they do once they notice), then refuse, naming them, rather than fail in the
        server's own words about shared memory in its log. The seconds it waited."""
        began = time.monotonic()
        procs = self._server_processes()
        headless = [pid for pid, _, pm in procs if pm]
        if headless:
            raise ClusterError(
                f"a server (pid {', '.join(map(str, headless))}) runs on {self.data_dir} "
                "without its postmaster.pid: stop it (kill -INT "
                f"{' '.join(map(str, headless))}) and start again"
            )
        while left := _orphans_of(procs):
            if time.monotonic() - began >= self.orphan_wait_s:
                raise ClusterError(
                    f"the last server of {self.data_dir} died, but its processes "
                    f"{', '.join(map(str, left))} still run (busy in a query they do not "
                    "interrupt) and hold its shared memory: end them (kill "
                    f"{' '.join(map(str, left))}) and start again"
                )
            time.sleep(0.2)
            procs = self._server_processes()
        return time.monotonic() - began

    def _is_our_postmaster(self, pid: int) -> bool:
        proc = Path(f"/proc/{pid}")
        if not Path("/proc/self").exists():  # no procfs: liveness is all we can check
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        try:
            stat_line = (proc / "stat").read_text()
            raw_argv = (proc / "cmdline").read_bytes()
        except OSError:
            return False
        # A killed postmaster stays a zombie when PID 1 does not reap (containers, microVMs).
        state = stat_line.rsplit(")", 1)[-1].split()[:1]
        if state in (["Z"], ["X"]):
            return False
        argv = [os.fsdecode(arg) for arg in raw_argv.split(b"\0") if arg]
        if not argv or Path(argv[0]).name not in ("postgres", "postmaster"):
            return False
        # After a crash the pid may have been reused, even by another cluster's postmaster.
        ours = os.path.realpath(self.data_dir)
        for arg in argv[1:]:
            candidate = arg[2:] if arg.startswith("-D") and len(arg) > 2 else arg
            if candidate.startswith("/") and os.path.realpath(candidate) == ours:
                return True
        # Started with another spelling of the path: the postmaster's cwd is its data dir.
        try:
            return os.path.samefile(proc / "cwd", self.data_dir)
        except OSError:
            return False

    def _remove_stale(self) -> None:
        pidfile = self.data_dir / "postmaster.pid"
        lines = self._read_pidfile() or ["?"]
        removed = [pidfile]
        try:
            pidfile.unlink(missing_ok=True)
            # The socket folder is private to this cluster, so any socket or lock in it is ours;
            # a lock naming a reused pid would otherwise block the next start.
            for leftover in self.socket_dir.glob(".s.PGSQL.*"):
                leftover.unlink(missing_ok=True)
                removed.append(leftover)
        except OSError as exc:
            raise ClusterError(f"cannot remove stale {pidfile}: {exc}") from exc
        log.warning(
            "recovered from a stale postmaster.pid (pid %s is no postmaster of this data"
            " directory any more: a crash or a kill): removed %s",
            lines[0].strip(),
            ", ".join(str(p) for p in removed),
        )

    # ------------------------------------------------------------------ start / stop

    def start(self, timeout: float = 60.0) -> None:
        """Start the cluster (creating it first if needed) and wait until it takes connections."""
        self._check_owner()
        with self._locked():
            self._start(timeout)

    def _start(self, timeout: float) -> None:
        self.init()
        deadline = time.monotonic() + timeout  # for the start: a first initdb is not counted
        pid = self._live_pid()
        if pid is not None:
            self._check_running_matches()
            self._wait_ready(deadline)
            return
        self._prepare_dirs()
        deadline += self._wait_for_orphans()  # not counted either
        if os.path.lexists(self.data_dir / "postmaster.pid"):
            self._remove_stale()
        try:
            self._write_conf(self.data_dir)
        except OSError as exc:
            raise ClusterError(f"cannot write {self.data_dir / 'appliance.conf'}: {exc}") from exc
        remaining = max(1.0, deadline - time.monotonic())
        result = self._run(
            [
                self._bin("pg_ctl"),
                "-D",
                self.data_dir,
                "-l",
                self.log_file,
                "-w",
                "-t",
                str(math.ceil(remaining)),
                "start",
            ],
            timeout=remaining + 15,
            what="pg_ctl start",
        )
        if result.returncode != 0:
            if self._live_pid() is not None:
                # pg_ctl gave up waiting, but the server runs: crash recovery of a large WAL
                # can outlast any timeout. Stopping it would only lose the work done so far.
                raise ClusterError(
                    f"PostgreSQL is still starting after {timeout:g} s (crash recovery can take"
                    " a while; see the log): run `appliance db start` again to wait for it;"
                    f" last lines of {self.log_file}:\n{self._log_tail()}"
                )
            raise ClusterError(
                f"PostgreSQL did not start (pg_ctl exit {result.returncode}: "
                f"{(result.stderr or result.stdout).strip()[-500:]}); "
                f"last lines of {self.log_file}:\n{self._log_tail()}"
            )
        try:
            self._wait_ready(deadline)
        except ClusterError:
            # Started but unreachable: not left running where no client can find it.
            with contextlib.suppress(ClusterError):
                self.stop()
            raise
        log.info("PostgreSQL started (data %s, socket %s)", self.data_dir, self.socket_dir)

    def running_mismatch(self) -> str | None:
        """Why the running server is not where these settings point (another port, socket or
        TCP address: it was started with other settings), or None."""
        try:
            self._check_running_matches()
        except ClusterError as exc:
            return str(exc)
        return None

    def _check_running_matches(self) -> None:
        """A running server must listen where conninfo() points, or clients cannot find it."""
        lines = self._read_pidfile() or []
        # postmaster.pid: pid, data dir, start time, port, first socket dir, ...
        if len(lines) >= 5:
            running_port, running_socket = lines[3].strip(), lines[4].strip()
            if running_port != str(self.port) or running_socket != str(self.socket_dir):
                raise ClusterError(
                    f"the cluster in {self.data_dir} is already running on port {running_port} "
                    f"(socket {running_socket}), not port {self.port} (socket {self.socket_dir}): "
                    "stop it first so the new settings apply"
                )
        if len(lines) >= 6:
            # The first TCP address it could bind ('' for none; not necessarily the first one
            # configured), against those configured.
            running_tcp = lines[5].strip()
            configured = self.extra_conf.get("listen_addresses", self.listen_addresses)
            wanted = {a.strip() for a in configured.split(",")} - {""}
            if running_tcp not in (wanted or {""}):
                raise ClusterError(
                    f"the cluster in {self.data_dir} is already running listening on TCP"
                    f" {running_tcp or '(none)'}, not {configured.strip() or '(none)'}: stop it"
                    " first so the new settings apply"
                )

    def _wait_ready(self, deadline: float) -> None:
        last: Exception | None = None
        while True:
            remaining = deadline - time.monotonic()
            try:
                with psycopg.connect(
                    self.conninfo(), connect_timeout=max(1, math.ceil(remaining))
                ) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.Error as exc:
                last = exc
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"PostgreSQL in {self.data_dir} does not accept connections on "
                    f"{self.socket_dir} port {self.port}: {last}; last lines of "
                    f"{self.log_file}:\n{self._log_tail()}"
                )
            time.sleep(0.1)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the cluster: fast shutdown, then immediate if that takes longer than timeout."""
        if not self.state_dir.exists():
            return  # nothing to stop; a mistyped state dir must not be created by looking
        self._check_owner()
        with self._locked():
            self._stop(timeout)

    def _stop(self, timeout: float) -> None:
        self._refuse_foreign()
        if self._live_pid() is None:
            return
        for mode, limit in (("fast", timeout), ("immediate", 30.0)):
            try:
                result = self._run(
                    [
                        self._bin("pg_ctl"),
                        "-D",
                        self.data_dir,
                        "-m",
                        mode,
                        "-w",
                        "-t",
                        str(max(1, math.ceil(limit))),
                        "stop",
                    ],
                    timeout=limit + 15,
                    what=f"pg_ctl stop -m {mode}",
                )
            except ClusterError as exc:
                # pg_ctl itself hung: the next mode is still worth a try (it was never tried).
                log.warning("%s", exc)
                continue
            if result.returncode == 0 or self._live_pid() is None:
                log.info("PostgreSQL stopped (%s shutdown)", mode)
                return
            log.warning(
                "pg_ctl stop -m %s failed (exit %s): %s",
                mode,
                result.returncode,
                (result.stderr or result.stdout).strip(),
            )
        raise ClusterError(
            f"PostgreSQL in {self.data_dir} (pid {self._pidfile_pid()}) did not stop, even with "
            f"an immediate shutdown: kill it by hand; last lines of {self.log_file}:\n"
            f"{self._log_tail()}"
        )

    def crash_restart(self, timeout: float = 60.0) -> None:
        """Restart with an immediate shutdown (no checkpoint: the server recovers from WAL on
        start, as after a crash). For failure drills and tests; clients are disconnected."""
        self._check_owner()
        with self._locked():
            self._crash_restart(timeout)

    def _crash_restart(self, timeout: float) -> None:
        self._refuse_foreign()
        # Only a postmaster of this data directory is stopped: pg_ctl signals whatever pid a
        # stale postmaster.pid names (a process that reused it), and start() takes care of a
        # stale file anyway.
        if self._live_pid() is not None:
            result = self._run(
                [self._bin("pg_ctl"), "-D", self.data_dir, "-m", "immediate", "-w", "stop"],
                timeout=timeout,
                what="pg_ctl stop -m immediate",
            )
            if self._live_pid() is not None:
                raise ClusterError(
                    f"PostgreSQL in {self.data_dir} did not stop for the crash restart (exit "
                    f"{result.returncode}): {(result.stderr or result.stdout).strip()[-2000:]}"
                )
        self.start(timeout=timeout)

    def _log_tail(self) -> str:
        # The end of the file only: the log grows for as long as the cluster lives.
        try:
            with self.log_file.open("rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(max(0, size - _LOG_TAIL_BYTES))
                text = fh.read().decode("utf-8", errors="replace")
        except OSError as exc:
            return f"(cannot read {self.log_file}: {exc})"
        lines = text.splitlines()
        if size > _LOG_TAIL_BYTES:
            lines = lines[1:]  # the first line read may be cut
        return "\n".join(lines[-_LOG_TAIL_LINES:]) or "(log is empty)"

    # ------------------------------------------------------------------ inspection

    def status(self) -> ClusterStatus:
        """Report whether the cluster exists and runs; reads files only, never starts anything."""
        self._check_owner()
        pid = self._live_pid()
        return ClusterStatus(
            running=pid is not None,
            pid=pid,
            data_dir=self.data_dir,
            socket_dir=self.socket_dir,
            port=self.port,
            initialized=self.initialized(),
            version=self._server_version(),
        )

    def _server_version(self) -> str | None:
        if self._version is not None:
            return self._version
        try:
            # --version is answered before postgres' refusal to run as root.
            out = subprocess.run(
                [str(self._bin("postgres")), "--version"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            match = re.search(r"\)\s*(\d+(?:\.\d+)*)", out.stdout)
            if out.returncode == 0 and match:
                self._version = match.group(1)
                return self._version
        except (ClusterError, OSError, subprocess.TimeoutExpired):
            pass
        try:
            return (self.data_dir / "PG_VERSION").read_text(encoding="utf-8").strip() or None
        except OSError:
            return None

    def conninfo(self, user: str = ADMIN_USER, dbname: str = "postgres") -> str:
        """libpq keyword string reaching this cluster over its Unix socket."""
        return make_conninfo(
            "", host=str(self.socket_dir), port=str(self.port), user=user, dbname=dbname
        )

    def psql_argv(self, user: str = ADMIN_USER, dbname: str = "postgres") -> list[str]:
        """argv that runs this cluster's psql against it (for `appliance db shell`)."""
        return [
            str(self._bin("psql")),
            "-h",
            str(self.socket_dir),
            "-p",
            str(self.port),
            "-U",
            user,
            "-d",
            dbname,
        ]

    def ensure_database(self, name: str) -> bool:
        """Create database ``name`` (owned by ADMIN_USER) unless it exists; True if created."""
        if not _DB_NAME_RE.match(name):
            raise ClusterError(
                f"database name {name!r} is not allowed: use 1-63 lowercase letters, digits and "
                "underscores, not starting with a digit"
            )
        try:
            with psycopg.connect(self.conninfo(), autocommit=True, connect_timeout=10) as conn:
                row = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
                if row.fetchone() is not None:
                    return False
                try:
                    conn.execute(
                        sql.SQL("CREATE DATABASE {} OWNER {}").format(
                            sql.Identifier(name), sql.Identifier(ADMIN_USER)
                        )
                    )
                except (psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
                    # Created concurrently by another process: the server's name check before
                    # its catalog insert is racy, so the loser may get the catalog's unique
                    # index violation instead of DuplicateDatabase.
                    return False
        except psycopg.OperationalError as exc:
            raise ClusterError(
                f"cannot reach the local cluster at {self.socket_dir} port {self.port} to "
                f"create database {name!r}: {exc}; start the cluster first"
            ) from exc
        log.info("created database %s", name)
        return True


def _mkdirs(path: Path) -> None:
    """mkdir -p with mode 0755 for the folders it creates (the umask could make them 0700)."""
    missing: list[Path] = []
    current = path
    while not os.path.lexists(current):
        missing.append(current)
        current = current.parent
    for folder in reversed(missing):
        folder.mkdir(mode=0o755, exist_ok=True)
        os.chmod(folder, 0o755)
