"""Settings: one pydantic-settings section per subsystem, read from APPLIANCE_* variables."""

from __future__ import annotations

from datetime import time, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from appliance.domain.envelope import DEFAULT_CONTEXT_MAX_BYTES, Lane
from appliance.domain.inference import Tier
from appliance.domain.retry import RetryPolicy


def default_state_dir() -> Path:
    """./var in a checkout (next to pyproject.toml); /var/lib/appliance in an installed image."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / "sql").is_dir():
        return root / "var"
    return Path("/var/lib/appliance")


DEFAULT_QUEUE_AGES: dict[Lane, float | None] = {
    Lane.INTERACTIVE: 3600.0,
    Lane.SYSTEM: 86400.0,
    Lane.BATCH: None,
}


class _Section(BaseModel):
    """A settings section: no infinite or NaN numbers (they passed the bounds, then failed
    the start with an OverflowError naming no setting)."""

    model_config = ConfigDict(allow_inf_nan=False)


class DatabaseSettings(_Section):
    """Where the database is: the local cluster under the state dir, or a given server."""

    # Set APPLIANCE_DATABASE_URL to use an existing server; the appliance then manages nothing.
    # That URL is the migrating (admin) user; the runtime roles connect as themselves unless
    # their URLs are given too.
    url: str | None = None
    app_url: str | None = None
    system_url: str | None = None
    pg_bindir: Path | None = None
    port: int = Field(default=5432, ge=1, le=65535)
    # Empty: no TCP at all, only the Unix socket inside the state dir.
    listen_addresses: str = ""
    name: str = Field(default="appliance", pattern=r"^[a-z_][a-z0-9_]{0,62}$")
    pool_min: int = Field(default=1, ge=0)
    pool_max: int = Field(default=8, ge=1)
    # The runtime roles' longest statement (claims, acknowledgements, maintenance batches, the
    # CLI's queries): longer, the server cancels it (see appliance/db/database.py).
    statement_timeout_seconds: float = Field(default=300.0, ge=1.0, le=86400.0)

    @property
    def statement_timeout(self) -> timedelta:
        return timedelta(seconds=self.statement_timeout_seconds)

    @model_validator(mode="after")
    def _pool_fits(self) -> DatabaseSettings:
        if self.pool_min > self.pool_max:
            raise ValueError(
                f"pool_min ({self.pool_min}) must be at most pool_max ({self.pool_max})"
            )
        return self


class BusSettings(_Section):
    """The envelope's rules: leases, retries, sizes, retention, queue ages."""

    lease_seconds: float = Field(default=30.0, ge=1.0, le=86400.0)
    max_attempts: int = Field(default=5, ge=1, le=100)
    # Bounded so that a delay is always a valid interval (a week is already far past useful).
    retry_base_seconds: float = Field(default=2.0, gt=0, le=604800.0)
    retry_cap_seconds: float = Field(default=600.0, gt=0, le=604800.0)
    # At most 64 MiB: a statement's JSON must stay under PostgreSQL's 256 MiB jsonb limit with
    # any one request in it (see ENQUEUE_STATEMENT_BYTES in appliance/db/message_store.py).
    context_max_bytes: int = Field(default=DEFAULT_CONTEXT_MAX_BYTES, ge=1024, le=64 * 2**20)
    idempotency_retention_days: float = Field(default=90.0, gt=0, le=36500.0)
    # Pending work older than this is expired instead of run (None: no limit for the lane).
    # A lane given alone (APPLIANCE_BUS__MAX_QUEUE_AGE_SECONDS__BATCH=7200) keeps the others'.
    max_queue_age_seconds: dict[Lane, float | None] = Field(
        default_factory=lambda: dict(DEFAULT_QUEUE_AGES)
    )
    maintenance_batch: int = Field(default=500, ge=1, le=100_000)

    @field_validator("max_queue_age_seconds", mode="after")
    @classmethod
    def _queue_ages(cls, given: dict[Lane, float | None]) -> dict[Lane, float | None]:
        for lane, age in given.items():
            if age is not None and not 0 < age <= 31_536_000:
                raise ValueError(
                    f"{lane.value}: {age:g} s is outside 0 < age <= 31536000 (none: no limit)"
                )
        return {**DEFAULT_QUEUE_AGES, **given}

    @property
    def lease(self) -> timedelta:
        return timedelta(seconds=self.lease_seconds)

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(
            base=timedelta(seconds=self.retry_base_seconds),
            cap=timedelta(seconds=self.retry_cap_seconds),
        )

    @property
    def idempotency_retention(self) -> timedelta:
        return timedelta(days=self.idempotency_retention_days)


