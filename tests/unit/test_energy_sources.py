"""Energy sources: unwrapping, RAPL on fake sysfs trees, NVML absent here, the fallback choice."""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import threading
from pathlib import Path

import psutil
import pytest

from appliance.domain.errors import ConfigurationError
from appliance.metering.sources import (
    EnergySourceUnavailable,
    EstimateSource,
    NvmlSource,
    RaplSource,
    ReplaySource,
    ThreadCpu,
    Unwrapper,
    choose_source,
    process_cpu_seconds,
)

# --- Unwrapper -----------------------------------------------------------------------------


def test_unwrapper_adds_the_range_once_per_decrease() -> None:
    u = Unwrapper({"pkg": 1000})
    values = [u.update("pkg", raw) for raw in (100, 900, 50, 60, 999, 0, 10)]
    assert values == [100, 900, 1050, 1060, 1999, 2000, 2010]


def test_unwrapper_keeps_devices_apart() -> None:
    u = Unwrapper({"a": 100, "b": 10})
    assert u.update("a", 90) == 90
    assert u.update("b", 9) == 9
    assert u.update("a", 5) == 105
    assert u.update("b", 9) == 9  # equal is not a decrease


def test_unwrapper_cannot_see_two_wraps_between_reads() -> None:
    # 10 -> (wrap) -> (wrap) -> 5 really added 1995; one read per wrap is the price of knowing.
    u = Unwrapper({"pkg": 1000})
    u.update("pkg", 10)
    assert u.update("pkg", 5) == 1005


def test_unwrapper_takes_a_fall_no_device_could_wrap_through_for_a_reset() -> None:
    # A RAPL package counter (range 262,143 J) reset by a suspend: 100 J, then 5 J a second
    # later. As a wrap that was 262,048 J in one second, charged to the calls then running as
    # measured. Taken as a reset, the value goes back and the meter drops that one interval.
    u = Unwrapper({"pkg": 262_143}, max_rate=5_000)
    assert u.update("pkg", 100, at=0.0) == 100
    assert u.update("pkg", 5, at=1.0) == 5  # gone back: that interval is nobody's
    assert u.update("pkg", 50, at=2.0) == 50  # and it counts on from there
    # A real wrap near the top of the range still adds the range once.
    assert u.update("pkg", 262_100, at=3.0) == 262_100
    assert u.update("pkg", 900, at=4.0) == 262_143 + 900
    # Without times, every fall is a wrap (as before).
    plain = Unwrapper({"pkg": 262_143}, max_rate=5_000)
    plain.update("pkg", 100)
    assert plain.update("pkg", 5) == 262_148


def test_unwrapper_refuses_out_of_range_and_unknown_devices() -> None:
    u = Unwrapper({"pkg": 1000})
    with pytest.raises(ValueError, match="outside"):
        u.update("pkg", 1001)
    with pytest.raises(ValueError, match="no range"):
        u.update("dram", 1)
    with pytest.raises(ConfigurationError):
        Unwrapper({"pkg": 0})


# --- RAPL on fake sysfs trees --------------------------------------------------------------


def zone(root: Path, directory: str, name: str, energy: int, span: int = 262143328850) -> Path:
    path = root / directory
    path.mkdir(parents=True)
    (path / "name").write_text(name + "\n")
    (path / "energy_uj").write_text(f"{energy}\n")
    (path / "max_energy_range_uj").write_text(f"{span}\n")
    return path


@pytest.fixture
def powercap(tmp_path: Path) -> Path:
    root = tmp_path / "powercap"
    root.mkdir()
    (root / "intel-rapl").mkdir()  # the control type folder: no counter of its own
    zone(root, "intel-rapl:0", "package-0", 5_000_000, span=10_000_000)
    zone(root, "intel-rapl:0:0", "core", 1_000_000)  # inside the package: not counted twice
    zone(root, "intel-rapl:0:1", "dram", 2_000_000, span=10_000_000)
    zone(root, "intel-rapl:1", "psys", 9_000_000)  # the whole SoC: overlaps the package
    return root


def test_rapl_reads_package_and_dram_in_joules(powercap: Path) -> None:
    source = RaplSource(powercap)
    ok, why = source.available()
    assert ok, why
    assert "package-0" in why and "dram" in why
    sample = source.read(12.5)
    assert sample.joules == {"package-0": 5.0, "dram": 2.0}
    assert sample.at == 12.5
    assert sample.provenance == "measured"


