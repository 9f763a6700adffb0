"""The llama.cpp pool with the real small models on CPU: parallel workers, bounded queues,
deadlines, cancellation between tokens, constrained output, and surviving a failed call."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import shutil
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import pytest

from appliance import runtime
from appliance.domain.errors import ConfigurationError
from appliance.domain.inference import (
    ENERGY_LIMIT,
    CallCancelled,
    CallControl,
    CapabilityUnavailable,
    ChatMessage,
    DeadlineExceeded,
    InferenceError,
    InferenceRequest,
    QueueFull,
    Tier,
)
from appliance.domain.pipeline import parse_output
from appliance.inference import pool as pool_module
from appliance.inference.cache import file_stamp
from appliance.inference.lockfile import load_lock
from appliance.inference.pool import InferencePool
from appliance.metering.meter import Meter
from appliance.metering.sources import EstimateSource, ThreadCpu, process_cpu_seconds
from appliance.pipelines.support import CLASSIFY_PROMPT, TicketLabel
from appliance.settings import Settings
from tests.inference.models import LOCK, spec

# A prompt the models keep writing after: long generations for the timing tests.
RAMBLE = "Here is a very long story about a dragon, told in great detail. Once upon a time,"

TICKETS = [
    ("Charged twice", "My card was charged twice for the same order."),
    ("App crash", "The mobile app crashes when I open my profile."),
    ("Password", "I cannot reset my password; the link has expired."),
    ("Dark mode", "Please add a dark mode to the web dashboard."),
    ("Refund", "I returned the item two weeks ago and still have no refund."),
    ("Error 500", "The export page shows error 500 since the last update."),
    ("Email change", "How do I change the email address of my account?"),
    ("CSV export", "It would help a lot to export reports as CSV files."),
    ("Invoice", "Can you send me an invoice with our company VAT number?"),
    ("Slow", "Search takes a minute to return anything today."),
    ("Two factor", "I lost my phone and cannot log in with two-factor codes."),
    ("API limits", "Could you raise the API rate limit for enterprise plans?"),
    ("Opening hours", "What are your support opening hours at Christmas?"),
    ("Price", "Why did the monthly price go up without notice?"),
    ("Sync", "Files I save on my laptop never appear on my phone."),
    ("Delete", "Please delete my account and all my data."),
    ("Integrations", "Do you plan a Slack integration?"),
    ("Broken link", "The link in your welcome email goes to a 404 page."),
    ("Partnership", "We would like to discuss a reseller partnership."),
    ("Coupon", "My discount code was not applied at checkout."),
]


@pytest.fixture
async def mechanical2() -> AsyncIterator[InferencePool]:
    """Two workers on the mechanical tier, one thread each (2 cores), a queue of 1."""
    pool = InferencePool([spec(Tier.MECHANICAL, workers=2, queue=1)], cores=2)
    await pool.start()
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def mechanical1() -> AsyncIterator[InferencePool]:
    pool = InferencePool([spec(Tier.MECHANICAL, workers=1, queue=4)], cores=2)
    await pool.start()
    try:
        yield pool
    finally:
        await pool.close()


def ramble(max_tokens: int = 48, stop: tuple[str, ...] = ()) -> InferenceRequest:
    return InferenceRequest(
        "extract", prompt=RAMBLE, max_tokens=max_tokens, temperature=0.0, stop=stop
    )


async def test_a_greedy_call_repeated_gives_the_same_text(mechanical1: InferencePool) -> None:
    # The first call meets an empty cache, its repeats find their prompt cached: the last
    # prompt token's logits must be computed alike either way. Computed within the prompt's
    # batch on the first call, they forked its text from its repeats' after a dozen tokens.
    texts = [(await mechanical1.infer(ramble(64), Tier.MECHANICAL)).text for _ in range(3)]
    assert texts[0] and texts[0] == texts[1] == texts[2], texts


async def test_two_workers_serve_in_parallel_and_a_third_waits(
    mechanical2: InferencePool,
) -> None:
    results = await asyncio.gather(
        *(mechanical2.infer(ramble(), Tier.MECHANICAL) for _ in range(3))
    )
    spans = sorted(mechanical2.spans(Tier.MECHANICAL), key=lambda s: s.start)
    assert len(spans) == 3
    first, second, third = spans
    # The first two ran at the same time, on different workers (overlapping windows).
    assert first.worker != second.worker
    assert second.start < first.end and first.start < second.end
    # The third waited for a free worker: it started after one of them ended.
    assert third.start >= min(first.end, second.end)
    assert max(r.queue_seconds for r in results) > 0
    # No instance was ever used by two threads, nor twice at once.
    by_instance: dict[int, list[tuple[float, float, int]]] = {}
    for s in spans:
        by_instance.setdefault(s.instance, []).append((s.start, s.end, s.thread))
    assert len(by_instance) == 2
    for uses in by_instance.values():
        assert len({thread for _, _, thread in uses}) == 1
        uses.sort()
        for (_, end, _), (start, _, _) in itertools.pairwise(uses):
            assert start >= end


async def test_a_full_queue_refuses_instead_of_queueing(mechanical2: InferencePool) -> None:
    assert mechanical2.capacity(Tier.MECHANICAL) == 3
    calls = [asyncio.create_task(mechanical2.infer(ramble(), Tier.MECHANICAL)) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert mechanical2.room(Tier.MECHANICAL) == 0
    with pytest.raises(QueueFull):
        await mechanical2.infer(ramble(), Tier.MECHANICAL)
    await asyncio.gather(*calls)
    assert mechanical2.room(Tier.MECHANICAL) == 3
    assert mechanical2.stats()["mechanical"]["requests_refused"] == 1  # counted, as in status


async def test_constrained_classification_returns_a_label_for_every_ticket(
    mechanical1: InferencePool,
) -> None:
    schema = TicketLabel.model_json_schema()
    labels = []
    for subject, body in TICKETS:
        result = await mechanical1.infer(
            InferenceRequest(
                "classify",
                prompt=CLASSIFY_PROMPT.format(subject=subject, body=body),
                json_schema=schema,
                max_tokens=24,
            ),
            Tier.MECHANICAL,
        )
        labels.append(parse_output(result.text, TicketLabel).label)
    assert len(labels) == 20
    assert set(labels) <= {"billing", "bug", "account", "feature", "other"}


async def test_chat_with_a_schema_returns_valid_json(mechanical1: InferencePool) -> None:
    result = await mechanical1.infer(
        InferenceRequest(
            "extract",
            messages=(ChatMessage("user", "Give the city of: 'I live in Paris.'"),),
            json_schema={
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
            },
            max_tokens=32,
        ),
        Tier.MECHANICAL,
    )
    assert isinstance(json.loads(result.text)["city"], str)
    assert result.prompt_tokens > 0 and result.completion_tokens > 0


async def test_a_request_whose_deadline_passes_in_the_queue_is_refused_unrun(
    mechanical1: InferencePool,
) -> None:
    long = asyncio.create_task(mechanical1.infer(ramble(120), Tier.MECHANICAL))
    await asyncio.sleep(0.05)
    control = CallControl(start_deadline=time.monotonic() + 0.2)
    with pytest.raises(DeadlineExceeded, match="refused"):
        await mechanical1.infer(ramble(8), Tier.MECHANICAL, control)
    await long
    stats = mechanical1.stats()["mechanical"]
    assert stats["requests_refused"] == 1
    assert stats["requests_total"] == 1  # only the long one ran
    assert len(mechanical1.spans(Tier.MECHANICAL)) == 1
    # A deadline already past is refused before it is queued.
    with pytest.raises(DeadlineExceeded):
        await mechanical1.infer(
            ramble(8), Tier.MECHANICAL, CallControl(start_deadline=time.monotonic() - 1)
        )


async def test_cancellation_stops_generation_within_a_few_tokens(
    mechanical1: InferencePool,
) -> None:
    cancel = asyncio.Event()
    loop = asyncio.get_running_loop()
    at_cancel: list[int] = []

    def progress(tokens: int) -> None:
        # Worker thread: ask for cancellation once 5 tokens are out.
        if tokens == 5:
            at_cancel.append(tokens)
            loop.call_soon_threadsafe(cancel.set)

    control = CallControl(cancel=cancel, on_token=progress)
    with pytest.raises(CallCancelled) as info:
        await mechanical1.infer(ramble(400), Tier.MECHANICAL, control)
    assert at_cancel == [5]
    assert 5 <= info.value.tokens <= 5 + 4, info.value.tokens
    # What it used rides on the error, for the run budget and the record (settled as 0).
    assert info.value.completion_tokens == info.value.tokens
    assert info.value.prompt_tokens is not None and info.value.prompt_tokens > 0
    # The worker is free again at once and serves the next request.
    after = await mechanical1.infer(ramble(4), Tier.MECHANICAL)
    assert after.completion_tokens >= 1
    assert mechanical1.stats()["mechanical"]["requests_cancelled"] == 1


async def test_a_call_timeout_stops_generation(mechanical1: InferencePool) -> None:
    with pytest.raises(DeadlineExceeded, match="ran past its timeout") as info:
        await mechanical1.infer(ramble(400), Tier.MECHANICAL, CallControl(timeout=0.3))
    assert info.value.prompt_tokens is not None and info.value.prompt_tokens > 0
    assert info.value.completion_tokens is not None


async def test_a_call_ends_by_the_end_its_caller_set_however_long_it_queued(
    mechanical1: InferencePool,
) -> None:
    # The timeout counts from the call's start; a stage's time left is an end. Queued behind
    # another call, it ran past that end by its time in the queue.
    ahead = asyncio.ensure_future(
        mechanical1.infer(ramble(400), Tier.MECHANICAL, CallControl(timeout=0.5))
    )
    await asyncio.sleep(0.05)  # the first one holds the only worker
    sent = time.monotonic()
    end = sent + 1.0
    with pytest.raises(DeadlineExceeded, match="ran past its timeout"):
        await mechanical1.infer(
            ramble(400), Tier.MECHANICAL, CallControl(timeout=1.0, finish_by=end)
        )
    assert time.monotonic() - sent < 1.3  # it queued about 0.45 s; it used to end at ~1.45 s
    with pytest.raises(DeadlineExceeded):
        await ahead


async def test_a_failing_call_leaves_the_pool_serving(mechanical1: InferencePool) -> None:
    # More tokens than the context holds, a schema llama.cpp cannot make a grammar of, a token
    # callback that raises: each fails its call, named, and the model is not reloaded for it
    # (it was, once per bad request: seconds for a large model, the worker held meanwhile).
    huge = InferenceRequest("extract", prompt="word " * 3000, max_tokens=8)
    with pytest.raises(InferenceError, match=r"the prompt is \d+ tokens, the context holds 1024"):
        await mechanical1.infer(huge, Tier.MECHANICAL)
    odd = InferenceRequest(
        "extract", prompt="Hi", max_tokens=4, json_schema={"type": "no-such-type"}
    )
    with pytest.raises(InferenceError, match="the request cannot be run"):
        await mechanical1.infer(odd, Tier.MECHANICAL)

    def explode(_n: int) -> None:
        raise RuntimeError("meter gone")

    with pytest.raises(InferenceError, match="the token callback raised RuntimeError"):
        await mechanical1.infer(ramble(8), Tier.MECHANICAL, control=CallControl(on_token=explode))
    ok = await mechanical1.infer(ramble(4), Tier.MECHANICAL)
    assert ok.completion_tokens >= 1
    stats = mechanical1.stats()["mechanical"]
    assert stats["requests_failed"] == 3
    assert stats["rebuilds"] == 0
    assert stats["workers_alive"] == 1
    assert mechanical1.health()["mechanical"]["up"]


async def test_a_call_stops_at_the_energy_its_reservation_paid_for() -> None:
    # The estimate source on this machine (no counters here): real thread CPU time, labelled.
    meter = Meter(
        EstimateSource(10.0, 15.0, process_cpu_seconds, time.monotonic()),
        ThreadCpu(),
        {"cpu": 10.0},
    )
    pool = InferencePool([spec(Tier.MECHANICAL, workers=1, queue=4)], cores=2, meter=meter)
    await pool.start()
    try:
        whole = await pool.infer(ramble(64), Tier.MECHANICAL)
        assert whole.completion_tokens == 64 and whole.finish_reason == "length"
        assert whole.energy_joules is not None and whole.energy_joules > 0
        # A reservation that paid for a third of what the whole generation used (the joules
        # per token behind it too low): the generation stops before its energy passes it.
        limit = whole.energy_joules / 3
        cut = await pool.infer(ramble(64), Tier.MECHANICAL, CallControl(energy_limit=limit))
        assert cut.finish_reason == ENERGY_LIMIT
        assert cut.energy_joules is not None and 0 < cut.energy_joules <= limit
        assert 0 < cut.completion_tokens < 64
        # What it wrote until then is kept (greedy: the same start as the whole answer).
        assert cut.text and whole.text.startswith(cut.text), (cut.text, whole.text)
        # The model's state was reset: the next call is whole and the same again.
        again = await pool.infer(ramble(64), Tier.MECHANICAL, CallControl(energy_limit=1e9))
        assert again.finish_reason == "length" and again.text == whole.text
        stats = pool.stats()["mechanical"]
        assert stats["requests_failed"] == 0 and stats["rebuilds"] == 0
    finally:
        await pool.close()


@dataclass
class _Figure:
    joules: float
    provenance: str = "estimated"


class ClockMeter:
    """A meter charging `watts` times the seconds since a call began; `used` may fail."""

    def __init__(self, watts: float, *, used_fails: bool = False) -> None:
        self.watts, self.used_fails = watts, used_fails
        self.began: dict[str, float] = {}
        self.devices: list[str] = []

    def begin(self, call_id: str, native_id: int, threads: int = 1, *, device: str = "cpu") -> None:
        self.began[call_id] = time.monotonic()
        self.devices.append(device)

    def used(self, call_id: str) -> float:
        if self.used_fails:
            raise OSError("counter gone")
        return self.watts * (time.monotonic() - self.began[call_id])

    def end(self, call_id: str) -> _Figure:
        return _Figure(self.watts * (time.monotonic() - self.began.pop(call_id)))


@pytest.mark.parametrize(("offload", "layers", "device"), [(False, -1, "cpu"), (True, 0, "cpu"),
                                                           (True, -1, "gpu")])  # fmt: skip
async def test_the_pool_tells_the_meter_which_device_a_call_computes_on(
    monkeypatch: pytest.MonkeyPatch, offload: bool, layers: int, device: str
) -> None:
    # Which counter may charge a call depends on it: a CPU tier's call given a share of the
    # GPU counter's energy was labelled measured. (This build has no GPU backend: with one
    # claimed, llama.cpp ignores the layers it cannot offload, and the call runs all the same.)
    monkeypatch.setattr(pool_module, "gpu_offload_supported", lambda: offload)
    meter = ClockMeter(1.0)
    pool = InferencePool([spec(Tier.MECHANICAL, n_gpu_layers=layers)], cores=2, meter=meter)
    await pool.start()
    try:
        await pool.infer(ramble(2), Tier.MECHANICAL)
    finally:
        await pool.close()
    assert meter.devices == [device]


async def test_a_generation_that_ended_is_never_cut_after_the_fact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # llama-cpp-python asks its stopping criteria once more after its loop has ended (at
    # max_tokens, a stop string, the end of generation), with the last token not evaluated.
    # A guard that would trip just then must not turn a whole answer into a cut one.
    ended = threading.Event()
    generate = llama_cpp.Llama.generate

    def marked(self: llama_cpp.Llama, *args: Any, **kwargs: Any) -> Any:
        try:
            yield from generate(self, *args, **kwargs)
        finally:
            ended.set()  # the completion's loop is over

    class TripsLate:
        def __init__(self, limit: float, *_: object, **__: object) -> None:
            self.limit, self.used = limit, 0.0

        def stop(self, now: float, tokens: int) -> bool:
            return ended.is_set()

    monkeypatch.setattr(llama_cpp.Llama, "generate", marked)
    monkeypatch.setattr(pool_module, "EnergyGuard", TripsLate)
    pool = InferencePool([spec(Tier.MECHANICAL)], cores=2, meter=ClockMeter(1.0))
    await pool.start()
    try:
        for request in (ramble(8), ramble(8, stop=("dragon",))):
            whole = await pool.infer(request, Tier.MECHANICAL)
            ended.clear()
            late = await pool.infer(request, Tier.MECHANICAL, CallControl(energy_limit=1e6))
            ended.clear()
            assert whole.finish_reason in {"length", "stop"}
            assert (late.finish_reason, late.text, late.completion_tokens) == (
                whole.finish_reason, whole.text, whole.completion_tokens,
            )  # fmt: skip
    finally:
        await pool.close()


async def test_a_meter_that_cannot_be_read_mid_call_stops_the_call() -> None:
    pool = InferencePool([spec(Tier.MECHANICAL)], cores=2, meter=ClockMeter(1.0, used_fails=True))
    await pool.start()
    try:
        result = await pool.infer(ramble(16), Tier.MECHANICAL, CallControl(energy_limit=1e-6))
        # Left unchecked, it ran whole and settled past its hold at the energy read at its end.
        # Three failed readings in a row stop it, its text so far kept, its energy still read.
        assert result.finish_reason == "energy_limit" and result.completion_tokens < 16
        assert result.energy_joules is not None
    finally:
        await pool.close()


def listing(tag: str, items: int) -> InferenceRequest:
    """A long prompt (about 8 tokens an item), starting with `tag` so that no call reuses
    another's evaluated prompt."""
    body = " ".join(f"item {i} is {(i * 7 + len(tag)) % 13}." for i in range(items))
    return InferenceRequest("extract", prompt=f"{tag}: {body} Summary:", max_tokens=8)