class RunnerSettings(_Section):
    """One runner process: capacity by lane, fairness, leases, wake-ups, shutdown."""

    # This runner's id, unique among live runners (the cockpit, the log's actors and the
    # stages runners share go by it). Unset: host:pid, which collides where runners share a
    # host name and their pids (containers on the host's network, each pid 1, say).
    id: str | None = Field(default=None, min_length=1, max_length=200, pattern=r"^\S+$")
    concurrency: int = Field(default=8, ge=1, le=1024)
    reserved_interactive: int = Field(default=2, ge=0)
    reserved_system: int = Field(default=1, ge=0)
    # Default limit of each tenant's leases across all runners, claimed-ahead ones included (a
    # tenant's own max_running overrides it); unset: concurrency + claim_ahead.
    tenant_limit: int | None = Field(default=None, ge=1)
    # The most messages one claim asks for.
    claim_batch: int = Field(default=48, ge=1, le=1000)
    # The most messages a runner holds leased beyond its free slots, for quick stages only
    # (0 turns claim-ahead off).
    claim_ahead: int = Field(default=40, ge=0, le=1000)
    # LISTEN/NOTIFY wake-ups; off means the runner relies on the fallback poll alone.
    listen: bool = True
    # Bounded so that every one is a valid interval (and a day is already far past useful).
    poll_interval_seconds: float = Field(default=30.0, gt=0, le=86400)
    drain_timeout_seconds: float = Field(default=10.0, ge=0, le=86400)
    cancel_grace_seconds: float = Field(default=5.0, ge=0, le=86400)
    reclaim_interval_seconds: float = Field(default=1.0, gt=0, le=86400)
    expire_interval_seconds: float = Field(default=5.0, gt=0, le=86400)
    archive_interval_seconds: float = Field(default=60.0, gt=0, le=86400)
    archive_retention_days: float = Field(default=7.0, ge=0, le=36500)
    # Finished history older than this is deleted (archived messages with their transition
    # logs, model calls, past months' ledger lines, runners long stopped; migration 0025).
    # None (`none` in the environment) keeps it for ever.
    history_retention_days: float | None = Field(default=400.0, gt=0, le=36500)
    # How long model work may wait for its tier (waiting_capability) before it expires.
    capability_wait_seconds: float = Field(default=3600.0, gt=0, le=31_536_000)
    # How long work may wait for a runner that serves its stage (none live: all stopped for an
    # upgrade, or a stage of a newer version) before it expires. Days, not a model's hour.
    stage_wait_seconds: float = Field(default=7 * 86400.0, gt=0, le=31_536_000)
    # Hand-offs a message may be from its run's start (a pipeline's budget may say fewer).
    max_hops: int = Field(default=1000, ge=1)
    pipelines: list[str] = Field(default_factory=lambda: ["demo", "support"])
    # Extra modules whose PIPELINES (and optional SCHEDULES) lists the runner serves too.
    pipeline_modules: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _history_outlives_the_archive(self) -> RunnerSettings:
        # History is pruned from the archive: a retention shorter than the archive's would
        # delete messages as they arrive there.
        kept = self.history_retention_days
        if kept is not None and kept < self.archive_retention_days:
            raise ValueError(
                f"history_retention_days ({kept:g}) must be at least archive_retention_days"
                f" ({self.archive_retention_days:g}): history is pruned from the archive"
            )
        return self


