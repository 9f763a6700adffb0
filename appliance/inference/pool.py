"""The in-process llama.cpp pool: per tier, worker threads that each own one `Llama` instance.

A `Llama` is not thread-safe, so each worker builds its own instance in its own thread and is
the only thread that ever touches it; ctypes releases the GIL inside llama.cpp, so workers run
truly in parallel. Each tier has a bounded queue: a request is refused when the queue is full,
refused (never run late) when it cannot start before its deadline, and stopped between tokens
(and between the chunks a long prompt is evaluated in) when cancelled, out of time, or (under a
meter) out of the energy its reservation paid for. A failed call fails that request alone
and the worker rebuilds its instance; the pool goes on serving.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import llama_chat_format
from llama_cpp.llama_grammar import LlamaGrammar

from appliance.domain.errors import ConfigurationError
from appliance.domain.inference import (
    ENERGY_LIMIT,
    CallCancelled,
    CallControl,
    CallMeter,
    CapabilityUnavailable,
    DeadlineExceeded,
    InferenceError,
    InferenceRequest,
    InferenceResult,
    ModelInfo,
    QueueFull,
    Tier,
)
from appliance.inference.build_probe import probe_build
from appliance.inference.cache import VerificationError, file_stamp, sha256_file
from appliance.inference.energy_guard import EnergyGuard
from appliance.inference.lockfile import ModelEntry

log = logging.getLogger("appliance.inference")


@dataclass(frozen=True)
class TierSpec:
    """One tier's model file and how many workers serve it, with what resources."""

    tier: Tier
    model: str
    sha256: str
    path: Path
    chat_format: str
    context_length: int
    workers: int = 1
    n_ctx: int = 2048
    n_threads: int | None = None  # None: the cores split evenly over every worker of the pool
    n_gpu_layers: int = 0
    queue: int = 8
    # The verified file's stamp (cache.file_stamp): a (re)load of a file that changed since is
    # hashed again first, and refused if it no longer matches.
    file_stamp: tuple[int, int, int, int, int] | None = None

    @classmethod
    def of(
        cls, entry: ModelEntry, path: Path, *, tier: Tier | None = None, **resources: Any
    ) -> TierSpec:
        """A pinned model whose file at `path` was verified, serving `tier` (the profile's
        tier for it, which may be below the model's own: a stronger model on a weaker tier;
        the model's own tier when not given), with `resources` (workers, n_ctx, n_threads,
        n_gpu_layers, queue) where not the defaults."""
        return cls(
            tier=tier if tier is not None else entry.tier,
            model=entry.name,
            sha256=entry.sha256,
            path=path,
            chat_format=entry.chat_format,
            context_length=entry.context_length,
            **resources,
        )


_LOAD_LOCK = threading.Lock()


def _chat_formatter(name: str) -> Callable[..., Any] | None:
    """llama.cpp's formatter of the chat format `name`, or None when it has none."""
    formatter = getattr(llama_chat_format, f"format_{name.replace('-', '_')}", None)
    return formatter if callable(formatter) else None


def chat_format_known(name: str) -> bool:
    """Whether llama.cpp has a chat format of this name (how a tier renders chat messages)."""
    return _chat_formatter(name) is not None


def gpu_offload_supported() -> bool:
    """True when this llama.cpp build has a GPU backend (CUDA, Metal, Vulkan, ...)."""
    return bool(llama_cpp.llama_supports_gpu_offload())


# A prompt longer than this many tokens is evaluated in chunks of it on a CPU (on a GPU, of
# llama.cpp's batch), with a check between them (cancel, timeout, energy). On a CPU it costs
# nothing: 128 tokens a call evaluated an 800-token prompt as fast as one call did.
PROMPT_CHUNK = 128


def _unmetered(outcome: InferenceResult | InferenceError) -> InferenceResult | InferenceError:
    """A failed call the meter did not follow: whether and how much it ran is not known (one
    stopped after the meter failed may carry no token counts), so it is charged its
    reservation, never nothing. A result without an energy figure is charged so already."""
    if isinstance(outcome, InferenceError):
        outcome.unmetered = True
    return outcome


