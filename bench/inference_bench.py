"""Inference pool benchmarks against raw llama-cpp-python, on the same models in the same run.

What it measures, per tier of the `dev` profile of models.lock (mechanical: SmolLM2-135M,
reasoning: Gemma 3 270M), with the model files from the model cache (verified by sha256):

1. generation speed: tokens/s through `InferencePool` (1 worker, 2 threads) against a raw
   `llama_cpp.Llama` with the same settings (n_ctx 2048, 2 threads, seed 0) on the same model,
   the same prompt and the same max_tokens (96), greedy. tokens/s = completion_tokens / wall time
   around the call, on both sides, so the pool's queueing and thread hand-off count against it.
   Raw and pool repeats alternate (5 each, the side that goes first alternates too) and the
   figures are medians; the target is pool/raw >= 0.95. The prompt is a counting list ("108,
   109, ...") that a model continues to max_tokens without an end-of-sequence token; each repeat
   gets a prompt that starts differently (the same for its raw and its pool call), so neither
   side reuses a cached prompt prefix;
2. aggregate throughput on the mechanical tier: 8 requests submitted at once to a pool of 1 worker
   (2 threads) and to a pool of 2 workers (1 thread each); total completion tokens / wall time
   from the first submit to the last result (3 repeats each, alternating);
3. time to first token: the pool's own `ttft_seconds` (worker start to the first sampled token)
   of the calls in (1), and the wall time of a max_tokens=1 call, raw and through the pool;
4. memory per worker: RSS (plus anonymous RSS and PSS) of a fresh process before and after
   starting a pool of 1 worker and of 2 workers and serving one short call on each worker, per
   tier;
5. GPU: when this llama.cpp build can offload (`llama_supports_gpu_offload()`), (1) again with
   n_gpu_layers=-1 as its own rows; otherwise a line says the GPU rows were skipped.

Every side runs in its own child process (`--serve`), driven over a pipe by this process, which
alternates the calls and loads no model itself. That is deliberate: this llama.cpp build uses
OpenMP, and when two OS threads of one process drive multi-threaded llama.cpp calls (a raw
`Llama` on the main thread and a pool worker thread, say), both slow down about 2.5x here. A
diagnostic row shows that case (raw on the main thread and a 1-worker pool in one process).

The machine may be shared: `others' CPU` is the cores' worth of CPU the rest of the machine used
during the median run (0.00 = a quiet box). Nothing is written to bench/RESULTS.md; the figures
are printed, and written as JSON with `--json PATH`.

Run from the repository root (the models must be fetched: `appliance models fetch`):

    .venv/bin/python -m bench.inference_bench                  # the full run (~3 minutes)
    .venv/bin/python -m bench.inference_bench --quick          # small sizes, a smoke test
    .venv/bin/python -m bench.inference_bench --json /tmp/inference_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import llama_cpp
import psutil

from appliance.domain.inference import InferenceRequest, InferenceResult, Tier
from appliance.inference.cache import ModelCache
from appliance.inference.lockfile import ModelEntry, load_lock
from appliance.inference.pool import InferencePool, TierSpec, gpu_offload_supported
from bench.harness import (
    Measurement,
    Sample,
    code_version,
    fmt_share,
    machine_facts,
    markdown_table,
)

ROOT = Path(__file__).resolve().parents[1]
LOCK_PATH = ROOT / "models.lock"
PROFILE = "dev"
TIERS = (Tier.MECHANICAL, Tier.REASONING)
N_CTX = 2048
THREADS = 2  # every configuration uses 2 cores in all: 1 worker x 2 threads or 2 x 1
SEED = 0

# Target from the issue.
TARGET_POOL_RATIO = 0.95


@dataclass(frozen=True)
class Sizes:
    """How much work each measurement does."""

    repeats: int  # (1): raw and pool calls each
    max_tokens: int  # (1)
    ttft_repeats: int  # (3): max_tokens=1 calls, raw and pool each
    tp_requests: int  # (2): requests submitted at once
    tp_max_tokens: int  # (2)
    tp_repeats: int  # (2): per layout
    mem_tokens: int  # (4): the one short call per worker
    diag_repeats: int  # the same-process diagnostic: raw and pool calls each


FULL = Sizes(
    repeats=5,
    max_tokens=96,
    ttft_repeats=5,
    tp_requests=8,
    tp_max_tokens=64,
    tp_repeats=3,
    mem_tokens=8,
    diag_repeats=2,
)
QUICK = Sizes(
    repeats=2,
    max_tokens=24,
    ttft_repeats=2,
    tp_requests=4,
    tp_max_tokens=16,
    tp_repeats=1,
    mem_tokens=4,
    diag_repeats=1,
)

_prompts = iter(range(1_000_000))


def counting_prompt() -> str:
    """A prompt a model continues up to max_tokens; every call gets a different start, so no
    instance can reuse a cached prompt prefix from its previous call."""
    k = next(_prompts)
    start = 100 + 113 * k
    numbers = ", ".join(str(start + j) for j in range(8))
    return f"Count upwards, one number per item: {numbers},"


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- models --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """One tier's pinned model and its verified file."""

    tier: Tier
    entry: ModelEntry
    path: Path

    def spec(self, workers: int, n_threads: int, n_gpu_layers: int = 0, queue: int = 8) -> TierSpec:
        return TierSpec.of(
            self.entry,
            self.path,
            workers=workers,
            n_threads=n_threads,
            n_ctx=N_CTX,
            n_gpu_layers=n_gpu_layers,
            queue=queue,
        )

    def raw(self, n_threads: int = THREADS, n_gpu_layers: int = 0) -> llama_cpp.Llama:
        """A raw instance built as the pool's worker builds its own."""
        return llama_cpp.Llama(
            model_path=str(self.path),
            n_ctx=min(N_CTX, self.entry.context_length),
            n_threads=n_threads,
            n_threads_batch=n_threads,
            n_gpu_layers=n_gpu_layers,
            chat_format=self.entry.chat_format,
            seed=SEED,
            verbose=False,
        )


