"""models.lock: the shipped lock is valid, bad locks are named precisely, side-loading appends."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from appliance.domain.errors import ConfigurationError, InvalidInput
from appliance.domain.inference import Tier
from appliance.inference.cache import ModelCache
from appliance.inference.lockfile import FileSource, ModelEntry, append_entry, load_lock

LOCK = Path(__file__).resolve().parents[2] / "models.lock"


def test_the_shipped_lock_pins_every_model_and_the_dev_profile() -> None:
    lock = load_lock(LOCK)
    dev = lock.profile("dev")
    assert set(dev) == {Tier.MECHANICAL, Tier.REASONING}
    assert dev[Tier.MECHANICAL].sha256 != dev[Tier.REASONING].sha256
    assert dev[Tier.REASONING].size > dev[Tier.MECHANICAL].size
    for entry in lock.models:
        assert len(entry.sha256) == 64 and entry.size > 0 and entry.sources


def test_unknown_profile_and_bad_fields_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="no profile 'box'"):
        load_lock(LOCK).profile("box")
    bad = tmp_path / "models.lock"
    bad.write_text(LOCK.read_text().replace("size = 98362432", "size = -1"))
    with pytest.raises(ConfigurationError, match=r"models\.0\.size"):
        load_lock(bad)
    bad.write_text("version = [")
    with pytest.raises(ConfigurationError, match="not valid TOML"):
        load_lock(bad)


def test_a_profile_may_not_put_a_weaker_model_on_a_stronger_tier(tmp_path: Path) -> None:
    bad = tmp_path / "models.lock"
    bad.write_text(
        LOCK.read_text().replace(
            'reasoning = "gemma3-270m-q4_k_m"', 'reasoning = "smollm2-135m-instruct-q4_1"'
        )
    )
    with pytest.raises(ConfigurationError, match="cannot serve the reasoning tier"):
        load_lock(bad)


def test_append_entry_keeps_the_file_and_adds_a_profile(tmp_path: Path) -> None:
    lock_path = tmp_path / "models.lock"
    shutil.copy(LOCK, lock_path)
    before = lock_path.read_text()
    entry = ModelEntry(
        name="big-box-model",
        tier=Tier.REASONING,
        file="big.gguf",
        size=10,
        sha256="0" * 64,
        license="apache-2.0",
        context_length=4096,
        chat_format="chatml",
        sources=[FileSource(kind="file", path=Path('/media/usb/"odd" name.gguf'))],
    )
    append_entry(lock_path, entry, profile="box")
    assert lock_path.read_text().startswith(before)  # comments and order kept
    lock = load_lock(lock_path)
    assert lock.profile("box")[Tier.REASONING] == entry
    with pytest.raises(InvalidInput, match="already has a model"):
        append_entry(lock_path, entry)
    with pytest.raises(InvalidInput, match="profile 'dev' exists"):
        append_entry(lock_path, entry.model_copy(update={"name": "other"}), profile="dev")


def _entry(data: bytes, sources: list[FileSource]) -> ModelEntry:
    return ModelEntry(
        name="tiny", tier=Tier.MECHANICAL, file="tiny.gguf", size=len(data),
        sha256=hashlib.sha256(data).hexdigest(), license="test", context_length=64,
        chat_format="chatml", sources=list(sources),
    )  # fmt: skip


def test_a_source_with_other_bytes_is_passed_over_for_the_next(tmp_path: Path) -> None:
    # "Tried in order": a corrupt first source stopped the fetch before the good second one.
    data = b"GGUF" + bytes(range(256)) * 4
    bad, good = tmp_path / "bad.gguf", tmp_path / "good.gguf"
    bad.write_bytes(data[:-1] + b"\x00")
    good.write_bytes(data)
    entry = _entry(data, [FileSource(kind="file", path=bad), FileSource(kind="file", path=good)])
    cache = ModelCache(tmp_path / "cache")
    verified, fetched = cache.fetch(entry)
    assert fetched and verified.path.read_bytes() == data
    # Every source wrong: one error naming them all, and nothing left in the cache.
    only_bad = _entry(data, [FileSource(kind="file", path=bad)])
    with pytest.raises(ConfigurationError, match="every source failed: file: model tiny"):
        ModelCache(tmp_path / "other").fetch(only_bad)
    assert not ModelCache(tmp_path / "other").path(only_bad).exists()
