"""How the pool evaluates a long prompt in chunks before its completion (the model faked: the
real one is in tests/inference/test_pool.py): from the prefix already evaluated, or from the
start where the model cannot drop part of its state (recurrent models)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from appliance.domain.inference import InferenceRequest
from appliance.inference.pool import PROMPT_CHUNK, _Job, _Stop, _Worker


@dataclass
class FakeContext:
    partial_removal: bool
    removed: list[int] = field(default_factory=list)

    def kv_cache_seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        self.removed.append(p0)
        return self.partial_removal or p0 == 0


@dataclass
class FakeLlama:
    """What _evaluate_prompt uses of a Llama: the evaluated tokens and eval/reset."""

    input_ids: list[int]
    partial_removal: bool = True
    n_batch: int = 512
    evals: list[tuple[int, int]] = field(default_factory=list)  # (from position, tokens)

    def __post_init__(self) -> None:
        self.n_tokens = len(self.input_ids)
        self._ctx = FakeContext(self.partial_removal)

    def eval(self, tokens: list[int]) -> None:
        self.evals.append((self.n_tokens, len(tokens)))
        self.input_ids[self.n_tokens :] = tokens
        self.n_tokens += len(tokens)

    def reset(self) -> None:
        self.n_tokens = 0


@dataclass
class FakeWorker:
    n_gpu_layers: int = 0


def job() -> _Job:
    loop = asyncio.new_event_loop()
    try:
        return _Job(InferenceRequest("x", prompt="p"), loop, loop.create_future(), 0.0, None, None)
    finally:
        loop.close()


def evaluate(
    llama: FakeLlama, tokens: list[int], the_job: _Job | None = None, gpu: bool = False
) -> None:
    worker: Any = FakeWorker(n_gpu_layers=-1 if gpu else 0)
    model: Any = llama
    _Worker._evaluate_prompt(worker, model, tokens, the_job or job(), 0.0, None)


PROMPT = list(range(1000, 1400))  # 400 tokens


def test_it_evaluates_from_the_prefix_already_evaluated_in_chunks() -> None:
    llama = FakeLlama([*PROMPT[:50], 7, 8, 9])
    evaluate(llama, PROMPT)
    # All but the last token (the completion evaluates it, and samples), from token 50.
    assert llama.evals == [(50, PROMPT_CHUNK), (178, PROMPT_CHUNK), (306, 93)]
    assert llama.n_tokens == 399 and llama.input_ids[:399] == PROMPT[:399]
    assert llama._ctx.removed == [50]


def test_a_model_that_cannot_drop_part_of_its_state_starts_afresh() -> None:
    # Recurrent models (Mamba, RWKV, hybrids): continuing at 50 would leave the state of the
    # three old tokens in place, and llama.cpp would refuse the next decode.
    llama = FakeLlama([*PROMPT[:50], 7, 8, 9], partial_removal=False)
    evaluate(llama, PROMPT)
    assert llama.evals[0] == (0, PROMPT_CHUNK) and llama.n_tokens == 399
    assert llama.input_ids[:399] == PROMPT[:399]


def test_a_short_prompt_is_evaluated_in_one_chunk_and_a_cached_one_not_at_all() -> None:
    # Never inside the completion: it then evaluates the last token alone, as it does when a
    # repeat finds the prompt cached, so both compute its logits alike (the same greedy text).
    short = FakeLlama([])
    evaluate(short, PROMPT[: PROMPT_CHUNK + 1])
    assert short.evals == [(0, PROMPT_CHUNK)]
    partly = FakeLlama(PROMPT[:300])
    evaluate(partly, PROMPT)  # 99 new tokens: one chunk
    assert partly.evals == [(300, 99)]
    cached = FakeLlama([*PROMPT, 5, 6])  # the prompt and a former answer's tokens
    evaluate(cached, PROMPT)
    assert cached.evals == [] and cached.n_tokens == len(PROMPT) + 2


def test_a_cancel_stops_it_between_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    the_job = job()
    llama = FakeLlama([])
    evals = 0
    original = FakeLlama.eval

    def eval_then_cancel(self: FakeLlama, tokens: list[int]) -> None:
        nonlocal evals
        evals += 1
        original(self, tokens)
        the_job.cancel.set()

    monkeypatch.setattr(FakeLlama, "eval", eval_then_cancel)
    with pytest.raises(_Stop) as stop:
        evaluate(llama, PROMPT, the_job)
    assert stop.value.why == "cancelled" and evals == 1


def test_on_a_gpu_the_chunks_are_llama_cpps_own_batch() -> None:
    llama = FakeLlama([], n_batch=256)
    evaluate(llama, PROMPT, gpu=True)
    assert llama.evals == [(0, 256), (256, 143)]
