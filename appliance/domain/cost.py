"""Money from energy: the tariff, the worst-case estimate a call must reserve, and the figures
of a spend refusal. Amounts are Decimals in the tariff's currency (never floats in the ledger).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, time, timedelta
from decimal import ROUND_CEILING, Decimal

from appliance.domain.errors import ConfigurationError

JOULES_PER_KWH = Decimal(3_600_000)
# Ledger precision: a call on a small model costs micro-cents; keep nine places.
QUANTUM = Decimal("0.000000001")


@dataclass(frozen=True)
class TimeOfUse:
    """A price for the hours [start, end) of the local day (end may wrap past midnight)."""

    start: time
    end: time
    price_per_kwh: Decimal

    def covers(self, moment: time) -> bool:
        if self.start <= self.end:
            return self.start <= moment < self.end
        return moment >= self.start or moment < self.end


@dataclass(frozen=True)
class Tariff:
    """What a kWh costs, with an optional time-of-use table and power overhead factor.

    `overhead` scales measured device energy to wall energy (power supply losses, cooling);
    1.0 means the measured or estimated figure is taken as is.
    """

    currency: str = "EUR"
    price_per_kwh: Decimal = Decimal("0.30")
    time_of_use: tuple[TimeOfUse, ...] = ()
    overhead: Decimal = Decimal("1.0")

    def __post_init__(self) -> None:
        if self.price_per_kwh < 0:
            raise ConfigurationError("tariff: price_per_kwh must be >= 0")
        if self.overhead < 1:
            raise ConfigurationError("tariff: overhead must be >= 1.0 (it only adds losses)")

    def price_at(self, local: datetime) -> Decimal:
        for band in self.time_of_use:
            if band.covers(local.time()):
                return band.price_per_kwh
        return self.price_per_kwh

    def max_price(self) -> Decimal:
        return max([self.price_per_kwh, *(b.price_per_kwh for b in self.time_of_use)])

    def cost(self, joules: float | Decimal, local: datetime) -> Decimal:
        """The cost of `joules` of device energy used at local time `local`."""
        energy = Decimal(str(joules)) * self.overhead
        # Multiply before dividing: exact where the figures allow it, before rounding up.
        return _round_up(energy * self.price_at(local) / JOULES_PER_KWH)


@dataclass(frozen=True)
class Amortisation:
    """Hardware cost spread over its lifetime, held as a platform cost at each month's start."""

    price: Decimal = Decimal(0)
    lifetime_months: int = 36

    def monthly(self) -> Decimal:
        if self.lifetime_months <= 0:
            raise ConfigurationError("amortisation: lifetime_months must be > 0")
        return _round_up(self.price / self.lifetime_months)


@dataclass(frozen=True)
class CallEstimate:
    """The worst case one model call may cost, reserved before it starts."""

    tokens: int
    joules: Decimal
    amount: Decimal


@dataclass(frozen=True)
class Pricing:
    """How the bus prices a call before it runs: conservative joules per token per model."""

    tariff: Tariff = field(default_factory=Tariff)
    joules_per_token: dict[str, Decimal] = field(default_factory=dict)
    default_joules_per_token: Decimal | None = None
    safety_factor: Decimal = Decimal("1.5")

    def worst_case(
        self, model: str, prompt_tokens: int, max_tokens: int, context_length: int
    ) -> CallEstimate:
        """Input tokens + max_tokens, clamped to the context, at the model's conservative joules
        per token, at the dearest price of the day, times the safety factor. A model without a
        figure cannot be estimated: ConfigurationError, and the call is refused."""
        per_token = self.joules_per_token.get(model, self.default_joules_per_token)
        if per_token is None:
            raise ConfigurationError(
                f"no joules-per-token figure for model {model} (run `appliance energy "
                "calibrate` or set metering.default_joules_per_token): its cost cannot be "
                "estimated"
            )
        tokens = min(prompt_tokens + max_tokens, context_length)
        joules = per_token * tokens * self.safety_factor
        energy = joules * self.tariff.overhead
        amount = _round_up(energy * self.tariff.max_price() / JOULES_PER_KWH)
        # Never a zero hold: a call that cannot cost nothing must hold something.
        return CallEstimate(tokens, joules, max(amount, QUANTUM))


def _round_up(value: Decimal) -> Decimal:
    return value.quantize(QUANTUM, rounding=ROUND_CEILING)


def month_of(local: datetime) -> datetime:
    """The first instant of the month containing `local` (same time zone)."""
    return local.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def next_month(local: datetime) -> datetime:
    first = month_of(local)
    return month_of(first + timedelta(days=32))
