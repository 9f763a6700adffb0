"""Auto metering takes the GPU's energy counter only when a model tier runs on the GPU.

With every tier on the CPU, the GPU counter charged each call the GPU's idle power, labelled
measured, and the CPU's own energy not at all. These tests go through the runtime's own
`build_meter` from settings and models.lock: an NVML binding that answers (there is no GPU
here) and no powercap counters, so the choice shows which way the runtime decided.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from appliance import runtime
from appliance.domain.inference import Tier
from appliance.metering import sources
from appliance.metering.sources import NvmlSource, RaplSource
from appliance.settings import InferenceSettings, MeteringSettings, Settings, TierSettings


class AnsweringNvml:
    """An NVML binding with one GPU whose energy counter reads 5 J."""

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        return 5_000


@pytest.fixture
def counters(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A usable GPU counter, no RAPL, and a llama.cpp build with a GPU backend."""
    monkeypatch.setattr(sources, "NvmlSource", lambda: NvmlSource(module=AnsweringNvml()))
    monkeypatch.setattr(sources, "RaplSource", lambda: RaplSource(tmp_path / "no-powercap"))
    monkeypatch.setattr(runtime, "gpu_offload_supported", lambda: True)


def settings(mechanical_gpu_layers: int, reasoning_gpu_layers: int) -> Settings:
    tiers = {
        Tier.MECHANICAL: TierSettings(n_gpu_layers=mechanical_gpu_layers),
        Tier.REASONING: TierSettings(n_gpu_layers=reasoning_gpu_layers),
    }
    return Settings(
        inference=InferenceSettings(tiers=tiers), metering=MeteringSettings(source="auto")
    )


@pytest.mark.usefixtures("counters")
def test_every_tier_on_the_cpu_is_metered_without_the_gpu_counter(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert sources.NvmlSource().available()[0]  # the counter is there to be taken
    caplog.set_level(logging.INFO, logger="appliance.runtime")
    meter = runtime.build_meter(settings(0, 0))
    assert meter.source.name == "estimate"
    assert meter.source.provenance == "estimated"
    assert "energy source nvml not used: no model tier runs on the GPU" in caplog.text


@pytest.mark.usefixtures("counters")
def test_a_tier_on_the_gpu_is_metered_by_the_gpu_counter() -> None:
    meter = runtime.build_meter(settings(0, -1))  # the reasoning tier offloads every layer
    assert meter.source.name == "nvml"
    assert meter.source.provenance == "measured"
    assert runtime.build_meter(settings(12, 0)).source.name == "nvml"


@pytest.mark.usefixtures("counters")
def test_gpu_layers_asked_of_a_build_without_a_gpu_backend_run_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # llama.cpp built for the CPU only ignores n_gpu_layers: the models run on the CPU.
    monkeypatch.setattr(runtime, "gpu_offload_supported", lambda: False)
    assert runtime.build_meter(settings(-1, -1)).source.name == "estimate"


@pytest.mark.usefixtures("counters")
def test_mixed_tiers_on_the_gpu_counter_estimate_the_cpu_tiers_calls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The mechanical tier on the CPU, the reasoning tier on the GPU: NVML counts only the
    # latter. The CPU tier's calls took a share of the GPU's energy, labelled measured.
    caplog.set_level(logging.WARNING, logger="appliance.runtime")
    meter = runtime.build_meter(settings(0, -1))
    assert meter.source.name == "nvml"
    assert meter.counts("gpu") and not meter.counts("cpu")
    assert "tier mechanical runs on the CPU, which energy source nvml does not count" in (
        caplog.text
    )
    assert "tier reasoning" not in caplog.text


@pytest.mark.usefixtures("counters")
def test_a_tier_with_no_workers_does_not_put_the_meter_on_the_gpu() -> None:
    # The GPU tier configured off: no call runs on the GPU, so its counter is not the meter's.
    s = settings(0, -1)
    s.inference.tiers[Tier.REASONING] = TierSettings(n_gpu_layers=-1, workers=0)
    assert runtime.build_meter(s).source.name == "estimate"
