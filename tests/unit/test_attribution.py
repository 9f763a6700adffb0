"""Energy attribution: conservation on replayed traces, wraps, overlapping calls, the meter."""

from __future__ import annotations

import math
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.domain.errors import ConfigurationError
from appliance.metering.attribution import (
    attribute_interval,
    attribute_samples,
    attribute_series,
)
from appliance.metering.meter import Meter
from appliance.metering.sources import EnergySample, ReplaySource, ThreadCpu
from tests.energy_fakes import ListCounter


def conserved(measured: float, attributed: float, platform: float) -> bool:
    return math.isclose(attributed + platform, measured, rel_tol=1e-9, abs_tol=1e-9)


def test_two_calls_in_one_interval_split_above_idle_by_weight() -> None:
    a = attribute_interval(
        device="cpu",
        start=10.0,
        end=11.0,
        measured=10.0,
        idle_watts=2.0,
        weights={"a": 3.0, "b": 1.0},
        provenance="replayed",
    )
    assert a.calls == {"a": 6.0, "b": 2.0}
    assert a.platform == 2.0
    assert a.attributed + a.platform == a.measured == 10.0
    assert a.provenance == "replayed"


def test_idle_larger_than_measured_goes_all_to_platform() -> None:
    a = attribute_interval(
        device="cpu",
        start=0.0,
        end=2.0,
        measured=3.0,
        idle_watts=5.0,
        weights={"a": 1.0},
        provenance="measured",
    )
    assert a.calls == {"a": 0.0}
    assert a.platform == 3.0


def test_interval_with_no_calls_is_all_platform() -> None:
    a = attribute_interval(
        device="cpu",
        start=0.0,
        end=1.0,
        measured=7.5,
        idle_watts=1.0,
        weights={},
        provenance="measured",
    )
    assert a.calls == {}
    assert a.platform == 7.5


def test_calls_that_used_no_cpu_share_above_idle_equally() -> None:
    a = attribute_interval(
        device="cpu",
        start=0.0,
        end=1.0,
        measured=9.0,
        idle_watts=1.0,
        weights={"a": 0.0, "b": 0.0},
        provenance="measured",
    )
    assert a.calls == {"a": 4.0, "b": 4.0}
    assert a.platform == 1.0


def test_negative_energy_names_device_and_interval() -> None:
    with pytest.raises(ValueError, match=r"'package-0'.*\[3.0, 4.0\]"):
        attribute_interval(
            device="package-0",
            start=3.0,
            end=4.0,
            measured=-1.0,
            idle_watts=0.0,
            weights={"a": 1.0},
            provenance="measured",
        )


def test_negative_weight_and_reversed_interval_are_refused() -> None:
    with pytest.raises(ValueError, match="weight"):
        attribute_interval(
            device="cpu",
            start=0.0,
            end=1.0,
            measured=1.0,
            idle_watts=0.0,
            weights={"a": -1.0},
            provenance="measured",
        )
    with pytest.raises(ValueError, match="backwards"):
        attribute_interval(
            device="cpu",
            start=2.0,
            end=1.0,
            measured=1.0,
            idle_watts=0.0,
            weights={},
            provenance="measured",
        )


def test_replayed_trace_with_wrap_and_overlapping_calls_conserves_energy() -> None:
    # Raw counter wrapping at 1000: 900 -> 950 -> (wrap) 20 -> 120 -> 130 -> 500.
    trace = [(0.0, {"cpu": 900}), (1.0, {"cpu": 950}), (2.0, {"cpu": 20})]
    trace += [(3.0, {"cpu": 120}), (4.0, {"cpu": 130}), (5.0, {"cpu": 500})]
    source = ReplaySource(trace, {"cpu": 1000})
    samples = [source.read(t) for t in (0.0, 1.0, 2.0, 3.0, 4.0, 5.0)]
    weights: list[dict[str, float]] = [
        {"a": 1.0},  # a starts
        {"a": 1.0, "b": 3.0},  # b joins mid-trace, busier
        {"b": 2.0},  # a has ended
        {},  # nothing runs
        {"a": 0.0, "b": 0.0},  # both back, neither used CPU
    ]
    result = attribute_series(samples, weights, idle_watts={"cpu": 5.0})
    assert [a.measured for a in result.intervals] == [50.0, 70.0, 100.0, 10.0, 370.0]
    assert result.intervals[1].calls == {"a": 16.25, "b": 48.75}
    assert result.intervals[3].platform == 10.0
    assert result.per_call == {"a": 243.75, "b": 326.25}
    assert result.measured == 600.0
    assert result.platform == 30.0
    assert result.attributed + result.platform == result.measured
    for a in result.intervals:
        assert a.attributed + a.platform == a.measured
        assert a.provenance == "replayed"


