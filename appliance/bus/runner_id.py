"""A runner's id, held by one live runner at a time: taken at the start, given up on a stop
or when the runner goes quiet.

Other runners read the stages a runner serves by its id; two live runners under one id would
each take the other's stages for their own and skip none of them. So a runner that finds its
id held by a runner that has not stopped waits for that holder's reports to age out (it died
without stopping: a restart under a configured id), and refuses to start as soon as the holder
reports again (it is alive). Only the database's clock and the holder's own reports decide:
pids and host names say nothing reliable across containers that share a host name.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from appliance.domain.errors import RunnerIdInUse
from appliance.domain.ports import RUNNER_ALIVE, RunnerStore

log = logging.getLogger(__name__)

# How often a runner waiting for an id asks again. A live holder reports every few seconds
# (RunnerConfig.report_every), so it is recognised within one of its report periods.
ASK_EVERY_S = 1.0


async def take_runner_id(
    store: RunnerStore, info: dict[str, Any], stop: asyncio.Event, *, ask_every: float = ASK_EVERY_S
) -> bool:
    """Register the runner described by `info`; False if `stop` was set while it waited for a
    silent holder to age out. Raises RunnerIdInUse when the holder reports meanwhile."""
    first = await store.register_runner(info)
    if first is None:
        return True
    log.warning(
        "runner id %s is held by host %s pid %d, which last reported %.0f s ago and did not "
        "stop: waiting up to %.0f s for it to report again (alive: this runner refuses to "
        "start) or to go quiet (it died: this runner takes the id over)",
        info["id"],
        first.host,
        first.pid,
        first.seen_age_s,
        max(0.0, RUNNER_ALIVE.total_seconds() - first.seen_age_s),
    )
    while True:
        try:
            await asyncio.wait_for(stop.wait(), ask_every)
            return False
        except TimeoutError:
            pass
        holder = await store.register_runner(info)
        if holder is None:
            return True
        # It reported since (or another runner took the id meanwhile): alive.
        if (holder.reported_at, holder.host, holder.pid, holder.started_at) != (
            first.reported_at,
            first.host,
            first.pid,
            first.started_at,
        ):
            raise RunnerIdInUse(
                info["id"],
                f"is held by a live runner (host {holder.host}, pid {holder.pid}, "
                f"started {holder.started_at.isoformat(timespec='seconds')})",
            )


def taken_over(runner_id: str) -> RunnerIdInUse:
    """The error of a runner whose id another one took while it was silent."""
    return RunnerIdInUse(
        runner_id,
        f"was taken over by another runner while this one did not report for "
        f"{RUNNER_ALIVE.total_seconds():.0f} s (taken as gone)",
    )
