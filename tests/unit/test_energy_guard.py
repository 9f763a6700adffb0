"""The energy guard: when a generation must stop so that its metered energy stays within what
its reservation paid for (readings and time given, no model)."""

from __future__ import annotations

import pytest

from appliance.inference.energy_guard import EnergyGuard


class Readings:
    """A meter reading that climbs by `step` joules each time it is read."""

    def __init__(self, step: float, start: float = 0.0) -> None:
        self.step = step
        self.value = start
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        self.value += self.step
        return self.value


def test_it_stops_while_the_last_stretches_still_fit() -> None:
    meter = Readings(step=1.0)
    guard = EnergyGuard(10.0, meter, started=0.0, every=0.5)
    stops = [guard.stop(0.5 * (i + 1)) for i in range(20)]
    first = stops.index(True)
    # 1 J a check: it stops once used + 2 stretches reaches 10 J, at 8 J used.
    assert guard.used == 8.0 and first == 7
    assert all(stops[first:])  # once stopped, every later ask says stop
    assert meter.reads == 8  # and the meter is not read again
    assert guard.used + 1.0 <= guard.limit  # the stretch to the end still fits


def test_it_reads_the_meter_at_most_every_interval() -> None:
    meter = Readings(step=0.001)
    guard = EnergyGuard(100.0, meter, started=0.0, every=0.5)
    for i in range(80):  # a token every 125 ms for 10 s
        assert not guard.stop(0.125 * i)
    assert meter.reads == 20


def test_the_first_check_keeps_a_margin_from_the_prompts_pace() -> None:
    # The prompt used 9 J in 0.9 s (10 W): the next 0.05 s stretch may use about 0.5 J, so a
    # call with 9.5 J stops at once (9 + 2 x 0.5 >= 9.5); one with 11 J does not.
    assert EnergyGuard(9.5, Readings(step=9.0), started=0.0).stop(0.9)
    assert not EnergyGuard(11.0, Readings(step=9.0), started=0.0).stop(0.9)


def test_a_sudden_larger_stretch_widens_the_margin() -> None:
    values = iter([1.0, 1.1, 1.2, 4.5, 4.6])
    guard = EnergyGuard(10.0, lambda: next(values), started=0.0, every=0.5)
    assert [guard.stop(t) for t in (0.5, 1.0, 1.5, 2.0)] == [False, False, False, True]
    assert guard.used == 4.5  # 4.5 + 2 x 3.3 >= 10 (its pace alone would keep going)


def test_a_meter_that_fails_ends_the_checks_not_the_call() -> None:
    def broken() -> float:
        raise OSError("counter gone")

    guard = EnergyGuard(1.0, broken, started=0.0)
    assert not guard.stop(0.0)
    assert not guard.stop(10.0)
    assert not guard.stopped


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0 J"):
        EnergyGuard(0.0, Readings(1.0), started=0.0)