def default_models_lock() -> Path:
    """models.lock at the root of a checkout; /etc/appliance/models.lock in an installed image."""
    root = Path(__file__).resolve().parents[1]
    if (root / "models.lock").is_file():
        return root / "models.lock"
    return Path("/etc/appliance/models.lock")


class TierSettings(_Section):
    """One model tier of the runner's pool."""

    # 0 takes the tier down: its work waits in waiting_capability (never downgraded).
    workers: int = Field(default=1, ge=0, le=64)
    n_ctx: int = Field(default=2048, ge=128, le=1_048_576)
    # None: the cores split evenly over every worker of the pool.
    n_threads: int | None = Field(default=None, ge=1, le=1024)
    # Layers offloaded to the GPU when llama.cpp was built with a GPU backend (-1: all).
    n_gpu_layers: int = Field(default=0, ge=-1)
    # Requests waiting beyond the busy workers; also what bounds the runner's claims.
    queue: int = Field(default=4, ge=0, le=10_000)


class InferenceSettings(_Section):
    """The in-process llama.cpp pool: which models (a profile of models.lock) and how many."""

    enabled: bool = True
    profile: str = "dev"
    lock: Path = Field(default_factory=default_models_lock)
    # None: $APPLIANCE_MODEL_CACHE or ~/.cache/appliance/models.
    cache_dir: Path | None = None
    tiers: dict[Tier, TierSettings] = Field(
        default_factory=lambda: {Tier.MECHANICAL: TierSettings(), Tier.REASONING: TierSettings()}
    )

    def tier(self, tier: Tier) -> TierSettings:
        """A tier's settings; a tier not named (an override of only the other) has defaults."""
        return self.tiers.get(tier) or TierSettings()


class TimeOfUseBand(_Section):
    """A price for local hours [start, end), for example 07:00-23:00 at the day rate."""

    start: time
    end: time
    price_per_kwh: Decimal = Field(ge=0)


class SpendSettings(_Section):
    """Money: the tariff, the monthly cap and how conservatively a call is priced."""

    enabled: bool = True
    # Applied once, when no cap is set yet (`appliance cap set` changes it afterwards).
    monthly_cap: Decimal = Field(default=Decimal("10.00"), ge=0)
    currency: str = Field(default="EUR", pattern=r"^[A-Z]{3}$")
    price_per_kwh: Decimal = Field(default=Decimal("0.30"), ge=0)
    time_of_use: list[TimeOfUseBand] = Field(default_factory=list)
    # Measured device energy times this is the wall energy (supply losses, cooling); 1.0 takes
    # the figure as measured or estimated.
    power_overhead: Decimal = Field(default=Decimal("1.0"), ge=1)
    amortisation_price: Decimal = Field(default=Decimal(0), ge=0)
    amortisation_months: int = Field(default=36, ge=1)
    # Month boundaries are taken in this zone, by the database clock.
    time_zone: str = "UTC"
    # The share of the cap only interactive work may use.
    interactive_share: Decimal = Field(default=Decimal("0.2"), ge=0, le=1)
    # Fractions of a cap at which an alert is recorded (each in (0, 1]; reaching the cap
    # always alerts).
    alert_fractions: list[Annotated[Decimal, Field(gt=0, le=1)]] = Field(
        default_factory=lambda: [Decimal("0.5"), Decimal("0.8"), Decimal("0.95")]
    )
    # The first call in the cap's waiting line (refused only because calls in flight hold the
    # room) asks again in place for this long at most before its message is deferred (0
    # defers at once); its stage's deadline may end the wait sooner.
    busy_wait_seconds: float = Field(default=120.0, ge=0, le=3600)
    # A call reserves its worst case times this (the cap stays conservative with estimates).
    safety_factor: Decimal = Field(default=Decimal("1.5"), ge=1)
    # Joules per token when a model has no calibration; None refuses such calls.
    default_joules_per_token: Decimal | None = Field(default=Decimal("2.0"), gt=0)
    joules_per_token: dict[str, Decimal] = Field(default_factory=dict)


