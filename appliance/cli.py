"""The `appliance` command: database, tenants, submit, status and bus operations."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from pydantic_settings import SettingsError

from appliance import cli_models, cli_spend
from appliance.bus.core import ID_MAX, LIST_MAX
from appliance.db.database import DATABASE_ERRORS, check_server, client_command, error_text
from appliance.db.migrate import migrate, schema_problem
from appliance.db.schema_dump import dump_schema
from appliance.domain.envelope import (
    CONTEXT_TEXT_SLACK,
    WAITING,
    EnqueueRequest,
    Lane,
    Message,
    MessageStatus,
    check_name,
    decode_context,
    differences,
)
from appliance.domain.errors import (
    ApplianceError,
    ConfigurationError,
    DatabaseUnavailable,
    InvalidInput,
    MigrationError,
    UnknownTenant,
)
from appliance.domain.pipeline import Pipeline
from appliance.domain.ports import BusStatus
from appliance.log_damping import RepeatDamper
from appliance.pipelines.registry import BUILT_IN
from appliance.pipelines.support import SAMPLE_TICKETS
from appliance.runtime import (
    Services,
    endpoints,
    load_pipelines,
    local_cluster,
    pg_tool,
    run_runner,
    services,
)
from appliance.settings import Settings, settings_error_text

if TYPE_CHECKING:
    from appliance.db.cluster import LocalCluster


def _parse_time(field: str, text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInput(field, f"{text!r} is not an ISO 8601 time") from None
    if moment.tzinfo is None:
        raise InvalidInput(field, f"{text!r} has no time zone (add Z or +00:00)")
    return moment


def message_fields(message: Message) -> dict[str, Any]:
    """A message's fields for JSON output (`bus show`, `bus list --json`), without `extra`."""
    return {k: v for k, v in vars(message).items() if k != "extra"}


def listing_table(messages: Sequence[Message]) -> str:
    """`bus list` for a person: one line a message, its error's first line cut short."""
    lines = [
        f"{'id':>10}  {'status':<18} {'lane':<11} {'pipeline/stage':<28} {'tries':>5}  "
        f"{'updated (UTC)':<19}  error"
    ]
    for m in messages:
        first = (m.error or "").strip().splitlines()
        error = first[0][:60] if first else ""
        updated = m.updated_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
        lines.append(
            f"{m.id:>10}  {m.status.value:<18} {m.lane.value:<11} "
            f"{(m.pipeline + '/' + m.stage)[:28]:<28} {f'{m.attempts}/{m.max_attempts}':>5}  "
            f"{updated:<19}  {error}".rstrip()
        )
    if not messages:
        lines.append("(none)")
    return "\n".join(lines)


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is not from {low} to {high}")
        return value

    return parse


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds over 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds over 0")
    return value


def _read_context(text: str | None, max_bytes: int) -> Any:
    """The --context argument: JSON text, @FILE, or @- for standard input."""
    if text is None:
        return None
    if not text.startswith("@"):
        return decode_context(text, max_bytes)
    if text == "@":
        raise InvalidInput("context", "@ names no file (@FILE, or @- for standard input)")
    # The limit is on the context, its compact JSON (as the API measures it), not on the
    # file's bytes: a file written with indentation or a final newline may be larger than its
    # context. Read at most the text decode_context takes, so that a huge file (or /dev/zero)
    # is refused by its size without being read whole into memory.
    cap = max_bytes * CONTEXT_TEXT_SLACK
    if text == "@-":
        # Standard input: the way to send a context larger than a command line may be.
        where = "standard input"
        data = sys.stdin.buffer.read(cap + 1)
    else:
        where = text[1:]
        try:
            with Path(where).open("rb") as f:
                data = f.read(cap + 1)
        except OSError as exc:
            raise InvalidInput("context", f"cannot read {where}: {exc.strerror}") from None
    if len(data) > cap:
        raise InvalidInput(
            "context",
            f"{where} is over {cap} bytes, {CONTEXT_TEXT_SLACK} times the limit of {max_bytes}"
            " bytes (on its compact JSON)",
        )
    try:
        return decode_context(data, max_bytes)
    except InvalidInput as exc:
        raise InvalidInput("context", f"{where}: {exc.problem}") from None


# -- db ----------------------------------------------------------------------------------------


def _start_hint(cluster: LocalCluster | None, *, migrate: bool) -> str:
    """What to do about a database that does not answer: start the local one, or, with
    APPLIANCE_DATABASE_URL, see to the server it names (the appliance manages none there)."""
    if cluster is None:
        return "(APPLIANCE_DATABASE_URL names a server the appliance does not manage: is it up?)"
    return "(the local one: appliance db start" + (" && appliance db migrate)" if migrate else ")")