class _Stop(Exception):
    def __init__(self, why: str, tokens: int, text: str = "") -> None:
        super().__init__(why)
        self.why = why
        self.tokens = tokens
        self.text = text  # what was generated until the stop (kept for an energy stop)
        self.limit = 0.0  # an energy stop: the joules allowed, and used when it stopped
        self.used = 0.0
        self.prompt_tokens = 0  # the prompt's, once it was tokenized

    @classmethod
    def energy(cls, guard: EnergyGuard, tokens: int, text: str) -> _Stop:
        stop = cls("energy", tokens, text)
        stop.limit, stop.used = guard.limit, guard.used
        return stop


def _stop_if_asked(job: _Job, stop_at: float | None, now: float, tokens: int) -> None:
    """Raise _Stop when the job was cancelled or ran past its timeout (`tokens` generated)."""
    if job.cancel.is_set():
        raise _Stop("cancelled", tokens)
    if stop_at is not None and now > stop_at:
        raise _Stop("timeout", tokens)


def _guard(job: _Job, started: float, paid_tokens: int | None = None) -> EnergyGuard | None:
    """The energy guard of a job run under a meter with a limit (None otherwise)."""
    if job.energy_limit is None or job.energy_limit <= 0 or job.energy_used is None:
        return None
    return EnergyGuard(job.energy_limit, job.energy_used, started, paid_tokens=paid_tokens)


class _RequestError(Exception):
    """A call that failed because of what it asked (a prompt longer than the context, a schema
    llama.cpp cannot turn into a grammar, a token callback that raised): the model is fine, so
    the worker is not rebuilt (a reload of a large model, for every bad request)."""


@dataclass(eq=False)
class _Job:
    request: InferenceRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[InferenceResult]
    enqueued: float
    start_deadline: float | None
    timeout: float | None
    on_token: Callable[[int], None] | None = None
    finish_by: float | None = None
    energy_limit: float | None = None
    # Set by the worker while the call runs under a meter: the joules charged to it so far.
    energy_used: Callable[[], float] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)

    def resolve(self, value: InferenceResult | BaseException) -> None:
        def apply() -> None:
            if self.future.done():
                return
            if isinstance(value, BaseException):
                self.future.set_exception(value)
            else:
                self.future.set_result(value)

        # A closed loop means nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(apply)


@dataclass
class TierStats:
    """Counters named as llama.cpp's server names them, plus the pool's own."""

    requests_total: int = 0
    requests_failed: int = 0
    requests_refused: int = 0
    requests_cancelled: int = 0
    prompt_tokens_total: int = 0
    tokens_predicted_total: int = 0
    prompt_seconds_total: float = 0.0
    tokens_predicted_seconds_total: float = 0.0
    ttft_seconds_last: float = 0.0
    rebuilds: int = 0


@dataclass(frozen=True)
class CallSpan:
    """Which instance ran a call, on which thread, when (kept for audits and tests)."""

    worker: str
    instance: int
    thread: int
    start: float
    end: float