class MeteringSettings(_Section):
    """Where energy figures come from: a counter when one exists, else an honest estimate."""

    source: Literal["auto", "nvml", "rapl", "estimate"] = "auto"
    # The estimate: idle watts of the box plus watts per fully busy core of inference threads.
    idle_watts: float = Field(default=10.0, ge=0)
    watts_per_busy_core: float = Field(default=15.0, ge=0)
    sample_seconds: float = Field(default=1.0, gt=0)


class Settings(BaseSettings):
    """All settings. Nested fields read APPLIANCE_<SECTION>__<FIELD>; a few have short names."""

    model_config = SettingsConfigDict(
        env_prefix="APPLIANCE_",
        env_nested_delimiter="__",
        extra="ignore",
        # `none` sets an optional setting to None (history_retention_days: keep for ever).
        env_parse_none_str="none",
        # An empty variable is unset (APPLIANCE_PG_BINDIR= read as the current folder).
        env_ignore_empty=True,
    )

    state_dir: Path = Field(default_factory=default_state_dir)
    db: DatabaseSettings = Field(default_factory=DatabaseSettings)
    bus: BusSettings = Field(default_factory=BusSettings)
    runner: RunnerSettings = Field(default_factory=RunnerSettings)
    inference: InferenceSettings = Field(default_factory=InferenceSettings)
    spend: SpendSettings = Field(default_factory=SpendSettings)
    metering: MeteringSettings = Field(default_factory=MeteringSettings)

    # The documented short names (APPLIANCE_DATABASE_URL, APPLIANCE_PG_BINDIR) win over nested ones.
    database_url: str | None = Field(
        default=None, validation_alias=AliasChoices("APPLIANCE_DATABASE_URL")
    )
    pg_bindir: Path | None = Field(
        default=None, validation_alias=AliasChoices("APPLIANCE_PG_BINDIR")
    )

    @model_validator(mode="after")
    def _history_outlives_the_keys(self) -> Settings:
        # A duplicate request is answered with its first message's id while the key lives: that
        # message (and its log) must still be there to show.
        # A key may live a retention past its message's last duplicate, which can come as late
        # as the message's move to the archive (migrations 0024, 0031): history must outlive
        # both together.
        kept = self.runner.history_retention_days
        keys = self.bus.idempotency_retention_days
        archive = self.runner.archive_retention_days
        if kept is not None and kept < keys + archive:
            raise ValueError(
                f"runner.history_retention_days ({kept:g}) must be at least"
                f" bus.idempotency_retention_days ({keys:g}) + runner.archive_retention_days"
                f" ({archive:g}): a duplicate request is answered with the id of the message its"
                " key names"
            )
        return self

    def model_post_init(self, __context: object) -> None:
        if self.database_url:
            self.db.url = self.database_url
        if self.pg_bindir:
            self.db.pg_bindir = self.pg_bindir


def settings_error_text(exc: ValidationError) -> str:
    """A refused setting as one line naming the setting, the environment variable that sets it
    and the rule it broke (instead of pydantic's multi-line report)."""
    parts = []
    for error in exc.errors():
        path = [str(p) for p in error["loc"]]
        if not path:
            # A rule across sections (its message names the settings): no one variable to name.
            parts.append(str(error["msg"]).removeprefix("Value error, "))
            continue
        name = ".".join(path)
        variable = (
            path[0] if path[0].startswith("APPLIANCE_") else "APPLIANCE_" + "__".join(path).upper()
        )
        parts.append(
            f"{name} (environment variable {variable}): {error['msg']}, got {error.get('input')!r}"
        )
    return "settings: " + "; ".join(parts)
