"""Budgets: a run's multi-dimensional budget (steps, tokens, calls, writes, wall time, money)
with a verification reserve, and the refusals the bus raises when work does not fit.

A run is one pipeline instance: (tenant, source, source id) moving through stages. Work is
reserved before it starts (the database checks and holds it atomically), so fan-out cannot
oversubscribe; ordinary work may never consume the share reserved for verification.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from appliance.domain.errors import ApplianceError, ConfigurationError

DIMENSIONS = ("steps", "tokens", "calls", "writes", "wall_time", "money", "hops")


@dataclass(frozen=True)
class RunBudget:
    """Limits of one run; None leaves a dimension unlimited (the monthly cap still applies)."""

    steps: int | None = None
    tokens: int | None = None
    calls: int | None = None
    writes: int | None = None
    wall_time: timedelta | None = None
    money: Decimal | None = None
    # The share of each limit only verification and cleanup stages may use.
    verification_reserve: Decimal = Decimal("0.2")
    # How many hand-offs a message may be away from its run's first message.
    max_hops: int | None = None

    def __post_init__(self) -> None:
        if not Decimal(0) <= self.verification_reserve < Decimal(1):
            raise ConfigurationError("run budget: verification_reserve must be in [0, 1)")
        for name in ("steps", "tokens", "calls", "writes", "max_hops"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigurationError(f"run budget: {name} must be >= 0")
        if self.money is not None and self.money < 0:
            raise ConfigurationError("run budget: money must be >= 0")

    def limits(self) -> dict[str, Any]:
        """The limits as the database holds them (JSON numbers, money as a string)."""
        out: dict[str, Any] = {}
        for name in ("steps", "tokens", "calls", "writes"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.wall_time is not None:
            out["wall_seconds"] = self.wall_time.total_seconds()
        if self.money is not None:
            out["money"] = str(self.money)
        return out


class BudgetRefused(ApplianceError):
    """Work that does not fit a budget. Never a reason to retry."""


class BudgetExhausted(BudgetRefused):
    """A run used up one dimension of its budget: the message ends (`budget_exhausted: X`)."""

    def __init__(self, dimension: str, detail: str = "") -> None:
        super().__init__(f"budget_exhausted: {dimension}" + (f" ({detail})" if detail else ""))
        self.dimension = dimension


class BudgetHeld(BudgetRefused):
    """No hold could be had against the monthly cap: the message waits in held_budget."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BudgetBusy(BudgetRefused):
    """The cap is not used up, only held by calls in flight (which settle at or below their
    reservations): the message tries again shortly, without counting an attempt."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Refusal:
    """Why the cap refused a hold, with the figures (shown in the message's reason)."""

    dimension: str
    month: datetime | None
    limit: Decimal | None
    spent: Decimal | None
    reserved: Decimal | None
    asked: Decimal
    # The message whose room this call was kept back for (the head of the cap's waiting line),
    # when that, not room held in flight alone, refused it.
    behind: int | None = None
    # The head of the waiting line, refused for room held in flight that can gather: it asks
    # again in place (the room that frees is kept for it while it asks).
    wait: bool = False

    @property
    def exhausted(self) -> bool:
        """True when spend alone leaves no room for the call (reservations in flight aside)."""
        if self.limit is None or self.spent is None:
            return True
        return self.spent + self.asked > self.limit

    def reason(self) -> str:
        def fmt(value: Decimal | None) -> str:
            return "-" if value is None else f"{value.normalize():f}"

        return (
            f"held_budget: {self.dimension}; limit {fmt(self.limit)}, spent {fmt(self.spent)}, "
            f"reserved {fmt(self.reserved)}, this call needs {fmt(self.asked)}"
        )