class _Worker(threading.Thread):
    def __init__(self, tier: TierPool, index: int, n_threads: int, n_gpu_layers: int) -> None:
        super().__init__(name=f"llama-{tier.spec.tier.value}-{index}", daemon=True)
        self.tier = tier
        self.n_threads = n_threads
        self.n_gpu_layers = n_gpu_layers
        self.llama: llama_cpp.Llama | None = None
        self.ready = threading.Event()
        self.alive = False
        self.busy = False
        self.load_error: str | None = None
        self.calls = 0
        self._guard = threading.Lock()

    def _build(self) -> None:
        spec = self.tier.spec
        # One load at a time in the process: with verbose=False, Llama() points the process's
        # stdout/stderr at /dev/null while it loads and restores them afterwards, which is not
        # thread-safe; two loads at once can leave the whole process silenced. The file is
        # checked under the lock, right before it is read (a file swapped while this waited
        # for another load was loaded unchecked), and again once read.
        with _LOAD_LOCK:
            self._check_unchanged(spec)
            self._load(spec)
            try:
                self._check_unchanged(spec, loaded=True)
            except VerificationError:
                self._drop()
                raise

    def _check_unchanged(self, spec: TierSpec, *, loaded: bool = False) -> None:
        """Changed on disk since it was verified (a rebuild after a failed call loads it
        again): verified again, never loaded, or kept loaded, unchecked."""
        if spec.file_stamp is None or file_stamp(spec.path) == spec.file_stamp:
            return
        if loaded:
            raise VerificationError(
                f"model {spec.model} at {spec.path} changed while it was being loaded; dropped"
            )
        size, digest = sha256_file(spec.path)
        if digest != spec.sha256:
            raise VerificationError(
                f"model {spec.model} at {spec.path} changed since it was verified: sha256"
                f" {digest} ({size} bytes), pinned {spec.sha256}; not loaded"
            )

    def _load(self, spec: TierSpec) -> None:
        self.llama = llama_cpp.Llama(
            model_path=str(spec.path),
            n_ctx=min(spec.n_ctx, spec.context_length),
            n_threads=self.n_threads,
            n_threads_batch=self.n_threads,
            n_gpu_layers=self.n_gpu_layers,
            chat_format=spec.chat_format,
            seed=0,
            # Read into the process, not mapped: a mapped file changed on disk afterwards (in
            # place, same inode) was served at once, under the pinned hash.
            use_mmap=False,
            verbose=False,
        )

    def _drop(self) -> None:
        if self.llama is not None:
            try:
                self.llama.close()
            except Exception:
                log.exception("%s: closing the model failed", self.name)
            self.llama = None

    def run(self) -> None:
        try:
            self._build()
            self.alive = True
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("%s: cannot load %s: %s", self.name, self.tier.spec.model, exc)
        finally:
            self.ready.set()
            self.tier.changed()
        try:
            while self.alive:
                job = self.tier.take(self)
                if job is None:
                    break
                self._serve(job)
        finally:
            self.alive = False
            self._drop()
            # The last worker of a tier gone: what waits in its queue can never run here.
            self.tier.fail_queued_if_dead()
            self.tier.changed()

    def _serve(self, job: _Job) -> None:
        try:
            outcome = self._metered(job)
        finally:
            # Free before the caller hears back: a caller that submits again at once must see
            # this worker idle (room and capacity are read right after a result arrives).
            self.busy = False
        job.resolve(outcome)
        self.tier.changed()

    def _metered(self, job: _Job) -> InferenceResult | InferenceError:
        """Serve a job with the meter running: its energy rides on the result or the error."""
        meter = self.tier.meter
        if meter is None:
            return self._serve_one(job)
        self.calls += 1
        call_id = f"{self.name}:{self.calls}"
        try:
            # Which device the call computes on says which counter may charge it: a CPU
            # call on a meter that reads only the GPU's counter (or a GPU call on one that
            # reads only the CPU's) is estimated, and labelled so, never given another
            # device's measured energy.
            device = "gpu" if self.n_gpu_layers else "cpu"
            meter.begin(call_id, threading.get_native_id(), self.n_threads, device=device)
        except Exception:
            log.exception("%s: the meter failed; this call is charged its reservation", self.name)
            return _unmetered(self._serve_one(job))
        outcome: InferenceResult | InferenceError | None = None
        job.energy_used = functools.partial(meter.used, call_id)
        try:
            outcome = self._serve_one(job)
            return outcome
        finally:
            job.energy_used = None
            try:
                energy = meter.end(call_id)
            except Exception:
                log.exception("%s: the meter failed at the end of a call", self.name)
                if outcome is not None:
                    outcome = _unmetered(outcome)
            else:
                if isinstance(outcome, InferenceResult):
                    outcome = dataclasses.replace(
                        outcome,
                        energy_joules=energy.joules,
                        energy_provenance=energy.provenance,
                    )
                elif outcome is not None:
                    outcome.energy_joules = energy.joules
                    outcome.energy_provenance = energy.provenance
            if outcome is not None:
                return outcome  # noqa: B012 - the metered outcome replaces the plain one

    def _serve_one(self, job: _Job) -> InferenceResult | InferenceError:
        tier = self.tier
        started = time.monotonic()
        if job.cancel.is_set():
            tier.count(requests_cancelled=1)
            return CallCancelled("cancelled before it started")
        if job.start_deadline is not None and started > job.start_deadline:
            tier.count(requests_refused=1)
            return DeadlineExceeded(
                f"refused: could not start before its deadline "
                f"(queued {started - job.enqueued:.3f} s)"
            )
        try:
            return self._call(job, started)
        except _Stop as stop:
            self._after_stop()
            error: InferenceError
            if stop.why == "cancelled":
                tier.count(requests_cancelled=1)
                error = CallCancelled(
                    f"cancelled; generation stopped after {stop.tokens} tokens", stop.tokens
                )
            else:
                tier.count(requests_refused=1)
                bound = (
                    f"its timeout of {job.timeout:.1f} s"
                    if job.timeout is not None
                    else "the end its caller set"
                )
                error = DeadlineExceeded(
                    f"the call ran past {bound}; generation stopped after {stop.tokens} tokens"
                )
            # What it used, for the run budget and the call's record (it settled 0 tokens).
            error.prompt_tokens, error.completion_tokens = stop.prompt_tokens, stop.tokens
            return error
        except _RequestError as exc:
            self._after_stop()
            tier.count(requests_failed=1)
            return InferenceError(f"{tier.spec.model}: {exc}")
        except Exception as exc:
            tier.count(requests_failed=1)
            log.warning("%s: call failed (%s); rebuilding the worker", self.name, exc)
            self._rebuild()
            return InferenceError(f"{tier.spec.model}: {type(exc).__name__}: {exc}")

    def _evaluate_prompt(
        self,
        llama: llama_cpp.Llama,
        tokens: list[int],
        job: _Job,
        started: float,
        stop_at: float | None,
    ) -> None:
        """Evaluate a long prompt (all but its last token) in chunks before the completion, so
        that a cancel, the call's timeout or its energy guard can stop it between two chunks:
        inside llama.cpp, one evaluation of thousands of tokens cannot be stopped. The
        completion then finds them cached (llama-cpp-python reuses the longest evaluated
        prefix) and evaluates only the rest.

        A short prompt is evaluated so too, in one chunk, never inside the completion: the
        last token's logits then always come from that token evaluated alone, as they do when
        a repeat of the call finds its prompt cached. Evaluated within the prompt's batch on a
        fresh call, they differed in the last bits (other kernels), and a greedy call's text
        forked from its own repeat's after a dozen tokens (seen on an AVX2 build)."""
        # On a GPU, smaller batches than llama.cpp's own would slow the evaluation down.
        chunk = PROMPT_CHUNK if self.n_gpu_layers == 0 else max(PROMPT_CHUNK, llama.n_batch)
        cached = llama.n_tokens
        upto = len(tokens) - 1
        evaluated = llama.input_ids
        prefix = 0
        while prefix < min(cached, upto) and evaluated[prefix] == tokens[prefix]:
            prefix += 1
        if upto <= prefix:
            return
        # A short prompt's one chunk is not metered apart: the guard's first reading is then,
        # as before, the one after the prompt (what it takes the next token to cost at most).
        energy = _guard(job, started) if upto - prefix > chunk else None
        if prefix < cached and not llama._ctx.kv_cache_seq_rm(-1, prefix, -1):
            # A recurrent model (Mamba, RWKV, hybrids) keeps no partial state: start afresh,
            # as the completion itself would.
            llama.reset()  # type: ignore[no-untyped-call]
            prefix = 0
        llama.n_tokens = prefix  # what differs from the cached tokens is evaluated again
        for done, start in enumerate(range(prefix, upto, chunk)):
            now = time.monotonic()
            _stop_if_asked(job, stop_at, now, 0)
            if energy is not None and energy.stop(now, done):  # counted in chunks here
                raise _Stop.energy(energy, 0, "")
            llama.eval(tokens[start : min(start + chunk, upto)])

    def _after_stop(self) -> None:
        # Generation was interrupted mid-way: forget the evaluated tokens, so the next call
        # cannot reuse a half-written state.
        if self.llama is not None:
            self.llama.reset()  # type: ignore[no-untyped-call]

    def _rebuild(self) -> None:
        self._drop()
        try:
            self._build()
            self.tier.count(rebuilds=1)
        except Exception as exc:
            self.alive = False
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("%s: rebuild failed, worker stops: %s", self.name, exc)

    def _call(self, job: _Job, started: float) -> InferenceResult:
        spec = self.tier.spec
        request = job.request
        llama = self.llama
        assert llama is not None
        if not self._guard.acquire(blocking=False):
            raise RuntimeError(f"{self.name}: instance already in use (pool bug)")
        first: float | None = None
        generated = 0
        prompt_ids = 0
        ends = [started + job.timeout] if job.timeout is not None else []
        if job.finish_by is not None:
            ends.append(job.finish_by)
        stop_at = min(ends) if ends else None
        energy: EnergyGuard | None = None  # set once the prompt's length is known
        try:

            def between_tokens(ids: Any, _scores: Any) -> bool:
                # Called in Python once per sampled token, after the prompt is evaluated. (Not a
                # logits processor: those run as a ctypes callback, where an exception is lost,
                # and they copy the whole vocabulary's logits every token.) `ids` holds the
                # evaluated tokens: the prompt, then every token generated before this one.
                nonlocal first, generated, prompt_ids
                now = time.monotonic()
                if first is None:
                    first, prompt_ids = now, len(ids)
                elif len(ids) - prompt_ids < generated:
                    # The library asks once more after its loop ended (max_tokens, a stop
                    # string, the end of generation): its last token was never evaluated. The
                    # generation is over; nothing to stop or count.
                    return False
                _stop_if_asked(job, stop_at, now, generated)
                if energy is not None and energy.stop(now, generated):
                    # Out of the energy the reservation paid for: keep what was written so far.
                    out = llama.detokenize(
                        list(ids[prompt_ids:]), prev_tokens=list(ids[:prompt_ids])
                    )
                    raise _Stop.energy(energy, len(ids) - prompt_ids, out.decode("utf-8", "ignore"))
                generated += 1
                if job.on_token is not None:
                    try:
                        job.on_token(generated)
                    except Exception as exc:
                        raise _RequestError(
                            f"the token callback raised {type(exc).__name__}: {exc}"
                        ) from exc
                return False

            try:
                prompt, stop = self.tier.render(request)
                schema = request.json_schema
                grammar = (
                    LlamaGrammar.from_json_schema(json.dumps(dict(schema)), verbose=False)
                    if schema is not None
                    else None
                )
                prompt_token_ids = llama.tokenize(prompt.encode("utf-8"), special=True)
                prompt_tokens_n = len(prompt_token_ids)
            except Exception as exc:
                raise _RequestError(
                    f"the request cannot be run: {type(exc).__name__}: {exc}"
                ) from exc
            if prompt_tokens_n >= llama.n_ctx():
                raise _RequestError(
                    f"the prompt is {prompt_tokens_n} tokens, the context holds"
                    f" {llama.n_ctx()}: shorten it"
                )
            # After the prompt, the next token's pass is bounded by the energy per token the
            # hold paid for (the prompt's own pass bounds it too, but a long prompt's loosely).
            energy = _guard(job, started, paid_tokens=prompt_tokens_n + request.max_tokens)
            response: Any
            try:
                self._evaluate_prompt(llama, prompt_token_ids, job, started, stop_at)
                response = llama.create_completion(
                    prompt=prompt,
                    grammar=grammar,
                    max_tokens=request.max_tokens,
                    temperature=request.temperature,
                    seed=request.seed,
                    stop=stop,
                    stopping_criteria=llama_cpp.StoppingCriteriaList([between_tokens]),
                )
            except _Stop as cut:
                if cut.why != "energy":
                    cut.prompt_tokens = prompt_ids or prompt_tokens_n
                    raise
                self._after_stop()
                log.warning(
                    "%s: a %s call stopped after %d tokens at the %.3f J its reservation paid"
                    " for (used %.3f J): the joules-per-token figure of %s is too low;"
                    " calibrate it again",
                    self.name, request.kind, cut.tokens, cut.limit, cut.used, spec.model,
                )  # fmt: skip
                response = {
                    "choices": [{"text": cut.text, "finish_reason": ENERGY_LIMIT}],
                    "usage": {
                        "prompt_tokens": prompt_ids or prompt_tokens_n,
                        "completion_tokens": cut.tokens,
                    },
                }
            text = response["choices"][0]["text"]
            ended = time.monotonic()
        finally:
            self._guard.release()
            self.tier.span(
                CallSpan(self.name, id(llama), threading.get_ident(), started, time.monotonic())
            )
        usage = response.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens", 0))
        completion_tokens = int(usage.get("completion_tokens", 0))
        ttft = (first if first is not None else ended) - started
        self.tier.count(
            requests_total=1,
            prompt_tokens_total=prompt_tokens,
            tokens_predicted_total=completion_tokens,
            prompt_seconds_total=ttft,
            tokens_predicted_seconds_total=ended - (first if first is not None else ended),
            ttft_seconds_last=ttft,
        )
        return InferenceResult(
            text=text,
            model=spec.model,
            model_sha256=spec.sha256,
            tier=spec.tier,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            finish_reason=str(response["choices"][0].get("finish_reason") or ""),
            queue_seconds=started - job.enqueued,
            ttft_seconds=ttft,
            total_seconds=ended - started,
            worker=self.name,
        )


