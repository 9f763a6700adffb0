"""The pipelines this appliance ships, by name."""

from __future__ import annotations

from appliance.domain.pipeline import Pipeline, Registry
from appliance.pipelines.demo import DEMO
from appliance.pipelines.support import SUPPORT

BUILT_IN: dict[str, Pipeline] = {DEMO.name: DEMO, SUPPORT.name: SUPPORT}


def registry(names: list[str] | None = None) -> Registry:
    """A registry of the named built-in pipelines (all of them by default)."""
    chosen = names if names is not None else list(BUILT_IN)
    return Registry([BUILT_IN[name] for name in chosen])
