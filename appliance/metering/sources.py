"""Energy sources: cumulative joules per device, each labelled with how it was obtained.

A source answers "how many joules has each device used so far" as monotone cumulative counters;
attribution works on the differences between two readings. Every figure carries a provenance:
`measured` (a hardware counter: NVML, RAPL), `estimated` (a model of power from CPU time) or
`replayed` (a recorded trace, for tests), so that nothing downstream can pass an estimate off as a
measurement. `choose_source` picks the most trusted source this machine offers.
"""

from __future__ import annotations

import bisect
import importlib
import itertools
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import psutil

from appliance.domain.errors import ApplianceError, ConfigurationError

Provenance = Literal["measured", "estimated", "replayed"]


class EnergySourceUnavailable(ApplianceError):
    """A source was read although it cannot be used here; the message says why."""


@dataclass(frozen=True)
class EnergySample:
    """One reading of a source: cumulative, unwrapped joules per device at `at`."""

    at: float  # seconds on the meter's monotonic clock
    joules: dict[str, float]  # cumulative, unwrapped, per device name
    provenance: Provenance


class EnergySource(Protocol):
    """Anything that reports cumulative joules per device."""

    name: str
    provenance: Provenance

    def available(self) -> tuple[bool, str]:
        """Return (usable?, why not / what it is)."""
        ...

    def read(self, at: float) -> EnergySample:
        """Read every device's cumulative joules, stamped with the meter's time `at`."""
        ...


# More than any CPU package or DRAM zone draws (in watts): a RAPL counter that falls back by
# more than a wrap at this rate could mean was reset, not wrapped.
RAPL_MAX_WATTS = 5_000.0


class Unwrapper:
    """Turns wrapping hardware counters into monotone cumulative values.

    A counter runs from 0 to its range and then starts again at 0. A reading lower than the
    previous one is taken as exactly one wrap, and the range is added to that device's offset.
    Two wraps between reads look the same as one and cannot be told apart, so the counters must be
    read at an interval well under the wrap time (a RAPL package counter of 2^32 uJ wraps after
    about 4300 J, some 40 s at 100 W: reading every second leaves a wide margin).

    The cumulative value is `raw + wraps * range`: with no wrap it equals the hardware counter.

    A counter can also start again from 0 without wrapping (a reset: suspend and resume, the
    driver reloaded). Read as a wrap, that added nearly a whole range (a RAPL package's is some
    262 kJ) to the interval, charged to the calls then running as measured. Given the times of
    the readings and `max_rate` (raw units a second no device reaches), a decrease whose wrap
    would mean more than that is taken as a reset: the cumulative value goes back (by what the
    counter had), and the meter leaves that one interval unattributed, as for any counter that
    goes back.
    """

    def __init__(self, ranges: Mapping[str, int | float], *, max_rate: float | None = None) -> None:
        for device, span in ranges.items():
            if span <= 0:
                raise ConfigurationError(f"energy counter {device!r}: range must be > 0")
        self._ranges = dict(ranges)
        self._max_rate = max_rate
        self._last: dict[str, float] = {}
        self._last_at: dict[str, float] = {}
        self._offset: dict[str, float] = {}
        # Sources may be read from the meter and from a diagnostic at once.
        self._lock = threading.Lock()

    def update(self, device: str, raw: int | float, at: float | None = None) -> float:
        """Fold in one raw reading of `device` (taken at time `at`, seconds) and return its
        cumulative value."""
        span = self._ranges.get(device)
        if span is None:
            raise ValueError(f"energy counter {device!r}: no range known for it")
        if raw < 0 or raw > span:
            raise ValueError(f"energy counter {device!r}: raw value {raw} outside [0, {span}]")
        with self._lock:
            last = self._last.get(device)
            last_at = self._last_at.get(device)
            offset = self._offset.get(device, 0.0)
            if last is not None and raw < last and not self._reset(raw + span - last, last_at, at):
                offset += span
                self._offset[device] = offset
            self._last[device] = raw
            if at is not None:
                self._last_at[device] = at
            return raw + offset

    def _reset(self, wrapped: float, last_at: float | None, at: float | None) -> bool:
        """Whether a decrease that, as a wrap, would mean `wrapped` raw units since the last
        reading is a reset instead: more than any device uses in that time."""
        if self._max_rate is None or last_at is None or at is None or at <= last_at:
            return False
        return wrapped > self._max_rate * (at - last_at)


