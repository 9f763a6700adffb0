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
3. time to first token: the pool's own `ttft_seconds` (worker start to first sampled token) of
   the calls in (1), and the wall time of a max_tokens=1 call, raw and through the pool;
4. memory per worker: RSS (plus anonymous RSS and PSS) of a fresh Python process before and after
   starting a pool of 1 worker and of 2 workers and serving one short call on each worker, per
   tier. Each measurement runs in its own subprocess, so freed heaps and other instances do not
   blur it;
5. GPU: when this llama.cpp build can offload (`llama_supports_gpu_offload()`), (1) again with
   n_gpu_layers=-1 as its own rows; otherwise a line says the GPU rows were skipped.

The machine may be shared: `others' CPU` is the cores' worth of CPU the rest of the machine used
during the median run (0.00 = a quiet box). Nothing is written to bench/RESULTS.md; the figures
are printed, and written as JSON with `--json PATH`.

Run from the repository root (the models must be fetched: `appliance models fetch`):

    .venv/bin/python -m bench.inference_bench                  # the full run (~2-3 minutes)
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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    tp_repeats: int  # (2): per configuration
    mem_tokens: int  # (4): the one short call per worker


FULL = Sizes(
    repeats=5,
    max_tokens=96,
    ttft_repeats=5,
    tp_requests=8,
    tp_max_tokens=64,
    tp_repeats=3,
    mem_tokens=8,
)
QUICK = Sizes(
    repeats=2,
    max_tokens=24,
    ttft_repeats=2,
    tp_requests=4,
    tp_max_tokens=16,
    tp_repeats=1,
    mem_tokens=4,
)

_prompts = iter(range(1_000_000))


def counting_prompt() -> str:
    """A prompt a model continues up to max_tokens; every call gets a different start, so no
    instance can reuse a cached prompt prefix from its previous call."""
    k = next(_prompts)
    start = 100 + 113 * k
    numbers = ", ".join(str(start + j) for j in range(8))
    return f"Count upwards, one number per item: {numbers},"


# -- stdout/stderr ------------------------------------------------------------------------------


class Stdio:
    """Puts stdout and stderr back after llama-cpp-python loads models.

    With verbose=False, `Llama(...)` silences output while it loads by pointing fds 1 and 2 and
    sys.stdout/sys.stderr at /dev/null and back, process-wide and not thread-safely. When two
    workers load at once (a pool of 2), the second one saves the first one's /dev/null as the
    "original" and restores it: the process stays silent for good. Call `restore()` after every
    pool start, when no load is in progress.
    """

    def __init__(self) -> None:
        self.out, self.err = sys.stdout, sys.stderr
        self.fds = (os.dup(1), os.dup(2))

    def restore(self) -> None:
        os.dup2(self.fds[0], 1)
        os.dup2(self.fds[1], 2)
        sys.stdout, sys.stderr = self.out, self.err


STDIO: Stdio | None = None


async def start(pool: InferencePool) -> None:
    """`pool.start()`, then output restored (see Stdio)."""
    try:
        await pool.start()
    finally:
        if STDIO is not None:
            STDIO.restore()


