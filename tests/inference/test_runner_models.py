"""The runner with the real pool against real PostgreSQL: routing never downgrades, reasoning work
waits in waiting_capability while its tier is down and resumes when it returns, mechanical work is
upgraded when its tier is down, and the pool's capacity bounds what the runner claims."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from pydantic import field_validator

from appliance.bus.core import Bus
from appliance.bus.runner import Runner, RunnerConfig
from appliance.db.database import Database, Endpoints
from appliance.db.listener import PgDoorbell
from appliance.db.runner_store import PgRunnerStore
from appliance.db.tenant_store import PgTenantStore
from appliance.domain.envelope import MessageStatus
from appliance.domain.inference import Tier
from appliance.domain.pipeline import Pipeline, Registry, Stage, StageContext, StageResult
from appliance.inference.pool import InferencePool, TierSpec
from appliance.pipelines.support import SUPPORT, TicketLabel
from tests.inference.models import spec
from tests.inference.rigs import DbChecks


async def quick_classify(ctx: StageContext) -> StageResult:
    answer = await ctx.infer(
        "classify", f"Ticket: {ctx.message.directive}\nCategory:", schema=TicketLabel, max_tokens=16
    )
    return ctx.finish({"label": answer.data.label, "model": answer.model})


class Refused(TicketLabel):
    """A shape whose validator refuses every value: the grammar cannot express it."""

    @field_validator("label")
    @classmethod
    def never(cls, value: str) -> str:
        raise ValueError(f"{value!r} refused by the handler's own rule")


async def strict_classify(ctx: StageContext) -> StageResult:
    await ctx.infer("classify", f"Ticket: {ctx.message.directive}\nCategory:", schema=Refused,
                    max_tokens=16)  # fmt: skip
    return ctx.finish({"unreachable": True})


STRICT = Pipeline(
    "strict",
    (Stage("classify", strict_classify, task_kind="classify", uses_model=True, max_attempts=1),),
)

TRIAGE = Pipeline(
    "triage",
    (Stage("classify", quick_classify, task_kind="classify", uses_model=True),),
)
PIPES = [SUPPORT, TRIAGE, STRICT]


@dataclass
class Rig(DbChecks):
    bus: Bus
    store: PgRunnerStore
    runner: Runner
    pool: InferencePool
    db: Database

    async def submit(self, source_id: str, pipeline: str = "support") -> int:
        stage = "classify"
        result = await self.bus.enqueue(
            tenant="acme",
            pipeline=pipeline,
            stage=stage,
            source="tickets",
            source_id=source_id,
            directive=f"ticket {source_id}: I was charged twice this month",
            context={"subject": "Charged twice", "body": "I was charged twice this month."},
        )
        return result.id

    async def stage_status(self, source_id: str, stage: str) -> str | None:
        rows = await self.rows(
            "SELECT status::text AS s FROM agent_messages WHERE source_id = %(s)s "
            "AND stage = %(stage)s",
            {"s": source_id, "stage": stage},
        )
        return str(rows[0]["s"]) if rows else None


@pytest.fixture
async def rig_factory(fresh_db: Endpoints) -> AsyncIterator[Callable[..., Any]]:
    started: list[tuple[asyncio.Event, asyncio.Task[None], InferencePool, Database]] = []

    async def make(specs: list[TierSpec], poll: float = 5.0) -> Rig:
        db = Database(fresh_db, max_size=8)
        await db.open()
        await PgTenantStore(db).add("acme")
        store = PgRunnerStore(db)
        await store.sync_pipelines(PIPES)
        pool = InferencePool(specs, cores=2)
        await pool.start()
        config = RunnerConfig(
            worker_id="models",
            concurrency=6,
            lease=timedelta(seconds=10),
            poll_interval=timedelta(seconds=poll),
            report_every=timedelta(seconds=0.5),
        )
        runner = Runner(
            store, Registry(PIPES), config, doorbell=PgDoorbell(fresh_db.system), inference=pool
        )
        stop = asyncio.Event()
        task = asyncio.create_task(runner.run(stop))
        started.append((stop, task, pool, db))
        return Rig(Bus(store), store, runner, pool, db)

    yield make
    for stop, task, pool, db in started:
        stop.set()
        await asyncio.wait_for(task, 30)
        await pool.close()
        await db.close()


async def test_reasoning_waits_for_its_tier_and_is_never_downgraded(
    rig_factory: Callable[..., Any],
) -> None:
    rig: Rig = await rig_factory([spec(Tier.MECHANICAL)])
    await rig.submit("t1")
    await rig.wait(lambda: _is(rig, "t1", "draft", "waiting_capability"), what="the draft to wait")
    (draft,) = await rig.rows(
        "SELECT id, waiting_for, status_reason, deadline, wait_expires_at FROM agent_messages "
        "WHERE stage = 'draft'"
    )
    assert draft["waiting_for"] == "reasoning"
    assert "never downgraded" in draft["status_reason"]
    assert draft["wait_expires_at"] is not None  # every wait has an expiry of its own
    assert draft["deadline"] is None  # and the message's own deadline is left alone
    # It stays waiting: nothing serves it on the small model in the meantime.
    await asyncio.sleep(1.0)
    assert await rig.stage_status("t1", "draft") == "waiting_capability"

    await rig.pool.start_tier(spec(Tier.REASONING))
    await rig.wait(lambda: _is(rig, "t1", "reply", "done"), what="the reply")

    log = await rig.rows(
        "SELECT to_status::text AS s, reason FROM message_transitions WHERE message_id = %(id)s "
        "ORDER BY id",
        {"id": draft["id"]},
    )
    assert [r["s"] for r in log] == [
        "pending", "running", "waiting_capability", "pending", "running", "done",
    ]  # fmt: skip
    assert log[3]["reason"] == "capability_available: reasoning"

    calls = await rig.rows("SELECT * FROM inference_calls ORDER BY id")
    assert [c["kind"] for c in calls] == ["classify", "draft"]
    reasoning = spec(Tier.REASONING)
    for call in calls:
        if call["min_tier"] == "reasoning":
            assert call["tier"] == "reasoning"
            assert call["model_sha256"] == reasoning.sha256
        assert call["status"] == "ok"
        assert call["prompt_tokens"] > 0 and call["completion_tokens"] > 0
    assert calls[0]["model_sha256"] == spec(Tier.MECHANICAL).sha256


async def test_mechanical_work_is_upgraded_when_its_tier_is_down(
    rig_factory: Callable[..., Any],
) -> None:
    rig: Rig = await rig_factory([spec(Tier.REASONING)])
    await rig.submit("u1", pipeline="triage")
    await rig.wait(lambda: _is(rig, "u1", "classify", "done"), what="the classification")
    (call,) = await rig.rows("SELECT * FROM inference_calls")
    assert (call["min_tier"], call["tier"]) == ("mechanical", "reasoning")
    assert call["route_reason"] == "upgraded: mechanical tier unavailable"


async def test_the_pool_capacity_bounds_what_the_runner_claims(
    rig_factory: Callable[..., Any],
) -> None:
    # One worker, no queue: at most one model call may be in flight from this runner. Each
    # next message is claimed when the one before frees the pool, not at the fallback poll
    # (a minute here): a claim made while the last attempt still counted came back short, and
    # nothing asked the lane again.
    rig: Rig = await rig_factory([spec(Tier.MECHANICAL, queue=0)], poll=60.0)
    ids = [f"b{i}" for i in range(6)]
    for source_id in ids:
        await rig.submit(source_id, pipeline="triage")
    most = 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        # (The database may count one more running: an attempt whose handler has returned
        # and whose outcome is on its way; its model call is over.)
        most = max(most, rig.runner._model_attempts(Tier.MECHANICAL))
        done = await rig.rows("SELECT count(*) AS n FROM agent_messages WHERE status = 'done'")
        if int(done[0]["n"]) == len(ids):
            break
        await asyncio.sleep(0.02)
    assert int(done[0]["n"]) == len(ids)
    assert most == 1
    assert rig.runner.stats.polls == 0
    stats = rig.pool.stats()["mechanical"]
    assert stats["requests_total"] == len(ids)
    # No queue: a second call in flight would have been refused.
    assert stats["requests_refused"] == 0 and stats["requests_failed"] == 0


async def _is(rig: Rig, source_id: str, stage: str, status: str) -> bool:
    return await rig.stage_status(source_id, stage) == status


def test_waiting_states_are_known() -> None:
    assert MessageStatus("waiting_capability") is MessageStatus.WAITING_CAPABILITY


async def test_output_that_does_not_parse_is_recorded_and_changes_nothing(
    rig_factory: Callable[..., Any],
) -> None:
    rig: Rig = await rig_factory([spec(Tier.MECHANICAL)])
    await rig.submit("s1", pipeline="strict")
    await rig.wait(lambda: _is(rig, "s1", "classify", "dead"), what="the attempt to fail")
    (call,) = await rig.rows("SELECT status, error, completion_tokens FROM inference_calls")
    assert call["status"] == "invalid_output"
    assert "refused by the handler's own rule" in call["error"]
    assert call["completion_tokens"] > 0
    (message,) = await rig.rows("SELECT tenant, error FROM agent_messages")
    assert message["tenant"] == "acme" and "OutputInvalid" in message["error"]
