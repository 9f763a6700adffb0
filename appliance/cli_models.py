"""`appliance models`: fetch, verify, list and side-load the models pinned in models.lock."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from appliance.domain.errors import ApplianceError, InvalidInput
from appliance.domain.inference import Tier
from appliance.inference.cache import sha256_file
from appliance.inference.lockfile import FileSource, ModelEntry, append_entry
from appliance.inference.pool import chat_format_known
from appliance.runtime import model_cache, model_lock
from appliance.settings import Settings


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    models = sub.add_parser("models", help="the pinned models: fetch, verify, list, add")
    ms = models.add_subparsers(dest="models_action", required=True)
    fetch = ms.add_parser("fetch", help="fetch the pinned models into the cache and verify them")
    fetch.add_argument("--all", action="store_true", help="every model, not only the profile's")
    verify = ms.add_parser("verify", help="check the cached models byte for byte")
    verify.add_argument("--all", action="store_true", help="every model, not only the profile's")
    ms.add_parser("list", help="the pinned models, their tiers and whether they are cached")
    add = ms.add_parser("add", help="side-load a model file: hash it, cache it, pin it")
    add.add_argument("path", type=Path)
    add.add_argument("--tier", required=True, choices=[t.value for t in Tier])
    add.add_argument("--name", required=True)
    add.add_argument("--license", default="unknown")
    add.add_argument("--context-length", type=int, default=4096)
    add.add_argument("--chat-format", default="chatml")
    add.add_argument("--profile", help="also create this profile, choosing the model for its tier")


def _chosen(settings: Settings, every: bool) -> list[ModelEntry]:
    lock = model_lock(settings)
    if every:
        return list(lock.models)
    return list(lock.profile(settings.inference.profile).values())


def cmd_models(settings: Settings, args: argparse.Namespace) -> int:
    action = args.models_action
    cache = model_cache(settings, lambda line: print(f"  {line}", file=sys.stderr))
    if action == "fetch":
        for entry in _chosen(settings, args.all):
            verified, fetched = cache.fetch(entry)
            print(f"{'fetched' if fetched else 'cached '} {entry.name:<32} {verified.path}")
        return 0
    if action == "verify":
        failed = 0
        for entry in _chosen(settings, args.all):
            try:
                cache.verify(entry)
                print(f"ok      {entry.name:<32} sha256 {entry.sha256}")
            except ApplianceError as exc:
                failed += 1
                print(f"FAILED  {exc}")
        return 1 if failed else 0
    if action == "list":
        lock = model_lock(settings)
        chosen = {
            (tier, name) for tier, name in lock.profiles.get(settings.inference.profile, {}).items()
        }
        print(f"profile {settings.inference.profile} (models.lock: {settings.inference.lock})")
        for entry in lock.models:
            serves = [t.value for t, n in chosen if n == entry.name]
            present = "cached" if cache.path(entry).is_file() else "missing"
            print(
                f"{entry.name:<32} {entry.tier.value:<11} {entry.size / 1e6:8.1f} MB  "
                f"{present:<8} serves: {', '.join(serves) or '-':<12} {entry.license}"
            )
        return 0
    if action == "add":
        path: Path = args.path
        if not path.is_file():
            raise InvalidInput("path", f"{path} is not a file")
        if path.suffix != ".gguf":
            raise InvalidInput("path", f"{path.name}: a model file is a .gguf file")
        # Everything that can be checked before hashing and copying gigabytes is checked first,
        # so that a refused add leaves nothing behind.
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise InvalidInput("path", f"{path} is not a GGUF model (no GGUF header)")
        if not chat_format_known(args.chat_format):
            raise InvalidInput(
                "chat_format",
                f"the model pool cannot render chat format {args.chat_format!r} (e.g. chatml)",
            )
        if any(m.name == args.name for m in model_lock(settings).models):
            raise InvalidInput("name", f"models.lock already has a model named {args.name!r}")
        size, digest = sha256_file(path)
        try:
            entry = ModelEntry(
                name=args.name,
                tier=Tier(args.tier),
                file=path.name,
                size=size,
                sha256=digest,
                license=args.license,
                context_length=args.context_length,
                chat_format=args.chat_format,
                sources=[FileSource(kind="file", path=path.resolve())],
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "model"
            raise InvalidInput(field, f"{first['msg']} (got {first.get('input')!r})") from None
        cache.add(path, entry)
        append_entry(settings.inference.lock, entry, args.profile)
        print(f"added {entry.name} ({entry.tier.value}, {size} bytes, sha256 {digest})")
        return 0
    raise InvalidInput("models", f"unknown action {action!r}")
