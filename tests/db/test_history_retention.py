"""History retention against real PostgreSQL (migration 0025): archive months past the
retention go with their transition logs, a bounded batch at a time; model calls, past months'
ledger lines and alerts and runners long stopped go too; work still in the envelope, the month
that straddles the cutoff and open reservations stay. Time is injected, nothing sleeps."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from appliance.bus.core import Bus, BusConfig
from appliance.db.database import Database
from appliance.db.runner_store import PgRunnerStore
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.envelope import Lane, Message
from appliance.domain.pipeline import Pipeline, Stage, StageContext, StageResult
from appliance.domain.ports import Completion, FailOutcome
from appliance.scheduler import Maintenance

SEP = datetime(2026, 9, 10, 12, 0, tzinfo=UTC)
OCT = datetime(2026, 10, 20, 12, 0, tzinfo=UTC)
NOV = datetime(2026, 11, 3, 12, 0, tzinfo=UTC)
# A cutoff inside October: September's month has ended before it, October's has not.
CUTOFF = datetime(2026, 10, 25, tzinfo=UTC)


async def noop(ctx: StageContext) -> StageResult:
    return ctx.finish()


FLOW = Pipeline("flow", (Stage("s", noop),))


@pytest.fixture
async def rstore(db: Database, tenants: PgTenantStore) -> PgRunnerStore:
    await tenants.add("acme")
    store = PgRunnerStore(db)
    await store.sync_pipelines([FLOW])
    return store


async def _claim(store: PgRunnerStore, n: int, at: datetime) -> list[Message]:
    found = await store.claim_lane(
        worker="w", lane=Lane.INTERACTIVE, limit=n, lease=timedelta(seconds=30),
        tenant_limit=100, now=at,
    )  # fmt: skip
    return list(found.messages)


async def _done(store: PgRunnerStore, prefix: str, n: int, at: datetime) -> list[int]:
    """`n` messages enqueued, run and finished at `at`, then archived; their ids."""
    bus = Bus(store, BusConfig())
    results = await bus.enqueue_many(
        [
            bus.request(
                tenant="acme",
                pipeline="flow",
                stage="s",
                source="t",
                source_id=f"{prefix}{i}",
                directive="go",
            )
            for i in range(n)
        ],
        now=at,
    )
    taken = await _claim(store, n, at)
    assert len(taken) == n
    await store.complete([Completion(m.lease) for m in taken], actor="w", now=at)
    while await store.archive(retention=timedelta(days=7), now=at + timedelta(days=8)):
        pass
    return sorted(r.id for r in results)


async def _count(db: Database, sql: str, *args: Any) -> int:
    """One number, read as the administrator (the archive's partitions are not the runtime
    roles' to read directly)."""
    async with await psycopg.AsyncConnection.connect(db.endpoints.admin) as conn:
        await conn.execute("SET search_path = appliance")
        row = await (await conn.execute(sql, args)).fetchone()
    assert row is not None
    return int(row[0])


async def _logged(db: Database, ids: list[int]) -> int:
    return await _count(
        db, "SELECT count(*) FROM message_transitions WHERE message_id = ANY (%s)", ids
    )


def _admin(db: Database, *statements: str) -> None:
    with psycopg.connect(db.endpoints.admin, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


async def _prune_all(store: PgRunnerStore, batch: int) -> list[int]:
    """prune_history until it reports nothing left; each call's count."""
    counts = []
    while True:
        n = await store.prune_history(retention=NOV - CUTOFF, batch=batch, now=NOV)
        counts.append(n)
        if n == 0:
            return counts
        assert len(counts) < 100


async def test_history_past_the_retention_goes_and_the_rest_stays(
    rstore: PgRunnerStore, db: Database
) -> None:
    sep = await _done(rstore, "sep", 5, SEP)
    octo = await _done(rstore, "oct", 2, OCT)
    # Dead in September: still in the envelope (re-drivable), so its log stays.
    bus = Bus(rstore, BusConfig())
    (dead,) = await bus.enqueue_many(
        [bus.request(tenant="acme", pipeline="flow", stage="s", source="t", source_id="dead",
                     directive="go", max_attempts=1)],
        now=SEP,
    )  # fmt: skip
    (m,) = await _claim(rstore, 1, SEP)
    outcome = await rstore.fail(m.lease, error="x", retry_delay=timedelta(0), actor="w", now=SEP)
    assert outcome is FailOutcome.DEAD
    _admin(
        db,
        # August has no partition: a row of the default one, with its log.
        "INSERT INTO appliance.agent_messages_archive (id, tenant, pipeline, stage, source,"
        " source_id, status, finished_at, archived_at, body) VALUES (900001, 'acme', 'flow',"
        " 's', 't', 'aug', 'done', '2026-08-05Z', '2026-08-13Z', '{}')",
        "INSERT INTO appliance.message_transitions (tenant, message_id, to_status, reason,"
        " actor, attempt, at) VALUES ('acme', 900001, 'done', 'x', 'w', 1, '2026-08-05Z')",
        # Model calls: two before the cutoff, one after.
        "INSERT INTO appliance.inference_calls (tenant, message_id, pipeline, stage, kind, tier,"
        " min_tier, route_reason, model, model_sha256, status, at) SELECT 'acme', 1, 'flow',"
        " 's', 'classify', 'mechanical', 'mechanical', 'r', 'm', 'h', 'ok', t FROM (VALUES"
        " (timestamptz '2026-09-10Z'), ('2026-10-24Z'), ('2026-10-26Z')) AS v(t)",
        # Ledger: September's settled lines go; its open reservation and November's line stay.
        "INSERT INTO appliance.spend_ledger (month, tenant, status, reserved, amount,"
        " created_at) VALUES ('2026-09-01', 'acme', 'settled', 0, 0.1, '2026-09-10Z'),"
        " ('2026-09-01', 'acme', 'platform', 0, 0.2, '2026-09-01Z'),"
        " ('2026-09-01', 'acme', 'reserved', 0.3, 0, '2026-09-30Z'),"
        " ('2026-10-01', 'acme', 'settled', 0, 0.1, '2026-10-02Z')",
        "INSERT INTO appliance.spend_alerts (month, scope, fraction, spent, cap, at) VALUES"
        " ('2026-09-01', 'appliance', 0.5, 5, 10, '2026-09-20Z'),"
        " ('2026-10-01', 'appliance', 0.5, 5, 10, '2026-10-20Z')",
        # Runners: stopped in September, killed (last seen) in September, alive now.
        "INSERT INTO appliance.runners (id, host, pid, started_at, seen_at, stopped_at) VALUES"
        " ('r-stopped', 'h', 1, '2026-09-01Z', '2026-09-02Z', '2026-09-02Z'),"
        " ('r-killed', 'h', 2, '2026-09-01Z', '2026-09-03Z', NULL),"
        " ('r-alive', 'h', 3, '2026-09-01Z', '2026-11-03Z', NULL)",
    )
    assert await _logged(db, sep) == 5 * 3  # enqueued, claimed, done

    counts = await _prune_all(rstore, batch=2)

    assert all(0 < n <= 2 for n in counts[:-1]), counts
    # 5 September messages + 1 August row + 2 calls + 2 ledger lines + 1 alert + 2 runners.
    assert sum(counts) == 13, counts
    assert await _logged(db, sep) == 0
    assert await _logged(db, [900001]) == 0
    assert await _logged(db, octo) == 2 * 3  # October straddles the cutoff: kept whole
    assert await _logged(db, [dead.id]) == 3  # still in the envelope
    assert all([await rstore.get("acme", i) is None for i in sep])
    assert all([await rstore.get("acme", i) is not None for i in octo])
    assert await rstore.get("acme", dead.id) is not None
    parts = await _count(
        db,
        "SELECT count(*) FILTER (WHERE to_regclass('appliance.agent_messages_archive_y2026m09')"
        " IS NULL AND to_regclass('appliance.agent_messages_archive_y2026m10') IS NOT NULL)"
        " FROM (SELECT 1) AS one",
    )
    assert parts == 1, "September's partition dropped, October's kept"
    assert await _count(db, "SELECT count(*) FROM agent_messages_archive_default") == 0
    assert await _count(db, "SELECT count(*) FROM inference_calls") == 1
    assert await _count(db, "SELECT count(*) FROM spend_ledger WHERE month = '2026-09-01'") == 1
    assert await _count(db, "SELECT count(*) FROM spend_ledger") == 2
    assert await _count(db, "SELECT count(*) FROM spend_alerts") == 1
    assert await _count(db, "SELECT count(*) FROM runners WHERE id = 'r-alive'") == 1
    assert await _count(db, "SELECT count(*) FROM runners") == 1
    assert await _count(db, "SELECT count(*) FROM prune_cursors") == 0
    # The archive still works for the months that are left, and for new ones.
    await _done(rstore, "nov", 1, NOV)


async def test_a_large_month_is_swept_from_where_the_last_batch_stopped(
    rstore: PgRunnerStore, db: Database
) -> None:
    sep = await _done(rstore, "sep", 3, SEP)
    assert await rstore.prune_history(retention=NOV - CUTOFF, batch=2, now=NOV) == 2
    assert await _logged(db, sep[:2]) == 0 and await _logged(db, sep[2:]) == 3
    assert await _count(db, "SELECT last_id FROM prune_cursors") == sep[1]
    # The month is not gone until its last log is: its messages are still readable.
    assert await rstore.get("acme", sep[2]) is not None
    assert await rstore.prune_history(retention=NOV - CUTOFF, batch=2, now=NOV) == 1
    assert await rstore.get("acme", sep[2]) is None
    assert await _count(db, "SELECT count(*) FROM prune_cursors") == 0


async def test_a_reader_of_the_archive_delays_the_drop_and_nothing_else(
    rstore: PgRunnerStore, db: Database
) -> None:
    # One session idle in a transaction that once read the archive: the month's DROP gives up
    # after its second and is tried again next round; the rest of the pruning goes on
    # (migration 0027: it all used to be undone).
    sep = await _done(rstore, "sep", 3, SEP)
    _admin(
        db,
        "INSERT INTO appliance.inference_calls (tenant, message_id, pipeline, stage, kind, tier,"
        " min_tier, route_reason, model, model_sha256, status, at) SELECT 'acme', 0, 'flow',"
        " 's', 'classify', 'mechanical', 'mechanical', 'r', 'm', 'h', 'ok', '2026-09-10Z'"
        " FROM generate_series(1, 5)",
    )
    with psycopg.connect(db.endpoints.admin) as reader:
        reader.execute("SELECT count(*) FROM appliance.agent_messages_archive")
        began = time.monotonic()
        assert await rstore.prune_history(retention=NOV - CUTOFF, batch=10, now=NOV) == 3 + 5
        assert time.monotonic() - began < 5
        assert await _count(db, "SELECT count(*) FROM inference_calls") == 0
        assert await rstore.get("acme", sep[0]) is not None  # the month is still there
    assert await _logged(db, sep) == 0
    assert await rstore.prune_history(retention=NOV - CUTOFF, batch=10, now=NOV) == 0
    assert await rstore.get("acme", sep[0]) is None  # dropped once the reader had gone
    assert await _count(db, "SELECT count(*) FROM prune_cursors") == 0


async def test_a_month_is_swept_only_once_all_of_it_has_been_archived(
    rstore: PgRunnerStore, db: Database
) -> None:
    # A message of the month still waiting for the archiver (it lags, or both retentions are
    # equal) would reach the month after the sweep had passed it, and its log would outlive
    # the DROP (migration 0027).
    bus = Bus(rstore, BusConfig())
    ids = sorted(
        r.id
        for r in await bus.enqueue_many(
            [
                bus.request(
                    tenant="acme",
                    pipeline="flow",
                    stage="s",
                    source="t",
                    source_id=f"m{i}",
                    directive="go",
                )
                for i in range(3)
            ],
            now=SEP,
        )
    )
    taken = await _claim(rstore, 3, SEP)
    late = next(m for m in taken if m.id == ids[0])  # the lowest id finishes last
    await rstore.complete([Completion(m.lease) for m in taken if m is not late], actor="w", now=SEP)
    await rstore.complete([Completion(late.lease)], actor="w", now=SEP + timedelta(hours=20))
    # The archiver has moved the first two only.
    assert await rstore.archive(retention=timedelta(days=7), batch=2, now=SEP + timedelta(days=8))
    assert await rstore.prune_history(retention=NOV - CUTOFF, batch=1, now=NOV) == 0
    assert await _logged(db, ids) == 9
    while await rstore.archive(retention=timedelta(days=7), now=SEP + timedelta(days=9)):
        pass
    while await rstore.prune_history(retention=NOV - CUTOFF, batch=1, now=NOV):
        pass
    assert await _logged(db, ids) == 0
    assert await _count(db, "SELECT count(*) FROM agent_messages_archive") == 0


async def test_model_calls_and_ledger_lines_of_work_still_in_the_envelope_stay(
    rstore: PgRunnerStore, db: Database
) -> None:
    bus = Bus(rstore, BusConfig())
    (dead,) = await bus.enqueue_many(
        [bus.request(tenant="acme", pipeline="flow", stage="s", source="t", source_id="dead",
                     directive="go", max_attempts=1)],
        now=SEP,
    )  # fmt: skip
    (m,) = await _claim(rstore, 1, SEP)
    await rstore.fail(m.lease, error="x", retry_delay=timedelta(0), actor="w", now=SEP)
    _admin(
        db,
        "INSERT INTO appliance.inference_calls (tenant, message_id, pipeline, stage, kind, tier,"
        " min_tier, route_reason, model, model_sha256, status, at) VALUES ('acme',"
        f" {dead.id}, 'flow', 's', 'classify', 'mechanical', 'mechanical', 'r', 'm', 'h',"
        " 'ok', '2026-09-10Z')",
        "INSERT INTO appliance.spend_ledger (month, tenant, message_id, status, amount,"
        f" created_at) VALUES ('2026-09-01', 'acme', {dead.id}, 'settled', 0.1, '2026-09-10Z')",
    )
    assert await rstore.prune_history(retention=NOV - CUTOFF, now=NOV) == 0
    assert await _count(db, "SELECT count(*) FROM inference_calls") == 1
    assert await _count(db, "SELECT count(*) FROM spend_ledger") == 1


async def test_one_pruner_at_a_time_and_bad_arguments_are_refused(
    rstore: PgRunnerStore, db: Database
) -> None:
    await _done(rstore, "sep", 1, SEP)
    with psycopg.connect(db.endpoints.admin) as other:
        other.execute("SELECT pg_advisory_xact_lock(hashtext('appliance.prune_history'))")
        assert await rstore.prune_history(retention=NOV - CUTOFF, now=NOV) == 0
    assert await rstore.prune_history(retention=NOV - CUTOFF, now=NOV) == 1
    with pytest.raises(psycopg.errors.InvalidParameterValue, match="batch of 1 to 1,000,000"):
        await rstore.prune_history(retention=NOV - CUTOFF, batch=0, now=NOV)


async def test_maintenance_prunes_with_a_retention_and_keeps_everything_without(
    rstore: PgRunnerStore, db: Database
) -> None:
    sep = await _done(rstore, "sep", 5, SEP)
    bus = Bus(rstore, BusConfig())
    kept = Maintenance(bus, rstore, history_retention=None)
    assert "prune_history" not in {job.name for job in kept.scheduler.get_jobs()}
    await kept.prune_history()
    assert await _logged(db, sep) == 15
    # The real clock: September 2026 is more than 30 days and a month's end in the past.
    pruning = Maintenance(bus, rstore, archive_batch=2, history_retention=timedelta(days=30))
    assert "prune_history" in {job.name for job in pruning.scheduler.get_jobs()}
    await pruning.prune_history()
    assert pruning.history_pruned == 5
    assert await _logged(db, sep) == 0


async def test_a_long_log_is_deleted_a_bounded_part_at_a_time(
    rstore: PgRunnerStore, db: Database
) -> None:
    # A message deferred or retried many times has a long log: a call deletes at most ten log
    # rows a message on average, and the month goes only once every log is gone.
    sep = await _done(rstore, "sep", 3, SEP)
    _admin(
        db,
        "INSERT INTO appliance.message_transitions (tenant, message_id, to_status, reason,"
        f" actor, attempt, at) SELECT 'acme', {sep[1]}, 'pending', 'deferred', 'w', 1,"
        " '2026-09-10Z' FROM generate_series(1, 45)",
    )
    calls = []
    while n := await rstore.prune_history(retention=NOV - CUTOFF, batch=2, now=NOV):
        calls.append((n, await _logged(db, sep)))
        assert len(calls) < 20
    # 54 rows: 20 a call, then the last 14 with the month's DROP.
    assert [left for _, left in calls] == [34, 14, 0], calls
    assert await rstore.get("acme", sep[0]) is None


async def test_a_lock_not_had_in_time_undoes_only_the_steps_that_needed_it(
    rstore: PgRunnerStore, db: Database
) -> None:
    # The archiver creating a month's partition holds the default partition: the default
    # partition's step waits a second and gives up, with the steps after it; the month's
    # sweep before it stays done.
    sep = await _done(rstore, "sep", 2, SEP)
    with psycopg.connect(db.endpoints.admin) as archiver:
        archiver.execute("LOCK appliance.agent_messages_archive_default IN ACCESS EXCLUSIVE MODE")
        # ... and reads the archive, so the month's DROP gives up too, and the call goes on.
        archiver.execute("SELECT count(*) FROM appliance.agent_messages_archive")
        began = time.monotonic()
        assert await rstore.prune_history(retention=NOV - CUTOFF, batch=3, now=NOV) == 2
        assert time.monotonic() - began < 5
    assert await _logged(db, sep) == 0
    assert await rstore.prune_history(retention=NOV - CUTOFF, batch=3, now=NOV) == 0
    assert await rstore.get("acme", sep[0]) is None  # dropped once the archiver had gone


async def test_a_drop_that_gives_up_ends_the_round(rstore: PgRunnerStore, db: Database) -> None:
    # Readers of the archive queue behind a waiting DROP: it is tried once a round, not once a
    # batch (a round of five batches kept readers waiting five seconds).
    await _done(rstore, "sep", 1, SEP)
    _admin(
        db,
        "INSERT INTO appliance.inference_calls (tenant, message_id, pipeline, stage, kind, tier,"
        " min_tier, route_reason, model, model_sha256, status, at) SELECT 'acme', 0, 'flow',"
        " 's', 'classify', 'mechanical', 'mechanical', 'r', 'm', 'h', 'ok', '2026-09-10Z'"
        " FROM generate_series(1, 5)",
    )
    maintenance = Maintenance(
        Bus(rstore, BusConfig()), rstore, archive_batch=2, history_retention=timedelta(days=30)
    )
    with psycopg.connect(db.endpoints.admin) as reader:
        reader.execute("SELECT count(*) FROM appliance.agent_messages_archive")
        await maintenance.prune_history()  # the real clock: September 2026 is long past
    # One call: the month's log, one model call, the DROP given up; the rest next round.
    assert await _count(db, "SELECT count(*) FROM inference_calls") == 4
    await maintenance.prune_history()  # the DROP ends its call (and that round)
    assert await _count(db, "SELECT count(*) FROM agent_messages_archive") == 0
    await maintenance.prune_history()
    assert await _count(db, "SELECT count(*) FROM inference_calls") == 0
