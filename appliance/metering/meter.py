"""The live meter: samples an energy source as calls begin and end, and charges each call its share.

Every sample closes an interval since the previous one. The energy each device used in it is
split by `attribution` among the calls active during the interval, weighted by the CPU-seconds
their threads used in it (real thread CPU time, from `ThreadCpu`); the idle floor and energy of
devices no call runs on go to the platform account. Samples are taken when a call begins (so
earlier calls are charged for the time before it), when one ends (so it is charged up to its
last moment) and on a periodic `tick`, which bounds the length of an interval.

A figure is labelled `measured` only when every joule of it came from a counter of the device
the call ran on; anything else is an estimate, labelled `estimated`, never left out:
- A call on a device the source does not count (a CPU tier while the meter reads only the GPU's
  counter, a GPU tier while it reads only the CPU's) takes none of the counted devices' energy
  (that is other calls' work, or idle) and is charged the estimate model instead: the watts of
  a busy core times the CPU seconds it used (see `EstimateSource`).
- An interval across which a counter went back (a reset, a driver reload) measured nothing. A
  call active in it is charged for it at its own measured rate over its other intervals (joules
  a second), or, with none measured, by the estimate model; the whole figure is `estimated`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from appliance.domain.errors import ConfigurationError
from appliance.metering.attribution import Attribution, attribute_interval, interval_joules
from appliance.metering.sources import EnergySample, EnergySource, Provenance, ThreadCpu

log = logging.getLogger("appliance.metering")


@dataclass(frozen=True)
class CallEnergy:
    """The energy charged to one call, how it was obtained, and over how many intervals."""

    joules: float
    provenance: Provenance
    intervals: int


def device_kind(device: str) -> str:
    """The kind of computing device a source's device name stands for: `gpu` for NVML's gpuN,
    `cpu` for the rest (RAPL's package-N and dram zones, the estimate's cpu)."""
    return "gpu" if device.startswith("gpu") else "cpu"


@dataclass
class _Active:
    native_id: int
    cpu_mark: float  # the thread's CPU seconds at the last sample
    # Threads the call computes on: llama.cpp splits its work over this many, the calling
    # thread among them, so the caller's CPU time is about 1/threads of the call's.
    threads: int = 1
    device: str = "cpu"  # the kind of device it computes on (see `device_kind`)
    counted: bool = True  # whether the source counts that device
    parts: list[float] = field(default_factory=list)  # joules per interval, summed at the end
    intervals: int = 0
    measured_seconds: float = 0.0  # length of the intervals a counter measured for it
    # (seconds, CPU weight) of each interval whose energy no counter gave (it went back)
    lost: list[tuple[float, float]] = field(default_factory=list)


class Meter:
    """Charges live calls their share of the energy a source reports. Thread-safe.

    Worker threads call `begin(call_id, threading.get_native_id(), device=...)` before a call
    and `end(call_id)` after it; a periodic task calls `tick()`. `call_device` names the
    source's device(s) calls are charged from; every other device's energy goes to the
    platform account. A call's `device` ("cpu" or "gpu") says which of them it may be charged
    from: only those of its kind. `watts_per_busy_core` is the estimate model for what no
    counter gives (see the module's docstring); without it such a call's figure cannot be
    made, and `end` raises (the pool then charges the call its reservation).
    """

    def __init__(
        self,
        source: EnergySource,
        cpu: ThreadCpu,
        idle_watts: Mapping[str, float],
        clock: Callable[[], float] = time.monotonic,
        ring: int = 4096,
        *,
        call_device: str | Collection[str] = "cpu",
        watts_per_busy_core: float | None = None,
    ) -> None:
        if ring < 1:
            raise ConfigurationError("metering: the ring must hold at least one sample")
        for device, watts in idle_watts.items():
            if watts < 0:
                raise ConfigurationError(f"metering: idle watts of {device!r} must be >= 0")
        if watts_per_busy_core is not None and not watts_per_busy_core >= 0:
            raise ConfigurationError("metering: watts per busy core must be >= 0")
        self.source = source
        self._cpu = cpu
        self._idle_watts = dict(idle_watts)
        self._clock = clock
        self._call_devices = (
            frozenset({call_device}) if isinstance(call_device, str) else frozenset(call_device)
        )
        self._busy_core_watts = watts_per_busy_core
        # The estimate source models the whole process's CPU time, a GPU call's host threads
        # included: every call shares its one device. A counter counts its own device only.
        self._counts_every_call = source.provenance == "estimated"
        self._active: dict[str, _Active] = {}
        self._last: EnergySample | None = None
        self._samples: deque[EnergySample] = deque(maxlen=ring)
        self._attributions: deque[Attribution] = deque(maxlen=ring)
        self._measured = 0.0
        self._attributed = 0.0
        self._platform = 0.0
        self.dropped_intervals = 0  # intervals a counter that went backwards left unknown
        self._lock = threading.Lock()

    @property
    def provenance(self) -> Provenance:
        """How the source's figures are obtained (measured, estimated or replayed): the best a
        call's figure can be labelled; a call's own may be `estimated` (see `end`)."""
        return self.source.provenance

    def begin(self, call_id: str, native_id: int, threads: int = 1, *, device: str = "cpu") -> None:
        """Close the current interval, then count `call_id` as running on thread `native_id`
        (the caller of a computation spread over `threads` threads, itself one of them), on
        `device` ("cpu", or "gpu" for a model offloaded to the GPU)."""
        if threads < 1:
            raise ValueError(f"metering: call {call_id!r} runs on {threads} threads")
        counted = self.counts(device)
        if not counted and self._busy_core_watts is None:
            # Refused before it runs: the pool charges a call the meter cannot follow its
            # reservation, never a figure made up or one borrowed from another device.
            raise ConfigurationError(
                f"metering: {self.source.name!r} does not count {device} energy and the meter "
                "has no estimate model (watts_per_busy_core)"
            )
        with self._lock:
            if call_id in self._active:
                raise ValueError(f"metering: call {call_id!r} has already begun")
            self._cpu.register(native_id)
            cpu_now = self._sample()
            self._active[call_id] = _Active(
                native_id, cpu_now.get(native_id, 0.0), threads, device, counted
            )

    def counts(self, device: str) -> bool:
        """Whether the source counts the energy of calls on `device` ("cpu" or "gpu")."""
        if device not in ("cpu", "gpu"):
            raise ValueError(f"metering: calls run on cpu or gpu, not {device!r}")
        return self._counts_every_call or any(device_kind(d) == device for d in self._call_devices)

    def end(self, call_id: str) -> CallEnergy:
        """Close the current interval (charging this call for it) and return the call's energy:
        labelled as the source's only when a counter measured every joule of it, else
        `estimated`. Raises when a lost interval has nothing to estimate it by."""
        with self._lock:
            if call_id not in self._active:
                raise KeyError(f"metering: call {call_id!r} has not begun (or already ended)")
            try:
                self._sample()
            finally:
                # Even if the source fails, the call must not stay active and soak up energy.
                active = self._active.pop(call_id)
            joules = math.fsum(active.parts) + self._lost_joules(call_id, active)
            measured = active.counted and not active.lost
            provenance = self.source.provenance if measured else "estimated"
            return CallEnergy(joules, provenance, active.intervals)

    def used(self, call_id: str) -> float:
        """Close the current interval and return the joules charged to a running call so far
        (the pool checks a call against the energy its reservation paid for)."""
        with self._lock:
            if call_id not in self._active:
                raise KeyError(f"metering: call {call_id!r} has not begun (or already ended)")
            self._sample()
            active = self._active[call_id]
            return math.fsum(active.parts) + self._lost_joules(call_id, active)

    def tick(self) -> None:
        """Take a periodic sample, closing the current interval."""
        with self._lock:
            self._sample()

    def totals(self) -> dict[str, float]:
        """Return the running joules: measured, attributed to calls, and platform."""
        with self._lock:
            return {
                "measured": self._measured,
                "attributed": self._attributed,
                "platform": self._platform,
            }

    def recent(self) -> list[Attribution]:
        """Return the last attributions kept in the ring, oldest first."""
        with self._lock:
            return list(self._attributions)

    def samples(self) -> list[EnergySample]:
        """Return the last samples kept in the ring, oldest first."""
        with self._lock:
            return list(self._samples)

    def active(self) -> list[str]:
        """Return the ids of the calls running now."""
        with self._lock:
            return list(self._active)

    def _estimate(self, call_id: str, weight: float) -> float:
        """The estimate model's joules for a call that used `weight` CPU seconds (its
        threads' share): watts per busy core times them, as `EstimateSource` counts."""
        if self._busy_core_watts is None:
            # Only for a lost interval of a call with nothing measured (`begin` refuses a call
            # the source does not count): `end` raises, and the pool charges the reservation.
            raise ConfigurationError(
                f"metering: call {call_id!r} ran across an interval a counter lost, and the "
                "meter has no estimate model (watts_per_busy_core) for it"
            )
        return self._busy_core_watts * weight

    def _lost_joules(self, call_id: str, active: _Active) -> float:
        """The estimate for the intervals a counter that went back left unknown: the call's
        own measured rate over its other intervals (it ran on the same device, under the same
        load, minutes apart at most), or the estimate model when none was measured."""
        if not active.lost:
            return 0.0
        if active.measured_seconds > 0:
            rate = math.fsum(active.parts) / active.measured_seconds
            return rate * math.fsum(seconds for seconds, _ in active.lost)
        return self._estimate(call_id, math.fsum(weight for _, weight in active.lost))

    def _sample(self) -> dict[int, float]:
        # CPU first, then energy: both close the same interval, and the estimate source reads
        # the same thread CPU counters, so their order does not change what each call is charged.
        cpu_now = self._cpu.snapshot()
        sample = self.source.read(self._clock())
        previous = self._last
        if previous is None:
            if not self._call_devices & set(sample.joules):
                raise ConfigurationError(
                    f"metering: calls run on {sorted(self._call_devices)} but source "
                    f"{self.source.name!r} reports only {sorted(sample.joules)}"
                )
        else:
            weights: dict[str, float] = {}
            for call_id, active in self._active.items():
                now = cpu_now.get(active.native_id, active.cpu_mark)
                # Scaled by its threads: a 1-thread and a 4-thread call, both busy, took 1:4
                # of the CPU, not the 1:1 their calling threads alone show.
                weights[call_id] = max(0.0, now - active.cpu_mark) * active.threads
            seconds = sample.at - previous.at
            # A call the source does not count takes none of the counted energy (that is
            # other calls' work, or idle): the estimate model charges it instead.
            counted = {c: w for c, w in weights.items() if self._active[c].counted}
            for call_id, weight in weights.items():
                if call_id not in counted:
                    self._active[call_id].parts.append(self._estimate(call_id, weight))
            try:
                attributions = self._attribute(previous, sample, counted)
            except ValueError as exc:
                # A counter that went backwards (a driver reload, a reset after suspend): this
                # interval's energy is unknown and is attributed to no one. Measuring goes on
                # from the new reading; kept as the baseline, the old one would fail every
                # later interval until the counter climbed back past it, and every call would
                # be charged its whole reservation meanwhile. Each call running across it is
                # charged an estimate for it instead, and labelled so (see `_lost_joules`).
                log.warning("energy sample dropped: %s; measuring again from this reading", exc)
                self.dropped_intervals += 1
                attributions = []
                for call_id, weight in counted.items():
                    self._active[call_id].lost.append((seconds, weight))
            else:
                for call_id in counted:
                    self._active[call_id].measured_seconds += seconds
            for attribution in attributions:
                self._attributions.append(attribution)
                self._measured += attribution.measured
                self._platform += attribution.platform
                for call_id, joules in attribution.calls.items():
                    self._attributed += joules
                    self._active[call_id].parts.append(joules)
            for active in self._active.values():
                active.intervals += 1
        for active in self._active.values():
            active.cpu_mark = cpu_now.get(active.native_id, active.cpu_mark)
        self._last = sample
        self._samples.append(sample)
        return cpu_now

    def _attribute(
        self, previous: EnergySample, sample: EnergySample, weights: Mapping[str, float]
    ) -> list[Attribution]:
        """Attribute one interval: each call device's energy among the calls it counts."""
        return [
            attribute_interval(
                device=device,
                start=previous.at,
                end=sample.at,
                measured=joules,
                idle_watts=self._idle_watts.get(device, 0.0),
                weights={c: w for c, w in weights.items() if self._takes(c, device)},
                provenance=sample.provenance,
            )
            for device, joules in sorted(interval_joules(previous, sample).items())
        ]

    def _takes(self, call_id: str, device: str) -> bool:
        """Whether a share of `device`'s energy may go to the call."""
        if device not in self._call_devices:
            return False
        return self._counts_every_call or self._active[call_id].device == device_kind(device)
