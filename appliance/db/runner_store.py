"""The runner's side of the envelope in PostgreSQL: fair lane claims, batched heartbeats,
release, stage graphs, runner health and archival (the RunnerStore port)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Collection, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from appliance.db.message_store import (
    SYSTEM_ACTOR,
    PgMessageStore,
    enqueue_chunks,
    enqueue_params,
    run_batches,
    run_fenced,
    stage_array,
    unique_requests,
)
from appliance.db.queries import q
from appliance.domain.envelope import EnqueueRequest, LeaseRef, storable_text
from appliance.domain.inference import CallRecord, Tier
from appliance.domain.pipeline import Pipeline
from appliance.domain.ports import RUNNER_ALIVE, BusStatus, IdHolder, RunnerInfo

log = logging.getLogger(__name__)

# Passes (and the pause before each) that re-stamp messages a sync skipped because an
# acknowledgement held them at that moment.
RETIER_ATTEMPTS = 100
RETIER_PAUSE_S = 0.05
# What a message waits for when no live runner serves its stage: 'stage:pipeline/stage'
# (a tier's wait names the tier).
STAGE_WAIT_PREFIX = "stage:"


def stage_wait(pipeline: str, stage: str) -> str:
    """The `waiting_for` of work parked until a runner serves (pipeline, stage)."""
    return f"{STAGE_WAIT_PREFIX}{pipeline}/{stage}"


class PgRunnerStore(PgMessageStore):
    """Everything the runner and the maintenance services need, on top of the envelope."""

    async def release(
        self, leases: Sequence[LeaseRef], *, actor: str = SYSTEM_ACTOR, now: datetime | None = None
    ) -> int:
        """Give leases back without counting the attempt; how many were still held."""
        if not leases:
            return 0
        params = {
            "id": [lease.message_id for lease in leases],
            "token": [lease.lease_token for lease in leases],
            "actor": actor,
            "now": now,
        }
        async with self.db.system_conn() as conn:
            rows = await (await conn.execute(q("message_release"), params)).fetchall()
        return len(rows)

    async def expire_running(
        self,
        lease: LeaseRef,
        *,
        reason: str = "deadline_passed",
        actor: str = SYSTEM_ACTOR,
        now: datetime | None = None,
    ) -> bool:
        """Expire a running attempt whose message's deadline passed (fenced by the lease)."""
        return await run_fenced(
            self.db, "message_expire_running", lease, reason=reason, actor=actor, now=now
        )

    async def wait_capability(
        self,
        lease: LeaseRef,
        *,
        tier: Tier,
        expires_at: datetime,
        reason: str,
        actor: str = SYSTEM_ACTOR,
        now: datetime | None = None,
    ) -> bool:
        """Park a running attempt until a tier at or above `tier` is up (fenced by the lease)."""
        return await run_fenced(
            self.db, "message_park", lease, status="waiting_capability", waiting_for=tier.value,
            expires_at=expires_at, reason=reason, actor=actor, now=now,
        )  # fmt: skip

    async def resume_capability(
        self,
        tiers: Sequence[Tier],
        *,
        actor: str = SYSTEM_ACTOR,
        batch: int = 500,
        now: datetime | None = None,
    ) -> int:
        """Send messages waiting for any of `tiers` back to pending; how many (all batches)."""
        return await self._resume_waits([t.value for t in tiers], actor, batch, now)

    async def _resume_waits(
        self, waits: list[str], actor: str, batch: int, now: datetime | None
    ) -> int:
        """Send messages in waiting_capability whose `waiting_for` is one of `waits` (tier
        names, or stage waits) back to pending, in bounded batches; how many."""
        if not waits:
            return 0
        # The statement's parameter is named for its first use, tier names.
        params = {"tiers": waits, "actor": actor, "batch": batch, "now": now}
        return await run_batches(self.db, "message_resume_capability", params)

    async def wait_stage(
        self,
        lease: LeaseRef,
        *,
        pipeline: str,
        stage: str,
        wait: timedelta,
        reason: str,
        actor: str = SYSTEM_ACTOR,
        now: datetime | None = None,
    ) -> str | None:
        """Park a running attempt of (pipeline, stage), which no live runner serves, until one
        that serves it resumes it (resume_stages), for `wait` at most (fenced by the lease);
        given back to pending instead when a live runner other than `actor` serves it now.
        The status it took ('waiting_capability' or 'pending'); None: the lease was gone."""
        params = {
            "id": lease.message_id, "token": lease.lease_token, "actor": actor, "now": now,
            "stage": f"{pipeline}/{stage}", "waiting_for": stage_wait(pipeline, stage),
            "wait": wait, "alive": RUNNER_ALIVE, "reason": storable_text(reason),
        }  # fmt: skip
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("message_park_stage"), params)).fetchone()
        return None if row is None else str(row["status"])

    async def resume_stages(
        self,
        stages: Collection[tuple[str, str]],
        *,
        actor: str = SYSTEM_ACTOR,
        batch: int = 500,
        now: datetime | None = None,
    ) -> int:
        """Send work parked until a runner serves one of `stages` back to pending; how many."""
        return await self._resume_waits(
            [stage_wait(p, s) for p, s in sorted(stages)], actor, batch, now
        )

    async def stages_elsewhere(
        self, runner_id: str, *, now: datetime | None = None
    ) -> frozenset[tuple[str, str]]:
        """The (pipeline, stage) pairs that live runners other than `runner_id` serve."""
        params = {"id": runner_id, "now": now, "alive": RUNNER_ALIVE}
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("runner_stages_elsewhere"), params)).fetchone()
        found: set[tuple[str, str]] = set()
        for text in row["stages"] if row is not None else []:
            pipeline, _, stage = str(text).partition("/")
            found.add((pipeline, stage))
        return frozenset(found)

    async def terminate(
        self,
        lease: LeaseRef,
        *,
        reason: str,
        actor: str = SYSTEM_ACTOR,
        now: datetime | None = None,
    ) -> bool:
        """End a running attempt for good (dead, with the reason), fenced by its lease."""
        return await run_fenced(
            self.db, "message_terminate", lease, reason=storable_text(reason), actor=actor, now=now
        )

    async def defer(
        self,
        lease: LeaseRef,
        *,
        delay: timedelta,
        reason: str,
        actor: str = SYSTEM_ACTOR,
        now: datetime | None = None,
    ) -> bool:
        """Back to pending after `delay`, the attempt not counted (fenced by the lease)."""
        return await run_fenced(
            self.db,
            "message_defer",
            lease,
            delay=delay,
            reason=storable_text(reason),
            actor=actor,
            now=now,
        )

    async def record_call(self, record: CallRecord) -> None:
        """Store one model call against its message."""
        params = {
            "tenant": record.tenant,
            "message_id": record.message_id,
            "pipeline": record.pipeline,
            "stage": record.stage,
            "kind": record.kind,
            "tier": record.tier.value,
            "min_tier": record.min_tier.value,
            "route_reason": record.route_reason,
            "model": record.model,
            "model_sha256": record.model_sha256,
            "status": record.status,
            "error": storable_text(record.error) if record.error is not None else None,
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "queue_seconds": record.queue_seconds,
            "ttft_seconds": record.ttft_seconds,
            "total_seconds": record.total_seconds,
            "at": record.at,
        }
        async with self.db.system_conn() as conn:
            await conn.execute(q("inference_call_insert"), params)

    async def calls_of(self, tenant: str, message_id: int) -> list[dict[str, Any]]:
        """The model calls recorded against a tenant's message, oldest first (row-level
        security: never another tenant's calls, whatever the id)."""
        async with self.db.tenant_tx(tenant) as conn:
            cur = await conn.execute(q("inference_calls_of_message"), {"message_id": message_id})
            return list(await cur.fetchall())

    async def archive(
        self, *, retention: timedelta, batch: int = 1000, now: datetime | None = None
    ) -> int:
        """Move one bounded batch of old terminal messages to the monthly archive."""
        params = {"retention": retention, "batch": batch, "now": now}
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("message_archive"), params)).fetchone()
        return int(row["moved"]) if row else 0

    async def purge_keys(self, *, batch: int = 1000, now: datetime | None = None) -> int:
        """Delete one bounded batch of expired idempotency keys whose messages have left
        the hot table; how many. Such a key answers no duplicate any more (a new request takes
        it over), so this changes no answer; it keeps the table from growing with every source
        id ever seen. A key whose message is still in the envelope is kept (migration 0024)."""
        async with self.db.system_conn() as conn:
            row = await (
                await conn.execute(q("idempotency_keys_purge"), {"batch": batch, "now": now})
            ).fetchone()
        return int(row["purged"]) if row else 0

    async def prune_history(
        self, *, retention: timedelta, batch: int = 1000, now: datetime | None = None
    ) -> int:
        """Remove one bounded batch of history finished longer than `retention` ago: archive
        months with their transition logs, model calls, past months' ledger lines and alerts,
        records of runners long stopped (migration 0025); how many rows. 0 while another
        runner prunes, or while a reader keeps a month's partition from being dropped."""
        params = {"retention": retention, "batch": batch, "now": now}
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("history_prune"), params)).fetchone()
        return int(row["pruned"]) if row else 0

    async def refresh_planner_stats(self, *, min_pages: int = 32, growth: float = 2.0) -> list[str]:
        """ANALYZE the envelope (and the other tables read by key) where the heap has outgrown
        its statistics: `growth` times the size they were taken at, and at least `min_pages` of
        8 KiB. The tables analyzed."""
        params = {"min_pages": min_pages, "growth": growth}
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("planner_stats_refresh"), params)).fetchone()
        return list(row["analyzed"]) if row else []

    # -- stage graphs ---------------------------------------------------------------------------

    async def sync_pipelines(
        self, pipelines: Sequence[Pipeline], *, only_new: bool = False
    ) -> None:
        """Write each declared pipeline's stage graph, replacing what was there (one tx each);
        the messages of a stage whose model tier changed get the new one, unless finished.
        `only_new`: leave a pipeline whose graph is already written alone (decided under the
        same lock as the write, so a runner's sync in between is never overwritten)."""
        for pipeline in pipelines:
            rows = pipeline.rows()
            async with self.db.system_tx() as conn:
                # Serialise concurrent syncs of the same pipeline (several runners start at once).
                await conn.execute(
                    "SELECT pg_advisory_xact_lock(hashtext('pipeline:' || %s))", (pipeline.name,)
                )
                if only_new:
                    cur = await conn.execute(q("pipeline_known"), {"pipeline": pipeline.name})
                    known = await cur.fetchone()
                    if known is not None and known["known"]:
                        continue
                await conn.execute(q("pipeline_routes_clear"), {"pipeline": pipeline.name})
                retier: list[str] = []
                stale = False
                for row in rows:
                    cur = await conn.execute(
                        q("pipeline_stage_upsert"), {k: v for k, v in row.items() if k != "routes"}
                    )
                    written = await cur.fetchone()
                    if written is not None and written["retier"]:
                        retier.append(row["stage"])
                for row in rows:
                    for outcome, target in row["routes"].items():
                        await conn.execute(
                            q("pipeline_route_insert"),
                            {
                                "pipeline": pipeline.name,
                                "stage": row["stage"],
                                "outcome": outcome,
                                "next_stage": target,
                            },
                        )
                cur = await conn.execute(
                    q("pipeline_stages_prune"),
                    {"pipeline": pipeline.name, "stages": [r["stage"] for r in rows]},
                )
                retier += [r["stage"] for r in await cur.fetchall() if r["retier"]]
                if retier:
                    # Rare (a tier changed, a stage declared or dropped). Enqueues in flight may
                    # have read the old tier: wait for them, then re-stamp, in the same
                    # transaction as the change.
                    await conn.execute(q("stage_tiers_fence"))
                    stale = await self._retier(conn, pipeline.name, retier)
            if retier and stale:
                await self._retier_skipped(pipeline.name, retier)

    async def deferrals(self, message_id: int, reason: str) -> int:
        """How many times the message was deferred with a reason starting `reason` (read
        from its transition log, by the log's message index)."""
        params = {"id": message_id, "prefix": reason}
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("message_deferrals"), params)).fetchone()
        return int(row["n"]) if row else 0

    async def enqueue_spawned(
        self,
        lease: LeaseRef,
        requests: Sequence[EnqueueRequest],
        *,
        retention: timedelta,
        default_max_attempts: int,
    ) -> bool:
        """Enqueue the work an attempt spawned, in one transaction with its row locked under
        its lease; False (nothing enqueued) when the lease is no longer current (the message
        was cancelled, or reclaimed): a completion that will be refused spawns nothing."""
        unique, _ = unique_requests(requests)
        if not unique:
            return True
        async with self.db.system_tx() as conn:
            cur = await conn.execute(
                q("message_lease_lock"), {"id": lease.message_id, "token": lease.lease_token}
            )
            if await cur.fetchone() is None:
                return False
            for chunk in enqueue_chunks(unique):
                params = enqueue_params(chunk, retention, None, default_max_attempts)
                params["scope"] = unique[0].tenant
                await conn.execute(q("message_enqueue"), params)
        return True

    async def item_stage_holders(
        self, tenant: str, *, pipeline: str, stage: str, source: str, source_id: str
    ) -> list[tuple[str, int]]:
        """(stage, message id) of the stages the pipeline's routes lead to from `stage` that a
        run of this source item already holds by their derived keys: where a new first
        message's hand-offs would go as duplicates."""
        params = {
            "tenant": tenant,
            "pipeline": pipeline,
            "stage": stage,
            "source": source,
            "source_id": source_id,
        }
        async with self.db.tenant_tx(tenant) as conn:
            cur = await conn.execute(q("item_stage_holders"), params)
            return [(row["stage"], row["message_id"]) for row in await cur.fetchall()]

    async def stages_of(self, pipeline: str) -> list[str]:
        """The stages written for `pipeline`; empty when it was never declared."""
        async with self.db.system_conn() as conn:
            cur = await conn.execute(q("pipeline_stage_names"), {"pipeline": pipeline})
            return [row["stage"] for row in await cur.fetchall()]

    async def _retier(
        self, conn: psycopg.AsyncConnection[Any], pipeline: str, stages: list[str]
    ) -> bool:
        """One re-stamping pass; whether it left rows with a stale tier (they were locked)."""
        cur = await conn.execute(
            q("pipeline_messages_retier"), {"pipeline": pipeline, "stages": stages}
        )
        row = await cur.fetchone()
        return row is not None and row["stale"] > row["stamped"]

    async def _retier_skipped(self, pipeline: str, stages: list[str]) -> None:
        """Re-stamp the rows the sync skipped (an acknowledgement held them: it commits within
        moments, and may have sent them back to pending with the old tier)."""
        for _ in range(RETIER_ATTEMPTS):
            await asyncio.sleep(RETIER_PAUSE_S)
            async with self.db.system_tx() as conn:
                if not await self._retier(conn, pipeline, stages):
                    return
        log.warning(
            "messages of %s stages %s still carry an old model tier after %d passes (locked "
            "throughout); they keep it until a sync changes these stages' tiers again",
            pipeline,
            stages,
            RETIER_ATTEMPTS,
        )

    # -- runner health --------------------------------------------------------------------------

    async def register_runner(self, info: dict[str, Any]) -> IdHolder | None:
        """Record a runner at its start; `info["serves"]`: the (pipeline, stage) pairs it
        serves (absent: it does not say, and no claim skips for it).

        Returns None when recorded; else the live runner that holds the id (one that reported
        within RUNNER_ALIVE and did not stop), and nothing is written. Two runners under one
        id would each read the other's stages as its own and skip none of them."""
        serves = info.get("serves")
        params = {
            **info,
            "serves": None if serves is None else stage_array(frozenset(serves)),
            "alive": RUNNER_ALIVE,
        }
        # A holder that stops or goes quiet between the two statements frees the id: ask
        # again (a few times; each loss is another runner's registration in between).
        for _ in range(5):
            async with self.db.system_conn() as conn:
                taken = await (await conn.execute(q("runner_register"), params)).fetchone()
                if taken is not None:
                    return None
                row = await (
                    await conn.execute(
                        q("runner_holder"),
                        {"id": info["id"], "now": info.get("seen_at"), "alive": RUNNER_ALIVE},
                    )
                ).fetchone()
            if row is not None:
                return IdHolder(
                    row["host"],
                    row["pid"],
                    row["started_at"],
                    row["seen_at"],
                    float(row["seen_age_s"]),
                )
        raise RuntimeError(f"runner id {info['id']!r}: registration kept racing other runners")

    async def report_runner(self, info: dict[str, Any]) -> bool:
        """Write a runner's health report; False when another runner has taken its id over
        (nothing written)."""
        params = {**info, "stats": Jsonb(info.get("stats", {}))}
        params.setdefault("stopped_at", None)
        async with self.db.system_conn() as conn:
            row = await (await conn.execute(q("runner_report"), params)).fetchone()
        return row is not None

    async def runners(self, *, now: datetime | None = None) -> list[RunnerInfo]:
        async with self.db.system_conn() as conn:
            rows = await (await conn.execute(q("runner_list"), {"now": now})).fetchall()
        found = []
        for r in rows:
            stats = r["stats"] if isinstance(r["stats"], dict) else json.loads(r["stats"])
            seen = float(r["seen_age_s"])
            found.append(
                RunnerInfo(
                    id=r["id"],
                    host=r["host"],
                    pid=r["pid"],
                    seen_age_s=seen,
                    # Alive: reported recently and did not say it stopped.
                    alive=r["stopped_at"] is None and seen < RUNNER_ALIVE.total_seconds(),
                    listener_connected=r["listener_connected"],
                    last_missed_wakeup_age_s=(
                        float(r["missed_age_s"]) if r["missed_age_s"] is not None else None
                    ),
                    missed_wakeups=r["missed_wakeups"],
                    claimed=r["claimed"],
                    completed=r["completed"],
                    failed=r["failed"],
                    stats=stats,
                )
            )
        return found

    async def status(self, *, now: datetime | None = None) -> BusStatus:
        """The envelope's counts (stage counts among them) plus runners, reclaims and dedup
        activity."""
        base = await super().status(now=now)
        runners = await self.runners(now=now)
        async with self.db.system_conn() as conn:
            activity = await (await conn.execute(q("bus_activity"), {"now": now})).fetchone()
        return replace(
            base,
            runners=runners,
            reclaims_last_hour=int(activity["reclaims"]) if activity else 0,
            dedup_keys_hit_last_hour=int(activity["dedup_keys_hit"]) if activity else 0,
        )