def cmd_db(settings: Settings, args: argparse.Namespace) -> int:
    cluster = local_cluster(settings)
    action = args.db_action
    if action in ("migrate", "dump-schema", "psql"):
        # A stopped or missing database: one line that says how to start it, not the client
        # library's (or psql's) own words alone.
        try:
            check_server(endpoints(settings).admin)
        except DatabaseUnavailable as exc:
            raise DatabaseUnavailable(f"{exc} {_start_hint(cluster, migrate=False)}") from None
    if action == "migrate":
        report = migrate(endpoints(settings).admin)
        print(
            f"migrations: applied {report.applied or 'none'}; already applied {len(report.already)}"
        )
        return 0
    if action == "dump-schema":
        text = dump_schema(Path(pg_tool(settings, "pg_dump")), endpoints(settings).admin)
        if args.output:
            try:
                Path(args.output).write_text(text)
            except OSError as exc:
                raise InvalidInput(
                    "output", f"cannot write {args.output}: {exc.strerror}"
                ) from None
        else:
            sys.stdout.write(text)
        return 0
    if action == "psql":
        ends = endpoints(settings)
        conninfo = {"admin": ends.admin, "app": ends.app, "system": ends.system}[args.role]
        argv, client_env = client_command(pg_tool(settings, "psql"), conninfo)
        env = dict(os.environ, PGOPTIONS="-c search_path=appliance,pg_catalog", **client_env)
        extra = list(args.psql_args)
        if extra[:1] == ["--"]:
            extra = extra[1:]
        os.execvpe(argv[0], argv + extra, env)
    if cluster is None:
        # Nothing to start or stop, but say whether the server named is there at all.
        try:
            version = check_server(endpoints(settings).admin)
        except DatabaseUnavailable as exc:
            print(f"database: external server (APPLIANCE_DATABASE_URL): {exc}", file=sys.stderr)
            return 3 if action == "status" else 2
        print(
            f"database: external server (APPLIANCE_DATABASE_URL), PostgreSQL {version},"
            " reachable; the appliance manages nothing"
        )
        return 0
    if action == "start":
        cluster.start()
        created = cluster.ensure_database(settings.db.name)
        st = cluster.status()
        note = " (database created)" if created else ""
        print(f"database: running, pid {st.pid}, socket {st.socket_dir}, port {st.port}{note}")
    elif action == "stop":
        if not cluster.state_dir.exists():
            print(f"database: no cluster in {cluster.state_dir} (nothing to stop)")
            return 0
        was = cluster.status()
        cluster.stop()
        print("database: stopped" if was.running else "database: was not running")
    elif action == "status":
        st = cluster.status()
        state = f"running, pid {st.pid}" if st.running else "stopped"
        foreign = cluster.foreign()
        if foreign:
            state = (
                "refused: the data directory (or the state directory itself) holds a cluster the"
                " appliance did not create (move it away or use another state directory)"
            )
        elif not st.initialized:
            state = "not initialised (appliance db start creates it)"
        elif not st.running and (left := cluster.orphans()):
            state = (
                f"stopped, but processes of its last server still run ({', '.join(map(str, left))}"
                f"): a start waits up to {cluster.orphan_wait_s:.0f} s for them, then refuses"
                f" (end them: kill {' '.join(map(str, left))})"
            )
        elif st.running and (elsewhere := cluster.running_mismatch()):
            # Running, but not where these settings (and so every command) look for it.
            print(f"database: running, pid {st.pid}, but {elsewhere}")
            return 3
        print(f"database: {state}; data {st.data_dir}; socket {st.socket_dir}; port {st.port}")
        # Refused: not the appliance's database, however it runs.
        return 0 if st.running and not foreign else 3
    return 0


# -- tenants, submit, status, bus ----------------------------------------------------------------


async def cmd_tenant(settings: Settings, args: argparse.Namespace) -> int:
    async with services(settings) as svc:
        if args.tenant_action == "add":
            created = await svc.tenants.add(args.name, display_name=args.display_name)
            print(f"{args.name} {'added' if created else 'exists'}")
            if not created and args.display_name is not None:
                # `add` registers; it never changes a tenant that is there.
                print(
                    f"note: tenant {args.name} was already registered; its display name was not"
                    " changed",
                    file=sys.stderr,
                )
        else:
            for name in await svc.tenants.list():
                print(name)
    return 0


def _declared_pipeline(settings: Settings, name: str) -> Pipeline | None:
    """The pipeline of that name this appliance declares (its runners' settings), if any."""
    try:
        pipelines, _ = load_pipelines(settings)
    except Exception as exc:
        # An extra module that does not load must not stop a submit: the built-ins still can.
        print(f"warning: the declared pipelines cannot be loaded ({exc})", file=sys.stderr)
        pipelines = [BUILT_IN[n] for n in settings.runner.pipelines if n in BUILT_IN]
    return next((p for p in pipelines if p.name == name), None)


