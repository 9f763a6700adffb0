"""The start-up probe of the llama.cpp build: a build that cannot run on this CPU is refused
with its cause named, before the appliance's process loads (and dies of) it.

The passing case runs the real probe on the real build and the small model of models.lock. The
failing cases run real child processes that die of the real signals a wrong build dies of."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from appliance.domain.errors import ConfigurationError
from appliance.domain.inference import Tier
from appliance.inference.build_probe import cpu_features, judge, probe_argv
from tests.inference.models import spec


def dies_of(name: str) -> list[str]:
    return [sys.executable, "-c", f"import os, signal; os.kill(os.getpid(), signal.{name})"]


def test_the_installed_build_passes_on_this_cpu() -> None:
    # The build scripts/lib/bootstrap.sh made: it must run here (it did not, with AVX-512 on
    # a CPU without it, and every model test died with the whole pytest process).
    judge(probe_argv(spec(Tier.MECHANICAL).path))


def test_a_build_that_dies_of_sigill_is_refused_naming_the_cpu() -> None:
    with pytest.raises(ConfigurationError) as caught:
        judge(dies_of("SIGILL"))
    text = str(caught.value)
    assert "SIGILL" in text and "CPU instructions this machine does not have" in text
    features = cpu_features()
    assert features is not None and f"this CPU has: {' '.join(features)}" in text
    assert "scripts/lib/bootstrap.sh" in text


def test_a_build_that_crashes_otherwise_is_refused_naming_the_signal() -> None:
    with pytest.raises(ConfigurationError, match="crashed \\(SIGSEGV\\)"):
        judge(dies_of("SIGSEGV"))


def test_a_probe_that_only_fails_is_left_to_the_load(caplog: pytest.LogCaptureFixture) -> None:
    # A bad file or a full memory is the load's to report, per worker; not a refusal here.
    judge([sys.executable, "-c", "raise SystemExit('no such model')"])
    assert "no such model" in caplog.text


def test_cpu_features_reads_the_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 fma f16c\nbugs\t: x\n")
    assert cpu_features(info) == ["sse4_2", "avx", "avx2", "fma", "f16c"]
    assert cpu_features(tmp_path / "missing") is None