async def test_a_long_prompt_is_evaluated_in_chunks_to_the_same_answer(
    mechanical1: InferencePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    evaluated: list[int] = []
    evaluate = llama_cpp.Llama.eval

    def counted(self: llama_cpp.Llama, tokens: Any) -> None:
        evaluated.append(len(tokens))
        evaluate(self, tokens)

    monkeypatch.setattr(llama_cpp.Llama, "eval", counted)
    chunked = await mechanical1.infer(listing("Alpha", 40), Tier.MECHANICAL)
    assert chunked.prompt_tokens > 2 * pool_module.PROMPT_CHUNK
    assert evaluated[0] == pool_module.PROMPT_CHUNK  # in chunks...
    # ...that the completion reuses: each prompt token is evaluated once.
    assert sum(evaluated) <= chunked.prompt_tokens + chunked.completion_tokens
    monkeypatch.setattr(pool_module, "PROMPT_CHUNK", 10**6)  # as before: in one go
    whole = await mechanical1.infer(listing("Alpha", 40), Tier.MECHANICAL)
    # The same answer, bit for bit on this model. (llama.cpp's CPU kernels for some K-quants
    # round differently with a batch's shape, so there greedy answers may part after a few
    # tokens: as they already did with how much of a prompt was cached.)
    assert whole.text == chunked.text and whole.prompt_tokens == chunked.prompt_tokens


async def test_a_cancel_or_a_timeout_stops_a_long_prompts_evaluation(
    mechanical1: InferencePool,
) -> None:
    # Inside llama.cpp one evaluation cannot be stopped: between two chunks it can.
    whole_s = (await mechanical1.infer(listing("Beta", 60), Tier.MECHANICAL)).ttft_seconds
    cancel = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.call_later(0.2, cancel.set)
    began = time.monotonic()
    with pytest.raises(CallCancelled, match="after 0 tokens"):
        await mechanical1.infer(listing("Gamma", 60), Tier.MECHANICAL, CallControl(cancel=cancel))
    assert time.monotonic() - began < whole_s * 0.75, whole_s
    began = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="ran past its timeout"):
        await mechanical1.infer(listing("Delta", 60), Tier.MECHANICAL, CallControl(timeout=0.2))
    assert time.monotonic() - began < whole_s * 0.75, whole_s
    ok = await mechanical1.infer(ramble(4), Tier.MECHANICAL)  # the worker serves on
    assert ok.completion_tokens >= 1


