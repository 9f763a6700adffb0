"""The `appliance` command as a user runs it: real processes against real PostgreSQL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from appliance.db.cluster import find_bindir
from appliance.db.database import Endpoints
from tests.pgserver import PgTestServer

APPLIANCE = [sys.executable, "-m", "appliance.cli"]
ROOT = Path(__file__).resolve().parents[2]


def run(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [*APPLIANCE, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"appliance {' '.join(args)} -> {proc.returncode}\n{proc.stderr}")
    return proc


@pytest.fixture
def env(fresh_db: Endpoints) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    return {**clean, "APPLIANCE_DATABASE_URL": fresh_db.admin}


def test_submit_twice_prints_same_id_new_then_duplicate(env: dict[str, str]) -> None:
    assert run(env, "tenant", "add", "acme").stdout.strip() == "acme added"
    assert run(env, "tenant", "add", "acme").stdout.strip() == "acme exists"
    args = [
        "submit", "--tenant", "acme", "--pipeline", "demo", "--stage", "intake",
        "--source", "cli", "--source-id", "42", "--directive", "triage this",
        "--context", '{"ticket": 42}',
    ]  # fmt: skip
    first = run(env, *args).stdout.split()
    again = run(env, *args)
    second = again.stdout.split()
    assert first[1] == "new" and second[1] == "duplicate" and first[0] == second[0]
    assert again.stderr == ""  # the same request: nothing to say
    # The same key with other content: still a duplicate, and told what was not taken.
    other = [*args[:-4], "--directive", "other", "--context", '{"ticket": 43}']
    changed = run(env, *other)
    assert changed.stdout.split() == [first[0], "duplicate"]
    assert "differs from this request in: directive, context" in changed.stderr
    status = json.loads(run(env, "status", "--json").stdout)
    assert status["lanes"]["interactive"]["pending"] == 1
    assert status["lanes"]["batch"]["pending"] == 0
    assert status["ages"]["interactive"]["oldest_pending_s"] >= 0
    shown = json.loads(run(env, "bus", "show", "--tenant", "acme", first[0]).stdout)
    assert shown["context"] == {"ticket": 42}
    assert [t["to_status"] for t in shown["transitions"]] == ["pending"]
    assert run(env, "bus", "cancel", "--tenant", "acme", first[0]).stdout.strip() == "cancelled"
    assert "interactive" in run(env, "status").stdout


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--lane", "urgent"], "lane: unknown lane 'urgent'"),
        (["--context", "{not json"], "context: is not valid JSON"),
        (["--context", "@/nonexistent/file.json"], "context: cannot read"),
        # Read no further than one byte past the limit: not a MemoryError after reading it all.
        (["--context", "@/dev/zero"], "context: /dev/zero is over 4194304 bytes, 4 times"),
        (["--context", '"\udcff"'], "context: contains a lone surrogate"),
        (["--deadline", "tomorrow"], "deadline: 'tomorrow' is not an ISO 8601 time"),
        (["--deadline", "2020-01-01T00:00:00Z"], "deadline: 2020-01-01T00:00:00+00:00 is not in"),
        (["--tenant", "nobody"], "tenant: unknown tenant 'nobody'"),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_nothing(
    env: dict[str, str], extra: list[str], needle: str
) -> None:
    run(env, "tenant", "add", "acme")
    base = {
        "--tenant": "acme", "--pipeline": "demo", "--stage": "intake", "--source": "cli",
        "--source-id": "1", "--directive": "x",
    }  # fmt: skip
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        base[flag] = value
    argv = [item for pair in base.items() for item in pair]
    proc = run(env, "submit", *argv, check=False)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    status = json.loads(run(env, "status", "--json").stdout)
    assert sum(sum(lane.values()) for lane in status["lanes"].values()) == 0


def test_oversized_context_file_names_the_limit(env: dict[str, str], tmp_path: Path) -> None:
    run(env, "tenant", "add", "acme")
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"blob": "x" * (1024 * 1024 + 10)}))
    proc = run(
        env, "submit", "--tenant", "acme", "--pipeline", "p", "--stage", "s", "--source", "c",
        "--source-id", "1", "--directive", "d", "--context", f"@{big}", check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "over the limit of 1048576 bytes" in proc.stderr


@pytest.fixture
def state_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="appliance-cli-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_local_cluster_lifecycle_from_the_cli(state_dir: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env = {**clean, "APPLIANCE_STATE_DIR": str(state_dir), "APPLIANCE_DB__PORT": "5433"}
    typo = {**env, "APPLIANCE_STATE_DIR": str(state_dir / "typo")}
    assert "no cluster in" in run(typo, "db", "stop").stdout
    assert run(typo, "db", "status", check=False).returncode == 3
    assert not (state_dir / "typo").exists()  # looking made nothing
    try:
        assert run(env, "db", "status", check=False).returncode == 3
        assert "running" in run(env, "db", "start").stdout
        assert "running" in run(env, "db", "start").stdout  # idempotent
        numbers = sorted(int(p.name[:4]) for p in (ROOT / "sql" / "migrations").glob("*.sql"))
        assert f"applied {numbers}" in run(env, "db", "migrate").stdout
        assert "applied none" in run(env, "db", "migrate").stdout
        run(env, "tenant", "add", "acme")
        out = run(
            env, "submit", "--tenant", "acme", "--pipeline", "demo", "--stage", "intake",
            "--source", "cli", "--source-id", "1", "--directive", "hi",
        ).stdout  # fmt: skip
        assert out.endswith("new\n")
        psql = run(env, "db", "psql", "--", "-tAc", "SELECT count(*) FROM agent_messages")
        assert psql.stdout.strip() == "1"
        # psql's options without the `--`; the appliance's own option before them.
        psql = run(env, "db", "psql", "--role", "system", "-tAc", "SELECT current_user")
        assert psql.stdout.strip() == "appliance_system"
        assert (state_dir / "pg" / "data" / "appliance-cluster.json").exists()
        assert run(env, "db", "status").stdout.startswith("database: running, pid")
        # Settings that point elsewhere than the running server: said, not "running, port X".
        moved = run({**env, "APPLIANCE_DB__PORT": "5434"}, "db", "status", check=False)
        assert moved.returncode == 3
        assert "already running on port 5433" in moved.stdout, moved.stdout
        assert "not port 5434" in moved.stdout, moved.stdout
    finally:
        assert run(env, "db", "stop", check=False).stdout == "database: stopped\n"
    assert run(env, "db", "status", check=False).returncode == 3
    assert run(env, "db", "stop").stdout == "database: was not running\n"


def test_a_db_command_ended_by_sigterm_ends_the_tool_it_runs(state_dir: Path) -> None:
    """SIGTERM ended the CLI at once; the tool it was running (here an initdb that hangs) went
    on without it. Now the command ends it, and exits as interrupted, without a trace."""
    bindir = state_dir / "bin"
    bindir.mkdir()
    real = find_bindir()
    for name in ("pg_ctl", "postgres"):
        (bindir / name).symlink_to(real / name)
    box = state_dir / "box"
    box.mkdir()
    box.chmod(0o777)  # written by the server's user when the CLI runs as root
    (bindir / "initdb").write_text(f"#!/bin/sh\necho $$ > {box}/initdb.pid\nexec sleep 60\n")
    (bindir / "initdb").chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env = {
        **clean,
        "APPLIANCE_STATE_DIR": str(state_dir / "state"),
        "APPLIANCE_PG_BINDIR": str(bindir),
    }
    proc = subprocess.Popen(
        [*APPLIANCE, "db", "start"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (box / "initdb.pid").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr
        time.sleep(0.05)
    initdb = int((box / "initdb.pid").read_text())
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err == "interrupted\n", (proc.returncode, err)
    while Path(f"/proc/{initdb}").exists() and "Z" not in _state(initdb):
        assert time.monotonic() < deadline, "the initdb outlived the command"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def test_context_file_that_is_not_utf8_is_named(env: dict[str, str], tmp_path: Path) -> None:
    run(env, "tenant", "add", "acme")
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"name": "caf\xe9"}')
    proc = run(
        env, "submit", "--tenant", "acme", "--pipeline", "p", "--stage", "s", "--source", "c",
        "--source-id", "1", "--directive", "d", "--context", f"@{bad}", check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert f"context: {bad}: is not UTF-8 text (byte 13" in proc.stderr
    assert "Traceback" not in proc.stderr
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    proc = run(
        env, "submit", "--tenant", "acme", "--pipeline", "p", "--stage", "s", "--source", "c",
        "--source-id", "1", "--directive", "d", "--context", f"@{empty}", check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert f"context: {empty}: is not valid JSON" in proc.stderr, proc.stderr


def test_operator_commands_say_what_they_did_not_do(env: dict[str, str]) -> None:
    run(env, "tenant", "add", "acme")
    out = run(
        env, "submit", "--tenant", "acme", "--pipeline", "p", "--stage", "s", "--source", "c",
        "--source-id", "1", "--directive", "d",
    ).stdout  # fmt: skip
    pending = out.split()[0]
    # An unknown tenant is an error, not "nothing to do".
    for args in (["redrive"], ["cancel", pending], ["show", pending], ["list"]):
        proc = run(env, "bus", args[0], "--tenant", "ghost", *args[1:], check=False)
        assert proc.returncode == 2, args
        assert "tenant: unknown tenant 'ghost'" in proc.stderr
    proc = run(env, "bus", "redrive", "--tenant", "acme", pending, "99999", check=False)
    assert proc.returncode == 1
    assert proc.stdout.strip() == "redriven: 0"
    assert f"message {pending} not redriven: is pending, not dead" in proc.stderr
    assert "message 99999 not redriven: not found for tenant acme" in proc.stderr
    # A cancel it refused says why, as a redrive does.
    assert run(env, "bus", "cancel", "--tenant", "acme", pending).stdout.strip() == "cancelled"
    proc = run(env, "bus", "cancel", "--tenant", "acme", pending, check=False)
    assert proc.returncode == 1
    assert f"message {pending} not cancelled: is cancelled: it has already ended" in proc.stderr
    proc = run(env, "bus", "cancel", "--tenant", "acme", "99999", check=False)
    assert "message 99999 not cancelled: not found for tenant acme" in proc.stderr
    assert run(env, "bus", "redrive", "--tenant", "acme").stdout.strip() == "redriven: 0"


def test_bus_list_pages_through_a_tenants_messages_by_status_and_lane(
    env: dict[str, str],
) -> None:
    for tenant in ("acme", "globex"):
        run(env, "tenant", "add", tenant)

    def submit(tenant: str, sid: str, *extra: str) -> str:
        return run(
            env, "submit", "--tenant", tenant, "--pipeline", "p", "--stage", "s", "--source",
            "c", "--source-id", sid, "--directive", "d", *extra,
        ).stdout.split()[0]  # fmt: skip

    first, second = submit("acme", "1"), submit("acme", "2", "--lane", "batch")
    third = submit("acme", "3")
    submit("globex", "1")  # another tenant's: never listed for acme
    run(env, "bus", "cancel", "--tenant", "acme", third)

    def ids(*args: str) -> list[str]:
        out = run(env, "bus", "list", "--tenant", "acme", *args).stdout.splitlines()
        assert out[0].split()[:3] == ["id", "status", "lane"]
        return [line.split()[0] for line in out[1:] if line != "(none)"]

    assert ids() == [third, second, first]  # newest first
    assert ids("--status", "cancelled") == [third]
    assert ids("--status", "pending,cancelled", "--lane", "batch") == [second]
    assert ids("--status", "pending", "--status", "dead") == [second, first]
    assert ids("--status", "dead") == []
    paged = run(env, "bus", "list", "--tenant", "acme", "--limit", "2")
    assert [line.split()[0] for line in paged.stdout.splitlines()[1:]] == [third, second]
    assert f"(more may follow: --before {second})" in paged.stderr
    assert ids("--before", second) == [first]
    listed = json.loads(run(env, "bus", "list", "--tenant", "acme", "--json").stdout)
    assert [(m["id"], m["status"], m["lane"]) for m in listed] == [
        (int(third), "cancelled", "interactive"),
        (int(second), "pending", "batch"),
        (int(first), "pending", "interactive"),
    ]
    assert all(m["tenant"] == "acme" for m in listed)
    for args, needle in (
        (["--status", "zombie"], "status: unknown status 'zombie' (one of: pending,"),
        (["--lane", "urgent"], "lane: unknown lane 'urgent'"),
        (["--limit", "0"], "argument --limit: 0 is not from 1 to 1000"),
    ):
        proc = run(env, "bus", "list", "--tenant", "acme", *args, check=False)
        assert proc.returncode == 2, args
        assert needle in proc.stderr
        assert "Traceback" not in proc.stderr


def test_a_cap_set_below_what_is_already_committed_says_so(
    env: dict[str, str], fresh_db: Endpoints
) -> None:
    run(env, "tenant", "add", "acme")
    run(env, "cap", "set", "1.0")
    with psycopg.connect(fresh_db.admin, autocommit=True) as conn:
        conn.execute(
            "SELECT * FROM appliance.spend_reserve('acme', 'interactive', 0.6, NULL, NULL,"
            " 'p', 's', 'classify', 'm', 'mechanical', NULL)"
        )
    lowered = run(env, "cap", "set", "0.5")
    assert "cap appliance: 0.5" in lowered.stdout
    assert "reserved 0.6 already pass the new cap" in lowered.stderr
    assert "already pass" not in run(env, "cap", "set", "0.7").stderr


def test_redrive_names_dead_work_past_its_deadline(
    env: dict[str, str], fresh_db: Endpoints
) -> None:
    run(env, "tenant", "add", "acme")
    out = run(
        env, "submit", "--tenant", "acme", "--pipeline", "p", "--stage", "s", "--source", "c",
        "--source-id", "late", "--directive", "d",
    ).stdout  # fmt: skip
    mid = out.split()[0]
    with psycopg.connect(fresh_db.admin, autocommit=True) as conn:
        conn.execute("SET search_path = appliance, pg_catalog")
        # Dead, with its deadline behind it (as after it ran out of attempts, late).
        conn.execute(
            "UPDATE agent_messages SET status = 'running', attempts = 1, lease_token = 1,"
            " lease_expires_at = now() + interval '1 minute' WHERE id = %s",
            (mid,),
        )
        conn.execute(
            "UPDATE agent_messages SET status = 'dead', lease_expires_at = NULL,"
            " finished_at = now(), deadline = now() - interval '1 minute' WHERE id = %s",
            (mid,),
        )
    everything = run(env, "bus", "redrive", "--tenant", "acme")  # not an error: one line
    assert everything.stdout.strip() == "redriven: 0"
    assert "1 dead messages left: their deadlines have passed" in everything.stderr
    named = run(env, "bus", "redrive", "--tenant", "acme", mid, check=False)
    assert named.returncode == 1
    assert f"message {mid} not redriven: its deadline has passed" in named.stderr
    cleared = run(env, "bus", "redrive", "--tenant", "acme", "--clear-deadline")
    assert cleared.stdout.strip() == f"redriven: 1 ({mid})"


def test_reclaim_says_when_the_work_is_back(env: dict[str, str], fresh_db: Endpoints) -> None:
    run(env, "tenant", "add", "acme")
    assert run(env, "bus", "reclaim").stdout.strip() == "reclaimed: 0"
    ids = []
    for sid in ("a", "b"):
        out = run(
            env, "submit", "--tenant", "acme", "--pipeline", "p", "--stage", "s", "--source",
            "c", "--source-id", sid, "--directive", "d",
        ).stdout  # fmt: skip
        ids.append(out.split()[0])
    with psycopg.connect(fresh_db.admin, autocommit=True) as conn:
        conn.execute("SET search_path = appliance, pg_catalog")
        # Both held by a worker that died: one with attempts left, one on its last.
        for mid, attempts in zip(ids, (1, 5), strict=True):
            conn.execute(
                "UPDATE agent_messages SET status = 'running', attempts = %s, lease_token = 1,"
                " lease_expires_at = now() - interval '1 second' WHERE id = %s",
                (attempts, mid),
            )
    out = run(env, "bus", "reclaim").stdout.strip()
    # After one attempt, the default backoff: 1-2 s.
    assert out.startswith("reclaimed: 2 (1 pending, claimable within "), out
    assert out.endswith(" s; 1 dead)"), out
    assert 0.9 < float(out.split("within ")[1].split(" s")[0]) <= 2.0, out


def test_text_that_is_not_utf8_or_too_long_is_named_not_a_trace(env: dict[str, str]) -> None:
    # "\udcff" reaches the command line as the byte 0xff, which is not UTF-8.
    run(env, "tenant", "add", "acme")
    out = run(
        env, "submit", "--tenant", "acme", "--pipeline", "p", "--stage", "s", "--source", "c",
        "--source-id", "u", "--directive", "d",
    ).stdout  # fmt: skip
    mid = out.split()[0]
    cases = [
        (["bus", "show", "--tenant", "\udcff", mid], "tenant: "),
        (["bus", "redrive", "--tenant", "\udcff"], "tenant: "),
        (["bus", "cancel", "--tenant", "acme", "--reason", "\udcff", mid], "reason: "),
        (["bus", "cancel", "--tenant", "acme", "--reason", "x" * 501, mid], "reason: must be"),
        (["tenant", "add", "okname", "--display-name", "\udcff"], "display_name: "),
    ]
    for args, named in cases:
        proc = run(env, *args, check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert named in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
    assert "cancelled" in run(env, "bus", "cancel", "--tenant", "acme", "--reason", "x" * 500,
                              mid).stdout  # fmt: skip


def test_a_list_setting_that_is_not_json_is_one_line_not_a_trace(env: dict[str, str]) -> None:
    proc = run({**env, "APPLIANCE_RUNNER__PIPELINES": "demo,support"}, "status", check=False)
    assert proc.returncode == 2
    assert "is written as JSON" in proc.stderr and "Traceback" not in proc.stderr


def test_an_unreachable_or_misnamed_database_is_one_line_not_a_trace(
    env: dict[str, str], tmp_path: Path
) -> None:
    gone = {**env, "APPLIANCE_DATABASE_URL": f"postgresql:///appliance?host={tmp_path}"}
    for args in (["db", "migrate"], ["status"], ["tenant", "list"], ["db", "status"]):
        proc = run(gone, *args, check=False)
        assert proc.returncode in (2, 3), args
        assert "cannot connect to the database" in proc.stderr or "error: database:" in (
            proc.stderr
        ), args
        assert "Traceback" not in proc.stderr, args
        # A server the appliance does not manage: nothing to `db start`.
        assert "appliance db start" not in proc.stderr, args
    garbled = {**env, "APPLIANCE_DATABASE_URL": "not a url"}
    proc = run(garbled, "db", "migrate", check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: database: missing")
    proc = run({**env, "APPLIANCE_DB__PORT": "abc"}, "status", check=False)
    assert proc.returncode == 2
    assert "db.port (environment variable APPLIANCE_DB__PORT)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_database_not_migrated_says_to_migrate(
    env: dict[str, str], pg_server: PgTestServer
) -> None:
    """It failed on the first relation it did not find (`relation "tenants" does not
    exist`), and a runner on every claim."""
    name = pg_server.create_empty()
    try:
        bare = {**env, "APPLIANCE_DATABASE_URL": pg_server.endpoints(name).admin}
        for args in (["status"], ["tenant", "list"], ["runner"]):
            proc = run(bare, *args, check=False)
            assert proc.returncode == 2, args
            assert "the database has no appliance schema" in proc.stderr, (args, proc.stderr)
            assert "run `appliance db migrate`" in proc.stderr, args
            assert "Traceback" not in proc.stderr, args
        run(bare, "db", "migrate")
        assert run(bare, "tenant", "list").returncode == 0
    finally:
        pg_server.drop(name)


def test_work_submitted_before_any_runner_gets_its_stages_lane_and_tier(
    env: dict[str, str], fresh_db: Endpoints
) -> None:
    # No runner has written the pipelines' stage graphs yet: submit writes the declared one, so
    # the message is not given the bus defaults (interactive, no tier) for good.
    run(env, "tenant", "add", "acme")
    # A submit refused for bad input writes nothing, the stage graph included.
    bad = run(env, "submit", "--tenant", "acme", "--pipeline", "demo", "--stage", "intake",
              "--source", "cli", "--source-id", "2", "--directive", "", check=False)  # fmt: skip
    assert bad.returncode == 2 and "directive" in bad.stderr
    ghost = run(env, "submit", "--tenant", "ghost", "--pipeline", "demo", "--stage", "intake",
                "--source", "cli", "--source-id", "2", "--directive", "d", check=False)  # fmt: skip
    assert ghost.returncode == 2 and "unknown tenant 'ghost'" in ghost.stderr
    with psycopg.connect(fresh_db.admin) as conn:
        demo = conn.execute(
            "SELECT count(*) FROM appliance.pipeline_stages WHERE pipeline = 'demo'"
        ).fetchone()
    assert demo == (0,)
    # A mistyped stage of a pipeline not yet written is refused, and writes nothing either.
    typo = run(env, "submit", "--tenant", "acme", "--pipeline", "demo", "--stage", "intak",
               "--source", "cli", "--source-id", "3", "--directive", "d", check=False)  # fmt: skip
    assert typo.returncode == 2, typo.stderr
    assert "(one of: enrich, intake, publish)" in typo.stderr
    with psycopg.connect(fresh_db.admin) as conn:
        stages = conn.execute("SELECT count(*) FROM appliance.pipeline_stages").fetchone()
    assert stages == (0,)
    for pipeline, stage in (("demo", "enrich"), ("support", "classify")):
        run(env, "submit", "--tenant", "acme", "--pipeline", pipeline, "--stage", stage,
            "--source", "cli", "--source-id", "1", "--directive", "d")  # fmt: skip
    status = json.loads(run(env, "status", "--json").stdout)
    assert status["lanes"]["batch"]["pending"] == 1  # demo.enrich is a batch stage
    with psycopg.connect(fresh_db.admin) as conn:
        rows = conn.execute(
            "SELECT pipeline, stage, lane::text, tier FROM appliance.agent_messages ORDER BY id"
        ).fetchall()
    assert rows == [("demo", "enrich", "batch", None), ("support", "classify", "interactive",
                                                        "mechanical")]  # fmt: skip
    # A pipeline nobody declares still takes work, with the defaults.
    run(env, "submit", "--tenant", "acme", "--pipeline", "elsewhere", "--stage", "s",
        "--source", "cli", "--source-id", "1", "--directive", "d")  # fmt: skip
    # A declared pipeline's stage mistyped: refused, naming the stages there are (taken, it
    # would wait for a runner that serves it until its wait expired).
    typo = run(env, "submit", "--tenant", "acme", "--pipeline", "demo", "--stage", "intak",
               "--source", "cli", "--source-id", "3", "--directive", "d", check=False)  # fmt: skip
    assert typo.returncode == 2, typo.stderr
    assert "stage: unknown stage 'intak' of pipeline demo (one of: enrich, intake, publish)" in (
        typo.stderr
    )


def test_a_pipeline_module_that_fails_to_load_does_not_stop_a_submit(
    env: dict[str, str], fresh_db: Endpoints, tmp_path: Path
) -> None:
    # The runner would refuse to start with it; a submit warns, declares the built-ins it
    # still can, and takes the work.
    (tmp_path / "broken_pipelines.py").write_text("raise RuntimeError('half-deployed')\n")
    env = {
        **env,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "APPLIANCE_RUNNER__PIPELINE_MODULES": '["broken_pipelines"]',
    }
    run(env, "tenant", "add", "acme")
    proc = run(env, "submit", "--tenant", "acme", "--pipeline", "demo", "--stage", "enrich",
               "--source", "cli", "--source-id", "1", "--directive", "d")  # fmt: skip
    assert proc.stdout.split()[1] == "new"
    assert "warning: the declared pipelines cannot be loaded" in proc.stderr
    assert "half-deployed" in proc.stderr
    with psycopg.connect(fresh_db.admin) as conn:
        row = conn.execute("SELECT lane::text FROM appliance.agent_messages").fetchone()
    assert row == ("batch",)  # the built-in demo pipeline was still declared
