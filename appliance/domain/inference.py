"""Inference contracts and the routing policy: tiers, task kinds, requests, results, errors.

Pure: the pool (inference/) serves these contracts and the runner (bus/) routes with them. The
policy maps a task kind to the weakest tier allowed to do it; a route may go up a tier (when the
allowed one is down), never down. Unknown kinds are treated as reasoning: the safe side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol

from appliance.domain.errors import ApplianceError, InvalidInput


class Tier(StrEnum):
    """A capability class of models, weakest first."""

    MECHANICAL = "mechanical"
    REASONING = "reasoning"

    @property
    def rank(self) -> int:
        return TIER_ORDER.index(self)


TIER_ORDER: tuple[Tier, ...] = (Tier.MECHANICAL, Tier.REASONING)

MECHANICAL_KINDS = frozenset({"classify", "score", "extract", "format", "health_check"})
REASONING_KINDS = frozenset({"synthesize", "analyze", "draft", "evaluate"})


def min_tier(kind: str) -> Tier:
    """The weakest tier allowed to do `kind`; anything not known to be mechanical is reasoning."""
    return Tier.MECHANICAL if kind in MECHANICAL_KINDS else Tier.REASONING


@dataclass(frozen=True)
class Route:
    """Where one call goes and why: the tier serving it and the weakest tier it was allowed."""

    kind: str
    tier: Tier
    min_tier: Tier
    reason: str

    @property
    def upgraded(self) -> bool:
        return self.tier is not self.min_tier


def route(kind: str, available: Collection[Tier]) -> Route | None:
    """The tier to serve `kind` now, or None when no allowed tier is up (the work must wait).

    Only tiers at or above the kind's minimum are ever considered: never a downgrade.
    """
    need = min_tier(kind)
    if need in available:
        return Route(kind, need, need, f"{kind} needs {need.value}")
    for tier in TIER_ORDER[need.rank + 1 :]:
        if tier in available:
            return Route(kind, tier, need, f"upgraded: {need.value} tier unavailable")
    return None


def resumable(available: Collection[Tier]) -> frozenset[Tier]:
    """The minimum tiers whose waiting work can run now (some tier at or above is up)."""
    return frozenset(t for t in TIER_ORDER if any(u.rank >= t.rank for u in available))


# -- requests and results ----------------------------------------------------------------------


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class InferenceRequest:
    """One call: a prompt (completion) or messages (chat), optionally constrained to a schema."""

    kind: str
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] = ()
    json_schema: Mapping[str, Any] | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.prompt is None) == (not self.messages):
            raise InvalidInput("request", "give exactly one of prompt or messages")
        if not 1 <= self.max_tokens <= 32768:
            raise InvalidInput("max_tokens", f"must be 1..32768, not {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidInput("temperature", f"must be 0..2, not {self.temperature}")
        for m in self.messages:
            if m.role not in {"system", "user", "assistant"}:
                raise InvalidInput("messages.role", f"unknown role {m.role!r}")


@dataclass(frozen=True)
class InferenceResult:
    """What a call produced and what it cost in tokens and time (recorded per call)."""

    text: str
    model: str
    model_sha256: str
    tier: Tier
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    queue_seconds: float
    ttft_seconds: float
    total_seconds: float
    worker: str = ""
    route: Route | None = None
    data: Any = None
    # The call's share of measured (or estimated) device energy, and where the figure came from.
    energy_joules: float | None = None
    energy_provenance: str | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What serves a tier: the model, its hash and the context it was loaded with."""

    model: str
    sha256: str
    n_ctx: int


@dataclass(frozen=True)
class CallRecord:
    """One inference call as stored against its message (the audit trail of routing)."""

    message_id: int
    tenant: str
    pipeline: str
    stage: str
    kind: str
    tier: Tier
    min_tier: Tier
    route_reason: str
    model: str
    model_sha256: str
    status: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    error: str | None = None
    at: datetime | None = None


# -- errors --------------------------------------------------------------------------------------


class InferenceError(ApplianceError):
    """A call failed; the pool goes on serving. `energy_joules`: what it used before failing;
    the token counts, when it was stopped part way (a timeout, a cancel). `unmetered`: the
    meter failed around it, so what it used is not known (it is charged its reservation)."""

    energy_joules: float | None = None
    energy_provenance: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    unmetered: bool = False


