"""Models as an operator meets them: `appliance models` fetch/verify/list/add, a corrupted file
refused by verify and by the runner, and support tickets answered by a real runner process with
the real models of models.lock."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.db.database import Endpoints
from appliance.domain.inference import Tier
from appliance.inference.cache import default_cache_dir
from tests.e2e.runners import query, runners, wait_until
from tests.inference.models import LOCK, entry

APPLIANCE = [sys.executable, "-m", "appliance.cli"]
pytestmark = pytest.mark.slow


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*APPLIANCE, *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )


def base_env(**extra: str) -> dict[str, str]:
    keep = {"APPLIANCE_MODEL_CACHE"}
    clean = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_") or k in keep}
    return {**clean, **extra}


def test_fetch_verify_and_list_the_pinned_models() -> None:
    env = base_env()
    fetched = run(env, "models", "fetch")
    assert fetched.returncode == 0, fetched.stderr
    assert (
        fetched.stdout.count("cached") == 2
    )  # scripts/test fetched them; a second fetch only checks
    verified = run(env, "models", "verify")
    assert verified.returncode == 0, verified.stdout
    assert verified.stdout.count("ok ") == 2
    listed = run(env, "models", "list").stdout
    assert "smollm2-135m-instruct-q4_1" in listed and "serves: mechanical" in listed
    assert "gemma3-270m-q4_k_m" in listed and "serves: reasoning" in listed


@pytest.fixture
def corrupted_cache(tmp_path: Path) -> Path:
    """A model cache whose mechanical model has one byte flipped (the reasoning one intact)."""
    real = Path(os.environ.get("APPLIANCE_MODEL_CACHE") or default_cache_dir())
    cache = tmp_path / "cache"
    small, big = entry(Tier.MECHANICAL), entry(Tier.REASONING)
    (cache / small.sha256).mkdir(parents=True)
    target = cache / small.sha256 / small.file
    shutil.copyfile(real / small.sha256 / small.file, target)
    with target.open("r+b") as f:
        f.seek(small.size // 2)
        byte = f.read(1)
        f.seek(small.size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    (cache / big.sha256).symlink_to(real / big.sha256)
    return cache


def test_a_corrupted_byte_fails_verification_and_the_runner_refuses_to_start(
    corrupted_cache: Path, fresh_db: Endpoints
) -> None:
    small = entry(Tier.MECHANICAL)
    env = base_env(APPLIANCE_MODEL_CACHE=str(corrupted_cache))
    verified = run(env, "models", "verify")
    assert verified.returncode == 1
    assert f"expected sha256 {small.sha256}" in verified.stdout
    assert "found " in verified.stdout and small.name in verified.stdout
    runner = run(
        {
            **env,
            "APPLIANCE_DATABASE_URL": fresh_db.admin,
            "APPLIANCE_RUNNER__PIPELINES": '["support"]',
        },
        "runner",
    )
    assert runner.returncode == 2
    assert f"model {small.name}" in runner.stderr and small.sha256 in runner.stderr
    # The runner never reached the bus.
    assert query(fresh_db.admin, "SELECT count(*) AS n FROM runners")[0]["n"] == 0


def test_a_fetch_that_does_not_match_its_pin_is_deleted_and_names_both_hashes(
    tmp_path: Path,
) -> None:
    fake = tmp_path / "usb" / "tiny.gguf"
    fake.parent.mkdir()
    fake.write_bytes(b"GGUF" + b"\0" * 60)
    lock = tmp_path / "models.lock"
    lock.write_text(
        'version = 1\n[profiles.test]\nmechanical = "tiny"\n\n[[models]]\nname = "tiny"\n'
        'tier = "mechanical"\nfile = "tiny.gguf"\nsize = 64\n'
        f'sha256 = "{"ab" * 32}"\nlicense = "test"\ncontext_length = 512\n'
        f'chat_format = "chatml"\n\n[[models.sources]]\nkind = "file"\npath = "{fake}"\n'
    )
    cache = tmp_path / "cache"
    env = base_env(
        APPLIANCE_MODEL_CACHE=str(cache),
        APPLIANCE_INFERENCE__LOCK=str(lock),
        APPLIANCE_INFERENCE__PROFILE="test",
    )
    fetched = run(env, "models", "fetch")
    assert fetched.returncode == 2
    assert f"expected sha256 {'ab' * 32}" in fetched.stderr
    assert "got " in fetched.stderr and "the file was deleted" in fetched.stderr
    assert not list(cache.rglob("*.gguf")) and not list(cache.rglob(".fetch-*"))


def test_a_pinned_file_that_will_not_load_stops_the_runner_before_the_bus(
    tmp_path: Path, fresh_db: Endpoints
) -> None:
    # Verified (its pin is its own hash) but no model: llama.cpp cannot load it. The runner
    # used to serve on without the tier, its work parked until it expired.
    junk = b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 56
    digest = hashlib.sha256(junk).hexdigest()
    cache = tmp_path / "cache"
    (cache / digest).mkdir(parents=True)
    (cache / digest / "junk.gguf").write_bytes(junk)
    lock = tmp_path / "models.lock"
    lock.write_text(
        'version = 1\n[profiles.test]\nmechanical = "junk"\n\n[[models]]\nname = "junk"\n'
        f'tier = "mechanical"\nfile = "junk.gguf"\nsize = {len(junk)}\nsha256 = "{digest}"\n'
        'license = "test"\ncontext_length = 512\nchat_format = "chatml"\n'
    )
    env = base_env(
        APPLIANCE_MODEL_CACHE=str(cache),
        APPLIANCE_INFERENCE__LOCK=str(lock),
        APPLIANCE_INFERENCE__PROFILE="test",
        APPLIANCE_DATABASE_URL=fresh_db.admin,
        APPLIANCE_RUNNER__PIPELINES='["support"]',
    )
    runner = run(env, "runner")
    assert runner.returncode == 2, runner.stderr
    assert "tier mechanical could not load its model" in runner.stderr
    assert query(fresh_db.admin, "SELECT count(*) AS n FROM runners")[0]["n"] == 0


def test_models_add_side_loads_a_file_into_the_cache_and_the_lock(tmp_path: Path) -> None:
    real = Path(os.environ.get("APPLIANCE_MODEL_CACHE") or default_cache_dir())
    small = entry(Tier.MECHANICAL)
    usb = tmp_path / "usb"
    usb.mkdir()
    stick = usb / "side-loaded.gguf"
    os.link(real / small.sha256 / small.file, stick)
    lock = tmp_path / "models.lock"
    shutil.copyfile(LOCK, lock)
    cache = tmp_path / "cache"
    env = base_env(APPLIANCE_MODEL_CACHE=str(cache), APPLIANCE_INFERENCE__LOCK=str(lock))
    added = run(
        env, "models", "add", str(stick), "--tier", "mechanical", "--name", "usb-small",
        "--license", "apache-2.0", "--context-length", "8192", "--profile", "side",
    )  # fmt: skip
    assert added.returncode == 0, added.stderr
    assert small.sha256 in added.stdout
    assert "usb-small" in lock.read_text()
    side = run({**env, "APPLIANCE_INFERENCE__PROFILE": "side"}, "models", "verify")
    assert side.returncode == 0 and "usb-small" in side.stdout
    bad = run(env, "models", "add", str(tmp_path / "nothing.gguf"), "--tier", "mechanical",
              "--name", "x")  # fmt: skip
    assert bad.returncode == 2 and "is not a file" in bad.stderr
    # Refused before anything is hashed or copied, each naming what is wrong (a bad name was a
    # pydantic traceback; a text file or an unknown chat format was pinned, to fail at start).
    text = usb / "notes.gguf"
    text.write_text("hello")
    before = sorted(p.name for p in cache.rglob("*"))
    for args, needle in (
        ([str(text), "--name", "notes"], "path: " + str(text) + " is not a GGUF model"),
        ([str(stick), "--name", "usb-small"], "already has a model named 'usb-small'"),
        ([str(stick), "--name", "x", "--chat-format", "nope"], "cannot render chat format 'nope'"),
        ([str(stick), "--name", "Bad Name"], "name: String should match pattern"),
        ([str(stick), "--name", "x", "--context-length", "0"], "context_length: Input should"),
    ):
        refused = run(env, "models", "add", *args, "--tier", "mechanical")
        assert refused.returncode == 2, (args, refused.stderr)
        assert needle in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    assert sorted(p.name for p in cache.rglob("*")) == before


def test_support_tickets_are_classified_and_answered_by_a_real_runner(
    fresh_db: Endpoints, tmp_path: Path
) -> None:
    env = base_env(APPLIANCE_DATABASE_URL=fresh_db.admin)
    assert run(env, "tenant", "add", "acme").returncode == 0
    tickets = {
        "T-1": {"subject": "Charged twice", "body": "I was charged twice for my plan."},
        "T-2": {"subject": "Crash", "body": "The app crashes when I open settings."},
    }
    for ticket_id, ticket in tickets.items():
        submitted = run(
            env, "submit", "--tenant", "acme", "--pipeline", "support", "--stage", "classify",
            "--source", "helpdesk", "--source-id", ticket_id, "--directive", "answer this ticket",
            "--context", json.dumps({**ticket, "ticket_id": ticket_id}),
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
    with runners(
        fresh_db.admin,
        tmp_path,
        APPLIANCE_INFERENCE__ENABLED="true",
        APPLIANCE_RUNNER__PIPELINES='["support"]',
        APPLIANCE_RUNNER__PIPELINE_MODULES="[]",
        APPLIANCE_BUS__LEASE_SECONDS="10",
    ) as procs:
        procs.start("models")
        try:
            wait_until(
                lambda: (
                    query(
                        fresh_db.admin,
                        "SELECT count(*) AS n FROM agent_messages WHERE stage = 'reply' "
                        "AND status = 'done'",
                    )[0]["n"]
                    == 2
                ),
                timeout=180,
                what="both replies",
            )
        except AssertionError:
            raise AssertionError(procs.logs()) from None
        replies = query(
            fresh_db.admin,
            "SELECT source_id, result FROM agent_messages WHERE stage = 'reply' ORDER BY source_id",
        )
        for row in replies:
            result = row["result"]
            assert isinstance(result, dict)
            assert result["ticket"] == row["source_id"]
            assert result["label"] in {"billing", "bug", "account", "feature", "other"}
            assert result["queue"]
            assert result["status"] in {"answered", "escalated"}
            assert result["classified_by"] == entry(Tier.MECHANICAL).name
            assert result["drafted_by"] == entry(Tier.REASONING).name
        calls = query(
            fresh_db.admin,
            "SELECT kind, tier, min_tier, model_sha256 FROM inference_calls ORDER BY id",
        )
        assert sorted(str(c["kind"]) for c in calls) == ["classify", "classify", "draft", "draft"]
        for call in calls:
            assert call["tier"] == call["min_tier"]
            assert call["model_sha256"] == entry(Tier(str(call["tier"]))).sha256
        wait_until(
            lambda: "model reasoning" in run(env, "status").stdout, timeout=15, what="pool stats"
        )
        status = run(env, "status").stdout
        assert "model mechanical" in status and "smollm2-135m-instruct-q4_1" in status


def test_energy_calibrate_stores_labelled_estimates_and_cap_status_shows_them(
    fresh_db: Endpoints,
) -> None:
    env = base_env(APPLIANCE_DATABASE_URL=fresh_db.admin, APPLIANCE_METERING__SOURCE="estimate")
    calibrated = run(env, "energy", "calibrate", "--calls", "1", "--max-tokens", "16")
    assert calibrated.returncode == 0, calibrated.stderr
    assert calibrated.stdout.count("(estimated)") == 2
    rows = query(
        fresh_db.admin,
        "SELECT model, sha256, joules_per_token, provenance, source FROM energy_calibration "
        "ORDER BY model",
    )
    assert {r["model"] for r in rows} == {entry(Tier.MECHANICAL).name, entry(Tier.REASONING).name}
    for row in rows:
        assert row["provenance"] == "estimated" and row["source"] == "estimate"
        assert float(str(row["joules_per_token"])) > 0
    assert run(env, "cap", "set", "2.50").returncode == 0
    status = json.loads(run(env, "cap", "status", "--json").stdout)
    (appliance,) = [s for s in status["scopes"] if s["scope"] == "appliance"]
    assert (appliance["cap"], appliance["spent"], appliance["remaining"]) == ("2.5", "0", "2.5")
    bad = run(env, "cap", "set", "lots")
    assert bad.returncode == 2 and "amount" in bad.stderr
