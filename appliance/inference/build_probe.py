"""Start-up probe of the llama.cpp build: does it run on this CPU at all?

A build compiled for instructions the CPU lacks (AVX-512 on a CPU without it, or an image built
with -march=native on another box) dies with SIGILL on its first call, and takes the whole
process with it: the runner, its leases and every handler, again at each restart. So before
the pool loads anything, a child process initialises the build's CPU backend, loads the
smallest configured model and evaluates one token on the CPU. A child killed by a signal is a
clear refusal at start-up that names the cause; anything else the child meets (a bad file, no
memory) is left to the pool's own load, which reports it per worker.
"""

from __future__ import annotations

import functools
import logging
import signal
import subprocess
import sys
from pathlib import Path

from appliance.domain.errors import ConfigurationError

log = logging.getLogger("appliance.inference")

# The CPU features a llama.cpp x86 build may be compiled for, as /proc/cpuinfo names them.
_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx_vnni", "amx_tile")

# CPU only (n_gpu_layers=0: the CPU kernels are what a wrong build breaks); mapped, not read in,
# so a large model costs the probe page cache, not a second copy in memory.
_PROBE = """
import sys, llama_cpp
llama_cpp.llama_backend_init()
llama_cpp.llama_print_system_info()
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, n_threads_batch=1,
                      n_gpu_layers=0, use_mmap=True, verbose=False)
llm.eval(llm.tokenize(b"a", add_bos=False)[:1] or [0])
"""

PROBE_TIMEOUT_S = 120.0


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str] | None:
    """The features of `_FEATURES` this CPU reports (None where /proc/cpuinfo is unreadable)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return [f for f in _FEATURES if f in flags]
    return None


def judge(argv: list[str], *, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Run `argv` (the probe) and refuse with a ConfigurationError if a signal killed it."""
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        log.warning("the llama.cpp build probe did not finish in %.0f s; not checked", timeout)
        return
    if done.returncode >= 0:
        if done.returncode:
            # Not a crash: the pool's own load meets it too and names it per worker.
            lines = done.stderr.decode(errors="replace").strip().splitlines()
            last = lines[-1] if lines else f"exit status {done.returncode}, no output"
            log.warning("the llama.cpp build probe failed (%s); the load will say why", last)
        return
    try:
        name = signal.Signals(-done.returncode).name
    except ValueError:
        name = f"signal {-done.returncode}"
    features = cpu_features()
    has = "unknown" if features is None else " ".join(features) or "none of them"
    if name == "SIGILL":
        raise ConfigurationError(
            "the installed llama.cpp build uses CPU instructions this machine does not have"
            f" (its first call died with SIGILL); this CPU has: {has}; rebuild llama-cpp-python"
            " with the portable flags of scripts/lib/bootstrap.sh (./scripts/run does; the"
            " wheel cache is keyed by those flags), never with -march=native or GGML_AVX512"
            " for a CPU without AVX-512"
        )
    raise ConfigurationError(
        f"the installed llama.cpp build crashed ({name}) on its first call on this machine"
        f" (CPU features: {has}); no model was loaded in the appliance's process"
    )


def probe_argv(model: Path) -> list[str]:
    """The probe: this interpreter's llama.cpp build, one token of `model` on the CPU."""
    return [sys.executable, "-c", _PROBE, str(model)]


@functools.cache
def probe_build(model: Path) -> None:
    """Refuse a llama.cpp build that cannot run here, once per process and model file."""
    judge(probe_argv(model))