async def _tell_run_taken(svc: Services, request: EnqueueRequest) -> None:
    """A new first message under a key of its own, for a source item that a run already took
    through later stages: its hand-offs, keyed (source, source id, stage), will be that run's
    (duplicates that create no work). Said, not refused: the caller may mean just this."""
    held = await svc.store.item_stage_holders(
        request.tenant,
        pipeline=request.pipeline,
        stage=request.stage,
        source=request.source,
        source_id=request.source_id,
    )
    if held:
        taken = ", ".join(f"{stage} (message {mid})" for stage, mid in held)
        print(
            f"note: source item {request.source}/{request.source_id} already has a run in"
            f" pipeline {request.pipeline}: {taken}. Hand-offs are keyed by source, source id"
            " and stage, so this message's will be duplicates of those (no work); a new run"
            " takes a new source id.",
            file=sys.stderr,
        )


async def cmd_submit(settings: Settings, args: argparse.Namespace) -> int:
    context = _read_context(args.context, settings.bus.context_max_bytes)
    deadline = _parse_time("deadline", args.deadline)
    not_before = _parse_time("not_before", args.not_before)
    fields: dict[str, Any] = {
        "tenant": args.tenant,
        "pipeline": args.pipeline,
        "stage": args.stage,
        "source": args.source,
        "source_id": args.source_id,
        "lane": args.lane,
        "directive": args.directive,
        "context": context,
        "priority": args.priority,
        "deadline": deadline,
        "not_before": not_before,
        "key": args.key,
        "from_agent": args.from_agent,
        "to_agent": args.to_agent,
    }
    async with services(settings) as svc:
        # Bad input writes nothing, the stage graph included: checked before it is declared.
        try:
            request = svc.bus.request(**fields)
        except InvalidInput as exc:
            # Named as the command line names it (the API's field is idempotency_key).
            if exc.field == "idempotency_key":
                raise InvalidInput("key", exc.problem) from None
            raise
        if not await svc.tenants.exists(args.tenant):
            raise UnknownTenant(args.tenant)
        # The stage graph as a runner wrote it; else as this appliance declares it, written
        # now (once the stage is known to be in it), so that work submitted before the first
        # runner started gets its stage's lane, tier and attempts (not the bus defaults).
        stages = await svc.store.stages_of(args.pipeline)
        declared = None if stages else _declared_pipeline(settings, args.pipeline)
        known = stages or (sorted(s.name for s in declared.stages) if declared else [])
        if known and args.stage not in known:
            # A declared pipeline: a typo'd stage would wait for a runner that serves it, which
            # none ever will, until its wait expires. A pipeline never declared is taken as it
            # comes.
            raise InvalidInput(
                "stage",
                f"unknown stage {args.stage!r} of pipeline {args.pipeline}"
                f" (one of: {', '.join(known)})",
            )
        if declared is not None:
            await svc.store.sync_pipelines([declared], only_new=True)
        (result,) = await svc.bus.enqueue_many([request])
        print(f"{result.id} {'new' if result.new else 'duplicate'}", flush=True)
        if not result.new:
            await _tell_differences(svc, request, result.id)
        elif args.key is not None:
            await _tell_run_taken(svc, request)
    return 0


async def _tell_differences(svc: Services, request: EnqueueRequest, message_id: int) -> None:
    """The same key with other content is usually a mistake (a reused source id): say what
    was not taken, on stderr, so that scripts reading the id are unaffected. A courtesy: the
    submit has succeeded, so a failed look-up is only logged."""
    try:
        stored = await svc.bus.get(request.tenant, message_id)
    except Exception:
        logging.getLogger("appliance.cli").warning(
            "could not compare duplicate %s with the stored message", message_id, exc_info=True
        )
        return
    if stored is not None and (changed := differences(request, stored)):
        print(
            f"note: message {message_id} already exists with this key and differs from this"
            f" request in: {', '.join(changed)} (a duplicate changes nothing)",
            file=sys.stderr,
        )