async def test_a_long_prompts_evaluation_stops_at_the_energy_its_hold_paid_for() -> None:
    meter = ClockMeter(10.0)
    pool = InferencePool([spec(Tier.MECHANICAL)], cores=2, meter=meter)
    await pool.start()
    try:
        first = await pool.infer(listing("Epsilon", 60), Tier.MECHANICAL)
        assert first.energy_joules is not None
        # Room for about a third of the prompt's evaluation.
        limit = first.energy_joules / 3
        cut = await pool.infer(
            listing("Zeta", 60), Tier.MECHANICAL, CallControl(energy_limit=limit)
        )
        assert cut.finish_reason == ENERGY_LIMIT and cut.completion_tokens == 0
        assert cut.text == "" and cut.prompt_tokens > 2 * pool_module.PROMPT_CHUNK
        assert cut.energy_joules is not None and cut.energy_joules <= limit
    finally:
        await pool.close()


async def test_stats_mirror_llama_server_names(mechanical1: InferencePool) -> None:
    result = await mechanical1.infer(ramble(6), Tier.MECHANICAL)
    stats = mechanical1.stats()["mechanical"]
    for name in (
        "requests_processing",
        "requests_deferred",
        "prompt_tokens_total",
        "tokens_predicted_total",
        "prompt_seconds_total",
        "tokens_predicted_seconds_total",
        "busy_workers",
    ):
        assert name in stats
    assert stats["prompt_tokens_total"] == result.prompt_tokens
    assert stats["tokens_predicted_total"] == result.completion_tokens
    assert result.ttft_seconds > 0 and result.total_seconds >= result.ttft_seconds