class NvmlSource:
    """GPU energy from NVML's total energy counter (millijoules since the driver loaded).

    `pynvml` is optional: it is imported only when the source is first used, and a missing module
    or a failing `nvmlInit` (no driver, no GPU) makes the source unavailable, not the appliance.
    NVML's counter is 64-bit and does not wrap in practice, so no unwrapping is needed.
    """

    name = "nvml"
    provenance: Provenance = "measured"

    def __init__(self, module: Any = None) -> None:
        # `module` lets a caller hand in an already imported NVML binding.
        self._nvml: Any = module
        self._handles: list[Any] | None = None
        self._why = "not probed yet"
        self._lock = threading.Lock()

    def _probe(self) -> None:
        if self._handles is not None:
            return
        try:
            nvml = self._nvml if self._nvml is not None else importlib.import_module("pynvml")
        except ImportError as exc:
            self._why = f"nvml: pynvml is not installed ({exc})"
            return
        try:
            nvml.nvmlInit()
            count = int(nvml.nvmlDeviceGetCount())
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            for handle in handles:
                # Older GPUs lack the counter: find out now rather than on the first call.
                nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except Exception as exc:  # NVMLError has many subclasses; any of them means unusable.
            self._why = f"nvml: {type(exc).__name__}: {exc}"
            return
        if not handles:
            self._why = "nvml: no GPU found"
            return
        self._nvml = nvml
        self._handles = handles

    def available(self) -> tuple[bool, str]:
        """Return whether NVML answers here, and which GPUs it sees or why not."""
        with self._lock:
            self._probe()
            if self._handles is None:
                return False, self._why
            return True, f"nvml: {len(self._handles)} GPU(s), total energy counter"

    def read(self, at: float) -> EnergySample:
        """Read each GPU's cumulative energy as gpu0, gpu1, ..."""
        with self._lock:
            self._probe()
            if self._handles is None:
                raise EnergySourceUnavailable(self._why)
            joules = {
                f"gpu{i}": float(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h)) / 1000.0
                for i, h in enumerate(self._handles)
            }
        return EnergySample(at=at, joules=joules, provenance=self.provenance)


_ZONE = re.compile(r"^intel-rapl:(\d+)(?::(\d+))?$")


@dataclass(frozen=True)
class _Zone:
    device: str
    path: Path
    range_uj: int