def status_json(st: BusStatus) -> dict[str, Any]:
    """The machine-readable status: counts under lanes.<lane>.<status>, ages under ages.<lane>."""
    return {
        "at": st.at.isoformat(),
        "tenants": st.tenants,
        "runners": [
            {
                "id": r.id,
                "host": r.host,
                "pid": r.pid,
                "alive": r.alive,
                "seen_age_s": r.seen_age_s,
                # As last reported, and only while it lives: a stopped or dead runner listens
                # to nothing, whatever its last report said.
                "listener_connected": r.alive and r.listener_connected,
                "last_missed_wakeup_age_s": r.last_missed_wakeup_age_s,
                "missed_wakeups": r.missed_wakeups,
                "claimed": r.claimed,
                "completed": r.completed,
                "failed": r.failed,
                "stats": r.stats,
            }
            for r in st.runners
        ],
        "listener_connected": any(r.alive and r.listener_connected for r in st.runners),
        "reclaims_last_hour": st.reclaims_last_hour,
        "dedup_keys_hit_last_hour": st.dedup_keys_hit_last_hour,
        "stages": st.stages,
        "overdue": st.overdue,
        "lanes": {
            lane.value: {s.value: n for s, n in counts.counts.items()}
            for lane, counts in st.lanes.items()
        },
        "deferred": {lane.value: counts.deferred for lane, counts in st.lanes.items()},
        "ages": {
            lane.value: {
                "oldest_pending_s": counts.oldest_pending_age_s,
                "oldest_running_lease_s": counts.oldest_running_lease_age_s,
            }
            for lane, counts in st.lanes.items()
        },
    }


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _rate(pool: dict[str, Any]) -> str:
    seconds = float(pool.get("tokens_predicted_seconds_total") or 0.0)
    if seconds <= 0:
        return "- tok/s"
    return f"{pool['tokens_predicted_total'] / seconds:.1f} tok/s"


def status_text(st: BusStatus) -> str:
    cols = ["pending", "deferred", "running", "waiting", "dead", "done", "cancelled", "expired"]
    lines = [
        f"appliance status at {st.at.isoformat(timespec='seconds')}  ({st.tenants} tenants)",
        f"{'lane':<12}" + "".join(f"{c:>10}" for c in cols) + f"{'oldest pending':>16}"
        f"{'oldest lease':>14}",
    ]
    for lane in Lane:
        lc = st.lanes[lane]
        waiting = sum(lc.counts[w] for w in WAITING)
        values = [
            lc.counts[MessageStatus.PENDING],
            lc.deferred,
            lc.counts[MessageStatus.RUNNING],
            waiting,
            lc.counts[MessageStatus.DEAD],
            lc.counts[MessageStatus.DONE],
            lc.counts[MessageStatus.CANCELLED],
            lc.counts[MessageStatus.EXPIRED],
        ]
        lines.append(
            f"{lane.value:<12}"
            + "".join(f"{v:>10}" for v in values)
            + f"{_age(lc.oldest_pending_age_s):>16}{_age(lc.oldest_running_lease_age_s):>14}"
        )
    alive = [r for r in st.runners if r.alive]
    listening = any(r.listener_connected for r in alive)
    missed = [r.last_missed_wakeup_age_s for r in alive if r.last_missed_wakeup_age_s is not None]
    lines.append(
        f"runners: {len(alive)} alive; listener {'connected' if listening else 'NOT connected'};"
        f" last poll that found missed work: {_age(min(missed)) + ' ago' if missed else 'never'}"
    )
    for runner in alive:
        # Handlers given up on hold their slots until they end: a runner that claims less
        # than its concurrency says why here.
        held = sum((runner.stats.get("abandoned_running") or {}).values())
        if held:
            lines.append(
                f"runner {runner.id}: {held} of {runner.stats.get('concurrency', '?')} slots held"
                " by handlers that ignore cancellation (given up on, still running)"
            )
    late = {k: n for k, n in st.overdue.items() if n}
    if late:
        words = {
            "leases_expired": "leases expired, not reclaimed",
            "due_not_promoted": "deferred messages due, not promoted",
            "past_deadline": "messages past their deadline, not expired",
            "waits_expired": "waits past their expiry, not ended",
        }
        lines.append(
            "OVERDUE: "
            + "; ".join(f"{n} {words.get(k, k)}" for k, n in late.items())
            + (" (maintenance runs in every runner: none is alive)" if not alive else "")
        )
    lines.append(
        f"last hour: {st.reclaims_last_hour} reclaims, "
        f"{st.dedup_keys_hit_last_hour} idempotency keys hit by duplicates"
    )
    for runner in alive:
        pools = runner.stats.get("inference") or {}
        for tier, p in pools.items():
            lines.append(
                f"model {tier:<10} {p['model']:<28} workers {p['workers_alive']}/{p['workers']}"
                f" busy {p['busy_workers']}  processing {p['requests_processing']}"
                f" deferred {p['requests_deferred']}  requests {p['requests_total']}"
                f" failed {p['requests_failed']} refused {p['requests_refused']}"
                f"  tokens in {p['prompt_tokens_total']} out {p['tokens_predicted_total']}"
                f" ({_rate(p)})  [{runner.id}]"
            )
    if st.stages:
        lines.append("stages:")
        for pipeline, of_pipeline in st.stages.items():
            for stage, counts in of_pipeline.items():
                shown = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                lines.append(f"  {pipeline + '/' + stage:<28} {shown}")
    return "\n".join(lines)


