"""A runner's id, held by one live runner at a time: taken at the start, given up on a stop
or when the runner goes quiet.

Other runners read the stages a runner serves by its id; two live runners under one id would
each take the other's stages for their own and skip none of them. So a runner that finds its
id held by a live runner refuses to start, unless that holder is a process of this host that
has exited (a restart under a configured id, before the dead one's reports have aged out).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import psutil

from appliance.domain.errors import RunnerIdInUse
from appliance.domain.ports import RUNNER_ALIVE, IdHolder, RunnerStore

log = logging.getLogger(__name__)

# Process start times and the runner's own started_at come from different reads of the same
# clock; a process that began more than this after the holder's start is not the holder.
_START_SLACK_S = 1.0


def holder_gone_here(holder: IdHolder, *, host: str | None = None) -> bool:
    """Whether the holder was a process of this host that no longer runs (its pid is free, or
    now belongs to a process started after the holder)."""
    if holder.host != (host if host is not None else socket.gethostname()):
        return False  # another machine's process: only its silence tells
    try:
        started = psutil.Process(holder.pid).create_time()
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False  # there, but not ours to inspect: taken as alive
    return started > holder.started_at.timestamp() + _START_SLACK_S


async def take_runner_id(store: RunnerStore, info: dict[str, Any]) -> None:
    """Register the runner described by `info`, or raise RunnerIdInUse naming the live holder
    of its id."""
    holder = await store.register_runner(info)
    if holder is not None and holder_gone_here(holder):
        log.warning(
            "runner id %s was held by pid %d of this host, which has exited; taking it over",
            info["id"],
            holder.pid,
        )
        holder = await store.register_runner(info, take_over=True)
    if holder is not None:
        raise RunnerIdInUse(
            info["id"],
            f"is held by a live runner (host {holder.host}, pid {holder.pid}, last report "
            f"{holder.seen_age_s:.0f} s ago; one that died without stopping gives its id up "
            f"{RUNNER_ALIVE.total_seconds():.0f} s after its last report)",
        )


def taken_over(runner_id: str) -> RunnerIdInUse:
    """The error of a runner whose id another one took while it was silent."""
    return RunnerIdInUse(
        runner_id,
        f"was taken over by another runner while this one did not report for "
        f"{RUNNER_ALIVE.total_seconds():.0f} s (taken as gone)",
    )
