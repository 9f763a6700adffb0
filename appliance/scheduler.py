"""APScheduler (asyncio) wiring of the periodic services: reclaim, expire, archive, listener
health, planner statistics, and declared schedules. Every job is safe when several runners run
it at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from appliance.bus.core import Bus
from appliance.db.runner_store import PgRunnerStore
from appliance.db.spend_store import PgSpendStore
from appliance.domain.errors import ConfigurationError
from appliance.domain.ports import Doorbell
from appliance.domain.schedule import Schedule

log = logging.getLogger("appliance.scheduler")
# How long one round of archiving or purging may go on while its batches come back full: ten
# batches of 1,000 a minute (the old bound) fell behind any sustained rate over about 170
# messages a second, and the hot and key tables grew without end.
UPKEEP_ROUND_S = 5.0
# The longest a maintenance job may run: ten of its intervals, at least a minute. With one
# instance per job, one statement that never returned (a half-open connection, a lock held by
# a manual VACUUM) held its job, and everything after it, for the rest of the process.
JOB_LIMIT_MIN_S = 60.0
PROMOTE_LIMIT_S = 30.0
# A wall clock set back by more than this (NTP, a restored VM, an operator) left every
# interval job scheduled that far in the future: all maintenance stopped for that long.
CLOCK_STEP_S = 2.0

EPOCH = datetime(2000, 1, 1, tzinfo=UTC)


def schedule_trigger(schedule: Schedule) -> Any:
    """The APScheduler trigger of a schedule; interval schedules are anchored at a fixed epoch so
    that every runner computes the same fire times."""
    if schedule.every is not None:
        return IntervalTrigger(
            seconds=schedule.every.total_seconds(), start_date=EPOCH, timezone=UTC
        )
    assert schedule.cron is not None
    fields = schedule.cron.split()
    if len(fields) == 5:
        if fields[2] != "*" and fields[4] != "*":
            # crontab fires when either day field matches; APScheduler only when both do.
            raise ConfigurationError(
                f"schedule {schedule.name}: {schedule.cron!r} restricts both the day of the"
                " month and the day of the week, which crontab reads as either one: declare"
                " two schedules, one for each"
            )
        fields[4] = _crontab_weekdays(fields[4], schedule.name)
    try:
        return CronTrigger.from_crontab(" ".join(fields), timezone=UTC)
    except ValueError as exc:
        raise ConfigurationError(
            f"schedule {schedule.name}: {schedule.cron!r} is not a crontab line: {exc}"
        ) from None


# Standard crontab numbers weekdays from Sunday (0 and 7); APScheduler's from_crontab reads
# the same numbers from Monday, so "1-5" ran Tuesday to Saturday. Numbers are turned into
# names, which both read alike.
_WEEKDAY_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")


def _crontab_weekdays(field: str, name: str) -> str:
    """A crontab day-of-week field with its numbers (0-7, Sunday = 0 or 7) as names."""
    if field == "*" or all(c.isalpha() or c in ",-" for c in field):
        return field  # names (mon-fri, sat,sun): read alike by both
    if any(c.isalpha() for c in field):
        # Its numbers would be read from Monday, its names as names: "1,sat" ran on Tuesday.
        raise ConfigurationError(
            f"schedule {name}: day-of-week {field!r} mixes numbers and names: use one or the other"
        )
    days: set[int] = set()
    for part in field.split(","):
        span, _, step_text = part.partition("/")
        try:
            step = int(step_text) if step_text else 1
            if span == "*":
                low, high = 0, 6
            elif "-" in span:
                low, high = (int(x) for x in span.split("-", 1))
            else:
                low = int(span)
                high = 7 if step_text else low
        except ValueError:
            raise ConfigurationError(
                f"schedule {name}: day-of-week {field!r} is not a crontab field"
            ) from None
        if not (0 <= low <= high <= 7 and step >= 1):
            raise ConfigurationError(
                f"schedule {name}: day-of-week {field!r} is outside 0-7 (Sunday is 0 or 7)"
            )
        days.update(d % 7 for d in range(low, high + 1, step))
    return ",".join(_WEEKDAY_NAMES[d] for d in sorted(days))


def latest_fire_time(schedule: Schedule, now: datetime) -> datetime | None:
    """The most recent scheduled time at or before `now` (the slot a firing stands for)."""
    if schedule.every is not None:
        period = schedule.every.total_seconds()
        slots = int((now - EPOCH).total_seconds() // period)
        return EPOCH + timedelta(seconds=slots * period)
    trigger = schedule_trigger(schedule)
    found = None
    t = trigger.get_next_fire_time(None, now - timedelta(days=1))
    while t is not None and t <= now:
        found = t
        t = trigger.get_next_fire_time(t, t + timedelta(microseconds=1))
    return found


async def fire(bus: Bus, schedule: Schedule, now: datetime) -> bool | None:
    """Enqueue the current slot of a schedule; True if new, False if it was already fired."""
    slot = latest_fire_time(schedule, now)
    if slot is None:
        return None
    result = await bus.enqueue(
        tenant=schedule.tenant,
        pipeline=schedule.pipeline,
        stage=schedule.stage,
        source="schedule",
        source_id=schedule.source_id(slot),
        directive=schedule.directive,
        context=schedule.context,
        lane=schedule.lane,
    )
    return result.new


class Maintenance:
    """The periodic services of one runner process."""

    def __init__(
        self,
        bus: Bus,
        store: PgRunnerStore,
        *,
        doorbell: Doorbell | None = None,
        schedules: Sequence[Schedule] = (),
        reclaim_every: timedelta = timedelta(seconds=1),
        expire_every: timedelta = timedelta(seconds=5),
        archive_every: timedelta = timedelta(seconds=60),
        archive_retention: timedelta = timedelta(days=7),
        archive_batch: int = 1000,
        history_retention: timedelta | None = None,
        purge_keys_every: timedelta = timedelta(seconds=60),
        spend: PgSpendStore | None = None,
        run_budget_idle: timedelta = timedelta(days=90),
        month_check_every: timedelta = timedelta(seconds=30),
        stats_every: timedelta = timedelta(seconds=2),
    ) -> None:
        self.bus = bus
        self.spend = spend
        self._month: object = None
        self.store = store
        self.doorbell = doorbell
        self.schedules = list(schedules)
        self.archive_retention = archive_retention
        self.archive_batch = archive_batch
        self.history_retention = history_retention
        self.run_budget_idle = run_budget_idle
        self.scheduler = AsyncIOScheduler(timezone=UTC)
        every = {"coalesce": True, "max_instances": 1, "misfire_grace_time": 30}
        # Jobs in flight, so that stop() can let them finish.
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        jobs: list[tuple[Callable[..., Awaitable[None]], Any]] = [
            (self.reclaim, IntervalTrigger(seconds=reclaim_every.total_seconds())),
            (self.expire, IntervalTrigger(seconds=expire_every.total_seconds())),
            (self.archive, IntervalTrigger(seconds=archive_every.total_seconds())),
            (self.purge_keys, IntervalTrigger(seconds=purge_keys_every.total_seconds())),
            (self.listener_health, IntervalTrigger(seconds=10)),
            (self.planner_stats, IntervalTrigger(seconds=stats_every.total_seconds())),
        ]
        if history_retention is not None:
            jobs.append(
                (self.prune_history, IntervalTrigger(seconds=archive_every.total_seconds()))
            )
        if spend is not None:
            jobs.append(
                (self.month_rollover, IntervalTrigger(seconds=month_check_every.total_seconds()))
            )
            jobs.append(
                (self.purge_run_budgets, IntervalTrigger(seconds=purge_keys_every.total_seconds()))
            )
        self._interval_jobs: list[str] = []
        for job, trigger in jobs:
            limit = max(JOB_LIMIT_MIN_S, 10 * trigger.interval.total_seconds())
            added = self.scheduler.add_job(
                self._tracked(job, limit), trigger, name=job.__name__, **every
            )
            self._interval_jobs.append(added.id)
        self._watch: asyncio.Task[None] | None = None
        self.clock_steps = 0
        for schedule in self.schedules:
            self.scheduler.add_job(
                self._tracked(self.fire, JOB_LIMIT_MIN_S),
                schedule_trigger(schedule),
                args=[schedule],
                name=f"schedule {schedule.name}",
                **every,
            )
        self.reclaimed = 0
        self.promoted = 0
        self.expired = 0
        self.archived = 0
        self.keys_purged = 0
        self.budgets_purged = 0
        self.places_purged = 0
        self.history_pruned = 0
        self.analyzed = 0

    def _tracked(
        self, job: Callable[..., Awaitable[None]], limit_s: float
    ) -> Callable[..., Awaitable[None]]:
        async def run(*args: Any) -> None:
            self._running += 1
            self._idle.clear()
            try:
                async with asyncio.timeout(limit_s):
                    await job(*args)
            except TimeoutError:
                log.error("%s ran past its limit of %.0f s and was stopped", job.__name__, limit_s)
            finally:
                self._running -= 1
                if not self._running:
                    self._idle.set()

        return run

    def start(self) -> None:
        self.scheduler.start()
        self._watch = asyncio.get_running_loop().create_task(self._watch_clock())

    async def _watch_clock(self) -> None:
        wall, mono = time.time(), time.monotonic()
        while True:
            await asyncio.sleep(1.0)  # monotonic: unmoved by the wall clock
            now_wall, now_mono = time.time(), time.monotonic()
            self.clock_stepped(now_wall - wall, now_mono - mono)
            wall, mono = now_wall, now_mono

    def clock_stepped(self, wall_moved_s: float, elapsed_s: float) -> bool:
        """Called with how far the wall clock moved and how much time really passed: when the
        wall clock went back, every maintenance job runs now (and on from there) rather than
        once the wall clock catches up. Schedules keep their wall-clock times."""
        if wall_moved_s >= elapsed_s - CLOCK_STEP_S:
            return False
        self.clock_steps += 1
        log.warning(
            "the wall clock went back %.0f s; maintenance jobs rescheduled from now",
            elapsed_s - wall_moved_s,
        )
        now = datetime.now(UTC)
        for job_id in self._interval_jobs:
            with contextlib.suppress(Exception):  # a job gone (shut down) has nothing to move
                self.scheduler.modify_job(job_id, next_run_time=now)
        return True

    def shutdown(self) -> None:
        """Stop at once: a job in flight is cancelled (and logged as failed by APScheduler)."""
        if self._watch is not None:
            self._watch.cancel()
        self.scheduler.shutdown(wait=False)

    async def stop(self, timeout: float = 5.0) -> None:
        """Start no more jobs, let those in flight finish (up to `timeout` seconds), then shut
        down: what a graceful runner shutdown does, instead of cutting a statement short."""
        self.scheduler.pause()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout)
        finally:
            self.shutdown()
        await asyncio.sleep(0)  # AsyncIOScheduler shuts down on the loop's next pass

    async def reclaim(self) -> None:
        """Promote deferred work that came due, then reclaim expired leases: one tick of the
        same job (a second job at the same interval ran at its own phase, and the runner's
        dispatch latency showed both)."""
        await self.promote()
        try:
            ids = await self.bus.reclaim()
            self.reclaimed += len(ids)
            if ids:
                log.info("reclaimed %d expired leases", len(ids))
        except Exception:
            log.exception("reclaim failed")
        if self.spend is not None:
            # A dead lease's spend hold goes with it: nothing stays reserved for work that stopped.
            try:
                released = await self.spend.release_dead(batch=500, now=None)
                if released:
                    log.info("released %d spend holds of dead leases", released)
            except Exception:
                log.exception("releasing dead spend holds failed")

    async def promote(self) -> None:
        """Deferred work that has come due goes back into the claim's index (and its lanes are
        rung), in bounded batches like the archive, so a retry storm drains in seconds."""
        try:
            # Bounded apart: it shares its tick with the reclaim, which must not wait on it.
            async with asyncio.timeout(PROMOTE_LIMIT_S):
                async for n in self._batches(
                    self.bus.promote_due, self.bus.config.maintenance_batch
                ):
                    self.promoted += n
        except TimeoutError:
            log.error("promoting due work ran past %.0f s and was stopped", PROMOTE_LIMIT_S)
        except Exception:
            log.exception("promoting due work failed")

    async def month_rollover(self) -> None:
        """A new month (by the database clock, in the ledger's time zone) resumes the messages
        held for budget: the month's cap starts afresh."""
        assert self.spend is not None
        try:
            month = await self.spend.month(now=None)
            if month != self._month:
                await self.spend.platform_month(now=None)
            # Every check, not only at a boundary this process saw: a runner that was down at
            # midnight, or a hold committed just after a sweep, still resumes.
            n = await self.spend.resume_stale(now=None)
            if n:
                log.info("month %s: resumed %d messages held for budget last month", month, n)
            self._month = month
        except Exception:
            log.exception("month rollover check failed")

    async def expire(self) -> None:
        """Batches until a short one (one batch a tick let a backlog of over-age work be
        claimed and run before it was expired)."""
        try:
            async for n in self._batches(self.bus.expire, self.bus.config.maintenance_batch):
                self.expired += n
        except Exception:
            log.exception("expire failed")

    async def _batches(
        self,
        step: Callable[[], Awaitable[int]],
        full: int | None = None,
        *,
        budget_s: float | None = None,
    ) -> AsyncIterator[int]:
        """Run `step` (one bounded batch of `full` rows, archive_batch unless given, returning
        how many rows it handled) until a short batch says it is done: at most ten times a
        round, or with `budget_s` for as long as that many seconds allow. Each batch is its
        own statement, so a backlog drains without one long lock. Yields each batch's count as
        it lands."""
        ends = time.monotonic() + budget_s if budget_s is not None else None
        rounds = 0
        while True:
            done = await step()
            rounds += 1
            yield done
            if done < (self.archive_batch if full is None else full):
                return
            if (rounds >= 10) if ends is None else (time.monotonic() >= ends):
                return

    async def _upkeep_round(self, step: Callable[[], Awaitable[int]], what: str) -> int:
        """One round of an upkeep sweep: `step` (one bounded batch) until a short batch or
        UPKEEP_ROUND_S; the rows it handled, those of the batches before a failure included
        (the failure is logged, and the next round tries again)."""
        handled = 0
        try:
            async for n in self._batches(step, budget_s=UPKEEP_ROUND_S):
                handled += n
        except Exception:
            log.exception("%s failed", what)
        return handled

    async def archive(self) -> None:
        """Move old terminal messages to the archive, in bounded batches."""
        self.archived += await self._upkeep_round(
            lambda: self.store.archive(retention=self.archive_retention, batch=self.archive_batch),
            "archive",
        )

    async def purge_keys(self) -> None:
        """Delete expired idempotency keys, in bounded batches like the archive."""
        self.keys_purged += await self._upkeep_round(
            lambda: self.store.purge_keys(batch=self.archive_batch),
            "purging expired idempotency keys",
        )

    async def purge_run_budgets(self) -> None:
        """Delete the budgets of runs idle past the horizon, and the cap's waiting-line places
        unasked-for for an hour, in bounded batches likewise."""
        assert self.spend is not None
        spend = self.spend
        self.budgets_purged += await self._upkeep_round(
            lambda: spend.purge_run_budgets(idle=self.run_budget_idle, batch=self.archive_batch),
            "purging idle run budgets",
        )
        # The cap's waiting line: places kept an hour past their last ask go too.
        self.places_purged += await self._upkeep_round(
            lambda: spend.purge_waiters(batch=self.archive_batch), "purging old waiting places"
        )

    async def prune_history(self) -> None:
        """Delete history finished longer than the history retention ago, in bounded batches
        like the archive (migration 0025)."""
        retention = self.history_retention
        if retention is None:
            return
        self.history_pruned += await self._upkeep_round(
            lambda: self.store.prune_history(retention=retention, batch=self.archive_batch),
            "pruning old history",
        )

    async def planner_stats(self) -> None:
        """Keep the envelope's statistics in step with bursts (autovacuum may take minutes):
        the runtime connections' kept plans are remade once they no longer fit the table."""
        try:
            tables = await self.store.refresh_planner_stats()
            if tables:
                self.analyzed += len(tables)
                log.info("analyzed %s: grown past their planner statistics", ", ".join(tables))
        except Exception:
            log.exception("refreshing planner statistics failed")

    async def listener_health(self) -> None:
        if self.doorbell is not None and not self.doorbell.connected:
            log.warning("the doorbell is not connected; pick-up relies on the fallback poll")

    async def fire(self, schedule: Schedule) -> None:
        try:
            new = await fire(self.bus, schedule, datetime.now(UTC))
            log.info("schedule %s fired (%s)", schedule.name, "new" if new else "already fired")
        except Exception:
            log.exception("schedule %s failed to fire", schedule.name)