async def cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    async with services(settings) as svc:
        st = await svc.bus.status()
        today = await svc.spend.today(now=None)
        month = cli_spend.cap_rows_json(await svc.spend.status(now=None))
    spend: dict[str, Any] = {
        "today": {
            "spent": cli_spend._fmt(today.get("spent")),
            "currency": today.get("currency"),
            "joules": float(today.get("joules") or 0),
            "calls": int(today.get("calls") or 0),
            "provenance": sorted(today.get("provenance") or []),
        },
        "month": month,
    }
    if args.json:
        print(json.dumps({**status_json(st), "spend": spend}, indent=2))
    else:
        print(status_text(st))
        t = spend["today"]
        line = (
            f"spend today: {t['spent']} {t['currency']} for {t['calls']} model calls, "
            f"{t['joules']:.1f} J ({', '.join(t['provenance']) or 'no figures yet'})"
        )
        for row in month:
            if row["scope"] == "appliance":
                line += (
                    f"; this month {row['spent']} of cap {row['cap']} {row['currency']}, "
                    f"{row['reserved']} reserved"
                )
        print(line)
    return 0


async def cmd_bus(settings: Settings, args: argparse.Namespace) -> int:
    async with services(settings) as svc:
        tenant = getattr(args, "tenant", None)
        if tenant is not None:
            check_name("tenant", tenant)  # text the database can take, before it is asked
        if tenant is not None and not await svc.tenants.exists(tenant):
            # Otherwise row-level security shows an unknown tenant nothing, indistinguishable
            # from "nothing to do".
            raise UnknownTenant(tenant)
        if args.bus_action == "redrive":
            done = await svc.bus.redrive(
                args.tenant, args.ids or None, clear_deadline=args.clear_deadline
            )
            moved = done.moved
            print(f"redriven: {len(moved)}" + (f" ({', '.join(map(str, moved))})" if moved else ""))
            late = set(done.past_deadline)
            if args.ids:
                for message_id in done.past_deadline:
                    print(
                        f"message {message_id} not redriven: its deadline has passed, so it"
                        " would expire unrun (add --clear-deadline to run it without one)",
                        file=sys.stderr,
                    )
            elif late:
                # "Everything dead" is not an error for the dead it leaves: one line, exit 0.
                print(
                    f"{len(late)} dead messages left: their deadlines have passed, so they would"
                    " expire unrun (add --clear-deadline to run them without one)",
                    file=sys.stderr,
                )
                late = set()
            left = [i for i in dict.fromkeys(args.ids) if i not in set(moved)]
            for message_id in (i for i in left if i not in late):
                message = await svc.bus.get(args.tenant, message_id)
                why = (
                    f"not found for tenant {args.tenant}"
                    if message is None
                    else f"is {message.status.value}, not dead"
                )
                print(f"message {message_id} not redriven: {why}", file=sys.stderr)
            return 1 if left or late else 0
        elif args.bus_action == "cancel":
            ok = await svc.bus.cancel(args.tenant, args.id, reason=args.reason)
            if not ok:
                # Read after the refusal, as redrive does: what it found (another tenant's
                # message is not found for this one).
                message = await svc.bus.get(args.tenant, args.id)
                why = (
                    f"not found for tenant {args.tenant}"
                    if message is None
                    else f"is {message.status.value}: it has already ended"
                )
                print(f"message {args.id} not cancelled: {why}", file=sys.stderr)
                return 1
            print("cancelled")
            return 0
        elif args.bus_action == "show":
            message = await svc.bus.get(args.tenant, args.id)
            if message is None:
                print(f"message {args.id} not found for tenant {args.tenant}", file=sys.stderr)
                return 1
            log = await svc.bus.store.transitions(args.tenant, args.id)  # type: ignore[attr-defined]
            shown = message_fields(message)
            shown["transitions"] = log
            # Visible to this tenant (checked above): its model calls, routing and tokens.
            shown["inference_calls"] = await svc.store.calls_of(args.tenant, args.id)
            print(json.dumps(shown, indent=2, default=str))
        elif args.bus_action == "list":
            statuses = [s.strip() for given in args.status for s in given.split(",") if s.strip()]
            page = await svc.bus.list_messages(
                args.tenant,
                statuses=statuses,
                lane=args.lane,
                limit=args.limit,
                before=args.before,
            )
            if args.json:
                rows = [message_fields(m) for m in page]
                print(json.dumps(rows, indent=2, default=str))
            else:
                print(listing_table(page))
                if len(page) == args.limit:
                    print(f"(more may follow: --before {page[-1].id})", file=sys.stderr)
        elif args.bus_action == "reclaim":
            found = await svc.bus.reclaim_due()
            waits = [due for _, due in found if due is not None]
            line = f"reclaimed: {len(found)}"
            if found:
                # Back after a failed attempt's backoff: promoted by a runner's maintenance, or
                # by a claim of the Bus API that finds too little.
                line += f" ({len(waits)} pending" + (
                    f", claimable within {max(waits):.1f} s" if waits else ""
                )
                line += f"; {len(found) - len(waits)} dead)"
            print(line)
        elif args.bus_action == "expire":
            print(f"expired: {await svc.bus.expire()}")
    return 0