def test_rapl_unwraps_a_counter_that_wrapped(powercap: Path) -> None:
    source = RaplSource(powercap)
    assert source.read(0.0).joules["package-0"] == 5.0
    (powercap / "intel-rapl:0" / "energy_uj").write_text("9000000\n")
    assert source.read(1.0).joules["package-0"] == 9.0
    (powercap / "intel-rapl:0" / "energy_uj").write_text("1000000\n")  # wrapped at 10 J
    assert source.read(2.0).joules["package-0"] == 11.0


def test_rapl_names_zones_of_two_sockets_apart(tmp_path: Path) -> None:
    zone(tmp_path, "intel-rapl:0", "package-0", 1)
    zone(tmp_path, "intel-rapl:0:0", "dram", 2)
    zone(tmp_path, "intel-rapl:1", "package-1", 3)
    zone(tmp_path, "intel-rapl:1:0", "dram", 4)
    sample = RaplSource(tmp_path).read(0.0)
    assert sample.joules == {"package-0": 1e-6, "dram-0": 2e-6, "package-1": 3e-6, "dram-1": 4e-6}


def test_rapl_with_an_unreadable_counter_is_unavailable(powercap: Path) -> None:
    # Tests run as root, for whom chmod 000 blocks nothing: a folder in its place cannot be read.
    counter = powercap / "intel-rapl:0" / "energy_uj"
    counter.unlink()
    counter.mkdir()
    source = RaplSource(powercap)
    ok, why = source.available()
    assert not ok
    assert "energy_uj" in why
    with pytest.raises(EnergySourceUnavailable, match="energy_uj"):
        source.read(0.0)


def test_rapl_with_a_missing_counter_is_unavailable(powercap: Path) -> None:
    (powercap / "intel-rapl:0:1" / "energy_uj").unlink()
    ok, why = RaplSource(powercap).available()
    assert not ok
    assert "intel-rapl:0:1" in why


def test_rapl_with_garbage_in_a_counter_is_unavailable(powercap: Path) -> None:
    (powercap / "intel-rapl:0" / "max_energy_range_uj").write_text("lots\n")
    ok, why = RaplSource(powercap).available()
    assert not ok
    assert "not an integer" in why


def test_rapl_without_root_or_zones_is_unavailable(tmp_path: Path) -> None:
    ok, why = RaplSource(tmp_path / "absent").available()
    assert not ok
    assert "does not exist" in why
    zone(tmp_path, "intel-rapl:0:0", "core", 1)  # only a subzone that is not counted
    ok, why = RaplSource(tmp_path).available()
    assert not ok
    assert "no package or dram zones" in why


def test_rapl_on_this_machine_answers_without_crashing() -> None:
    root = Path("/sys/class/powercap")
    ok, why = RaplSource().available()
    assert isinstance(ok, bool)
    assert isinstance(why, str) and why
    if not root.exists():  # FACTS.md: the kernel here has no powercap
        assert not ok
        assert "does not exist" in why


# --- NVML ----------------------------------------------------------------------------------


def test_nvml_is_unavailable_here_with_a_reason() -> None:
    ok, why = NvmlSource().available()
    assert isinstance(ok, bool)
    if importlib.util.find_spec("pynvml") is None:
        assert not ok
        assert "pynvml is not installed" in why
        with pytest.raises(EnergySourceUnavailable, match="pynvml"):
            NvmlSource().read(0.0)


class FakeNvml:
    """Stands in for the NVML binding, which has no driver to talk to on this machine."""

    def __init__(self, millijoules: list[int], fail: Exception | None = None) -> None:
        self.millijoules = millijoules
        self.fail = fail

    def nvmlInit(self) -> None:
        if self.fail is not None:
            raise self.fail

    def nvmlDeviceGetCount(self) -> int:
        return len(self.millijoules)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        return self.millijoules[handle]


def test_nvml_reads_millijoules_as_joules_per_gpu() -> None:
    nvml = FakeNvml([1500, 250_000])
    source = NvmlSource(module=nvml)
    assert source.available() == (True, "nvml: 2 GPU(s), total energy counter")
    nvml.millijoules[0] = 2500
    sample = source.read(3.0)
    assert sample.joules == {"gpu0": 2.5, "gpu1": 250.0}
    assert sample.provenance == "measured"


def test_nvml_whose_init_fails_is_unavailable() -> None:
    source = NvmlSource(module=FakeNvml([1], fail=RuntimeError("Driver Not Loaded")))
    ok, why = source.available()
    assert not ok
    assert "Driver Not Loaded" in why


