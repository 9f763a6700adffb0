"""The routing policy: kinds to minimum tiers, upgrades allowed, downgrades never."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from appliance.domain.inference import (
    MECHANICAL_KINDS,
    REASONING_KINDS,
    TIER_ORDER,
    Tier,
    min_tier,
    resumable,
    route,
)

KINDS = [*sorted(MECHANICAL_KINDS | REASONING_KINDS), "summarise-ish", "", "CLASSIFY"]


def test_kinds_map_to_their_minimum_tier() -> None:
    for kind in ("classify", "score", "extract", "format", "health_check"):
        assert min_tier(kind) is Tier.MECHANICAL
    for kind in ("synthesize", "analyze", "draft", "evaluate"):
        assert min_tier(kind) is Tier.REASONING
    # Unknown kinds take the safe side.
    assert min_tier("haiku") is Tier.REASONING
    assert min_tier("CLASSIFY") is Tier.REASONING


def test_routes_prefer_the_minimum_tier_and_upgrade_when_it_is_down() -> None:
    both = {Tier.MECHANICAL, Tier.REASONING}
    assert route("classify", both).tier is Tier.MECHANICAL  # type: ignore[union-attr]
    up = route("classify", {Tier.REASONING})
    assert up is not None and up.tier is Tier.REASONING and up.upgraded
    assert up.reason == "upgraded: mechanical tier unavailable"
    assert route("draft", {Tier.MECHANICAL}) is None  # waits: never the small model
    assert route("draft", set()) is None


@given(st.sampled_from(KINDS), st.sets(st.sampled_from(TIER_ORDER)))
def test_a_route_is_never_a_downgrade(kind: str, available: set[Tier]) -> None:
    found = route(kind, available)
    need = min_tier(kind)
    if found is None:
        assert all(t.rank < need.rank for t in available)
    else:
        assert found.tier in available
        assert found.tier.rank >= need.rank
        assert found.min_tier is need


@given(st.sets(st.sampled_from(TIER_ORDER)))
def test_resumable_tiers_are_those_some_route_can_serve(available: set[Tier]) -> None:
    for tier in TIER_ORDER:
        kind = "classify" if tier is Tier.MECHANICAL else "draft"
        assert (tier in resumable(available)) == (route(kind, available) is not None)