def _dump_tasks() -> None:
    out = io.StringIO()
    for task in asyncio.all_tasks():
        out.write(f"--- {task.get_name()}\n")
        task.print_stack(file=out)
    logging.getLogger("appliance.runner").warning("asyncio tasks:\n%s", out.getvalue())


async def cmd_runner(settings: Settings, args: argparse.Namespace) -> int:
    if args.concurrency is not None:
        settings.runner.concurrency = args.concurrency
    if args.no_listen:
        settings.runner.listen = False
    if args.pipeline_module:
        settings.runner.pipeline_modules = [
            *settings.runner.pipeline_modules,
            *args.pipeline_module,
        ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # SIGUSR1 prints every asyncio task's stack to the log: how to see what a runner waits on.
    loop.add_signal_handler(signal.SIGUSR1, _dump_tasks)
    try:
        await run_runner(settings, stop)
    except BaseException as exc:
        await _end_stuck_tasks(exc)
        raise
    await _end_stuck_tasks(None)
    return 0


async def _end_stuck_tasks(failure: BaseException | None) -> None:
    """A handler that ignores cancellation was abandoned (its lease lapses or was already
    settled), but asyncio.run would wait for its task forever: the stop must end, also when
    the runner ends in an error (reported here, since the process then ends at once)."""
    stuck = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    if not stuck:
        return
    for task in stuck:
        task.cancel()
    _, pending = await asyncio.wait(stuck, timeout=2.0)
    if pending:
        logging.getLogger("appliance.runner").error(
            "exiting with %d tasks that ignore cancellation: %s",
            len(pending),
            ", ".join(sorted(t.get_name() for t in pending)),
        )
        if failure is not None:
            print(f"error: {failure}", file=sys.stderr)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if failure is None else 2)


async def cmd_demo(settings: Settings, args: argparse.Namespace) -> int:
    """Submit support tickets and show them classified and answered (needs a runner)."""
    # Checked before anything is written (the demo's tenant included).
    cap = cli_spend._amount(args.cap) if args.cap is not None else None
    async with services(settings) as svc:
        await svc.tenants.add("demo")
        if cap is not None:
            await svc.spend.set_cap("appliance", cap, actor="demo")
            resumed = await svc.spend.resume_budget(reason=f"cap_set: appliance {cap}", now=None)
            print(
                f"monthly cap set to {cli_spend._fmt(cap)} for this demo "
                f"({resumed} messages held for budget resumed)"
            )
        batch = f"{int(time.time())}"
        tickets = [SAMPLE_TICKETS[i % len(SAMPLE_TICKETS)] for i in range(args.count)]
        requests = [
            svc.bus.request(
                tenant="demo",
                pipeline="support",
                stage="classify",
                source="demo-tickets",
                source_id=f"{batch}-{i}",
                directive=f"support ticket: {ticket['subject']}",
                context={**ticket, "ticket_id": f"T-{batch}-{i}"},
            )
            for i, ticket in enumerate(tickets)
        ]
        results = await svc.bus.enqueue_many(requests)
        print(
            f"submitted {args.count} support tickets (pipeline support: classify -> draft -> reply)"
        )
        deadline = time.monotonic() + args.timeout
        source_ids = [r.source_id for r in requests]
        while True:
            st = await svc.bus.status()
            print(status_text(st), end="\n\n", flush=True)
            rows = await svc.store.stage_outputs(
                "demo", pipeline="support", stage="reply", source="demo-tickets",
                source_ids=source_ids,
            )  # fmt: skip
            finished = sum(1 for r in rows if r["status"] == MessageStatus.DONE)
            # Done when every ticket is answered, or nothing is left to run (the rest waits:
            # held for budget at the cap, or for a model tier).
            active = sum(
                lc.counts[MessageStatus.PENDING] + lc.counts[MessageStatus.RUNNING]
                for lc in st.lanes.values()
            )
            if finished >= args.count or active == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(args.every)
        new = sum(1 for r in results if r.new)
        done_rows = [r for r in rows if r["status"] == MessageStatus.DONE]
        print(f"answers ({len(done_rows)} of {new} tickets):")
        for row in done_rows:
            answer = row["result"] or {}
            print(
                f"  {answer.get('ticket')} [{answer.get('label')} -> {answer.get('queue')}] "
                f"{answer.get('status')}: {answer.get('reply')}"
            )
        waiting = await svc.store.waiting("demo")
        if waiting:
            print(f"waiting ({len(waiting)}):")
            for w in waiting:
                print(f"  {w['pipeline']}.{w['stage']} {w['source_id']}: {w['status_reason']}")
        for row in cli_spend.cap_rows_json(await svc.spend.status(now=None)):
            print(
                f"cap {row['scope']}: {row['cap']} {row['currency']}, spent {row['spent']}, "
                f"reserved {row['reserved']}, remaining {row['remaining']} "
                f"(figures: {', '.join(sorted(row['provenance'])) or 'none yet'})"
            )
    return 0