def load_model(tier: Tier) -> Model:
    entry = load_lock(LOCK_PATH).profile(PROFILE)[tier]
    return Model(tier, entry, ModelCache().verify(entry).path)


def request(prompt: str, max_tokens: int) -> InferenceRequest:
    return InferenceRequest(
        "bench", prompt=prompt, max_tokens=max_tokens, temperature=0.0, seed=SEED
    )


# -- measuring (in the child processes) ------------------------------------------------------------


def _machine_busy() -> float:
    """System-wide busy CPU seconds (all cores) since boot."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def _steal() -> float:
    return getattr(psutil.cpu_times(), "steal", 0.0)


class Clock:
    """Times a block: wall clock, this process's CPU (every thread, so the pool's workers too) and
    what the rest of the machine used meanwhile."""

    def __init__(self) -> None:
        self.n = 0
        self.figures: dict[str, Any] = {}

    def __enter__(self) -> Clock:
        self._busy0, self._steal0 = _machine_busy(), _steal()
        self._cpu0 = time.process_time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        cpu = time.process_time() - self._cpu0
        self.figures = {
            "tokens": self.n,
            "wall": wall,
            "cpu": cpu,
            "other": max(0.0, _machine_busy() - self._busy0 - cpu),
            "steal": _steal() - self._steal0,
        }


def memory_now() -> dict[str, float]:
    """This process's memory in MB: RSS, its anonymous and file-backed parts, and PSS."""
    gc.collect()
    proc = psutil.Process()
    out: dict[str, float] = {"rss": proc.memory_info().rss / 2**20}
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key[3:].lower()] = int(value.split()[0]) / 1024  # kB
    with contextlib.suppress(psutil.Error, AttributeError):
        out["pss"] = proc.memory_full_info().pss / 2**20
    return out


class Stdio:
    """Puts stdout and stderr back after llama-cpp-python loads models.

    With verbose=False, `Llama(...)` silences output while it loads by pointing fds 1 and 2 and
    sys.stdout/sys.stderr at /dev/null and back, process-wide and not thread-safely. When two
    workers load at once (a pool of 2), the second one saves the first one's /dev/null as the
    "original" and restores it: the process stays silent for good. `restore()` after every
    load, when no load is in progress.
    """

    def __init__(self) -> None:
        self.out, self.err = sys.stdout, sys.stderr
        self.fds = (os.dup(1), os.dup(2))

    def restore(self) -> None:
        os.dup2(self.fds[0], 1)
        os.dup2(self.fds[1], 2)
        sys.stdout, sys.stderr = self.out, self.err