class TierPool:
    """One tier: its workers, its bounded queue and its counters."""

    def __init__(
        self,
        spec: TierSpec,
        n_threads: int,
        on_change: Callable[[], None],
        meter: CallMeter | None = None,
    ) -> None:
        self.spec = spec
        self.meter = meter
        self.n_threads = n_threads
        self.stats = TierStats()
        self.spans: collections.deque[CallSpan] = collections.deque(maxlen=1000)
        self._queue: collections.deque[_Job] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._on_change = on_change
        gpu = spec.n_gpu_layers if gpu_offload_supported() else 0
        if spec.n_gpu_layers and not gpu:
            log.warning(
                "%s: n_gpu_layers=%d asked, but this llama.cpp build has no GPU backend; "
                "running on the CPU",
                spec.tier.value,
                spec.n_gpu_layers,
            )
        self.n_gpu_layers = gpu
        self.workers = [_Worker(self, i, n_threads, gpu) for i in range(spec.workers)]
        formatter = _chat_formatter(spec.chat_format)
        if formatter is None:
            raise ConfigurationError(
                f"inference: model {spec.model} names chat format {spec.chat_format!r}, "
                "which this llama.cpp binding does not know"
            )
        self._formatter: Callable[..., Any] = formatter

    def render(self, request: InferenceRequest) -> tuple[str, list[str]]:
        """The prompt text and stop strings of a request (chat messages through the model's
        chat format, so chat and completion share one generation path)."""
        if not request.messages:
            return request.prompt or "", list(request.stop)
        formatted = self._formatter(
            messages=[{"role": m.role, "content": m.content} for m in request.messages]
        )
        stops = formatted.stop or []
        return formatted.prompt, [*([stops] if isinstance(stops, str) else stops), *request.stop]

    def start(self) -> None:
        for worker in self.workers:
            worker.start()

    def wait_loaded(self, timeout: float | None = None) -> None:
        for worker in self.workers:
            worker.ready.wait(timeout)

    @property
    def alive(self) -> int:
        return sum(1 for w in self.workers if w.alive)

    def room(self) -> int:
        with self._cond:
            alive = self.alive
            if self._closed or alive == 0:
                return 0
            idle = sum(1 for w in self.workers if w.alive and not w.busy)
            return max(0, idle - len(self._queue)) + max(
                0, self.spec.queue - max(0, len(self._queue) - idle)
            )

    def submit(self, job: _Job) -> None:
        with self._cond:
            if self._closed or self.alive == 0:
                raise CapabilityUnavailable(job.request.kind, self.spec.tier)
            idle = sum(1 for w in self.workers if w.alive and not w.busy)
            if len(self._queue) - idle >= self.spec.queue:
                self.stats.requests_refused += 1  # under _cond, as count() does
                raise QueueFull(f"{self.spec.tier.value} queue is full ({self.spec.queue} waiting)")
            self._queue.append(job)
            self._cond.notify()

    def take(self, worker: _Worker) -> _Job | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            worker.busy = True  # counted busy from the moment it holds a job
            return self._queue.popleft()

    def withdraw(self, job: _Job, error: BaseException) -> bool:
        """Take a job back out of the queue (deadline passed, caller gone); True if it was there."""
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                return False
        job.resolve(error)
        self.changed()
        return True

    def fail_queued_if_dead(self) -> None:
        with self._cond:
            if self.alive > 0:
                return
            left = list(self._queue)
            self._queue.clear()
        for job in left:
            job.resolve(CapabilityUnavailable(job.request.kind, self.spec.tier))

    def close(self) -> list[_Job]:
        with self._cond:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        return left

    def count(self, **deltas: float) -> None:
        with self._cond:
            for name, value in deltas.items():
                if name == "ttft_seconds_last":
                    self.stats.ttft_seconds_last = value
                else:
                    setattr(self.stats, name, getattr(self.stats, name) + value)

    def span(self, span: CallSpan) -> None:
        self.spans.append(span)

    def changed(self) -> None:
        self._on_change()

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            s = self.stats
            return {
                "model": self.spec.model,
                "sha256": self.spec.sha256,
                "workers": len(self.workers),
                "workers_alive": self.alive,
                "busy_workers": sum(1 for w in self.workers if w.alive and w.busy),
                "n_threads": self.n_threads,
                "n_gpu_layers": self.n_gpu_layers,
                "queue_limit": self.spec.queue,
                "requests_processing": sum(1 for w in self.workers if w.busy),
                "requests_deferred": len(self._queue),
                "requests_total": s.requests_total,
                "requests_failed": s.requests_failed,
                "requests_refused": s.requests_refused,
                "requests_cancelled": s.requests_cancelled,
                "prompt_tokens_total": s.prompt_tokens_total,
                "tokens_predicted_total": s.tokens_predicted_total,
                "prompt_seconds_total": round(s.prompt_seconds_total, 6),
                "tokens_predicted_seconds_total": round(s.tokens_predicted_seconds_total, 6),
                "ttft_seconds_last": round(s.ttft_seconds_last, 6),
                "rebuilds": s.rebuilds,
                "load_errors": [w.load_error for w in self.workers if w.load_error],
            }