def test_devices_no_call_runs_on_go_to_platform() -> None:
    trace = [(0.0, {"cpu": 0, "dram": 0}), (1.0, {"cpu": 40, "dram": 6})]
    source = ReplaySource(trace, {"cpu": 1000, "dram": 1000})
    by_device = {
        a.device: a
        for a in attribute_samples(
            source.read(0.0),
            source.read(1.0),
            idle_watts={"cpu": 10.0},
            weights={"a": 1.0},
            call_devices={"cpu"},
        )
    }
    assert by_device["cpu"].calls == {"a": 30.0}
    assert by_device["dram"].calls == {}
    assert by_device["dram"].platform == 6.0


def test_samples_of_different_devices_or_provenance_do_not_mix() -> None:
    a = EnergySample(0.0, {"cpu": 0.0}, "measured")
    with pytest.raises(ValueError, match="different devices"):
        attribute_samples(
            a, EnergySample(1.0, {"gpu0": 1.0}, "measured"), idle_watts={}, weights={}
        )
    with pytest.raises(ValueError, match="mix provenances"):
        attribute_samples(
            a, EnergySample(1.0, {"cpu": 1.0}, "estimated"), idle_watts={}, weights={}
        )
    with pytest.raises(ValueError, match="interval weights"):
        attribute_series([a], [{}], idle_watts={})


class StepClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_meter_on_replayed_trace_charges_overlapping_calls_and_conserves() -> None:
    # Wraps between t=3 and t=4 (900 -> 50 at range 1000 is 150 J).
    raw = [100, 300, 600, 900, 50, 250, 260]
    source = ReplaySource([(float(t), {"cpu": r}) for t, r in enumerate(raw)], {"cpu": 1000})
    clock = StepClock()
    meter = Meter(source, ThreadCpu(), {"cpu": 5.0}, clock=clock)
    me = threading.get_native_id()
    # Both calls run on this thread, so whenever both are active their CPU weights are equal.
    meter.begin("a", me)  # t=0
    clock.now = 1.0
    meter.tick()
    clock.now = 2.0
    meter.begin("b", me)
    clock.now = 3.0
    a = meter.end("a")
    clock.now = 4.0
    meter.tick()
    clock.now = 5.0
    b = meter.end("b")
    clock.now = 6.0
    meter.tick()  # nobody runs: 10 J to platform

    assert (a.joules, a.intervals, a.provenance) == (637.5, 3, "replayed")
    assert (b.joules, b.intervals, b.provenance) == (487.5, 3, "replayed")
    totals = meter.totals()
    assert totals == {"measured": 1160.0, "attributed": 1125.0, "platform": 35.0}
    assert totals["attributed"] + totals["platform"] == totals["measured"]
    assert meter.active() == []
    assert len(meter.recent()) == 6


def test_meter_ring_keeps_only_the_last_samples_but_totals_keep_everything() -> None:
    source = ReplaySource([(float(t), {"cpu": 10 * t}) for t in range(10)], {"cpu": 1000})
    clock = StepClock()
    meter = Meter(source, ThreadCpu(), {"cpu": 0.0}, clock=clock, ring=3)
    for t in range(10):
        clock.now = float(t)
        meter.tick()
    assert [s.at for s in meter.samples()] == [7.0, 8.0, 9.0]
    assert [a.end for a in meter.recent()] == [7.0, 8.0, 9.0]
    assert meter.totals()["measured"] == 90.0
    assert meter.totals()["platform"] == 90.0


def test_meter_refuses_a_source_without_the_call_device() -> None:
    source = ReplaySource([(0.0, {"package-0": 0})], {"package-0": 1000})
    meter = Meter(source, ThreadCpu(), {}, clock=StepClock())
    with pytest.raises(ConfigurationError, match="package-0"):
        meter.tick()


def test_meter_refuses_double_begin_and_unknown_end() -> None:
    source = ReplaySource([(0.0, {"cpu": 0})], {"cpu": 1000})
    meter = Meter(source, ThreadCpu(), {}, clock=StepClock())
    meter.begin("a", threading.get_native_id())
    with pytest.raises(ValueError, match="already begun"):
        meter.begin("a", threading.get_native_id())
    with pytest.raises(KeyError, match="not begun"):
        meter.end("z")


RANGE = 1 << 16