class RaplSource:
    """CPU package and DRAM energy from Linux powercap (RAPL) counters in sysfs.

    Uses the top-level package zones (`intel-rapl:N`, named `package-N`) and their `dram`
    subzones. `core`/`uncore` subzones lie inside the package and `psys` covers the whole SoC, so
    taking them as well would count the same joules twice. Counters (`energy_uj`) wrap at
    `max_energy_range_uj` and are unwrapped here. Since the 2020 PLATYPUS fix `energy_uj` is
    readable by root only on many kernels, so an unreadable file makes the source unavailable.
    """

    name = "rapl"
    provenance: Provenance = "measured"

    def __init__(self, root: Path = Path("/sys/class/powercap")) -> None:
        self.root = root
        self._zones: list[_Zone] | None = None
        self._unwrap: Unwrapper | None = None
        self._lock = threading.Lock()

    def _discover(self) -> list[_Zone]:
        if not self.root.is_dir():
            raise EnergySourceUnavailable(f"rapl: {self.root} does not exist (no powercap here)")
        found: list[tuple[tuple[int, int], str, Path]] = []
        for entry in self.root.iterdir():
            match = _ZONE.match(entry.name)
            if match is None:
                continue
            package, sub = int(match.group(1)), match.group(2)
            label = _read_text(entry / "name")
            if sub is None and label.startswith("package"):
                found.append(((package, -1), label, entry))
            elif sub is not None and label == "dram":
                found.append(((package, int(sub)), label, entry))
        if not found:
            raise EnergySourceUnavailable(f"rapl: no package or dram zones under {self.root}")
        found.sort()
        zones: list[_Zone] = []
        taken: set[str] = set()
        labels = [label for _, label, _ in found]
        for (package, _), label, path in found:
            # Two sockets give two "dram" zones: tell them apart by package number.
            device = label if labels.count(label) == 1 else f"{label}-{package}"
            if device in taken:
                device = f"{label}@{path.name}"
            taken.add(device)
            span = _read_int(path / "max_energy_range_uj")
            if span <= 0:
                raise EnergySourceUnavailable(f"rapl: {path}/max_energy_range_uj is {span}")
            _read_int(path / "energy_uj")  # unreadable counters make the source unusable now
            zones.append(_Zone(device, path, span))
        return zones

    def _ensure(self) -> list[_Zone]:
        if self._zones is None:
            zones = self._discover()
            self._unwrap = Unwrapper(
                {z.device: z.range_uj for z in zones}, max_rate=RAPL_MAX_WATTS * 1e6
            )
            self._zones = zones
        return self._zones

    def available(self) -> tuple[bool, str]:
        """Return whether RAPL counters can be read here, and which zones or why not."""
        with self._lock:
            try:
                zones = self._ensure()
            except EnergySourceUnavailable as exc:
                return False, str(exc)
            return True, "rapl: " + ", ".join(z.device for z in zones)

    def read(self, at: float) -> EnergySample:
        """Read every zone's counter and return unwrapped cumulative joules."""
        with self._lock:
            zones = self._ensure()
            assert self._unwrap is not None
            joules = {
                z.device: self._unwrap.update(z.device, _read_int(z.path / "energy_uj"), at) / 1e6
                for z in zones
            }
        return EnergySample(at=at, joules=joules, provenance=self.provenance)


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:  # missing, a directory, permission denied: all mean "cannot use"
        raise EnergySourceUnavailable(f"rapl: cannot read {path}: {exc.strerror or exc}") from exc


def _read_int(path: Path) -> int:
    text = _read_text(path)
    try:
        return int(text)
    except ValueError as exc:
        raise EnergySourceUnavailable(f"rapl: {path} holds {text!r}, not an integer") from exc


class EstimateSource:
    """An estimate of CPU energy from the inference threads' CPU time, labelled `estimated`.

    joules(at) = idle_watts * (at - start) + watts_per_busy_core * cpu_seconds(): a constant
    floor for the machine being on, plus a fixed power per core kept busy. It is the fallback
    where no counter can be read; its figures are only as good as the two wattages.

    `cpu_seconds` must cover all the CPU inference uses. llama.cpp computes on helper threads
    besides the calling one (with 2 threads, measured here: half the CPU time is on a helper
    thread the caller never sees), so `ThreadCpu.total()` over the calling threads undercounts
    by about the thread count; `process_cpu_seconds` counts the helpers too.
    """

    name = "estimate"
    provenance: Provenance = "estimated"
    device = "cpu"

    def __init__(
        self,
        idle_watts: float,
        watts_per_busy_core: float,
        cpu_seconds: Callable[[], float],
        start: float,
    ) -> None:
        if idle_watts < 0 or watts_per_busy_core < 0:
            raise ConfigurationError("metering.estimate: idle and busy-core watts must be >= 0")
        self.idle_watts = idle_watts
        self.watts_per_busy_core = watts_per_busy_core
        self._cpu_seconds = cpu_seconds
        self.start = start

    def available(self) -> tuple[bool, str]:
        """Return True: an estimate can always be made (the reason says how)."""
        return True, (
            f"estimate: {self.idle_watts} W idle + {self.watts_per_busy_core} W per busy core, "
            "from inference thread CPU time (no energy counter read)"
        )

    def read(self, at: float) -> EnergySample:
        """Return the estimated cumulative joules of device "cpu" at `at`."""
        joules = self.idle_watts * (at - self.start) + self.watts_per_busy_core * (
            self._cpu_seconds()
        )
        return EnergySample(at=at, joules={self.device: joules}, provenance=self.provenance)