async def test_a_tier_that_is_down_refuses_and_can_come_back() -> None:
    pool = InferencePool([spec(Tier.MECHANICAL)], cores=2)
    await pool.start()
    try:
        assert pool.available() == frozenset({Tier.MECHANICAL})
        with pytest.raises(CapabilityUnavailable):
            await pool.infer(InferenceRequest("draft", prompt="Hi", max_tokens=4), Tier.REASONING)
        changes: list[int] = []
        pool.subscribe(lambda: changes.append(1))
        await pool.start_tier(spec(Tier.REASONING))
        assert pool.available() == frozenset({Tier.MECHANICAL, Tier.REASONING})
        drafted = await pool.infer(
            InferenceRequest("draft", prompt="Dear customer,", max_tokens=4), Tier.REASONING
        )
        assert drafted.model == spec(Tier.REASONING).model
        await pool.stop_tier(Tier.REASONING)
        await asyncio.sleep(0.05)
        assert pool.available() == frozenset({Tier.MECHANICAL})
        assert changes
    finally:
        await pool.close()


def test_threads_never_exceed_the_cores() -> None:
    with pytest.raises(ConfigurationError, match="more than the 2 cores"):
        InferencePool([spec(Tier.MECHANICAL, workers=2, n_threads=2)], cores=2)
    # Left to itself, the pool splits the cores over every worker.
    pool = InferencePool(
        [spec(Tier.MECHANICAL, n_threads=None), spec(Tier.REASONING, n_threads=None)], cores=2
    )
    assert [t["n_threads"] for t in pool.stats().values()] == [1, 1]


