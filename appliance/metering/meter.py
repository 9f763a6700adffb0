"""The live meter: samples an energy source as calls begin and end, and charges each call its share.

Every sample closes an interval since the previous one. The energy each device used in it is
split by `attribution` among the calls active during the interval, weighted by the CPU-seconds
their threads used in it (real thread CPU time, from `ThreadCpu`); the idle floor and energy of
devices no call runs on go to the platform account. Samples are taken when a call begins (so
earlier calls are charged for the time before it), when one ends (so it is charged up to its
last moment) and on a periodic `tick`, which bounds the length of an interval.
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
from appliance.metering.attribution import Attribution, attribute_samples
from appliance.metering.sources import EnergySample, EnergySource, Provenance, ThreadCpu

log = logging.getLogger("appliance.metering")


@dataclass(frozen=True)
class CallEnergy:
    """The energy charged to one call, how it was obtained, and over how many intervals."""

    joules: float
    provenance: Provenance
    intervals: int


@dataclass
class _Active:
    native_id: int
    cpu_mark: float  # the thread's CPU seconds at the last sample
    # Threads the call computes on: llama.cpp splits its work over this many, the calling
    # thread among them, so the caller's CPU time is about 1/threads of the call's.
    threads: int = 1
    parts: list[float] = field(default_factory=list)  # joules per interval, summed at the end
    intervals: int = 0


class Meter:
    """Charges live calls their share of the energy a source reports. Thread-safe.

    Worker threads call `begin(call_id, threading.get_native_id())` before a call and
    `end(call_id)` after it; a periodic task calls `tick()`. `call_device` names the device(s)
    the calls run on; every other device's energy goes to the platform account.
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
    ) -> None:
        if ring < 1:
            raise ConfigurationError("metering: the ring must hold at least one sample")
        for device, watts in idle_watts.items():
            if watts < 0:
                raise ConfigurationError(f"metering: idle watts of {device!r} must be >= 0")
        self.source = source
        self._cpu = cpu
        self._idle_watts = dict(idle_watts)
        self._clock = clock
        self._call_devices = (
            frozenset({call_device}) if isinstance(call_device, str) else frozenset(call_device)
        )
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
        """How this meter's figures are obtained (measured, estimated or replayed)."""
        return self.source.provenance

    def begin(self, call_id: str, native_id: int, threads: int = 1) -> None:
        """Close the current interval, then count `call_id` as running on thread `native_id`
        (the caller of a computation spread over `threads` threads, itself one of them)."""
        if threads < 1:
            raise ValueError(f"metering: call {call_id!r} runs on {threads} threads")
        with self._lock:
            if call_id in self._active:
                raise ValueError(f"metering: call {call_id!r} has already begun")
            self._cpu.register(native_id)
            cpu_now = self._sample()
            self._active[call_id] = _Active(native_id, cpu_now.get(native_id, 0.0), threads)

    def end(self, call_id: str) -> CallEnergy:
        """Close the current interval (charging this call for it) and return the call's energy."""
        with self._lock:
            if call_id not in self._active:
                raise KeyError(f"metering: call {call_id!r} has not begun (or already ended)")
            try:
                self._sample()
            finally:
                # Even if the source fails, the call must not stay active and soak up energy.
                active = self._active.pop(call_id)
            return CallEnergy(math.fsum(active.parts), self.source.provenance, active.intervals)

    def used(self, call_id: str) -> float:
        """Close the current interval and return the joules charged to a running call so far
        (the pool checks a call against the energy its reservation paid for)."""
        with self._lock:
            if call_id not in self._active:
                raise KeyError(f"metering: call {call_id!r} has not begun (or already ended)")
            self._sample()
            return math.fsum(self._active[call_id].parts)

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
            try:
                attributions = attribute_samples(
                    previous,
                    sample,
                    idle_watts=self._idle_watts,
                    weights=weights,
                    call_devices=self._call_devices,
                )
            except ValueError as exc:
                # A counter that went backwards (a driver reload, a reset after suspend): this
                # interval's energy is unknown and is attributed to no one. Measuring goes on
                # from the new reading; kept as the baseline, the old one would fail every
                # later interval until the counter climbed back past it, and every call would
                # be charged its whole reservation meanwhile.
                log.warning("energy sample dropped: %s; measuring again from this reading", exc)
                self.dropped_intervals += 1
                attributions = []
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