# -- models --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """One tier's pinned model and its verified file."""

    tier: Tier
    entry: ModelEntry
    path: Path

    def spec(self, workers: int, n_threads: int, n_gpu_layers: int = 0, queue: int = 8) -> TierSpec:
        e = self.entry
        return TierSpec(
            tier=self.tier,
            model=e.name,
            sha256=e.sha256,
            path=self.path,
            chat_format=e.chat_format,
            context_length=e.context_length,
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


def load_models() -> dict[Tier, Model]:
    lock = load_lock(LOCK_PATH)
    cache = ModelCache()
    entries = lock.profile(PROFILE)
    return {tier: Model(tier, entries[tier], cache.verify(entries[tier]).path) for tier in TIERS}


def request(prompt: str, max_tokens: int) -> InferenceRequest:
    return InferenceRequest(
        "bench", prompt=prompt, max_tokens=max_tokens, temperature=0.0, seed=SEED
    )


# -- timing --------------------------------------------------------------------------------------


def _machine_busy() -> float:
    """System-wide busy CPU seconds (all cores) since boot."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def _steal() -> float:
    return getattr(psutil.cpu_times(), "steal", 0.0)


class Clock:
    """Times a block: wall clock, this process's CPU (every thread, so the pool's workers too) and
    what the rest of the machine used meanwhile; leaves a harness `Sample` of `n` items."""

    def __init__(self) -> None:
        self.n = 0
        self.sample: Sample | None = None

    def __enter__(self) -> Clock:
        self._busy0, self._steal0 = _machine_busy(), _steal()
        self._cpu0 = time.process_time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        cpu = time.process_time() - self._cpu0
        other = max(0.0, _machine_busy() - self._busy0 - cpu)
        self.sample = Sample(self.n, wall, cpu, None, other, _steal() - self._steal0)

    @property
    def wall(self) -> float:
        return self.sample.wall if self.sample else float("nan")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- (1) and (3): generation, raw against the pool ------------------------------------------------


@dataclass
class Generation:
    """One tier on one backend: raw and pool repeats, and the time-to-first-token probes."""

    tier: Tier
    model: str
    backend: str  # "cpu" or "gpu"
    n_gpu_layers: int
    max_tokens: int
    raw: Measurement = field(default_factory=lambda: Measurement("raw", "tokens/s"))
    pool: Measurement = field(default_factory=lambda: Measurement("pool", "tokens/s"))
    raw_tokens: list[int] = field(default_factory=list)
    pool_tokens: list[int] = field(default_factory=list)
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


def _raw_call(llm: llama_cpp.Llama, prompt: str, max_tokens: int) -> tuple[Sample, int]:
    with Clock() as clock:
        out: Any = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, seed=SEED)
        clock.n = int(out["usage"]["completion_tokens"])
    assert clock.sample is not None
    return clock.sample, clock.n


async def _pool_call(
    pool: InferencePool, tier: Tier, prompt: str, max_tokens: int
) -> tuple[Sample, InferenceResult]:
    with Clock() as clock:
        result = await pool.infer(request(prompt, max_tokens), tier)
        clock.n = result.completion_tokens
    assert clock.sample is not None
    return clock.sample, result


async def measure_generation(model: Model, sizes: Sizes, n_gpu_layers: int = 0) -> Generation:
    backend = "gpu" if n_gpu_layers else "cpu"
    gen = Generation(model.tier, model.entry.name, backend, n_gpu_layers, sizes.max_tokens)
    t0 = time.perf_counter()
    llm = model.raw(n_gpu_layers=n_gpu_layers)
    gen.load_raw_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pool = InferencePool([model.spec(workers=1, n_threads=THREADS, n_gpu_layers=n_gpu_layers)])
    await start(pool)
    gen.load_pool_s = time.perf_counter() - t0
    try:
        # Warm-up (untimed): page the weights in and settle both instances.
        _raw_call(llm, counting_prompt(), sizes.max_tokens)
        await _pool_call(pool, model.tier, counting_prompt(), sizes.max_tokens)
        for rep in range(sizes.repeats):
            prompt = counting_prompt()
            print(f"  {model.tier.value}/{backend}: repeat {rep + 1}/{sizes.repeats}", flush=True)
            for side in ("raw", "pool") if rep % 2 == 0 else ("pool", "raw"):
                if side == "raw":
                    sample, tokens = _raw_call(llm, prompt, sizes.max_tokens)
                    gen.raw.add(sample)
                    gen.raw_tokens.append(tokens)
                else:
                    sample, result = await _pool_call(pool, model.tier, prompt, sizes.max_tokens)
                    gen.pool.add(sample)
                    gen.pool_tokens.append(result.completion_tokens)
                    gen.pool_ttft.append(result.ttft_seconds)
                    gen.pool_queue.append(result.queue_seconds)
                    gen.pool_overhead.append(sample.wall - result.total_seconds)
        for rep in range(sizes.ttft_repeats):
            prompt = counting_prompt()
            for side in ("raw", "pool") if rep % 2 == 0 else ("pool", "raw"):
                if side == "raw":
                    gen.raw_first.append(_raw_call(llm, prompt, 1)[0].wall)
                else:
                    gen.pool_first.append((await _pool_call(pool, model.tier, prompt, 1))[0].wall)
    finally:
        await pool.close()
        llm.close()
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


async def _burst(
    pool: InferencePool, tier: Tier, n: int, max_tokens: int
) -> tuple[Sample, int, int]:
    """`n` requests at once; the timed sample, how many workers served them, how many stopped
    short of max_tokens."""
    prompts = [counting_prompt() for _ in range(n)]
    with Clock() as clock:
        results = await asyncio.gather(*(pool.infer(request(p, max_tokens), tier) for p in prompts))
        clock.n = sum(r.completion_tokens for r in results)
    assert clock.sample is not None
    short = sum(1 for r in results if r.completion_tokens < max_tokens)
    return clock.sample, len({r.worker for r in results}), short


async def measure_throughput(model: Model, sizes: Sizes) -> list[Throughput]:
    layouts = [
        Throughput("1 worker x 2 threads", 1, THREADS, sizes.tp_requests, sizes.tp_max_tokens),
        Throughput(
            f"{THREADS} workers x 1 thread", THREADS, 1, sizes.tp_requests, sizes.tp_max_tokens
        ),
    ]
    queue = max(8, sizes.tp_requests)
    pools = [
        InferencePool([model.spec(workers=t.workers, n_threads=t.n_threads, queue=queue)])
        for t in layouts
    ]
    try:
        for pool in pools:
            await start(pool)
        for pool, layout in zip(pools, layouts, strict=True):  # warm-up: every worker once
            await _burst(pool, model.tier, layout.workers, sizes.tp_max_tokens)
        for rep in range(sizes.tp_repeats):
            print(f"  throughput: repeat {rep + 1}/{sizes.tp_repeats}", flush=True)
            order = [0, 1] if rep % 2 == 0 else [1, 0]
            for i in order:
                sample, used, short = await _burst(
                    pools[i], model.tier, sizes.tp_requests, sizes.tp_max_tokens
                )
                layouts[i].run.add(sample)
                layouts[i].workers_used.append(used)
                layouts[i].short_calls += short
    finally:
        for pool in pools:
            await pool.close()
    return layouts


# -- (4): memory per worker, each layout in a fresh process ----------------------------------------


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


async def _memory_probe(tier: Tier, workers: int, tokens: int) -> dict[str, Any]:
    model = load_models()[tier]
    n_threads = max(1, THREADS // workers)
    spec = model.spec(workers=workers, n_threads=n_threads)
    before = memory_now()
    pool = InferencePool([spec])
    await start(pool)
    loaded = memory_now()
    try:
        results = await asyncio.gather(
            *(pool.infer(request(counting_prompt(), tokens), tier) for _ in range(workers))
        )
        serving = memory_now()
        used = len({r.worker for r in results})
    finally:
        await pool.close()
    return {
        "tier": tier.value,
        "model": model.entry.name,
        "workers": workers,
        "n_threads": n_threads,
        "workers_used": used,
        "before": before,
        "loaded": loaded,
        "serving": serving,
    }


def memory_probe_main(arg: str) -> int:
    """`--memory-probe TIER:WORKERS`: measure in this (fresh) process and print one JSON line."""
    tier_name, _, workers = arg.partition(":")
    tokens = int(os.environ.get("INFERENCE_BENCH_MEM_TOKENS", "8"))
    out = asyncio.run(_memory_probe(Tier(tier_name), int(workers), tokens))
    print(json.dumps(out))
    return 0


def measure_memory(sizes: Sizes) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    env = {**os.environ, "INFERENCE_BENCH_MEM_TOKENS": str(sizes.mem_tokens)}
    for tier in TIERS:
        for workers in (1, THREADS):
            print(f"  memory: {tier.value}, {workers} worker(s) in a fresh process", flush=True)
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.inference_bench",
                    "--memory-probe",
                    f"{tier}:{workers}",
                ],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode != 0 or not lines:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                rows.append({"tier": tier.value, "workers": workers, "error": " / ".join(tail)})
                continue
            rows.append(json.loads(lines[-1]))
    return rows


# -- the whole run ---------------------------------------------------------------------------------


@dataclass
class Report:
    sizes: Sizes
    facts: dict[str, str]
    generation: list[Generation] = field(default_factory=list)
    throughput: list[Throughput] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    gpu: bool = False
    wall: float = 0.0


async def run_all(sizes: Sizes) -> Report:
    t0 = time.perf_counter()
    facts = machine_facts()
    facts["loadavg_start"] = facts.pop("loadavg")
    facts.pop("psycopg", None)
    facts["tree"] = code_version()
    facts["llama_cpp"] = llama_cpp.__version__
    with contextlib.suppress(Exception):
        facts["llama_system_info"] = llama_cpp.llama_print_system_info().decode().strip()
    report = Report(sizes, facts, gpu=gpu_offload_supported())
    models = load_models()
    for tier in TIERS:
        print(f"generation: {tier.value} ({models[tier].entry.name}), raw vs pool ...", flush=True)
        report.generation.append(await measure_generation(models[tier], sizes))
    if report.gpu:
        for tier in TIERS:
            print(f"generation on the GPU: {tier.value}, raw vs pool ...", flush=True)
            report.generation.append(await measure_generation(models[tier], sizes, -1))
    print("throughput: mechanical, 1 worker vs 2 workers ...", flush=True)
    report.throughput = await measure_throughput(models[Tier.MECHANICAL], sizes)
    print("memory per worker ...", flush=True)
    report.memory = await asyncio.to_thread(measure_memory, sizes)
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


def _tokens(values: Sequence[int], max_tokens: int) -> str:
    if not values:
        return "-"
    lo = min(values)
    return f"{max_tokens}" if lo == max_tokens else f"{lo}-{max(values)} of {max_tokens}"


def _generation_table(r: Report) -> str:
    rows = [
        [
            g.tier.value,
            g.model,
            g.backend,
            _tps(g.raw),
            _tps(g.pool),
            f"{g.ratio:.3f}",
            f"{g.paired_ratio:.3f}",
            f"{_tokens(g.raw_tokens, g.max_tokens)} / {_tokens(g.pool_tokens, g.max_tokens)}",
            f"{fmt_share(g.raw.other_share)} / {fmt_share(g.pool.other_share)}",
        ]
        for g in r.generation
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
            " Raw: `Llama(...).create_completion` in the main thread; pool: `await"
            " pool.infer(...)` to a 1-worker pool, so queueing, the thread hand-off and the"
            " pool's per-token callback count against it. `paired` = median of the per-repeat"
            " ratios.",
            f"- Throughput: {s.tp_requests} requests of max_tokens {s.tp_max_tokens} submitted"
            " at once (`asyncio.gather`); tokens/s = all completion tokens / wall time of the"
            f" burst; medians of {s.tp_repeats}, layouts alternating; both layouts use"
            f" {THREADS} threads in all.",
            f"- Time to first token: `ttft_seconds` of the pool's generation calls (worker"
            " start to the first sampled token; excludes queueing); `wall - total_seconds` ="
            " what the pool adds around the model call; max_tokens=1 wall: medians of"
            f" {s.ttft_repeats} alternating calls per side.",
            "- Memory: a fresh `python -m bench.inference_bench --memory-probe` process per row;"
            " before = after imports, +loaded = after `pool.start()`, +serving = after one"
            f" max_tokens={s.mem_tokens} call per worker. Weights are mmap'd: RSS counts a"
            " file page once per mapping (so a second worker of the same model adds its"
            " weights to RSS again), PSS counts it once; anon RSS is the private part (KV"
            " cache, compute buffers).",
            gpu_line,
            "",
            "### Generation (tokens/s)",
            "",
            _generation_table(r),
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
    parser.add_argument("--memory-probe", metavar="TIER:WORKERS", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global STDIO
    STDIO = Stdio()
    logging.basicConfig(level=logging.WARNING)
    if args.memory_probe:
        return memory_probe_main(args.memory_probe)
    sizes = QUICK if args.quick else FULL

    report = asyncio.run(run_all(sizes))
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