async def test_a_model_file_changed_since_it_was_verified_is_never_loaded(tmp_path: Path) -> None:
    # A worker rebuilt after a failed call loaded the file again unchecked: a file swapped
    # since the start was served under the pinned hash. Every load checks its stamp.
    good = spec(Tier.MECHANICAL)
    copy = tmp_path / good.path.name
    shutil.copyfile(good.path, copy)
    stamped = dataclasses.replace(good, path=copy, file_stamp=file_stamp(copy))
    pool = InferencePool([stamped], cores=2)
    await pool.start()
    try:
        assert pool.health()["mechanical"]["up"]
        with copy.open("r+b") as f:  # one byte flipped, as by a bad disk or a swapped file
            f.seek(4096)
            byte = f.read(1)
            f.seek(4096)
            f.write(bytes([byte[0] ^ 0xFF]))
        # Loaded again (as a worker is rebuilt after a call fails): refused, never served.
        await pool.stop_tier(Tier.MECHANICAL)
        await pool.start_tier(stamped)
        assert not pool.health()["mechanical"]["up"]
        assert "changed since it was verified" in str(pool.health()["mechanical"])
    finally:
        await pool.close()


def test_one_file_declared_as_two_tiers_is_refused(tmp_path: Path) -> None:
    # The mechanical model registered again as "reasoning" served reasoning work under another
    # name: a downgrade nothing showed.
    lock = tmp_path / "models.lock"
    text = LOCK.read_text()
    start = text.index("[[models]]")
    end = text.index("[[models]]", start + 1)
    twin = (
        text[start:end]
        .replace('name = "smollm2-135m-instruct-q4_1"', 'name = "smollm2-as-reasoning"')
        .replace('tier = "mechanical"', 'tier = "reasoning"')
    )
    lock.write_text(text + "\n" + twin)
    with pytest.raises(ConfigurationError, match=r"as smollm2-135m-instruct-q4_1 \(mechanical\)"):
        load_lock(lock)


