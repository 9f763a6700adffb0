"""The doorbell's notifications as the database sends them: one per lane per transaction that
makes work of that lane claimable, the lane the only payload, none for work that is not
claimable (deferred, cancelled, reclaimed into its backoff)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from appliance.bus.core import Bus
from appliance.db.database import Endpoints
from appliance.domain.envelope import Lane

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def listener(fresh_db: Endpoints) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with psycopg.connect(fresh_db.system, autocommit=True) as conn:
        conn.execute("LISTEN appliance_work")
        yield conn


def rung(conn: psycopg.Connection[tuple[object, ...]]) -> list[str]:
    """The notifications that arrived (each payload), waiting briefly for stragglers."""
    return sorted(n.payload for n in conn.notifies(timeout=0.3))


def _requests(bus: Bus, n: int, lane: Lane, prefix: str, **kw: object) -> list[object]:
    return [
        bus.request(
            tenant="acme", pipeline="demo", stage="intake", source="t",
            source_id=f"{prefix}{i}", directive="d", lane=lane, **kw,
        )
        for i in range(n)
    ]  # fmt: skip


async def test_one_notification_per_lane_per_transaction_payload_only_the_lane(
    bus: Bus, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    await bus.enqueue_many(_requests(bus, 200, Lane.INTERACTIVE, "i"), now=T0)  # type: ignore[arg-type]
    assert rung(listener) == ["interactive"]
    both = _requests(bus, 3, Lane.INTERACTIVE, "j") + _requests(bus, 3, Lane.BATCH, "b")
    await bus.enqueue_many(both, now=T0)  # type: ignore[arg-type]
    assert rung(listener) == ["batch", "interactive"]
    # Duplicates create no work: no ring.
    await bus.enqueue_many(_requests(bus, 3, Lane.BATCH, "b"), now=T0)  # type: ignore[arg-type]
    assert rung(listener) == []


async def test_work_that_is_not_claimable_rings_nothing(
    bus: Bus, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    later = T0 + timedelta(hours=1)
    await bus.enqueue_many(
        _requests(bus, 2, Lane.BATCH, "later", not_before=later),  # type: ignore[arg-type]
        now=T0,
    )
    assert rung(listener) == []  # deferred: out of the claim's index
    (first, *_) = await bus.enqueue_many(_requests(bus, 1, Lane.INTERACTIVE, "c"), now=T0)  # type: ignore[arg-type]
    assert rung(listener) == ["interactive"]
    (m,) = await bus.claim("w", lease=timedelta(seconds=10), now=T0)
    assert m.id == first.id
    assert await bus.reclaim(now=T0 + timedelta(seconds=11)) == [m.id]
    assert rung(listener) == []  # back in its backoff: deferred
    assert await bus.cancel("acme", m.id)
    assert rung(listener) == []
    # Due at last: the promoter makes both claimable in one statement, one ring.
    assert await bus.promote_due(now=later) == 2
    assert rung(listener) == ["batch"]