class CapabilityUnavailable(InferenceError):
    """No tier allowed to do this kind of work is up: the message waits instead of downgrading."""

    def __init__(self, kind: str, tier: Tier) -> None:
        super().__init__(f"no model of tier {tier.value} or above is available for {kind!r}")
        self.kind = kind
        self.tier = tier


class QueueFull(InferenceError):
    """The tier's queue is at its bound: the request was refused, not queued."""


class DeadlineExceeded(InferenceError):
    """The request could not start (or finish) before its deadline: refused, not run late."""


class CallCancelled(InferenceError):
    """The call was cancelled; generation stopped between tokens (`tokens` were generated)."""

    def __init__(self, message: str, tokens: int = 0) -> None:
        super().__init__(message)
        self.tokens = tokens


class OutputInvalid(InferenceError):
    """The model's output does not parse into the expected schema (it is data, never commands)."""


# -- the port the runner uses ----------------------------------------------------------------------


# The finish reason of a call whose generation was stopped at the energy its reservation paid
# for (a cut like max_tokens' "length": the text is what was generated until then).
ENERGY_LIMIT = "energy_limit"


@dataclass
class CallControl:
    """How a caller bounds one call: a deadline to start by, a timeout to finish in, a cancel."""

    start_deadline: float | None = None  # time.monotonic() value
    timeout: float | None = None  # seconds of processing
    # time.monotonic() value the call ends by, however long it waited in the queue (a stage's
    # time left is an end, not a length of processing).
    finish_by: float | None = None
    cancel: asyncio.Event | None = None
    # Progress: called from the worker thread with the tokens generated so far, once per token.
    # Must be cheap and thread-safe (hand off to the loop with call_soon_threadsafe).
    on_token: Callable[[int], None] | None = None
    # Joules of metered energy the call may use (what its reservation against the cap paid
    # for): generation stops before its energy would pass it, and the result says so with
    # finish_reason ENERGY_LIMIT. Not enforced where the pool has no meter (such a call is
    # charged its whole reservation anyway).
    energy_limit: float | None = None


class InferenceService(Protocol):
    """The pool as the bus sees it."""

    def available(self) -> frozenset[Tier]:
        """Tiers with at least one live worker."""
        ...

    def room(self, tier: Tier) -> int:
        """Requests the tier can still accept now (free workers plus free queue places)."""
        ...

    def capacity(self, tier: Tier) -> int:
        """Requests the tier holds at most: live workers plus its queue bound (0: down)."""
        ...

    def describe(self, tier: Tier) -> ModelInfo | None:
        """The model serving `tier` (None: the tier is down)."""
        ...

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the event loop) when availability or room may have changed."""
        ...

    async def infer(
        self, request: InferenceRequest, tier: Tier, control: CallControl | None = None
    ) -> InferenceResult:
        """Serve one request on `tier`'s pool."""
        ...

    def stats(self) -> dict[str, Any]:
        """Per-tier counters named as llama.cpp's server names them."""
        ...


class EnergyFigure(Protocol):
    """A call's energy as a meter reports it."""

    @property
    def joules(self) -> float: ...

    @property
    def provenance(self) -> str: ...


class CallMeter(Protocol):
    """What the pool needs of a meter: mark a call's start on its thread, and its end."""

    def begin(self, call_id: str, native_id: int, threads: int = 1, *, device: str = "cpu") -> None:
        """Count a call as running on thread `native_id`, computing on `device` ("cpu", or
        "gpu" for a model offloaded to the GPU)."""
        ...

    def end(self, call_id: str) -> EnergyFigure: ...

    def used(self, call_id: str) -> float:
        """The joules charged to a running call so far (closes the meter's current interval)."""
        ...


def as_messages(items: Sequence[Mapping[str, str] | ChatMessage]) -> tuple[ChatMessage, ...]:
    """Chat messages from dicts ({"role", "content"}) or ChatMessage values."""
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        if isinstance(item, ChatMessage):
            out.append(item)
            continue
        try:
            out.append(ChatMessage(str(item["role"]), str(item["content"])))
        except KeyError as exc:
            raise InvalidInput(f"messages[{i}]", f"missing {exc.args[0]!r}") from exc
    return tuple(out)
