"""Attribution: splitting the energy a device used in an interval among the calls that ran.

Pure arithmetic, no I/O. For one interval on one device: the idle floor (idle watts times the
interval, capped at what was measured) goes to the platform account, and the energy above it is
split among the active calls in proportion to their weights (CPU-seconds, tokens, ...), or equally
when every weight is zero. With no active call everything goes to the platform. Conservation is
the invariant: the platform part is computed as the remainder, so attributed + platform equals
measured up to the last bit of a float addition, never by a drift that grows with the calls.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from appliance.metering.sources import EnergySample, Provenance


@dataclass(frozen=True)
class Attribution:
    """Where the energy one device used in [start, end] went."""

    device: str
    start: float
    end: float
    measured: float  # joules the device used in the interval
    platform: float  # joules not charged to a call (idle floor, or no call running)
    calls: dict[str, float] = field(default_factory=dict)  # call id -> joules
    provenance: Provenance = "measured"

    @property
    def attributed(self) -> float:
        """Joules charged to calls in this interval."""
        return math.fsum(self.calls.values())


def attribute_interval(
    *,
    device: str,
    start: float,
    end: float,
    measured: float,
    idle_watts: float,
    weights: Mapping[str, float],
    provenance: Provenance,
) -> Attribution:
    """Split `measured` joules of `device` over [start, end] among the calls in `weights`.

    `weights` holds every call active in the interval (weight >= 0). Raises ValueError for a
    negative or non-finite measurement, a reversed interval, or a negative weight: after
    unwrapping a counter never goes down, so a negative figure is a fault to surface, not to hide.
    """
    where = f"device {device!r}, interval [{start}, {end}]"
    if not (math.isfinite(start) and math.isfinite(end)) or end < start:
        raise ValueError(f"energy attribution: {where}: the interval runs backwards")
    if not math.isfinite(measured) or measured < 0:
        raise ValueError(f"energy attribution: {where}: measured {measured} J is negative")
    if not math.isfinite(idle_watts) or idle_watts < 0:
        raise ValueError(f"energy attribution: {where}: idle watts {idle_watts} must be >= 0")
    for call, weight in weights.items():
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"energy attribution: {where}: call {call!r} has weight {weight}")
    if not weights:
        return Attribution(device, start, end, measured, measured, {}, provenance)

    idle = min(measured, idle_watts * (end - start))
    above = measured - idle
    total = math.fsum(weights.values())
    if total > 0:
        shares = {call: above * (weight / total) for call, weight in weights.items()}
    else:
        # Every active call used no measurable CPU: they are still the only work running.
        shares = dict.fromkeys(weights, above / len(weights))
    # The platform part is the remainder, which is what makes conservation hold. Rounding can
    # leave it a few ulps below zero when idle is 0; a negative platform share means nothing.
    platform = max(0.0, measured - math.fsum(shares.values()))
    return Attribution(device, start, end, measured, platform, shares, provenance)


def interval_joules(previous: EnergySample, current: EnergySample) -> dict[str, float]:
    """Return the joules each device used between two samples of the same source."""
    if set(previous.joules) != set(current.joules):
        raise ValueError(
            f"energy samples at {previous.at} and {current.at} cover different devices: "
            f"{sorted(previous.joules)} vs {sorted(current.joules)}"
        )
    if previous.provenance != current.provenance:
        raise ValueError(
            f"energy samples at {previous.at} and {current.at} mix provenances "
            f"({previous.provenance} and {current.provenance})"
        )
    return {d: current.joules[d] - previous.joules[d] for d in current.joules}


def attribute_samples(
    previous: EnergySample,
    current: EnergySample,
    *,
    idle_watts: Mapping[str, float],
    weights: Mapping[str, float],
    call_devices: Collection[str] | None = None,
) -> list[Attribution]:
    """Attribute the interval between two samples, one Attribution per device.

    Devices outside `call_devices` (None: every device) run no call, so all their energy goes to
    the platform. A device missing from `idle_watts` has an idle floor of 0 W.
    """
    used = interval_joules(previous, current)
    return [
        attribute_interval(
            device=device,
            start=previous.at,
            end=current.at,
            measured=joules,
            idle_watts=idle_watts.get(device, 0.0),
            weights=weights if call_devices is None or device in call_devices else {},
            provenance=current.provenance,
        )
        for device, joules in sorted(used.items())
    ]


@dataclass(frozen=True)
class SeriesAttribution:
    """The attribution of a run of samples: each interval, and the sums per call and overall."""

    intervals: list[Attribution]
    per_call: dict[str, float]
    measured: float
    attributed: float
    platform: float


def attribute_series(
    samples: Sequence[EnergySample],
    weights: Sequence[Mapping[str, float]],
    *,
    idle_watts: Mapping[str, float],
    call_devices: Collection[str] | None = None,
) -> SeriesAttribution:
    """Attribute every interval between consecutive samples.

    `weights[i]` are the weights of the calls active between `samples[i]` and `samples[i + 1]`,
    so there is one fewer than samples.
    """
    if len(samples) < 1 or len(weights) != len(samples) - 1:
        raise ValueError(
            f"energy attribution: {len(samples)} samples need {max(0, len(samples) - 1)} "
            f"interval weights, got {len(weights)}"
        )
    intervals: list[Attribution] = []
    for (previous, current), interval_weights in zip(
        itertools.pairwise(samples), weights, strict=True
    ):
        intervals.extend(
            attribute_samples(
                previous,
                current,
                idle_watts=idle_watts,
                weights=interval_weights,
                call_devices=call_devices,
            )
        )
    per_call: dict[str, list[float]] = {}
    for attribution in intervals:
        for call, joules in attribution.calls.items():
            per_call.setdefault(call, []).append(joules)
    return SeriesAttribution(
        intervals=intervals,
        per_call={call: math.fsum(parts) for call, parts in per_call.items()},
        measured=math.fsum(a.measured for a in intervals),
        attributed=math.fsum(j for a in intervals for j in a.calls.values()),
        platform=math.fsum(a.platform for a in intervals),
    )