# --- Estimate, replay and the choice --------------------------------------------------------


def test_estimate_is_idle_floor_plus_busy_core_watts() -> None:
    cpu = [0.0]
    source = EstimateSource(
        idle_watts=10.0, watts_per_busy_core=20.0, cpu_seconds=lambda: cpu[0], start=100.0
    )
    assert source.read(100.0).joules == {"cpu": 0.0}
    cpu[0] = 1.5
    sample = source.read(102.0)
    assert sample.joules == {"cpu": 10.0 * 2.0 + 20.0 * 1.5}
    assert sample.provenance == "estimated"
    with pytest.raises(ConfigurationError):
        EstimateSource(idle_watts=-1.0, watts_per_busy_core=1.0, cpu_seconds=lambda: 0.0, start=0.0)


def test_replay_steps_to_the_latest_point_and_sees_skipped_wraps() -> None:
    trace = [(0.0, {"d": 800}), (1.0, {"d": 100}), (2.0, {"d": 700}), (3.0, {"d": 50})]
    source = ReplaySource(trace, {"d": 1000})
    assert source.read(0.5).joules == {"d": 800.0}
    # Reading only the ends still counts both wraps, because the trace is unwrapped in order.
    assert source.read(3.0).joules == {"d": 2050.0}
    assert source.read(99.0).provenance == "replayed"
    with pytest.raises(ValueError, match="before the trace starts"):
        source.read(-1.0)
    with pytest.raises(ValueError, match="must not decrease"):
        ReplaySource([(1.0, {"d": 1}), (0.0, {"d": 2})], {"d": 1000})


def estimate() -> EstimateSource:
    return EstimateSource(
        idle_watts=5.0, watts_per_busy_core=10.0, cpu_seconds=lambda: 0.0, start=0.0
    )


def test_choose_source_falls_back_to_the_estimate_here() -> None:
    nvml_ok, _ = NvmlSource().available()
    rapl_ok, _ = RaplSource().available()
    chosen, skipped = choose_source(estimate())
    if not nvml_ok and not rapl_ok:  # this machine, per FACTS.md
        assert chosen.name == "estimate"
        assert chosen.provenance == "estimated"
        assert [name for name, _ in skipped] == ["nvml", "rapl"]
        assert all(why for _, why in skipped)


def test_choose_source_prefers_a_readable_rapl_to_the_estimate(powercap: Path) -> None:
    unavailable_nvml = NvmlSource(module=FakeNvml([], fail=RuntimeError("no GPU")))
    chosen, skipped = choose_source(estimate(), nvml=unavailable_nvml, rapl=RaplSource(powercap))
    assert chosen.name == "rapl"
    assert skipped == [("nvml", "nvml: RuntimeError: no GPU")]
    chosen, skipped = choose_source(
        estimate(), nvml=unavailable_nvml, rapl=RaplSource(powercap / "absent")
    )
    assert chosen.name == "estimate"
    assert [name for name, _ in skipped] == ["nvml", "rapl"]


def test_a_gpu_counter_is_not_used_when_no_model_runs_on_the_gpu(powercap: Path) -> None:
    # Calls run on the CPU were charged the GPU's idle power, labelled measured.
    gpu = NvmlSource(module=FakeNvml([5_000]))
    assert gpu.available()[0]
    chosen, _ = choose_source(estimate(), nvml=gpu, rapl=RaplSource(powercap))
    assert chosen.name == "nvml"
    chosen, skipped = choose_source(
        estimate(), nvml=gpu, rapl=RaplSource(powercap), gpu_in_use=False
    )
    assert chosen.name == "rapl"
    assert skipped == [("nvml", "no model tier runs on the GPU")]


# --- ThreadCpu with real threads -----------------------------------------------------------

BLOCK = b"\x5a" * (1 << 20)  # hashlib drops the GIL for buffers this large


def burn(rounds: int) -> None:
    for _ in range(rounds):
        hashlib.sha256(BLOCK).digest()


class Worker(threading.Thread):
    """A thread that burns CPU when told to and exits when told to."""

    def __init__(self, rounds: int) -> None:
        super().__init__(daemon=True)
        self.rounds = rounds
        self.native: int | None = None
        self.started_up = threading.Event()
        self.go = threading.Event()
        self.done = threading.Event()
        self.finish = threading.Event()

    def run(self) -> None:
        self.native = threading.get_native_id()
        self.started_up.set()
        self.go.wait(10)
        burn(self.rounds)
        self.done.set()
        self.finish.wait(10)


