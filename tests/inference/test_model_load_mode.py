"""The pool reads a model's weights into the process; it never maps the file.

A mapped file changed on disk afterwards (in place, same inode) was served at once, under the
hash pinned at load: the pool's file stamp and load lock guard the load, not what a mapping
reads later. Checked on the real small model of models.lock, as llama.cpp loaded it: its load
mode, and the process's own memory map (where a mapped model file shows by its path).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import llama_cpp
import pytest

from appliance.domain.inference import InferenceRequest, Tier
from appliance.inference.pool import InferencePool
from tests.inference.models import spec


def is_mapped(path: Path) -> bool:
    """Whether the file at `path` is mapped into this process's memory."""
    real = os.path.realpath(path)
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].removesuffix(" (deleted)") == real:
            return True
    return False


@pytest.fixture
async def mechanical() -> AsyncIterator[InferencePool]:
    pool = InferencePool([spec(Tier.MECHANICAL)], cores=2)
    await pool.start()
    try:
        yield pool
    finally:
        await pool.close()


async def test_the_loaded_model_is_read_into_the_process_not_mapped(
    mechanical: InferencePool,
) -> None:
    tier = mechanical._tiers[Tier.MECHANICAL]
    (worker,) = tier.workers
    assert worker.alive and worker.llama is not None
    # What the pool asked llama.cpp for: the weights read, neither mapped nor locked in memory.
    assert worker.llama.model_params.load_mode == llama_cpp.LLAMA_LOAD_MODE_NONE
    # And what it did: the model's file is nowhere in the process's memory map.
    assert not is_mapped(tier.spec.path), f"{tier.spec.path} is mapped into the process"
    # It serves from the copy it read.
    answer = await mechanical.infer(
        InferenceRequest("extract", prompt="Once upon a time,", max_tokens=4), Tier.MECHANICAL
    )
    assert answer.completion_tokens >= 1