async def test_a_model_file_swapped_while_it_waited_to_load_is_not_loaded(
    tmp_path: Path,
) -> None:
    # The file was checked before the load lock was taken; one swapped while another model
    # loaded was then loaded unchecked. And a writer that sets the modification time back no
    # longer passes: the change time is in the stamp.
    good = spec(Tier.MECHANICAL)
    copy = tmp_path / good.path.name
    shutil.copyfile(good.path, copy)
    stamped = dataclasses.replace(good, path=copy, file_stamp=file_stamp(copy))
    before = copy.stat()
    with copy.open("r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(copy, ns=(before.st_atime_ns, before.st_mtime_ns))  # modification time set back
    pool = InferencePool([stamped], cores=2)
    with pool_module._LOAD_LOCK:  # another model loading: the start waits here
        starting = asyncio.ensure_future(pool.start())
        await asyncio.sleep(0.2)
    try:
        await starting
        assert not pool.health()["mechanical"]["up"]
        assert "changed since it was verified" in str(pool.health()["mechanical"])
    finally:
        await pool.close()


def test_a_stronger_model_serves_the_weaker_tier_a_profile_gives_it(tmp_path: Path) -> None:
    lock = tmp_path / "models.lock"
    lock.write_text(
        LOCK.read_text()
        + '\n[profiles.up]\nmechanical = "gemma3-270m-q4_k_m"\nreasoning = "gemma3-270m-q4_k_m"\n'
    )
    settings = Settings(inference={"profile": "up", "lock": lock})  # type: ignore[arg-type]
    specs = runtime.tier_specs(settings)
    assert [(s.tier, s.model) for s in specs] == [
        (Tier.MECHANICAL, "gemma3-270m-q4_k_m"),
        (Tier.REASONING, "gemma3-270m-q4_k_m"),
    ]