def _probe(specs: list[TierSpec]) -> None:
    """The llama.cpp build must run on this CPU (build_probe), tried on the smallest model."""
    files = [s.path for s in specs if s.workers > 0 and s.path.is_file()]
    if files:
        probe_build(min(files, key=lambda p: p.stat().st_size))


class InferencePool:
    """Every tier's pool; implements the bus's InferenceService port."""

    def __init__(
        self, specs: list[TierSpec], *, cores: int | None = None, meter: CallMeter | None = None
    ) -> None:
        cores = cores or os.cpu_count() or 1
        self.meter = meter
        total = sum(s.workers for s in specs)
        tiers = [s.tier for s in specs]
        if len(set(tiers)) != len(tiers):
            twice = sorted({t.value for t in tiers if tiers.count(t) > 1})
            raise ConfigurationError(f"inference: tier {', '.join(twice)} is configured twice")
        auto = max(1, cores // max(total, 1))
        threads = {s.tier: s.n_threads or auto for s in specs}
        used = sum(threads[s.tier] * s.workers for s in specs)
        if used > cores:
            raise ConfigurationError(
                f"inference: the workers' threads add up to {used}, more than the {cores} cores "
                f"(lower inference.tiers.*.workers or n_threads)"
            )
        self._subscribers: list[Callable[[], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tiers: dict[Tier, TierPool] = {
            s.tier: TierPool(s, threads[s.tier], self._changed, meter) for s in specs
        }

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, timeout: float = 300.0) -> None:
        """Load every tier's workers (in their own threads) and wait until each is up or failed."""
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(_probe, [t.spec for t in self._tiers.values()])
        for tier in self._tiers.values():
            tier.start()
        await asyncio.to_thread(self._wait_loaded, timeout)
        for tier in self._tiers.values():
            log.info(
                "tier %s: %s, %d/%d workers up, %d threads each",
                tier.spec.tier.value,
                tier.spec.model,
                tier.alive,
                len(tier.workers),
                tier.n_threads,
            )

    def _wait_loaded(self, timeout: float) -> None:
        for tier in self._tiers.values():
            tier.wait_loaded(timeout)

    async def stop_tier(self, tier: Tier) -> None:
        """Take a tier down (operators, tests): its queued requests fail, its models close."""
        pool = self._tiers.pop(tier, None)
        if pool is None:
            return
        await self._close_tier(pool)
        self._changed()

    async def start_tier(self, spec: TierSpec) -> None:
        """Bring a tier up (again); its waiting work resumes once it is loaded."""
        current = self._tiers.get(spec.tier)
        if current is not None and current.alive > 0:
            raise ConfigurationError(f"inference: tier {spec.tier.value} is already up")
        if current is not None:
            # Its workers all failed: replace them.
            await self._close_tier(self._tiers.pop(spec.tier))
        await asyncio.to_thread(_probe, [spec])
        threads = spec.n_threads or max(1, (os.cpu_count() or 1) // max(1, spec.workers))
        pool = TierPool(spec, threads, self._changed, self.meter)
        self._tiers[spec.tier] = pool
        pool.start()
        await asyncio.to_thread(pool.wait_loaded, 300.0)
        self._changed()

    async def _close_tier(self, pool: TierPool) -> None:
        for job in pool.close():
            job.resolve(CapabilityUnavailable(job.request.kind, pool.spec.tier))

        def join() -> None:
            for worker in pool.workers:
                worker.join(30.0)

        await asyncio.to_thread(join)

    async def close(self) -> None:
        """Fail what is queued, let running calls finish, close every model."""
        tiers, self._tiers = list(self._tiers.values()), {}
        for pool in tiers:
            await self._close_tier(pool)

    # -- the port ------------------------------------------------------------------------------

    def available(self) -> frozenset[Tier]:
        return frozenset(t for t, p in self._tiers.items() if p.alive > 0)

    def room(self, tier: Tier) -> int:
        pool = self._tiers.get(tier)
        return pool.room() if pool is not None else 0

    def describe(self, tier: Tier) -> ModelInfo | None:
        pool = self._tiers.get(tier)
        if pool is None or pool.alive == 0:
            return None
        spec = pool.spec
        return ModelInfo(spec.model, spec.sha256, min(spec.n_ctx, spec.context_length))

    def capacity(self, tier: Tier) -> int:
        pool = self._tiers.get(tier)
        if pool is None or pool.alive == 0:
            return 0
        return pool.alive + pool.spec.queue

    def subscribe(self, callback: Callable[[], None]) -> None:
        self._subscribers.append(callback)

    def _changed(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def fire() -> None:
            for callback in list(self._subscribers):
                try:
                    callback()
                except Exception:
                    log.exception("inference subscriber failed")

        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(fire)

    async def infer(
        self, request: InferenceRequest, tier: Tier, control: CallControl | None = None
    ) -> InferenceResult:
        control = control or CallControl()
        pool = self._tiers.get(tier)
        if pool is None or pool.alive == 0:
            raise CapabilityUnavailable(request.kind, tier)
        loop = asyncio.get_running_loop()
        self._loop = self._loop or loop
        now = time.monotonic()
        if control.start_deadline is not None and now >= control.start_deadline:
            pool.count(requests_refused=1)
            raise DeadlineExceeded("refused: its deadline passed before it was queued")
        job = _Job(
            request=request,
            loop=loop,
            future=loop.create_future(),
            enqueued=now,
            start_deadline=control.start_deadline,
            timeout=control.timeout,
            on_token=control.on_token,
            energy_limit=control.energy_limit,
            finish_by=control.finish_by,
        )
        pool.submit(job)
        timer = None
        if control.start_deadline is not None:

            def refuse_if_queued() -> None:
                if pool.withdraw(
                    job, DeadlineExceeded("refused: its deadline passed in the queue")
                ):
                    pool.count(requests_refused=1)

            timer = loop.call_later(max(0.0, control.start_deadline - now), refuse_if_queued)
        watcher = None
        if control.cancel is not None:
            cancel_event = control.cancel

            async def watch() -> None:
                await cancel_event.wait()
                job.cancel.set()
                if pool.withdraw(job, CallCancelled("cancelled while queued")):
                    pool.count(requests_cancelled=1)

            watcher = asyncio.create_task(watch(), name="inference-cancel-watch")
        try:
            return await job.future
        except asyncio.CancelledError:
            job.cancel.set()
            pool.withdraw(job, CallCancelled("the caller went away"))
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if watcher is not None:
                watcher.cancel()

    def stats(self) -> dict[str, Any]:
        return {tier.value: pool.snapshot() for tier, pool in self._tiers.items()}

    def spans(self, tier: Tier) -> list[CallSpan]:
        pool = self._tiers.get(tier)
        return list(pool.spans) if pool is not None else []

    def health(self) -> dict[str, Any]:
        """Up or down per tier, with why a tier is down."""
        out: dict[str, Any] = {}
        for tier, pool in self._tiers.items():
            errors = [w.load_error for w in pool.workers if w.load_error]
            out[tier.value] = {
                "up": pool.alive > 0,
                "workers_alive": pool.alive,
                "errors": errors,
            }
        return out