@st.composite
def traces(draw: st.DrawFn) -> tuple[list[tuple[float, dict[str, int]]], list[int], list[float]]:
    n = draw(st.integers(2, 25))
    # Increments below the range: at most one wrap between points, as the Unwrapper requires.
    increments = draw(st.lists(st.integers(0, RANGE - 1), min_size=n - 1, max_size=n - 1))
    gaps = draw(st.lists(st.floats(0.001, 10.0), min_size=n - 1, max_size=n - 1))
    raw = draw(st.integers(0, RANGE - 1))
    # Distinct times: two samples at one time would read the same (latest) trace point.
    t = draw(st.floats(-1e3, 1e3))
    trace = [(t, {"cpu": raw})]
    for inc, gap in zip(increments, gaps, strict=True):
        raw = (raw + inc) % RANGE
        t += gap
        trace.append((t, {"cpu": raw}))
    return trace, increments, [p[0] for p in trace]


weights_strategy = st.dictionaries(
    st.sampled_from(["a", "b", "c", "d"]),
    st.one_of(st.just(0.0), st.floats(0.0, 1e6, allow_nan=False)),
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(traces(), st.data(), st.floats(0.0, 1e4))
def test_attributed_plus_platform_equals_measured_for_any_trace(trace_data, data, idle) -> None:
    trace, increments, times = trace_data
    source = ReplaySource(trace, {"cpu": RANGE}, scale=0.001)
    samples = [source.read(t) for t in times]
    weights = [data.draw(weights_strategy) for _ in increments]
    result = attribute_series(samples, weights, idle_watts={"cpu": idle})
    # The unwrapped trace measures exactly what was added, wraps included.
    assert math.isclose(result.measured, 0.001 * sum(increments), rel_tol=1e-9, abs_tol=1e-9)
    assert conserved(result.measured, result.attributed, result.platform)
    assert conserved(result.measured, math.fsum(result.per_call.values()), result.platform)
    for a, w in zip(result.intervals, weights, strict=True):
        assert conserved(a.measured, a.attributed, a.platform)
        assert a.platform >= 0.0
        assert all(j >= 0.0 for j in a.calls.values())
        assert set(a.calls) == set(w)
        if not w:
            assert a.platform == a.measured
        else:
            idle_part = min(a.measured, idle * (a.end - a.start))
            assert a.platform >= idle_part - 1e-9 * max(1.0, a.measured)


def test_a_counter_that_goes_back_costs_one_interval_not_the_meter() -> None:
    # The old reading stayed the baseline: every later interval failed as negative until the
    # counter climbed back past it, and every call was charged its whole reservation.
    meter = Meter(ListCounter([1000.0, 1010.0, 5.0, 15.0, 25.0]), ThreadCpu(), {},
                  clock=(clock := StepClock()), call_device="gpu0")  # fmt: skip
    me = threading.get_native_id()
    meter.begin("a", me, device="gpu")  # t=0, reading 1000
    for t in (1.0, 2.0, 3.0):
        clock.now = t
        meter.tick()
    clock.now = 4.0
    charged = meter.end("a")
    # 10 J measured before the reset, none for the interval across it, 10 + 10 after; the
    # call's figure makes up the lost interval (see test_meter_provenance).
    assert meter.totals()["measured"] == pytest.approx(30.0)
    assert meter.dropped_intervals == 1
    assert charged.joules == pytest.approx(40.0)
    assert charged.provenance == "estimated"


def test_a_call_on_more_threads_takes_its_share_by_them() -> None:
    # llama.cpp spreads a call over its tier's threads, the caller one of them: a 1-thread and
    # a 4-thread call whose callers burned the same CPU took 1:4 of it, not 1:1.
    source = ReplaySource([(0.0, {"cpu": 0}), (1.0, {"cpu": 100})], {"cpu": 1 << 30})
    clock = StepClock()
    meter = Meter(source, ThreadCpu(), {"cpu": 0.0}, clock=clock)
    ready, spun = threading.Barrier(3), threading.Barrier(3)
    go, finish = threading.Event(), threading.Event()
    ids: dict[str, int] = {}

    def caller(name: str) -> None:
        ids[name] = threading.get_native_id()
        ready.wait()
        go.wait()
        spin = time.thread_time() + 0.2
        while time.thread_time() < spin:
            pass
        spun.wait()
        finish.wait()  # alive until its call is ended: a thread's CPU time dies with it

    workers = [threading.Thread(target=caller, args=(n,)) for n in ("one", "four")]
    for w in workers:
        w.start()
    ready.wait()
    meter.begin("one", ids["one"], threads=1)
    meter.begin("four", ids["four"], threads=4)
    go.set()
    spun.wait()
    clock.now = 1.0
    one, four = meter.end("one").joules, meter.end("four").joules
    finish.set()
    for w in workers:
        w.join()
    assert one + four == pytest.approx(100.0)
    assert four / (one + four) == pytest.approx(0.8, abs=0.05)