def test_thread_cpu_counts_a_real_thread_and_keeps_it_after_exit() -> None:
    cpu = ThreadCpu()
    worker = Worker(rounds=150)
    worker.start()
    assert worker.started_up.wait(10)
    assert worker.native is not None
    cpu.register(worker.native)
    before = cpu.total()
    worker.go.set()
    assert worker.done.wait(30)
    busy = cpu.total()
    assert busy > before
    cpu.register(worker.native)  # a second register is a no-op, not a reset of the baseline
    assert cpu.total() == busy  # the worker is parked: it used no CPU since
    assert cpu.seconds(worker.native) >= busy - before
    assert cpu.snapshot() == {worker.native: cpu.seconds(worker.native)}
    worker.finish.set()
    worker.join(10)
    after = cpu.total()
    assert after >= busy
    assert cpu.total() == after  # frozen at the last value seen, not lost
    cpu.unregister(worker.native)
    assert cpu.total() == after  # unregistering keeps what it used
    assert cpu.snapshot() == {}


def test_thread_cpu_reads_what_psutil_reads_and_falls_back_to_it() -> None:
    # Only the registered threads' /proc entries are read (psutil reads every thread of the
    # process, and the meter samples between tokens); the figures are the kernel's either way.
    native: list[int] = []
    turns = [threading.Event(), threading.Event()]
    done = [threading.Event(), threading.Event()]
    leave = threading.Event()

    def work() -> None:
        native.append(threading.get_native_id())
        for turn, finished in zip(turns, done, strict=True):
            turn.wait(10)
            burn(60)
            finished.set()
        leave.wait(10)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    turns[0].set()
    assert done[0].wait(30)
    (tid,) = native
    fast, slow = ThreadCpu(), ThreadCpu()
    slow._ticks = 0.0  # as where there is no /proc: psutil
    for cpu in (fast, slow):
        cpu.register(tid)
    by_psutil = {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}
    used = fast.seconds(tid)
    assert used == slow.seconds(tid) == by_psutil[tid] and used > 0
    # A thread name holding ") " does not shift the fields (psutil itself misreads it).
    Path(f"/proc/self/task/{tid}/comm").write_text("odd) 1 2 (3")
    turns[1].set()
    assert done[1].wait(30)
    assert fast.seconds(tid) > used  # still counted, and counting
    leave.set()
    thread.join(10)
    last = fast.seconds(tid)
    assert fast.snapshot() == {tid: last}  # exited: the last value seen is kept


def test_a_read_error_is_raised_never_taken_for_a_thread_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Taken for an exit, a transient error (too many open files) would freeze a live thread's
    # CPU time for good: its calls under-charged, their energy guard under-reading.
    cpu = ThreadCpu()
    me = threading.get_native_id()
    cpu.register(me)
    read = Path.read_bytes

    def full(self: Path) -> bytes:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(Path, "read_bytes", full)
    with pytest.raises(OSError, match="Too many open files"):
        cpu.snapshot()
    monkeypatch.setattr(Path, "read_bytes", read)
    burn(20)
    # This thread runs on between the readings: its time, read live, lies between them.
    before = cpu.seconds(me)
    live = cpu.snapshot()[me]
    assert cpu._tracked[me].alive and 0 < before <= live <= cpu.seconds(me)


def test_thread_cpu_refuses_a_thread_that_does_not_exist() -> None:
    cpu = ThreadCpu()
    with pytest.raises(ValueError, match="not a live thread"):
        cpu.register(2**31 - 7)
    with pytest.raises(KeyError):
        cpu.seconds(2**31 - 7)
    assert cpu.seconds(threading.get_native_id()) >= 0.0


def test_process_cpu_seconds_include_threads_nobody_registered() -> None:
    worker = Worker(rounds=150)
    worker.start()
    assert worker.started_up.wait(10)
    assert worker.native is not None
    cpu = ThreadCpu()
    cpu.register(worker.native)  # only to know what the worker used; the process sees it anyway
    before = process_cpu_seconds()
    worker.go.set()
    assert worker.done.wait(30)
    used = cpu.total()
    assert used > 0.0
    # Kernel ticks are 10 ms: allow one either side.
    assert process_cpu_seconds() - before >= used - 0.011
    worker.finish.set()
    worker.join(10)