def process_cpu_seconds() -> float:
    """Return the CPU seconds (user + system) this whole process has used, every thread included.

    The fallback estimate's busy-core term for a process whose CPU is mostly inference: it counts
    llama.cpp's own helper threads, which no caller can register, and threads that have exited.
    """
    times = psutil.Process().cpu_times()
    return float(times.user + times.system)


@dataclass
class _Tracked:
    baseline: float  # CPU seconds the thread had used when registered
    last: float  # CPU seconds last seen
    alive: bool = True


class ThreadCpu:
    """Real per-thread CPU time (user + system) of registered threads, from /proc (psutil where
    there is none).

    Thread ids are native ids (`threading.get_native_id()`), the ids the kernel reports.
    `seconds(id)` is the thread's cumulative CPU time since it started; `total()` is the CPU time
    registered threads used while registered, summed over every thread ever registered, and never
    decreases: a thread that exited (or was unregistered) keeps the last value seen. Once a
    registered id vanishes it is frozen, so a new thread that later reuses the id is not counted
    (unless registered again). Thread-safe.
    """

    def __init__(self) -> None:
        self._proc = psutil.Process()
        self._tracked: dict[int, _Tracked] = {}
        self._retired = 0.0  # CPU seconds of threads no longer tracked
        self._lock = threading.Lock()
        # Linux: read the few threads asked about from /proc (every registered one, at each
        # sample of the meter, between tokens too); psutil reads every thread of the process,
        # about 10 us each (0.6 ms with 60 threads).
        self._tasks = Path("/proc/self/task")  # this process, also after a fork
        self._ticks = float(os.sysconf("SC_CLK_TCK")) if self._tasks.is_dir() else 0.0

    def _now(self, also: int | None = None) -> dict[int, float]:
        """CPU seconds of the registered threads still alive (and of `also`), by thread id."""
        if not self._ticks:
            return {t.id: t.user_time + t.system_time for t in self._proc.threads()}
        wanted = [tid for tid, t in self._tracked.items() if t.alive]
        if also is not None:
            wanted.append(also)
        out: dict[int, float] = {}
        for tid in wanted:
            try:
                stat = (self._tasks / str(tid) / "stat").read_bytes()
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited (any other error is raised: a live thread is never frozen)
            # After "(comm)", which may hold spaces: state is field 3; utime, stime 14 and 15.
            fields = stat[stat.rindex(b")") + 2 :].split()
            out[tid] = (int(fields[11]) + int(fields[12])) / self._ticks
        return out

    def _refresh(self, also: int | None = None) -> dict[int, float]:
        now = self._now(also)
        for tid, tracked in self._tracked.items():
            value = now.get(tid)
            if not tracked.alive:
                continue  # a vanished id that shows up again is a different thread
            if value is None or value < tracked.last:
                tracked.alive = False  # exited (a lower value: the id was reused meanwhile)
                continue
            tracked.last = value
        return now

    def register(self, native_id: int) -> None:
        """Start counting a thread of this process (no-op if it is already counted)."""
        with self._lock:
            now = self._refresh(also=native_id)
            tracked = self._tracked.get(native_id)
            if tracked is not None and tracked.alive:
                return
            if native_id not in now:
                raise ValueError(f"thread {native_id} is not a live thread of this process")
            if tracked is not None:
                self._retired += tracked.last - tracked.baseline
            self._tracked[native_id] = _Tracked(baseline=now[native_id], last=now[native_id])

    def unregister(self, native_id: int) -> None:
        """Stop counting a thread; what it used while registered stays in `total()`."""
        with self._lock:
            self._refresh()
            tracked = self._tracked.pop(native_id, None)
            if tracked is not None:
                self._retired += tracked.last - tracked.baseline

    def seconds(self, native_id: int) -> float:
        """Return a thread's cumulative CPU seconds (the last value seen if it has exited)."""
        with self._lock:
            now = self._refresh(also=native_id)
            tracked = self._tracked.get(native_id)
            if tracked is not None:
                return tracked.last
            if native_id in now:
                return now[native_id]
            raise KeyError(f"thread {native_id}: neither registered nor alive")

    def snapshot(self) -> dict[int, float]:
        """Return the cumulative CPU seconds of every registered thread, from one reading."""
        with self._lock:
            self._refresh()
            return {tid: t.last for tid, t in self._tracked.items()}

    def total(self) -> float:
        """Return the CPU seconds every registered thread used while registered (monotone)."""
        with self._lock:
            self._refresh()
            return self._retired + sum(t.last - t.baseline for t in self._tracked.values())


