"""Claim-ahead: small (a limit), brief (bounded by the measured rates), first in first out."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.bus.claim_ahead import ClaimAhead
from appliance.bus.slots import LaneSlots
from appliance.domain.envelope import Lane, Message, MessageStatus
from appliance.domain.errors import ConfigurationError

NOW = datetime(2026, 11, 1, tzinfo=UTC)
BASE = Message(
    id=1, tenant="acme", pipeline="p", stage="s", source="s", source_id="1",
    idempotency_key="k", directive="d", context={}, from_agent=None, to_agent=None,
    lane=Lane.INTERACTIVE, priority=0, status=MessageStatus.RUNNING, attempts=1, max_attempts=5,
    not_before=NOW, deadline=None, lease_token=7, lease_expires_at=NOW, claimed_by="w",
    result=None, error=None, created_at=NOW, updated_at=NOW,
)  # fmt: skip


def msg(i: int, lane: Lane = Lane.INTERACTIVE) -> Message:
    return replace(BASE, id=i, lane=lane, lease_token=100 + i)


def measured(limit: int = 24, claim: float = 0.0015, busy: float = 0.0002) -> ClaimAhead:
    ahead = ClaimAhead(limit)
    ahead.observe_claim(claim)
    for lane in Lane:
        ahead.observe_busy(lane, busy)
    return ahead


def test_nothing_ahead_until_claims_and_runs_were_measured() -> None:
    ahead = ClaimAhead(24)
    assert ahead.allowance(Lane.INTERACTIVE, 7) == 0
    ahead.observe_claim(0.0015)
    assert ahead.allowance(Lane.INTERACTIVE, 7) == 0  # no run of this lane seen yet
    ahead.observe_busy(Lane.BATCH, 0.0001)
    assert ahead.allowance(Lane.INTERACTIVE, 7) == 0
    ahead.observe_busy(Lane.INTERACTIVE, 0.0001)
    assert ahead.allowance(Lane.INTERACTIVE, 7) == 24


def test_quick_stages_get_up_to_the_limit_less_what_is_held() -> None:
    ahead = measured(limit=24)
    assert ahead.allowance(Lane.INTERACTIVE, 7) == 24
    for i in range(10):
        ahead.hold(msg(i), due=1.0)
    assert ahead.allowance(Lane.INTERACTIVE, 7) == 14
    # The limit is the runner's, over every lane.
    assert ahead.allowance(Lane.BATCH, 5) == 14
    for i in range(10, 24):
        ahead.hold(msg(i, Lane.BATCH), due=1.0)
    assert ahead.allowance(Lane.INTERACTIVE, 7) == 0


def test_slow_stages_get_no_claim_ahead() -> None:
    # 5 slots of 20 ms handlers finish 250 messages a second: in two round trips of 1.5 ms,
    # under one. A held message would wait for a slot instead of another runner taking it.
    ahead = measured(busy=0.020)
    assert ahead.allowance(Lane.BATCH, 5) == 0
    # A model stage of seconds, likewise.
    assert measured(busy=3.0).allowance(Lane.INTERACTIVE, 7) == 0


def test_allowance_is_what_the_slots_finish_within_the_window() -> None:
    # 7 slots, 2 ms each: 3,500 a second; two claim round trips of 1.5 ms: 10.5 -> 10.
    assert measured(busy=0.002).allowance(Lane.INTERACTIVE, 7) == 10
    assert measured(busy=0.002).allowance(Lane.INTERACTIVE, 0) == 0
    assert measured(limit=0).allowance(Lane.INTERACTIVE, 7) == 0


def test_estimates_follow_a_change_in_stage_speed() -> None:
    ahead = measured(busy=0.0002)
    assert ahead.allowance(Lane.INTERACTIVE, 7) == 24
    for _ in range(30):  # the lane's stages turn slow: the moving average follows
        ahead.observe_busy(Lane.INTERACTIVE, 0.5)
    assert ahead.allowance(Lane.INTERACTIVE, 7) == 0


def test_held_messages_come_out_first_in_first_out_per_lane() -> None:
    ahead = ClaimAhead(8)
    ahead.hold(msg(1), due=9.0)
    ahead.hold(msg(2, Lane.BATCH), due=9.0)
    ahead.hold(msg(3), due=5.0)
    assert len(ahead) == 3 and ahead.held(Lane.INTERACTIVE) == 2
    first, second = ahead.pop(Lane.INTERACTIVE), ahead.pop(Lane.INTERACTIVE)
    assert first is not None and second is not None
    assert (first.message, first.due, second.message, second.due) == (msg(1), 9.0, msg(3), 5.0)
    assert ahead.pop(Lane.INTERACTIVE) is None
    held = ahead.pop(Lane.BATCH)
    assert held is not None and held.message == msg(2, Lane.BATCH)


def test_messages_whose_time_to_start_came_are_taken_out_to_be_given_back() -> None:
    # Each has its own time (a short run deadline makes it early), in any order of holding.
    ahead = ClaimAhead(8)
    ahead.hold(msg(1), due=4.0)
    ahead.hold(msg(2), due=1.0)
    ahead.hold(msg(3, Lane.SYSTEM), due=2.0)
    ahead.hold(msg(4), due=9.0)
    assert ahead.next_due() == 1.0
    assert ahead.take_due(3.0) == [msg(2), msg(3, Lane.SYSTEM)]
    assert len(ahead) == 2 and ahead.next_due() == 4.0
    popped = ahead.pop(Lane.INTERACTIVE)
    assert popped is not None and popped.message == msg(1)  # still first in line
    assert ahead.take_all() == [msg(4)]
    assert len(ahead) == 0 and ahead.next_due() is None


def test_a_wide_window_holds_up_to_the_limit_whatever_the_rates() -> None:
    ahead = ClaimAhead(5, window=1e9)
    ahead.observe_claim(0.001)
    ahead.observe_busy(Lane.INTERACTIVE, 10.0)
    assert ahead.allowance(Lane.INTERACTIVE, 1) == 5


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match="claim_ahead"):
        ClaimAhead(-1)
    with pytest.raises(ConfigurationError, match="window"):
        ClaimAhead(4, window=0)


@given(st.integers(1, 16), st.data())
def test_capacity_is_what_a_lane_may_start_when_nothing_runs(
    total: int, data: st.DataObject
) -> None:
    ri = data.draw(st.integers(0, total))
    rs = data.draw(st.integers(0, total - ri))
    slots = LaneSlots(total=total, reserved_interactive=ri, reserved_system=rs)
    for lane in Lane:
        assert slots.capacity(lane) == slots.free(lane)
