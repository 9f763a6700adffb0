"""Energy fakes for tests of the meter: a counter read from a list, thread CPU time set by hand.

Time is a parameter: the counter's reading at time t is `readings[int(t)]`, and a test moves the
meter's clock and the threads' CPU seconds itself.
"""

from __future__ import annotations

from appliance.metering.sources import EnergySample, Provenance, ThreadCpu


class ListCounter:
    """A counter of one device that reads `readings[int(at)]`: it may restart from zero part
    way (as NVML's does when its driver reloads), which ReplaySource cannot play, since it
    reads every drop as a wrap."""

    name = "list"
    provenance: Provenance = "measured"

    def __init__(self, readings: list[float], device: str = "gpu0") -> None:
        self.readings = readings
        self.device = device

    def available(self) -> tuple[bool, str]:
        return True, ""

    def read(self, at: float) -> EnergySample:
        return EnergySample(at, {self.device: self.readings[int(at)]}, self.provenance)


class HandCpu(ThreadCpu):
    """Thread CPU seconds set by the test (`seconds_of[thread] = ...`), not read from /proc."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds_of: dict[int, float] = {}

    def register(self, native_id: int) -> None:
        self.seconds_of.setdefault(native_id, 0.0)

    def snapshot(self) -> dict[int, float]:
        return dict(self.seconds_of)