# -- parser ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    db = sub.add_parser("db", help="the database: start, stop, status, migrate, psql")
    dbs = db.add_subparsers(dest="db_action", required=True)
    dbs.add_parser("start", help="create (once) and start the local cluster")
    dbs.add_parser("stop", help="stop the local cluster (fast, then immediate)")
    dbs.add_parser("status", help="is the local cluster running")
    dbs.add_parser("migrate", help="apply pending migrations (idempotent)")
    dump = dbs.add_parser("dump-schema", help="print the migrated schema (sql/schema.sql)")
    dump.add_argument("--output", help="write here instead of standard output")
    psql = dbs.add_parser(
        "psql",
        help="psql on the appliance database; psql's own options follow "
        "(appliance db psql -Atc 'SELECT 1'; a -- before them is allowed)",
    )
    psql.add_argument("--role", choices=ROLES, default="admin")
    psql.add_argument("psql_args", nargs=argparse.REMAINDER, help="passed to psql")

    tenant = sub.add_parser("tenant", help="register and list tenants")
    ts = tenant.add_subparsers(dest="tenant_action", required=True)
    add = ts.add_parser("add", help="register a tenant")
    add.add_argument("name")
    add.add_argument("--display-name")
    ts.add_parser("list", help="list tenants")

    submit = sub.add_parser("submit", help="put one message on the bus (idempotent)")
    submit.add_argument("--tenant", required=True)
    submit.add_argument("--pipeline", required=True)
    submit.add_argument("--stage", required=True)
    submit.add_argument("--source", required=True)
    submit.add_argument("--source-id", required=True)
    submit.add_argument("--lane", help="default: the stage's declared lane, else interactive")
    submit.add_argument("--directive", required=True)
    submit.add_argument("--context", help="JSON text, or @file to read it from a file")
    submit.add_argument("--priority", type=int, default=0)
    submit.add_argument("--deadline", help="ISO 8601 time with zone")
    submit.add_argument("--not-before", help="ISO 8601 time with zone")
    submit.add_argument("--key", help="idempotency key (default: derived from source, id, stage)")
    submit.add_argument("--from-agent")
    submit.add_argument("--to-agent")

    runner = sub.add_parser("runner", help="run stage handlers until SIGTERM (drains gracefully)")
    # The setting's own bounds, checked before the models load.
    runner.add_argument("--concurrency", type=whole_number(1, 1024))
    runner.add_argument("--no-listen", action="store_true", help="rely on the fallback poll only")
    runner.add_argument(
        "--pipeline-module", action="append", help="also serve this module's PIPELINES"
    )

    demo = sub.add_parser(
        "demo", help="submit support tickets and watch them answered (needs a runner)"
    )
    demo.add_argument("--count", type=whole_number(1, 10_000), default=4)
    demo.add_argument("--every", type=positive_seconds, default=2.0)
    demo.add_argument("--timeout", type=positive_seconds, default=300.0)
    demo.add_argument(
        "--cap", help="set the appliance's monthly cap first (a tiny one shows held_budget)"
    )

    status = sub.add_parser("status", help="the bus at a glance")
    status.add_argument("--json", action="store_true", help="machine-readable")

    cli_models.add_parser(sub)
    cli_spend.add_parser(sub)
    cli_spend.add_energy_parser(sub)

    bus = sub.add_parser("bus", help="operate on messages")
    bs = bus.add_subparsers(dest="bus_action", required=True)
    redrive = bs.add_parser("redrive", help="send dead messages back to pending")
    redrive.add_argument("--tenant", required=True)
    redrive.add_argument(
        "ids", nargs="*", type=whole_number(1, ID_MAX), help="message ids (default: all dead)"
    )
    redrive.add_argument(
        "--clear-deadline",
        action="store_true",
        help="also redrive dead messages whose deadline has passed, removing it",
    )
    cancel = bs.add_parser("cancel", help="cancel a message in any non-terminal state")
    cancel.add_argument("--tenant", required=True)
    cancel.add_argument("id", type=whole_number(1, ID_MAX))
    cancel.add_argument("--reason", default="cancelled by operator")
    show = bs.add_parser("show", help="a message and its transition log")
    show.add_argument("--tenant", required=True)
    show.add_argument("id", type=whole_number(1, ID_MAX))
    listing = bs.add_parser("list", help="a tenant's messages, newest first (dead ones, say)")
    listing.add_argument("--tenant", required=True)
    listing.add_argument(
        "--status",
        action="append",
        default=[],
        help="only these statuses (repeat it, or separate them with commas; default: all)",
    )
    listing.add_argument("--lane", help="only this lane (default: all)")
    listing.add_argument("--limit", type=whole_number(1, LIST_MAX), default=50)
    listing.add_argument(
        "--before",
        type=whole_number(1, ID_MAX),
        help="only ids below this one: the next page, after the last id shown",
    )
    listing.add_argument("--json", action="store_true", help="a JSON array, every field")
    bs.add_parser("reclaim", help="run the lease reclaimer once")
    bs.add_parser("expire", help="run the expirer once")
    return parser


