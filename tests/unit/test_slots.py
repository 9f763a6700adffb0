"""Lane capacity: reserved interactive slots, a system share, batch only in shared slots."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.bus.slots import LaneSlots
from appliance.domain.envelope import Lane
from appliance.domain.errors import ConfigurationError


def test_batch_backfill_never_takes_reserved_slots() -> None:
    slots = LaneSlots(total=8, reserved_interactive=2, reserved_system=1)
    assert slots.free(Lane.BATCH) == 5
    slots.take(Lane.BATCH, 5)
    assert slots.free(Lane.BATCH) == 0
    assert slots.free(Lane.INTERACTIVE) == 2
    assert slots.free(Lane.SYSTEM) == 1
    with pytest.raises(RuntimeError):
        slots.take(Lane.BATCH)


def test_interactive_may_use_shared_slots() -> None:
    slots = LaneSlots(total=4, reserved_interactive=1, reserved_system=1)
    slots.take(Lane.INTERACTIVE, 3)
    assert slots.free(Lane.INTERACTIVE) == 0
    assert slots.free(Lane.SYSTEM) == 1
    assert slots.free(Lane.BATCH) == 0
    slots.give(Lane.INTERACTIVE, 3)
    assert slots.free(Lane.BATCH) == 2


def test_reservations_cannot_exceed_total() -> None:
    with pytest.raises(ConfigurationError, match="exceed"):
        LaneSlots(total=2, reserved_interactive=2, reserved_system=1)


@given(
    st.integers(1, 16),
    st.data(),
    st.lists(st.tuples(st.sampled_from(list(Lane)), st.booleans()), max_size=60),
)
def test_invariants_hold_for_any_sequence(total: int, data: st.DataObject, ops) -> None:
    ri = data.draw(st.integers(0, total))
    rs = data.draw(st.integers(0, total - ri))
    slots = LaneSlots(total=total, reserved_interactive=ri, reserved_system=rs)
    for lane, start in ops:
        if start and slots.free(lane) > 0:
            slots.take(lane)
        elif not start:
            slots.give(lane)
        assert slots.busy <= total
        # Batch never eats into what is reserved for the other lanes.
        assert slots.running[Lane.BATCH] <= total - ri - rs
        assert slots.free(Lane.INTERACTIVE) >= max(0, ri - slots.running[Lane.INTERACTIVE])


def test_own_free_counts_only_a_lanes_reserved_slots() -> None:
    slots = LaneSlots(total=8, reserved_interactive=2, reserved_system=1)
    assert slots.own_free(Lane.INTERACTIVE) == 2 and slots.own_free(Lane.BATCH) == 0
    slots.take(Lane.INTERACTIVE, 1)
    assert slots.own_free(Lane.INTERACTIVE) == 1
    slots.take(Lane.INTERACTIVE, 3)  # one reserved, two shared
    assert slots.own_free(Lane.INTERACTIVE) == 0
    assert slots.free(Lane.BATCH) == 3


def _free_by_definition(slots: LaneSlots, lane: Lane) -> int:
    """Free slots as the rule says: a lane's own free reserve plus the free shared slots, where
    interactive and system work beyond their reserves, and all batch work, use shared slots."""
    r = slots.running
    shared_used = (
        max(0, r[Lane.INTERACTIVE] - slots.reserved_interactive)
        + max(0, r[Lane.SYSTEM] - slots.reserved_system)
        + r[Lane.BATCH]
    )
    shared_free = max(0, slots.shared - shared_used)
    own = {
        Lane.INTERACTIVE: max(0, slots.reserved_interactive - r[Lane.INTERACTIVE]),
        Lane.SYSTEM: max(0, slots.reserved_system - r[Lane.SYSTEM]),
        Lane.BATCH: 0,
    }
    return own[lane] + shared_free


@given(st.integers(1, 16), st.data())
def test_free_matches_its_definition_in_every_state(total: int, data: st.DataObject) -> None:
    ri = data.draw(st.integers(0, total))
    rs = data.draw(st.integers(0, total - ri))
    slots = LaneSlots(total=total, reserved_interactive=ri, reserved_system=rs)
    for lane in Lane:
        slots.running[lane] = data.draw(st.integers(0, total))
    for lane in Lane:
        assert slots.free(lane) == _free_by_definition(slots, lane)