class ReplaySource:
    """Recorded raw counter traces played back (for tests and offline analysis).

    `trace` is a time-ordered list of (time, raw counter per device), each counter wrapping at
    `ranges[device]`. The whole trace is unwrapped once, in order, so a read that skips points
    still sees every wrap. `read(at)` is a step function: the cumulative value of the latest
    trace point at or before `at` (no interpolation). Raw units times `scale` give joules (1.0 for
    a trace in joules, 1e-6 for RAPL microjoules).
    """

    name = "replay"

    def __init__(
        self,
        trace: Sequence[tuple[float, Mapping[str, int]]],
        ranges: Mapping[str, int],
        provenance: Provenance = "replayed",
        *,
        scale: float = 1.0,
    ) -> None:
        if not trace:
            raise ValueError("replay: the trace is empty")
        times = [t for t, _ in trace]
        if any(b < a for a, b in itertools.pairwise(times)):
            raise ValueError("replay: trace times must not decrease")
        devices = set(trace[0][1])
        unwrap = Unwrapper(ranges)
        points: list[dict[str, float]] = []
        for t, raw in trace:
            if set(raw) != devices:
                raise ValueError(f"replay: point at {t} has devices {sorted(raw)}, not {devices}")
            points.append({d: unwrap.update(d, v) * scale for d, v in raw.items()})
        self.provenance: Provenance = provenance
        self._times = times
        self._points = points

    def available(self) -> tuple[bool, str]:
        """Return True: a trace is always there to be replayed."""
        return True, f"replay: {len(self._times)} recorded points"

    def read(self, at: float) -> EnergySample:
        """Return the unwrapped values of the latest trace point at or before `at`."""
        index = bisect.bisect_right(self._times, at) - 1
        if index < 0:
            raise ValueError(f"replay: {at} is before the trace starts at {self._times[0]}")
        return EnergySample(at=at, joules=dict(self._points[index]), provenance=self.provenance)


def choose_source(
    estimate: EnergySource,
    *,
    nvml: EnergySource | None = None,
    rapl: EnergySource | None = None,
    gpu_in_use: bool = True,
) -> tuple[EnergySource, list[tuple[str, str]]]:
    """Pick the most trusted usable source: NVML (only when a model runs on the GPU), then
    RAPL, then the estimate.

    Returns the source and, for each one passed over, (its name, why it was not usable), so the
    runtime can announce that it runs on an estimate and why.
    """
    skipped: list[tuple[str, str]] = []
    candidates: list[EnergySource] = []
    if gpu_in_use:
        candidates.append(nvml if nvml is not None else NvmlSource())
    else:
        # Calls that run on the CPU would be charged the GPU's (idle) power, labelled measured,
        # and the CPU's own energy not at all.
        skipped.append(("nvml", "no model tier runs on the GPU"))
    candidates += [rapl if rapl is not None else RaplSource(), estimate]
    for source in candidates:
        usable, why = source.available()
        if usable:
            return source, skipped
        skipped.append((source.name, why))
    raise EnergySourceUnavailable(
        "no energy source is usable: " + "; ".join(f"{n}: {w}" for n, w in skipped)
    )
