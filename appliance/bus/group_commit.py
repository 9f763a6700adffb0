"""Group commit for single enqueues: concurrent `Bus.enqueue` calls share one statement.

Every enqueue is a durable transaction: one statement, one WAL flush, one trigger pass. When many
producers in one process enqueue at once (pipelines, the cockpit, schedules), most of that cost is
per statement, not per message. So calls that arrive while a statement for the same tenant (and
the same injected clock) is in flight wait and go together in the next one; a call that finds
nothing in flight or waiting goes at once, from its own task. No timer is involved: an idle bus
adds no latency, a busy one fills its statements.

What each caller sees is what it would see alone:
- its call returns only once the statement holding its request has committed;
- a key repeated among waiting callers is sent in a later statement, once the one holding it
  has ended, never twice in one or in two at once: the repeat is answered `duplicate` by the
  database and counted as a dedup hit like any other;
- when the database refuses a shared statement's input, each of its requests is retried alone,
  so the error reaches only the caller it belongs to (retrying is safe: the idempotency key makes
  it a no-op if the failed statement did commit after all); an error that is not about the
  input (the database unreachable) reaches every caller of the statement at once;
- a caller cancelled before its request was sent is dropped from the queue; one cancelled after
  may still land, as a statement cancelled in flight may.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from appliance.domain.envelope import EnqueueRequest, EnqueueResult
from appliance.domain.errors import InvalidInput, UnknownTenant

Send = Callable[[Sequence[EnqueueRequest], datetime | None], Awaitable[list[EnqueueResult]]]
GroupKey = tuple[str, datetime | None]
Waiter = tuple[EnqueueRequest, asyncio.Future[EnqueueResult]]


@dataclass
class _Group:
    """Callers of one tenant and clock: waiting ones, the keys of the statements in flight, and
    how many statements are in flight."""

    waiting: list[Waiter] = field(default_factory=list)
    sending: set[str] = field(default_factory=set)
    inflight: int = 0


class EnqueueGroupCommit:
    """Coalesces concurrent single enqueues into shared statements (see the module docstring)."""

    def __init__(self, send: Send, *, max_batch: int = 1000, max_inflight: int = 2) -> None:
        if max_batch < 1 or max_inflight < 1:
            raise ValueError("group commit needs max_batch and max_inflight of at least 1")
        self._send = send
        self.max_batch = max_batch
        self.max_inflight = max_inflight
        self._groups: dict[GroupKey, _Group] = {}
        # Flush tasks are referenced until they end (the loop keeps only weak references).
        self._tasks: set[asyncio.Task[None]] = set()
        self.statements = 0  # shared statements sent, for diagnostics and tests

    async def enqueue(self, request: EnqueueRequest, now: datetime | None) -> EnqueueResult:
        key: GroupKey = (request.tenant, now)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group()
        if group.inflight == 0 and not group.waiting:
            # Uncontended: sent from the caller's own task, with nothing added to its latency.
            group.inflight += 1
            group.sending.add(request.idempotency_key)
            self.statements += 1
            try:
                (result,) = await self._send([request], now)
            finally:
                group.sending.discard(request.idempotency_key)
                self._finished(key, group)
            return result
        future: asyncio.Future[EnqueueResult] = asyncio.get_running_loop().create_future()
        group.waiting.append((request, future))
        if group.inflight < self.max_inflight:
            group.inflight += 1
            self._start_flush(key, group)
        return await future

    def _start_flush(self, key: GroupKey, group: _Group) -> None:
        task = asyncio.create_task(self._flush(key, group))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _finished(self, key: GroupKey, group: _Group) -> None:
        """A statement sent from a caller's task ended: keep the queue moving, or forget it."""
        if group.waiting:
            self._start_flush(key, group)  # the slot passes to a flush task
        else:
            group.inflight -= 1
            if group.inflight == 0 and self._groups.get(key) is group:
                del self._groups[key]

    def _take(self, group: _Group) -> list[Waiter]:
        """The next statement's requests: in arrival order, each key at most once, and none
        whose key a statement in flight holds (that one's answer comes first)."""
        batch: list[Waiter] = []
        later: list[Waiter] = []
        keys: set[str] = set()
        for request, future in group.waiting:
            if future.done():  # cancelled while waiting: never sent
                continue
            k = request.idempotency_key
            if len(batch) >= self.max_batch or k in keys or k in group.sending:
                later.append((request, future))
                continue
            keys.add(k)
            batch.append((request, future))
        group.waiting = later
        group.sending |= keys
        return batch

    async def _flush(self, key: GroupKey, group: _Group) -> None:
        try:
            while True:
                # One pass of the loop first: callers woken by the previous statement's answers
                # (or arriving together) join this statement instead of each starting one.
                await asyncio.sleep(0)
                batch = self._take(group)
                if not batch:
                    return
                try:
                    await self._run(batch, key[1])
                except asyncio.CancelledError:
                    for _, future in batch:
                        future.cancel()
                    raise
                except Exception as exc:  # a bug here must reach the callers, not hang them
                    for _, future in batch:
                        _settle(future, exc)
                finally:
                    group.sending.difference_update(r.idempotency_key for r, _ in batch)
        finally:
            group.inflight -= 1
            if group.inflight == 0:
                # Only a cancelled flush can leave callers behind: they must not wait forever.
                for _, future in group.waiting:
                    future.cancel()
                group.waiting.clear()
                if self._groups.get(key) is group:
                    del self._groups[key]

    async def _run(self, batch: list[Waiter], now: datetime | None) -> None:
        self.statements += 1
        try:
            results = await self._send([request for request, _ in batch], now)
        except InvalidInput as exc:
            if len(batch) == 1 or isinstance(exc, UnknownTenant):
                # One tenant per group: an unknown tenant is every caller's error.
                for _, future in batch:
                    _settle(future, exc)
                return
            # A request the database refused: each alone, so that the error reaches only its
            # own caller (callers that gave up meanwhile are not sent again).
            for request, future in batch:
                if future.done():
                    continue
                try:
                    (result,) = await self._send([request], now)
                except Exception as single:  # handed to the caller it belongs to
                    _settle(future, single)
                else:
                    _settle(future, result)
            return
        except Exception as exc:
            # The database unreachable, the pool exhausted, ...: every caller's error at once
            # (request by request, each would wait its own timeout).
            for _, future in batch:
                _settle(future, exc)
            return
        for (_, future), result in zip(batch, results, strict=True):
            _settle(future, result)


def _settle(future: asyncio.Future[EnqueueResult], outcome: EnqueueResult | BaseException) -> None:
    if future.done():  # the caller was cancelled meanwhile
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
