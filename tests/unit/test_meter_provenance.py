"""A call's figure is labelled measured only when every joule of it came from a counter of the
device it ran on: a call across an interval a counter lost, or on a device the source does not
count, is charged an estimate for it, labelled `estimated`, never left out or borrowed."""

from __future__ import annotations

import pytest

from appliance.domain.errors import ConfigurationError
from appliance.metering.meter import Meter
from appliance.metering.sources import EstimateSource
from tests.energy_fakes import HandCpu, ListCounter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(meter: Meter, clock: Clock, until: int) -> None:
    """Tick the meter once a second from 1 up to `until` - 1, then set the clock to `until`."""
    for t in range(1, until):
        clock.now = float(t)
        meter.tick()
    clock.now = float(until)


def test_a_call_across_a_counter_that_went_back_is_estimated_at_its_measured_rate() -> None:
    # A CPU package counter: 10 J a second, then reset (a reload) between t=1 and t=2. The
    # call used the lost second too: it was charged 30 J, labelled measured.
    clock = Clock()
    meter = Meter(ListCounter([1000.0, 1010.0, 5.0, 15.0, 25.0], device="package-0"),
                  HandCpu(), {}, clock=clock, call_device="package-0")  # fmt: skip
    meter.begin("a", 1)
    run(meter, clock, 4)
    charged = meter.end("a")
    # 30 J measured over 3 s, and the lost second at that rate.
    assert charged.provenance == "estimated"
    assert charged.joules == pytest.approx(40.0)
    assert charged.intervals == 4
    assert meter.dropped_intervals == 1


def test_what_a_call_used_so_far_includes_the_lost_interval() -> None:
    # The energy guard reads this mid-call: the lost interval counts against the hold too.
    clock = Clock()
    meter = Meter(ListCounter([1000.0, 1010.0, 5.0, 15.0], device="package-0"),
                  HandCpu(), {}, clock=clock, call_device="package-0")  # fmt: skip
    meter.begin("a", 1)
    run(meter, clock, 3)
    assert meter.used("a") == pytest.approx(30.0)


def test_a_call_whose_only_interval_was_lost_is_estimated_by_the_model() -> None:
    # Nothing measured to take a rate from: 2 CPU seconds on 2 threads at 15 W a busy core.
    clock, cpu = Clock(), HandCpu()
    meter = Meter(ListCounter([1000.0, 5.0], device="package-0"), cpu, {}, clock=clock,
                  call_device="package-0", watts_per_busy_core=15.0)  # fmt: skip
    meter.begin("a", 1, threads=2)
    cpu.seconds_of[1] = 1.0
    clock.now = 1.0
    charged = meter.end("a")
    assert charged.joules == pytest.approx(30.0)
    assert charged.provenance == "estimated"


def test_a_lost_interval_with_nothing_to_estimate_it_by_has_no_figure() -> None:
    # No rate and no model: the meter says so (the pool then charges the reservation).
    clock = Clock()
    meter = Meter(ListCounter([1000.0, 5.0]), HandCpu(), {}, clock=clock, call_device="gpu0")
    meter.begin("a", 1, device="gpu")
    clock.now = 1.0
    with pytest.raises(ConfigurationError, match="estimate model"):
        meter.end("a")
    assert meter.active() == []


def test_mixed_tiers_on_a_gpu_counter_the_cpu_call_is_estimated_and_takes_no_gpu_energy() -> None:
    # One tier on the GPU, one on the CPU, the meter reading NVML only. The CPU call burned
    # far more CPU time than the GPU call's host thread: weighted by it, it took most of the
    # GPU's energy, labelled measured, and its own CPU energy was never counted.
    clock, cpu = Clock(), HandCpu()
    meter = Meter(ListCounter([0.0, 100.0, 200.0]), cpu, {}, clock=clock,
                  call_device=["gpu0"], watts_per_busy_core=15.0)  # fmt: skip
    meter.begin("on-gpu", 2, device="gpu")
    meter.begin("on-cpu", 1, threads=2, device="cpu")
    cpu.seconds_of.update({1: 1.0, 2: 0.1})
    clock.now = 1.0
    meter.tick()
    cpu.seconds_of.update({1: 2.0, 2: 0.2})
    clock.now = 2.0
    on_cpu, on_gpu = meter.end("on-cpu"), meter.end("on-gpu")
    assert on_gpu.joules == pytest.approx(200.0)
    assert on_gpu.provenance == "measured"
    # 2 CPU seconds of its calling thread, on 2 threads, at 15 W a busy core.
    assert on_cpu.joules == pytest.approx(60.0)
    assert on_cpu.provenance == "estimated"
    assert meter.totals() == {"measured": 200.0, "attributed": 200.0, "platform": 0.0}


def test_a_gpu_call_on_a_cpu_counter_is_estimated_and_the_package_goes_to_the_platform() -> None:
    clock, cpu = Clock(), HandCpu()
    meter = Meter(ListCounter([0.0, 50.0], device="package-0"), cpu, {}, clock=clock,
                  call_device=["package-0"], watts_per_busy_core=15.0)  # fmt: skip
    meter.begin("on-gpu", 1, device="gpu")
    cpu.seconds_of[1] = 0.5
    clock.now = 1.0
    charged = meter.end("on-gpu")
    assert charged.joules == pytest.approx(7.5)
    assert charged.provenance == "estimated"
    assert meter.totals()["platform"] == 50.0


def test_a_call_on_a_device_the_counter_does_not_count_needs_a_model() -> None:
    meter = Meter(ListCounter([0.0, 1.0]), HandCpu(), {}, clock=Clock(), call_device="gpu0")
    with pytest.raises(ConfigurationError, match="does not count cpu energy"):
        meter.begin("a", 1, device="cpu")
    assert meter.active() == []
    with pytest.raises(ValueError, match="cpu or gpu"):
        meter.begin("a", 1, device="tpu")


def test_a_call_on_the_counted_device_with_nothing_lost_stays_measured() -> None:
    clock = Clock()
    meter = Meter(ListCounter([0.0, 10.0, 20.0]), HandCpu(), {}, clock=clock,
                  call_device="gpu0", watts_per_busy_core=15.0)  # fmt: skip
    meter.begin("a", 1, device="gpu")
    run(meter, clock, 2)
    charged = meter.end("a")
    assert (charged.joules, charged.provenance) == (20.0, "measured")


def test_on_the_estimate_every_call_shares_its_one_device() -> None:
    # The estimate models the process's whole CPU time, a GPU call's host threads included.
    clock, cpu = Clock(), HandCpu()
    source = EstimateSource(0.0, 10.0, lambda: cpu.seconds_of.get(1, 0.0), start=0.0)
    meter = Meter(source, cpu, {"cpu": 0.0}, clock=clock, watts_per_busy_core=99.0)
    meter.begin("on-gpu", 1, device="gpu")
    cpu.seconds_of[1] = 2.0
    clock.now = 1.0
    charged = meter.end("on-gpu")
    assert charged.joules == pytest.approx(20.0)
    assert charged.provenance == "estimated"
