"""Group commit of single enqueues: how concurrent calls are grouped, split and answered.

The statement sender here is a recording function, because what is under test is the grouping
(pure coordination); tests/db/test_envelope.py runs the same through the real database.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest

from appliance.bus.group_commit import EnqueueGroupCommit
from appliance.domain.envelope import EnqueueRequest, EnqueueResult
from appliance.domain.errors import InvalidInput, UnknownTenant

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def request(source_id: str, tenant: str = "acme") -> EnqueueRequest:
    return EnqueueRequest.build(
        tenant=tenant, pipeline="p", stage="s", source="t", source_id=source_id, directive="d"
    )


class Recorder:
    """Answers every request with a fresh id (or refuses the ones named `bad`), recording each
    statement; a gate holds statements in flight until the test opens it."""

    def __init__(self) -> None:
        self.statements: list[list[str]] = []
        self.clocks: list[datetime | None] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.next_id = 0
        self.seen: set[tuple[str, str]] = set()
        self.in_flight: list[str] = []
        self.overlaps: list[str] = []  # keys sent while a statement holding them was in flight
        self.fail_with: Exception | None = None

    async def send(
        self, requests: Sequence[EnqueueRequest], now: datetime | None
    ) -> list[EnqueueResult]:
        self.statements.append([r.source_id for r in requests])
        self.clocks.append(now)
        keys = [r.idempotency_key for r in requests]
        self.overlaps.extend(k for k in keys if k in self.in_flight)
        self.in_flight.extend(keys)
        try:
            await self.gate.wait()
        finally:
            for k in keys:
                self.in_flight.remove(k)
        if self.fail_with is not None:
            raise self.fail_with
        if any(r.source_id.startswith("bad") for r in requests):
            raise InvalidInput("source_id", "refused")
        results = []
        for r in requests:
            key = (r.tenant, r.idempotency_key)
            self.next_id += 1
            results.append(EnqueueResult(self.next_id, key not in self.seen))
            self.seen.add(key)
        return results


async def test_an_uncontended_call_is_sent_alone_at_once() -> None:
    rec = Recorder()
    group = EnqueueGroupCommit(rec.send)
    result = await group.enqueue(request("a"), None)
    assert result.new and rec.statements == [["a"]]
    assert group.statements == 1


async def test_calls_arriving_during_a_statement_share_the_next() -> None:
    rec = Recorder()
    rec.gate.clear()
    group = EnqueueGroupCommit(rec.send, max_inflight=1)
    first = asyncio.create_task(group.enqueue(request("0"), None))
    await asyncio.sleep(0)  # the first statement is now in flight, held by the gate
    rest = [asyncio.create_task(group.enqueue(request(str(i)), None)) for i in range(1, 50)]
    await asyncio.sleep(0)
    rec.gate.set()
    results = await asyncio.gather(first, *rest)
    assert rec.statements[0] == ["0"]
    assert rec.statements[1] == [str(i) for i in range(1, 50)]
    assert len(rec.statements) == 2
    assert len({r.id for r in results}) == 50 and all(r.new for r in results)


async def test_statements_hold_at_most_max_batch() -> None:
    rec = Recorder()
    rec.gate.clear()
    group = EnqueueGroupCommit(rec.send, max_batch=7, max_inflight=1)
    calls = [asyncio.create_task(group.enqueue(request(str(i)), None)) for i in range(30)]
    await asyncio.sleep(0)
    rec.gate.set()
    await asyncio.gather(*calls)
    assert max(len(s) for s in rec.statements) == 7
    assert sorted(int(x) for s in rec.statements for x in s) == list(range(30))


async def test_a_repeated_key_goes_in_a_later_statement() -> None:
    rec = Recorder()
    rec.gate.clear()
    group = EnqueueGroupCommit(rec.send, max_inflight=1)
    calls = [asyncio.create_task(group.enqueue(request(sid), None)) for sid in "xaxbx"]
    await asyncio.sleep(0)
    rec.gate.set()
    results = await asyncio.gather(*calls)
    assert all(len(s) == len(set(s)) for s in rec.statements)
    # The database answers the repeats (here: the recorder, as ON CONFLICT would).
    assert [r.new for r in results] == [True, True, False, True, False]


async def test_tenants_and_clocks_never_share_a_statement() -> None:
    rec = Recorder()
    rec.gate.clear()
    group = EnqueueGroupCommit(rec.send, max_inflight=1)
    calls = [
        asyncio.create_task(group.enqueue(request(f"{tenant}{i}", tenant), now))
        for i in range(4)
        for tenant in ("acme", "globex")
        for now in (None, T0)
    ]
    await asyncio.sleep(0)
    rec.gate.set()
    await asyncio.gather(*calls)
    for ids in rec.statements:
        assert len({sid.rstrip("0123456789") for sid in ids}) == 1
    assert set(rec.clocks) == {None, T0}


async def test_a_failed_statement_is_retried_request_by_request() -> None:
    rec = Recorder()
    rec.gate.clear()
    group = EnqueueGroupCommit(rec.send, max_inflight=1)
    first = asyncio.create_task(group.enqueue(request("0"), None))
    await asyncio.sleep(0)
    rest = [
        asyncio.create_task(group.enqueue(request(sid), None)) for sid in ("1", "bad", "2", "3")
    ]
    await asyncio.sleep(0)
    rec.gate.set()
    outcomes = await asyncio.gather(first, *rest, return_exceptions=True)
    assert isinstance(outcomes[2], InvalidInput)
    assert all(isinstance(o, EnqueueResult) and o.new for i, o in enumerate(outcomes) if i != 2)
    # The shared statement failed, then each request went alone.
    assert rec.statements[1] == ["1", "bad", "2", "3"]
    assert rec.statements[2:] == [["1"], ["bad"], ["2"], ["3"]]


async def test_a_caller_cancelled_while_waiting_is_never_sent() -> None:
    rec = Recorder()
    rec.gate.clear()
    group = EnqueueGroupCommit(rec.send, max_inflight=1)
    first = asyncio.create_task(group.enqueue(request("0"), None))
    await asyncio.sleep(0)
    waiting = asyncio.create_task(group.enqueue(request("gone"), None))
    kept = asyncio.create_task(group.enqueue(request("kept"), None))
    await asyncio.sleep(0)
    waiting.cancel()
    rec.gate.set()
    await asyncio.gather(first, kept)
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert rec.statements == [["0"], ["kept"]]
    assert not group._groups  # nothing left behind


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        EnqueueGroupCommit(Recorder().send, max_batch=0)


async def test_a_repeated_key_never_goes_beside_the_statement_holding_it() -> None:
    # With two statements allowed in flight, the repeat still waits for the first to end, so
    # the database never sees one key in two concurrent statements.
    rec = Recorder()
    rec.gate.clear()
    group = EnqueueGroupCommit(rec.send, max_inflight=2)
    first = asyncio.create_task(group.enqueue(request("x"), None))
    await asyncio.sleep(0)
    rest = [asyncio.create_task(group.enqueue(request(sid), None)) for sid in ("a", "x", "b")]
    for _ in range(3):
        await asyncio.sleep(0)
    assert rec.statements == [["x"], ["a", "b"]]  # the second went beside the first, without x
    rec.gate.set()
    results = await asyncio.gather(first, *rest)
    assert rec.statements[2:] == [["x"]]
    assert rec.overlaps == []
    assert [r.new for r in results] == [True, True, False, True]


async def test_an_error_not_about_the_input_reaches_every_caller_at_once() -> None:
    for error in (ConnectionError("database unreachable"), UnknownTenant("acme")):
        rec = Recorder()
        rec.gate.clear()
        group = EnqueueGroupCommit(rec.send, max_inflight=1)
        first = asyncio.create_task(group.enqueue(request("0"), None))
        await asyncio.sleep(0)
        rest = [asyncio.create_task(group.enqueue(request(str(i)), None)) for i in range(1, 6)]
        await asyncio.sleep(0)
        rec.fail_with = error
        rec.gate.set()
        outcomes = await asyncio.gather(first, *rest, return_exceptions=True)
        assert all(o is error for o in outcomes)
        assert len(rec.statements) == 2  # no request-by-request retries
