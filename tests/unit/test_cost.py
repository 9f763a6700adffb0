"""Pricing: tariffs with time-of-use bands, the worst case a call reserves, amortisation."""

from __future__ import annotations

from datetime import datetime, time
from decimal import Decimal

import pytest

from appliance.domain.budget import Refusal, RunBudget
from appliance.domain.cost import Amortisation, Pricing, Tariff, TimeOfUse, next_month
from appliance.domain.errors import ConfigurationError

NIGHT = TimeOfUse(time(23), time(7), Decimal("0.10"))


def test_cost_follows_the_time_of_use_band_and_the_overhead() -> None:
    tariff = Tariff(price_per_kwh=Decimal("0.30"), time_of_use=(NIGHT,), overhead=Decimal("1.2"))
    kwh = 3_600_000  # joules
    assert tariff.cost(kwh, datetime(2031, 1, 1, 12)) == Decimal("0.360000000")
    assert tariff.cost(kwh, datetime(2031, 1, 1, 2)) == Decimal("0.120000000")
    assert tariff.cost(kwh, datetime(2031, 1, 1, 23, 30)) == Decimal("0.120000000")
    # Rounded up to the ledger's precision, never down.
    assert tariff.cost(0.001, datetime(2031, 1, 1, 12)) == Decimal("0.000000001")
    with pytest.raises(ConfigurationError):
        Tariff(overhead=Decimal("0.9"))


def test_the_worst_case_is_clamped_priced_at_the_dearest_band_and_never_zero() -> None:
    pricing = Pricing(
        tariff=Tariff(price_per_kwh=Decimal("0.30"), time_of_use=(NIGHT,)),
        joules_per_token={"small": Decimal("2")},
        safety_factor=Decimal("1.5"),
    )
    estimate = pricing.worst_case("small", prompt_tokens=1000, max_tokens=5000, context_length=2048)
    assert estimate.tokens == 2048  # clamped to the context
    assert estimate.joules == Decimal("2") * 2048 * Decimal("1.5")
    assert estimate.amount == Decimal("0.000512000")  # 6144 J at 0.30 EUR/kWh
    assert pricing.worst_case("small", 0, 1, 10).amount > 0
    with pytest.raises(ConfigurationError, match="cannot be estimated"):
        pricing.worst_case("unknown", 10, 10, 100)


def test_amortisation_and_months() -> None:
    assert Amortisation(Decimal("3600"), 36).monthly() == Decimal("100.000000000")
    assert next_month(datetime(2031, 1, 31, 23, 59)) == datetime(2031, 2, 1)
    assert next_month(datetime(2031, 12, 15)) == datetime(2032, 1, 1)


def test_budget_declarations_and_refusals() -> None:
    budget = RunBudget(steps=3, money=Decimal("0.5"), wall_time=None)
    assert budget.limits() == {"steps": 3, "money": "0.5"}
    with pytest.raises(ConfigurationError):
        RunBudget(verification_reserve=Decimal("1"))
    refusal = Refusal(
        "money: x", None, Decimal("1"), Decimal("0.2"), Decimal("0.7"), Decimal("0.3")
    )
    assert not refusal.exhausted  # only the reservations in flight are in the way
    assert Refusal(
        "money: x", None, Decimal("1"), Decimal("0.8"), Decimal(0), Decimal("0.3")
    ).exhausted
