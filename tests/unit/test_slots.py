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


def test_abandoned_handlers_hold_shared_slots_first() -> None:
    slots = LaneSlots(total=8, reserved_interactive=2, reserved_system=1)
    slots.take(Lane.BATCH, 5)
    for _ in range(5):
        slots.abandon(Lane.BATCH)
    # Batch handlers given up on still hold the five shared slots: no new batch work, while
    # the reserves stay whole.
    assert slots.running[Lane.BATCH] == 0 and slots.abandoned[Lane.BATCH] == 5
    assert slots.free(Lane.BATCH) == 0
    assert slots.free(Lane.INTERACTIVE) == 2 and slots.free(Lane.SYSTEM) == 1
    slots.abandoned_ended(Lane.BATCH)
    assert slots.free(Lane.BATCH) == 1 and slots.free(Lane.INTERACTIVE) == 3


def test_abandoned_handlers_beyond_the_shared_slots_take_their_own_lanes_reserve() -> None:
    slots = LaneSlots(total=4, reserved_interactive=1, reserved_system=1)  # 2 shared
    slots.take(Lane.INTERACTIVE, 3)  # its reserve and both shared slots
    slots.take(Lane.SYSTEM)
    for _ in range(3):
        slots.abandon(Lane.INTERACTIVE)
    # Three interactive handlers given up on: both shared slots and the interactive reserve.
    # The system reserve is its own lane's (its handler still runs there).
    assert slots.free(Lane.INTERACTIVE) == 0 and slots.free(Lane.BATCH) == 0
    slots.give(Lane.SYSTEM)
    assert slots.free(Lane.SYSTEM) == 1 and slots.free(Lane.INTERACTIVE) == 0
    assert slots.own_free(Lane.INTERACTIVE) == 0 and slots.own_free(Lane.SYSTEM) == 1
    with pytest.raises(RuntimeError):
        slots.take(Lane.INTERACTIVE)
    # One ends: the two left hold the shared slots, and the interactive reserve is free again.
    slots.abandoned_ended(Lane.INTERACTIVE)
    assert slots.free(Lane.INTERACTIVE) == 1 and slots.free(Lane.BATCH) == 0
    slots.abandoned_ended(Lane.INTERACTIVE)
    assert slots.free(Lane.BATCH) == 1 and slots.free(Lane.INTERACTIVE) == 2


def test_the_system_reserve_gives_way_first_when_both_lanes_wedge() -> None:
    slots = LaneSlots(total=4, reserved_interactive=1, reserved_system=1)  # 2 shared
    slots.take(Lane.INTERACTIVE, 2)
    slots.take(Lane.SYSTEM, 2)
    for lane in (Lane.INTERACTIVE, Lane.SYSTEM, Lane.SYSTEM):
        slots.abandon(lane)
    slots.give(Lane.INTERACTIVE)  # the one interactive handler still running ends
    # Three abandoned, two shared slots: the third holds the system reserve, not the
    # interactive one.
    assert slots.free(Lane.INTERACTIVE) == 1 and slots.free(Lane.SYSTEM) == 0


@given(
    st.integers(1, 16),
    st.data(),
    st.lists(
        st.tuples(st.sampled_from(list(Lane)), st.sampled_from(["take", "give", "abandon", "end"])),
        max_size=80,
    ),
)
def test_running_and_abandoned_never_exceed_the_total(
    total: int, data: st.DataObject, ops: list[tuple[Lane, str]]
) -> None:
    ri = data.draw(st.integers(0, total))
    rs = data.draw(st.integers(0, total - ri))
    slots = LaneSlots(total=total, reserved_interactive=ri, reserved_system=rs)
    for lane, op in ops:
        if op == "take" and slots.free(lane) > 0:
            slots.take(lane)
        elif op == "give":
            slots.give(lane)
        elif op == "abandon" and slots.running[lane] > 0:  # only a running handler is given up
            slots.abandon(lane)
        elif op == "end" and slots.abandoned[lane] > 0:
            slots.abandoned_ended(lane)
        a, r = slots.abandoned, slots.running
        assert slots.abandoned_total == sum(a.values())
        held = slots.busy + slots.abandoned_total
        assert held <= total  # the concurrency's promise
        for each in Lane:
            assert slots.free(each) <= total - held
        # Batch, abandoned or not, never holds a reserved slot.
        assert r[Lane.BATCH] + a[Lane.BATCH] <= total - ri - rs
        # A lane's reserve gives way only to its own lane's handlers, abandoned or running.
        assert slots.free(Lane.INTERACTIVE) >= ri - r[Lane.INTERACTIVE] - a[Lane.INTERACTIVE]
        assert slots.free(Lane.SYSTEM) >= rs - r[Lane.SYSTEM] - a[Lane.SYSTEM]
        assert slots.own_free(Lane.INTERACTIVE) <= slots.free(Lane.INTERACTIVE)