class RawSide:
    """A raw `Llama`, called on this process's main thread."""

    def __init__(self, model: Model, n_gpu_layers: int) -> None:
        self.llm = model.raw(n_gpu_layers=n_gpu_layers)

    def call(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        with Clock() as clock:
            out: Any = self.llm.create_completion(
                prompt, max_tokens=max_tokens, temperature=0.0, seed=SEED
            )
            clock.n = int(out["usage"]["completion_tokens"])
        return clock.figures

    def close(self) -> None:
        self.llm.close()


class PoolSide:
    """An `InferencePool` of one tier, driven by its own event loop on this process's main
    thread (which never touches a model itself)."""

    def __init__(self, spec: TierSpec, stdio: Stdio) -> None:
        self.tier = spec.tier
        self.loop = asyncio.new_event_loop()
        self.pool = InferencePool([spec])
        try:
            self.loop.run_until_complete(self.pool.start())
        finally:
            stdio.restore()

    async def _call(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        with Clock() as clock:
            result = await self.pool.infer(request(prompt, max_tokens), self.tier)
            clock.n = result.completion_tokens
        return clock.figures | {
            "ttft": result.ttft_seconds,
            "queue": result.queue_seconds,
            "total": result.total_seconds,
        }

    async def _burst(self, prompts: list[str], max_tokens: int) -> dict[str, Any]:
        with Clock() as clock:
            results: list[InferenceResult] = await asyncio.gather(
                *(self.pool.infer(request(p, max_tokens), self.tier) for p in prompts)
            )
            clock.n = sum(r.completion_tokens for r in results)
        return clock.figures | {
            "workers_used": len({r.worker for r in results}),
            "short": sum(1 for r in results if r.completion_tokens < max_tokens),
        }

    def call(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        return self.loop.run_until_complete(self._call(prompt, max_tokens))

    def burst(self, prompts: list[str], max_tokens: int) -> dict[str, Any]:
        return self.loop.run_until_complete(self._burst(prompts, max_tokens))

    def close(self) -> None:
        self.loop.run_until_complete(self.pool.close())
        self.loop.close()


def serve(config: dict[str, Any]) -> int:
    """`--serve CONFIG`: load one side, then answer JSON commands from stdin, one a line.

    config: {"role": "raw" | "pool" | "same-process", "tier", "n_gpu_layers", "workers",
    "n_threads"}. Commands: {"op": "call", "prompt", "max_tokens", "side"?}, {"op": "burst",
    "prompts", "max_tokens"}, {"op": "memory"}, {"op": "quit"}. Replies go to a copy of the
    original stdout; fd 1 itself is pointed at stderr, so nothing llama.cpp prints can get
    into them.
    """
    replies = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    stdio = Stdio()

    def reply(**data: Any) -> None:
        replies.write(json.dumps(data) + "\n")

    sides: dict[str, RawSide | PoolSide] = {}
    try:
        model = load_model(Tier(config["tier"]))
        gpu = int(config.get("n_gpu_layers", 0))
        before = memory_now()
        t0 = time.perf_counter()
        if config["role"] in ("raw", "same-process"):
            sides["raw"] = RawSide(model, gpu)
            stdio.restore()
        if config["role"] in ("pool", "same-process"):
            workers = int(config.get("workers", 1))
            n_threads = int(config.get("n_threads", THREADS))
            queue = max(8, int(config.get("queue", 8)))
            sides["pool"] = PoolSide(model.spec(workers, n_threads, gpu, queue), stdio)
        reply(ready=True, load_s=time.perf_counter() - t0, before=before, loaded=memory_now())
        default = next(iter(sides))
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "quit":
                break
            if op == "memory":
                reply(**memory_now())
            elif op == "call":
                side = sides[cmd.get("side", default)]
                reply(**side.call(cmd["prompt"], int(cmd["max_tokens"])))
            elif op == "burst":
                pool = sides["pool"]
                assert isinstance(pool, PoolSide)
                reply(**pool.burst(list(cmd["prompts"]), int(cmd["max_tokens"])))
            else:
                raise ValueError(f"unknown op {op!r}")
    except Exception as exc:
        reply(error=f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        for side in sides.values():
            with contextlib.suppress(Exception):
                side.close()
    return 0


# -- driving the children ------------------------------------------------------------------------


class ChildFailed(RuntimeError):
    pass


class Child:
    """One `--serve` process, asked one command at a time."""

    def __init__(self, label: str, **config: Any) -> None:
        self.label = label
        self._err: IO[str] = tempfile.TemporaryFile("w+", encoding="utf-8")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.inference_bench", "--serve", json.dumps(config)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            bufsize=1,
        )
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        data = json.loads(line) if line.strip() else None
        if not isinstance(data, dict) or "error" in data:
            self._err.seek(0)
            tail = " / ".join(self._err.read().strip().splitlines()[-3:])
            why = data.get("error") if isinstance(data, dict) else "no reply"
            raise ChildFailed(f"{self.label}: {why} (stderr: {tail or '-'})")
        return data

    def ask(self, op: str, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **cmd}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def call(self, prompt: str, max_tokens: int, side: str | None = None) -> dict[str, Any]:
        extra = {"side": side} if side else {}
        return self.ask("call", prompt=prompt, max_tokens=max_tokens, **extra)

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._err.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sample(figures: dict[str, Any]) -> Sample:
    """A harness `Sample` (items = completion tokens) from a child's reply."""
    return Sample(
        int(figures["tokens"]),
        float(figures["wall"]),
        float(figures["cpu"]),
        None,
        float(figures["other"]),
        float(figures["steal"]),
    )


# -- (1) and (3): generation, raw against the pool ------------------------------------------------


@dataclass
class Generation:
    """One tier on one backend: raw and pool repeats, and the time-to-first-token probes."""

    tier: Tier
    model: str
    backend: str  # "cpu", "gpu" or a diagnostic label
    n_gpu_layers: int
    max_tokens: int
    raw: Measurement = field(default_factory=lambda: Measurement("raw", "tokens/s"))
    pool: Measurement = field(default_factory=lambda: Measurement("pool", "tokens/s"))
    pool_ttft: list[float] = field(default_factory=list)  # the pool's ttft_seconds
    pool_queue: list[float] = field(default_factory=list)  # the pool's queue_seconds
    pool_overhead: list[float] = field(default_factory=list)  # wall - total_seconds
    raw_first: list[float] = field(default_factory=list)  # wall of a max_tokens=1 call
    pool_first: list[float] = field(default_factory=list)
    load_raw_s: float = 0.0
    load_pool_s: float = 0.0

    @property
    def ratio(self) -> float:
        return self.pool.median / self.raw.median if self.raw.median else float("nan")

    @property
    def paired_ratio(self) -> float:
        """Median over repeats of pool/raw for the same prompt (robust to the box drifting)."""
        pairs = zip(self.pool.samples, self.raw.samples, strict=False)
        return median([p.rate / r.rate for p, r in pairs if r.rate > 0])

    def add_pool(self, figures: dict[str, Any]) -> None:
        self.pool.add(sample(figures))
        self.pool_ttft.append(figures["ttft"])
        self.pool_queue.append(figures["queue"])
        self.pool_overhead.append(figures["wall"] - figures["total"])


def _alternate(rep: int) -> tuple[str, str]:
    return ("raw", "pool") if rep % 2 == 0 else ("pool", "raw")


def measure_generation(model: Model, sizes: Sizes, n_gpu_layers: int = 0) -> Generation:
    backend = "gpu" if n_gpu_layers else "cpu"
    gen = Generation(model.tier, model.entry.name, backend, n_gpu_layers, sizes.max_tokens)
    common = {"tier": model.tier.value, "n_gpu_layers": n_gpu_layers}
    with (
        Child(f"raw {model.tier.value}", role="raw", **common) as raw,
        Child(
            f"pool {model.tier.value}", role="pool", workers=1, n_threads=THREADS, **common
        ) as pool,
    ):
        gen.load_raw_s, gen.load_pool_s = raw.ready["load_s"], pool.ready["load_s"]
        children = {"raw": raw, "pool": pool}
        for child in children.values():  # warm-up (untimed): page the weights in
            child.call(counting_prompt(), sizes.max_tokens)
        for rep in range(sizes.repeats):
            prompt = counting_prompt()
            print(f"  {model.tier.value}/{backend}: repeat {rep + 1}/{sizes.repeats}", flush=True)
            for name in _alternate(rep):
                figures = children[name].call(prompt, sizes.max_tokens)
                if name == "raw":
                    gen.raw.add(sample(figures))
                else:
                    gen.add_pool(figures)
        for rep in range(sizes.ttft_repeats):
            prompt = counting_prompt()
            for name in _alternate(rep):
                wall = children[name].call(prompt, 1)["wall"]
                (gen.raw_first if name == "raw" else gen.pool_first).append(wall)
    return gen


def measure_same_process(model: Model, sizes: Sizes) -> Generation:
    """Diagnostic: raw on the main thread and a 1-worker pool in ONE process, alternating."""
    gen = Generation(model.tier, model.entry.name, "cpu, one process", 0, sizes.max_tokens)
    with Child(
        f"same-process {model.tier.value}",
        role="same-process",
        tier=model.tier.value,
        workers=1,
        n_threads=THREADS,
    ) as child:
        for name in ("raw", "pool"):
            child.call(counting_prompt(), sizes.max_tokens, side=name)
        for rep in range(sizes.diag_repeats):
            prompt = counting_prompt()
            print(f"  same process: repeat {rep + 1}/{sizes.diag_repeats}", flush=True)
            for name in _alternate(rep):
                figures = child.call(prompt, sizes.max_tokens, side=name)
                if name == "raw":
                    gen.raw.add(sample(figures))
                else:
                    gen.add_pool(figures)
    return gen


# -- (2): aggregate throughput, 1 worker x 2 threads against 2 workers x 1 thread ------------------


@dataclass
class Throughput:
    """Aggregate tokens/s of one pool layout under a burst of concurrent requests."""

    label: str
    workers: int
    n_threads: int
    requests: int
    max_tokens: int
    run: Measurement = field(default_factory=lambda: Measurement("burst", "tokens/s"))
    workers_used: list[int] = field(default_factory=list)
    short_calls: int = 0  # results that stopped before max_tokens


def measure_throughput(model: Model, sizes: Sizes) -> list[Throughput]:
    n, tokens = sizes.tp_requests, sizes.tp_max_tokens
    layouts = [
        Throughput("1 worker x 2 threads", 1, THREADS, n, tokens),
        Throughput(f"{THREADS} workers x 1 thread", THREADS, 1, n, tokens),
    ]
    with contextlib.ExitStack() as stack:
        children = [
            stack.enter_context(
                Child(
                    t.label,
                    role="pool",
                    tier=model.tier.value,
                    workers=t.workers,
                    n_threads=t.n_threads,
                    queue=n,
                )
            )
            for t in layouts
        ]
        for child, layout in zip(children, layouts, strict=True):  # warm-up: every worker once
            child.ask(
                "burst",
                prompts=[counting_prompt() for _ in range(layout.workers)],
                max_tokens=tokens,
            )
        for rep in range(sizes.tp_repeats):
            print(f"  throughput: repeat {rep + 1}/{sizes.tp_repeats}", flush=True)
            for i in (0, 1) if rep % 2 == 0 else (1, 0):
                figures = children[i].ask(
                    "burst", prompts=[counting_prompt() for _ in range(n)], max_tokens=tokens
                )
                layouts[i].run.add(sample(figures))
                layouts[i].workers_used.append(int(figures["workers_used"]))
                layouts[i].short_calls += int(figures["short"])
    return layouts


# -- (4): memory per worker, each layout in a fresh process ----------------------------------------


def measure_memory(sizes: Sizes) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for tier in TIERS:
        for workers in (1, THREADS):
            print(f"  memory: {tier.value}, {workers} worker(s) in a fresh process", flush=True)
            n_threads = max(1, THREADS // workers)
            row: dict[str, Any] = {"tier": tier.value, "workers": workers, "n_threads": n_threads}
            try:
                with Child(
                    f"memory {tier.value} x{workers}",
                    role="pool",
                    tier=tier.value,
                    workers=workers,
                    n_threads=n_threads,
                ) as child:
                    prompts = [counting_prompt() for _ in range(workers)]
                    burst = child.ask("burst", prompts=prompts, max_tokens=sizes.mem_tokens)
                    row |= {
                        "before": child.ready["before"],
                        "loaded": child.ready["loaded"],
                        "serving": child.ask("memory"),
                        "workers_used": burst["workers_used"],
                    }
            except ChildFailed as exc:
                row["error"] = str(exc)
            rows.append(row)
    return rows


# -- the whole run ---------------------------------------------------------------------------------


@dataclass
class Report:
    sizes: Sizes
    facts: dict[str, str]
    generation: list[Generation] = field(default_factory=list)
    same_process: Generation | None = None
    throughput: list[Throughput] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    gpu: bool = False
    wall: float = 0.0


def run_all(sizes: Sizes) -> Report:
    t0 = time.perf_counter()
    facts = machine_facts()
    facts["loadavg_start"] = facts.pop("loadavg")
    facts.pop("psycopg", None)
    facts["tree"] = code_version()
    facts["llama_cpp"] = llama_cpp.__version__
    with contextlib.suppress(Exception):
        facts["llama_system_info"] = llama_cpp.llama_print_system_info().decode().strip()
    report = Report(sizes, facts, gpu=gpu_offload_supported())
    models = {tier: load_model(tier) for tier in TIERS}
    for tier in TIERS:
        print(f"generation: {tier.value} ({models[tier].entry.name}), raw vs pool ...", flush=True)
        report.generation.append(measure_generation(models[tier], sizes))
    if report.gpu:
        for tier in TIERS:
            print(f"generation on the GPU: {tier.value}, raw vs pool ...", flush=True)
            report.generation.append(measure_generation(models[tier], sizes, -1))
    print("throughput: mechanical, 1 worker vs 2 workers ...", flush=True)
    report.throughput = measure_throughput(models[Tier.MECHANICAL], sizes)
    print("memory per worker ...", flush=True)
    report.memory = measure_memory(sizes)
    print("diagnostic: raw and pool in one process ...", flush=True)
    report.same_process = measure_same_process(models[Tier.MECHANICAL], sizes)
    facts["loadavg"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    report.wall = time.perf_counter() - t0
    return report


# -- reporting -------------------------------------------------------------------------------------


def _tps(m: Measurement) -> str:
    rates = sorted(s.rate for s in m.samples)
    if not rates:
        return "-"
    return f"{m.median:.1f} ({rates[0]:.1f}-{rates[-1]:.1f})"


def _ms(value: float) -> str:
    return "-" if value != value else f"{value * 1000:.1f}"


def _tokens(m: Measurement, max_tokens: int) -> str:
    values = [s.n for s in m.samples]
    if not values:
        return "-"
    lo = min(values)
    return f"{max_tokens}" if lo == max_tokens else f"{lo}-{max(values)} of {max_tokens}"


def _generation_table(gens: Sequence[Generation]) -> str:
    rows = [
        [
            g.tier.value,
            g.model,
            g.backend,
            _tps(g.raw),
            _tps(g.pool),
            f"{g.ratio:.3f}",
            f"{g.paired_ratio:.3f}",
            f"{_tokens(g.raw, g.max_tokens)} / {_tokens(g.pool, g.max_tokens)}",
            f"{fmt_share(g.raw.other_share)} / {fmt_share(g.pool.other_share)}",
        ]
        for g in gens
    ]
    return markdown_table(
        [
            "tier",
            "model",
            "backend",
            "raw tokens/s (min-max)",
            "pool tokens/s (min-max)",
            "pool/raw",
            "paired pool/raw",
            "tokens/call raw / pool",
            "others' CPU raw / pool",
        ],
        rows,
    )


def _throughput_table(r: Report) -> str:
    base = r.throughput[0].run.median if r.throughput else float("nan")
    rows = [
        [
            t.label,
            f"{t.requests} x {t.max_tokens}",
            _tps(t.run),
            f"{t.run.median / base:.2f}" if base else "-",
            ", ".join(str(n) for n in t.workers_used),
            str(t.short_calls),
            fmt_share(t.run.other_share),
            fmt_share(t.run.client_cpu_share),
        ]
        for t in r.throughput
    ]
    return markdown_table(
        [
            "mechanical pool",
            "requests x max_tokens",
            "aggregate tokens/s (min-max)",
            "vs 1 worker",
            "workers used",
            "short calls",
            "others' CPU",
            "our CPU (cores)",
        ],
        rows,
    )


def _ttft_table(r: Report) -> str:
    rows = [
        [
            g.tier.value,
            g.backend,
            _ms(median(g.pool_ttft)),
            _ms(median(g.pool_queue)),
            _ms(median(g.pool_overhead)),
            _ms(median(g.raw_first)),
            _ms(median(g.pool_first)),
            f"{g.load_raw_s:.2f} / {g.load_pool_s:.2f}",
        ]
        for g in r.generation
    ]
    return markdown_table(
        [
            "tier",
            "backend",
            "pool ttft_seconds (ms)",
            "pool queue (ms)",
            "pool wall - total_seconds (ms)",
            "max_tokens=1 wall raw (ms)",
            "max_tokens=1 wall pool (ms)",
            "load raw / pool (s)",
        ],
        rows,
    )


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _delta(row: dict[str, Any], key: str, at: str = "serving") -> float | None:
    after, before = row.get(at, {}).get(key), row.get("before", {}).get(key)
    return None if after is None or before is None else after - before


def _memory_table(r: Report) -> str:
    rows = []
    for m in r.memory:
        layout = f"{m['workers']} x {m.get('n_threads', '?')}"
        if "error" in m:
            rows.append([m["tier"], layout, *["-"] * 6, f"failed: {m['error']}"])
            continue
        n = m["workers"]

        def per(key: str, at: str = "serving", n: int = n, m: dict[str, Any] = m) -> str:
            d = _delta(m, key, at)
            return _mb(None if d is None else d / n)

        rows.append(
            [
                m["tier"],
                layout,
                _mb(m["before"]["rss"]),
                _mb(_delta(m, "rss", "loaded")),
                _mb(_delta(m, "rss")),
                per("rss"),
                per("anon"),
                per("pss"),
                f"{m['workers_used']} of {n} served a call",
            ]
        )
    return markdown_table(
        [
            "tier",
            "workers x threads",
            "RSS before (MB)",
            "RSS +loaded (MB)",
            "RSS +serving (MB)",
            "RSS / worker",
            "anon RSS / worker",
            "PSS / worker",
            "note",
        ],
        rows,
    )


def _targets(r: Report) -> list[tuple[str, str, bool]]:
    return [
        (
            f"{g.tier.value}/{g.backend}: pool tokens/s >= {TARGET_POOL_RATIO} x raw",
            f"{g.ratio:.3f} (paired {g.paired_ratio:.3f})",
            g.ratio >= TARGET_POOL_RATIO,
        )
        for g in r.generation
    ]


def render(r: Report) -> str:
    f, s = r.facts, r.sizes
    gpu_line = (
        "- GPU: this llama.cpp build can offload; the `gpu` rows run with n_gpu_layers=-1."
        if r.gpu
        else "- GPU rows skipped: this llama.cpp build has no GPU backend"
        " (`llama_supports_gpu_offload()` is False); every figure is CPU only."
    )
    targets = markdown_table(
        ["target", "measured (median)", "verdict"],
        [[t, got, "met" if ok else "**MISSED**"] for t, got, ok in _targets(r)],
    )
    return "\n".join(
        [
            f"Run {f['date']}, `python -m bench.inference_bench` (total {r.wall:.0f} s), code:"
            f" {f['tree']}.",
            "",
            f"- Machine: {f['cores']} cores ({f['cpu']}), {f['memory']} RAM, Linux {f['kernel']};"
            " the box may be shared with other runs: load average (1/5/15 min)"
            f" {f['loadavg_start']} at start, {f['loadavg']} at end. `others' CPU` = cores'"
            " worth of CPU the rest of the machine used during the median run.",
            f"- llama-cpp-python {f['llama_cpp']}, Python {f['python']}; models of the"
            f" `{PROFILE}` profile from the model cache, verified by sha256; n_ctx {N_CTX},"
            f" seed {SEED}, greedy (temperature 0).",
            f"- Generation: {s.repeats} raw and {s.repeats} pool calls per tier, alternating"
            f" (which side goes first alternates too), max_tokens {s.max_tokens}, a counting"
            " prompt (different per repeat, the same for its raw and its pool call);"
            " tokens/s = completion_tokens / wall time around the call on both sides; medians."
            " Raw: `Llama(...).create_completion` on the main thread of its own process; pool:"
            " `await pool.infer(...)` to a 1-worker pool in another process, so queueing, the"
            " thread hand-off and the pool's per-token callback count against it. This process"
            " drives both over pipes (outside the timed part) and loads no model. `paired` ="
            " median of the per-repeat ratios.",
            f"- Throughput: {s.tp_requests} requests of max_tokens {s.tp_max_tokens} submitted"
            " at once (`asyncio.gather`); tokens/s = all completion tokens / wall time of the"
            f" burst; medians of {s.tp_repeats}, layouts alternating, each layout in its own"
            f" process; both use {THREADS} threads in all.",
            f"- Time to first token: `ttft_seconds` of the pool's generation calls (worker"
            " start to the first sampled token; excludes queueing); `wall - total_seconds` ="
            " what the pool adds around the model call; max_tokens=1 wall: medians of"
            f" {s.ttft_repeats} alternating calls per side.",
            "- Memory: a fresh child process per row; before = after imports and the sha256"
            " check, +loaded = after `pool.start()`, +serving = after one"
            f" max_tokens={s.mem_tokens} call per worker. Weights are mmap'd: RSS counts a"
            " file page once per mapping (so a second worker of the same model adds its"
            " weights to RSS again), PSS counts it once; anon RSS is the private part (KV"
            " cache, compute buffers).",
            gpu_line,
            "",
            "### Generation (tokens/s)",
            "",
            _generation_table(r.generation),
            "",
            "### Aggregate throughput",
            "",
            _throughput_table(r),
            "",
            "### Time to first token",
            "",
            _ttft_table(r),
            "",
            "### Memory",
            "",
            _memory_table(r),
            "",
            "### Targets",
            "",
            targets,
            "",
            "### Diagnostic: raw and pool in one process (not a product figure)",
            "",
            f"The raw `Llama` called on the main thread and a 1-worker pool ({THREADS} threads)"
            f" in the same process, alternating, mechanical tier, {s.diag_repeats} repeats each;"
            " compare with the mechanical row above, where each side has a process of its own."
            " This llama.cpp build links libgomp (OpenMP); with two OS threads of one process"
            " running multi-threaded llama.cpp calls, libgomp manages more threads than there"
            " are cores and stops spinning at its barriers (as far as we can tell), so both"
            " sides slow down. Anything that calls llama.cpp outside the pool's workers inside"
            " the appliance process would do the same to every worker.",
            "",
            _generation_table([r.same_process]) if r.same_process else "(not run)",
        ]
    )


def _samples(m: Measurement) -> list[dict[str, float | None]]:
    return [
        {
            "tokens": s.n,
            "wall_s": s.wall,
            "tokens_per_s": s.rate,
            "process_cpu_s": s.client_cpu,
            "others_cpu_s": s.other_cpu,
        }
        for s in m.samples
    ]


def to_json(r: Report) -> dict[str, Any]:
    return {
        "benchmark": "inference",
        "wall_s": r.wall,
        "facts": r.facts,
        "sizes": vars(r.sizes),
        "gpu_offload_supported": r.gpu,
        "gpu_skipped": None if r.gpu else "this llama.cpp build has no GPU backend",
        "target_pool_ratio": TARGET_POOL_RATIO,
        "generation": [
            {
                "tier": g.tier.value,
                "model": g.model,
                "backend": g.backend,
                "n_gpu_layers": g.n_gpu_layers,
                "max_tokens": g.max_tokens,
                "raw_tokens_per_s": g.raw.median,
                "pool_tokens_per_s": g.pool.median,
                "pool_over_raw": g.ratio,
                "paired_pool_over_raw": g.paired_ratio,
                "target_met": g.ratio >= TARGET_POOL_RATIO,
                "pool_ttft_s": median(g.pool_ttft),
                "pool_queue_s": median(g.pool_queue),
                "pool_overhead_s": median(g.pool_overhead),
                "raw_first_token_wall_s": median(g.raw_first),
                "pool_first_token_wall_s": median(g.pool_first),
                "load_raw_s": g.load_raw_s,
                "load_pool_s": g.load_pool_s,
                "raw": _samples(g.raw),
                "pool": _samples(g.pool),
                "pool_ttft_all_s": g.pool_ttft,
            }
            for g in r.generation
        ],
        "throughput": [
            {
                "layout": t.label,
                "workers": t.workers,
                "n_threads": t.n_threads,
                "requests": t.requests,
                "max_tokens": t.max_tokens,
                "tokens_per_s": t.run.median,
                "vs_1_worker": t.run.median / r.throughput[0].run.median,
                "workers_used": t.workers_used,
                "short_calls": t.short_calls,
                "runs": _samples(t.run),
            }
            for t in r.throughput
        ],
        "same_process_diagnostic": (
            {
                "raw_tokens_per_s": r.same_process.raw.median,
                "pool_tokens_per_s": r.same_process.pool.median,
                "pool_over_raw": r.same_process.ratio,
                "raw": _samples(r.same_process.raw),
                "pool": _samples(r.same_process.pool),
            }
            if r.same_process
            else None
        ),
        "memory": [
            {
                **m,
                "rss_per_worker_mb": (_delta(m, "rss") or 0.0) / m["workers"],
                "anon_per_worker_mb": (_delta(m, "anon") or 0.0) / m["workers"],
                "pss_per_worker_mb": (_delta(m, "pss") or 0.0) / m["workers"],
            }
            if "error" not in m
            else m
            for m in r.memory
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the figures here")
    parser.add_argument("--serve", metavar="CONFIG", help=argparse.SUPPRESS)  # a child side
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.serve:
        return serve(json.loads(args.serve))
    sizes = QUICK if args.quick else FULL

    report = run_all(sizes)
    text = render(report)
    print()
    print("## inference")
    print()
    print(text)
    if args.quick:
        print("\n(--quick: sizes too small to be figures)")
    if args.json:
        args.json.write_text(json.dumps(to_json(report), indent=2) + "\n", encoding="utf-8")
        print(f"\nfigures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
