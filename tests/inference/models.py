"""The real models of models.lock for tests: their verified files and tier specs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from appliance.domain.errors import ConfigurationError
from appliance.domain.inference import Tier
from appliance.inference.cache import ModelCache
from appliance.inference.lockfile import ModelEntry, load_lock
from appliance.inference.pool import TierSpec

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "models.lock"


def entry(tier: Tier) -> ModelEntry:
    return load_lock(LOCK).profile("dev")[tier]


def spec(tier: Tier, **overrides: object) -> TierSpec:
    """A tier of the dev profile, its file verified; skips (with what to run) when not fetched."""
    e = entry(tier)
    try:
        verified = ModelCache().verify(e)
    except ConfigurationError as exc:  # pragma: no cover - scripts/test fetches the models
        pytest.fail(f"{exc} (./scripts/test fetches them)")
    resources: dict[str, Any] = {"workers": 1, "n_ctx": 1024, "n_threads": 1, "queue": 4}
    return TierSpec.of(e, verified.path, file_stamp=verified.stamp, **{**resources, **overrides})
