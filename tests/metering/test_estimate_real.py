"""The estimate on this machine: real thread CPU time through a Meter gives labelled figures."""

from __future__ import annotations

import hashlib
import math
import threading
import time

from appliance.metering.meter import CallEnergy, Meter
from appliance.metering.sources import EstimateSource, ThreadCpu

BLOCK = b"\xa5" * (1 << 20)  # hashlib releases the GIL for large buffers: threads run in parallel
IDLE_WATTS = 10.0
WATTS_PER_CORE = 15.0


def burn(rounds: int) -> None:
    for _ in range(rounds):
        hashlib.sha256(BLOCK).digest()


def test_two_real_calls_get_estimated_joules_in_proportion_to_their_cpu() -> None:
    cpu = ThreadCpu()
    source = EstimateSource(
        idle_watts=IDLE_WATTS,
        watts_per_busy_core=WATTS_PER_CORE,
        cpu_seconds=cpu.total,
        start=time.monotonic(),
    )
    meter = Meter(source, cpu, {"cpu": IDLE_WATTS})
    meter.tick()  # the first sample: intervals start here
    results: dict[str, CallEnergy] = {}
    used: dict[str, float] = {}
    errors: list[BaseException] = []
    together = threading.Barrier(2, timeout=10)

    def call(call_id: str, rounds: int) -> None:
        try:
            me = threading.get_native_id()
            cpu.register(me)
            together.wait()  # the two calls overlap, as two pool workers would
            meter.begin(call_id, me)
            before = cpu.seconds(me)
            burn(rounds)
            used[call_id] = cpu.seconds(me) - before
            results[call_id] = meter.end(call_id)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=call, args=("busy", 600)),  # ~0.3 s of hashing
        threading.Thread(target=call, args=("light", 150)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not errors, errors
    meter.tick()

    busy, light = results["busy"], results["light"]
    assert busy.provenance == light.provenance == "estimated"
    assert light.joules > 0.0
    assert busy.joules > light.joules
    assert busy.intervals >= 1 and light.intervals >= 1
    # Above the idle floor, each call is charged the busy-core power times the CPU its own thread
    # used, as the kernel counted it (10 ms ticks: allow for a few of them).
    for call_id, energy in results.items():
        expected = WATTS_PER_CORE * used[call_id]
        assert math.isclose(energy.joules, expected, rel_tol=0.25, abs_tol=WATTS_PER_CORE * 0.05)

    totals = meter.totals()
    assert math.isclose(totals["attributed"] + totals["platform"], totals["measured"], rel_tol=1e-9)
    assert math.isclose(totals["attributed"], busy.joules + light.joules, rel_tol=1e-9)
    assert totals["platform"] > 0.0  # the idle floor of the elapsed time
    assert all(a.provenance == "estimated" for a in meter.recent())
