"""`appliance cap` and `appliance energy`: the monthly cap, spend, and energy calibration."""

from __future__ import annotations

import argparse
import json
import re
import sys
from decimal import Decimal
from typing import Any

from appliance.domain.cost import QUANTUM
from appliance.domain.errors import InvalidInput, UnknownTenant
from appliance.runtime import calibrate, services
from appliance.settings import Settings


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    cap = sub.add_parser("cap", help="the monthly spend cap: set it, see where it stands")
    cs = cap.add_subparsers(dest="cap_action", required=True)
    cap_set = cs.add_parser("set", help="set the monthly cap (resumes work held for budget)")
    cap_set.add_argument("amount", help="in the tariff's currency, for example 25.00")
    cap_set.add_argument("--tenant", help="a tenant's own cap instead of the appliance's")
    status = cs.add_parser("status", help="cap, spent, reserved, remaining, provenance")
    status.add_argument("--json", action="store_true")


def add_energy_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    energy = sub.add_parser("energy", help="energy figures: calibrate joules per token")
    es = energy.add_subparsers(dest="energy_action", required=True)
    cal = es.add_parser(
        "calibrate", help="measure idle power and joules per token of each tier's model"
    )
    cal.add_argument("--calls", type=int, default=3)
    cal.add_argument("--max-tokens", type=int, default=64)


async def cmd_energy(settings: Settings, args: argparse.Namespace) -> int:
    if not 1 <= args.calls <= 100:
        raise InvalidInput("calls", "must be 1..100")
    if not 8 <= args.max_tokens <= 4096:
        raise InvalidInput("max_tokens", "must be 8..4096")
    figures = await calibrate(settings, calls=args.calls, max_tokens=args.max_tokens)
    for f in figures:
        print(
            f"{f['model']:<32} {f['joules_per_token']} J/token over {f['tokens']} tokens, "
            f"idle {f['idle_watts']} W ({f['provenance']})"
        )
    print("stored: calls are priced with these figures from the next runner start")
    return 0


# Amounts are kept to the ledger's step (a billionth of the currency unit).
AMOUNT_DECIMALS = -int(QUANTUM.as_tuple().exponent)
AMOUNT_MAX = Decimal(10) ** 15


def _amount(text: str) -> Decimal:
    # Plain decimal notation only ("1_000" and "1e3" are Python's, not an operator's), at the
    # ledger's precision.
    if not re.fullmatch(r"\s*\d+(\.\d*)?\s*", text):
        raise InvalidInput(
            "amount", f"{text!r} is not an amount (digits, an optional decimal point: 12.50)"
        )
    value = Decimal(text.strip())
    if value.as_tuple().exponent < -AMOUNT_DECIMALS:  # type: ignore[operator]
        raise InvalidInput(
            "amount", f"{text.strip()} has more than {AMOUNT_DECIMALS} decimal places"
        )
    if value >= AMOUNT_MAX:
        raise InvalidInput("amount", f"{text.strip()} is over the limit of {AMOUNT_MAX}")
    return value


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    return f"{Decimal(value).normalize():f}"


def cap_rows_json(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        cap = r["cap"]
        remaining = None if cap is None else max(Decimal(0), cap - r["spent"] - r["reserved"])
        out.append(
            {
                "scope": r["scope"],
                "month": r["month"].isoformat(),
                "currency": r["currency"],
                "cap": _fmt(cap),
                "spent": _fmt(r["spent"]),
                "reserved": _fmt(r["reserved"]),
                "remaining": _fmt(remaining),
                "interactive_share": _fmt(r["interactive_share"]),
                "provenance": r["provenance"] or {},
            }
        )
    return out


async def cmd_cap(settings: Settings, args: argparse.Namespace) -> int:
    async with services(settings) as svc:
        if args.cap_action == "set":
            amount = _amount(args.amount)
            scope = "appliance"
            if args.tenant:
                if not await svc.tenants.exists(args.tenant):
                    raise UnknownTenant(args.tenant)
                scope = f"tenant:{args.tenant}"
            await svc.spend.set_cap(scope, amount, actor="operator")
            # A tenant's cap frees that tenant's held work only: resuming the others would
            # only have them refused and held again.
            resumed = await svc.spend.resume_budget(
                reason=f"cap_set: {scope} {amount}",
                actor="operator",
                tenant=args.tenant or None,
                now=None,
            )
            print(f"cap {scope}: {_fmt(amount)}; resumed {resumed} messages held for budget")
            for row in await svc.spend.status(now=None):
                committed = row["spent"] + row["reserved"]
                if row["scope"] == scope and committed > amount:
                    # Holds taken under the old cap are calls already running: they finish
                    # and settle. Nothing new is admitted in this scope meanwhile.
                    print(
                        f"note: this month's spent {_fmt(row['spent'])} and reserved"
                        f" {_fmt(row['reserved'])} already pass the new cap; the calls"
                        " holding the reserve finish, and new work in"
                        f" {scope} is admitted only once what they settle leaves room",
                        file=sys.stderr,
                    )
            return 0
        rows = cap_rows_json(await svc.spend.status(now=None))
        alerts = await svc.spend.alerts(now=None)
        if args.json:
            print(
                json.dumps(
                    {
                        "scopes": rows,
                        "alerts": [
                            {"scope": a["scope"], "fraction": _fmt(a["fraction"]),
                             "at": a["at"].isoformat()}
                            for a in alerts
                        ],
                    },
                    indent=2,
                )
            )  # fmt: skip
            return 0
        for r in rows:
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(r["provenance"].items())) or "none"
            print(
                f"{r['scope']:<20} month {r['month']}  cap {r['cap']} {r['currency']}  "
                f"spent {r['spent']}  reserved {r['reserved']}  remaining {r['remaining']}  "
                f"(settled figures: {kinds})"
            )
        for a in alerts:
            print(f"alert: {a['scope']} passed {_fmt(Decimal(a['fraction']) * 100)}% at {a['at']}")
    return 0