# The roles `db psql --role` connects as.
ROLES = ("admin", "app", "system")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; `db psql` passes the options it does not know to psql, with or
    without a `--` before them."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if getattr(args, "command", None) != "db" or getattr(args, "db_action", None) != "psql":
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        # Options psql takes come first: what follows the first word that is not one (a
        # value, or `--`) is in psql_args already, in order.
        args.psql_args = unknown + list(args.psql_args)
    if getattr(args, "command", None) == "db" and getattr(args, "db_action", None) == "psql":
        args.psql_args = _own_role(parser, args)
    return args


def _own_role(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """psql's arguments without a `--role` given among them (before any `--`): psql has no
    such option, so it is ours wherever it stands; after psql's options, argparse had handed it
    on to psql, which refused it, or the session ran as another role than asked."""
    out: list[str] = []
    words = list(args.psql_args)
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            out += words[i:]
            break
        if word == "--role" or word.startswith("--role="):
            value = word.partition("=")[2] if "=" in word else None
            if value is None:
                if i + 1 >= len(words):
                    parser.error("argument --role: expected one argument")
                value = words[i + 1]
                i += 1
            if value not in ROLES:
                parser.error(
                    f"argument --role: invalid choice: {value!r} (choose from {', '.join(ROLES)})"
                )
            args.role = value
        else:
            out.append(word)
        i += 1
    return out


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # The scheduler logs every job run at INFO; its failures still show at WARNING.
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    # A failure that repeats (each step of a runner while the database is down) is logged
    # once a minute with a count, not a traceback a few times a second into an unrotated log.
    for log_handler in logging.getLogger().handlers:
        log_handler.addFilter(RepeatDamper())
    try:
        try:
            settings = Settings()
        except ValidationError as exc:
            raise ConfigurationError(settings_error_text(exc)) from None
        except SettingsError as exc:
            # A list or mapping variable that is not JSON (pydantic-settings parses them).
            raise ConfigurationError(
                f"settings: {exc}; a list or mapping setting is written as JSON, for example"
                ' APPLIANCE_RUNNER__PIPELINES=\'["demo", "support"]\''
            ) from None
        if args.command == "db":
            # A SIGTERM ended this process at once and left the tool it was running (initdb,
            # pg_ctl: in sessions of their own) running without it; as an interrupt, the
            # cluster manager ends them first.
            signal.signal(signal.SIGTERM, _interrupt)
            return cmd_db(settings, args)
        if args.command == "models":
            return cli_models.cmd_models(settings, args)
        handler = {
            "tenant": cmd_tenant,
            "submit": cmd_submit,
            "status": cmd_status,
            "bus": cmd_bus,
            "runner": cmd_runner,
            "demo": cmd_demo,
            "cap": cli_spend.cmd_cap,
            "energy": cli_spend.cmd_energy,
        }[args.command]
        if args.command != "runner":
            # One quick connection first: a command finds a stopped or misnamed database in
            # a moment, not after the pool's 30 s of retries (a runner does wait for it).
            try:
                check_server(endpoints(settings).system)
            except DatabaseUnavailable as exc:
                hint = _start_hint(local_cluster(settings), migrate=True)
                raise DatabaseUnavailable(f"{exc} {hint}") from None
            # And a schema this code was written for: a database not migrated (or migrated
            # by other code) failed later, on a relation or a function it did not find.
            problem = schema_problem(endpoints(settings).system)
            if problem is not None:
                raise MigrationError(problem)
        return asyncio.run(handler(settings, args))
    except ApplianceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except UnicodeError as exc:
        # An argument that is not valid text (bytes that are not UTF-8 in the command line)
        # where no check names it first: one line, not a trace.
        print(f"error: an argument is not valid UTF-8 text ({exc})", file=sys.stderr)
        return 2
    except DATABASE_ERRORS as exc:
        # The server went away, refused a statement or was never there: one line, no trace.
        print(f"error: database: {error_text(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C, or SIGTERM (mapped to it for `db` commands, so that the server tools they
        # run are ended with them): the command is abandoned, quietly, as a shell reports it.
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of our output went away (`| head`): nothing to say, and nowhere to say
        # it. Standard output goes to /dev/null so that its flush at exit fails no more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a command ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
