-- Named queries of the stage runner and its maintenance services.
--
-- Writes under a lease test `lease_expires_at IS NOT NULL` for "running" (the same thing, by the
-- table's check), never the status: see the top of messages.sql.

-- name: message_claim_lane :many
-- Lease up to `limit` pending messages of one lane (but those of the stages in `skip`, 'pipeline/stage' each: served by other runners): tenants round-robin (least recently served first, an equal share each), each within its concurrency limit; only work of the tiers in `open_tiers` ('' for work without model calls) (the caller's finished but unacknowledged attempts, `finished_ids`/`finished_tokens`, not counted), checked against its counter row locked (waiting, never skipping) in tenant order; with the lane's backlog as found (lane_pending, capped at limit + 1). One autocommit statement that commits without waiting for the WAL flush.
WITH nondurable AS MATERIALIZED (
    -- A claim is one round trip: its own implicit transaction, made non-durable here rather
    -- than by a SET LOCAL in a transaction block (which costs three more statements). A server
    -- crash may lose the claim; the lease turns that into a re-run, which at-least-once
    -- delivery tolerates. Read by `eligible`, so it runs whenever anything can be claimed.
    SELECT set_config('synchronous_commit', 'off', true) AS setting
),
finished AS MATERIALIZED (
    -- The caller's attempts whose handlers have returned but whose acknowledgement has not
    -- committed (as of this statement's snapshot, like `released` below): still running in the
    -- database, not running in fact, so not counted against their tenant's limit. Matched by
    -- lease: a message since reclaimed and leased again is not the caller's any more.
    -- One primary-key probe per attempt, whatever the statistics: the LIMIT keeps the other
    -- conditions out of the probe, so no index of running messages can be scanned instead.
    SELECT f.tenant, count(*) AS n
    FROM unnest(%(finished_ids)s::bigint[], %(finished_tokens)s::bigint[]) AS u(id, token)
    CROSS JOIN LATERAL (
        SELECT f.tenant, f.lease_token, f.status FROM agent_messages f WHERE f.id = u.id LIMIT 1
    ) AS f
    WHERE f.lease_token = u.token AND f.status = 'running'
    GROUP BY f.tenant
),
eligible AS MATERIALIZED (
    -- A snapshot read: which tenants have claimable work and room. Nothing is locked here, so
    -- concurrent claimers of one tenant all proceed; the limit is enforced below. The view
    -- tenant_released sums a tenant's 8 shards by key: one probe per tenant read (0043).
    SELECT r.tenant,
           coalesce(t.max_running, %(tenant_limit)s) - (r.claimed - x.released)
               + coalesce(f.n, 0) AS room,
           r.last_claimed_at,
           -- For `counters`: the limit, and the leases ended plus the caller's finished ones.
           coalesce(t.max_running, %(tenant_limit)s) AS cap, x.released + coalesce(f.n, 0) AS freed
    FROM nondurable, tenant_runtime r
    JOIN tenant_released x ON x.tenant = r.tenant
    JOIN tenants t ON t.name = r.tenant
    LEFT JOIN finished f ON f.tenant = r.tenant
    WHERE r.claimed - x.released - coalesce(f.n, 0) < coalesce(t.max_running, %(tenant_limit)s)
      AND (%(tenant)s::text IS NULL OR r.tenant = %(tenant)s::text)
      -- One probe per tenant and open tier ('' for work without model calls), whatever the
      -- statistics were when the generic plan was built (an empty table, on a fresh box):
      -- OFFSET 0 keeps it a correlated subplan, never a semi-join that reads (and groups) the
      -- lane's whole backlog; the pending index's order makes it the index probed.
      AND EXISTS (
          SELECT FROM unnest(%(open_tiers)s::text[]) AS o(tier)
          CROSS JOIN LATERAL (
              SELECT FROM agent_messages m
              WHERE m.status = 'pending' AND NOT m.deferred AND m.lane = %(lane)s::lane
                AND coalesce(m.tier, '') = o.tier AND m.tenant = r.tenant
                AND m.not_before <= clock(%(now)s)
                -- As `picked` takes: a tenant whose work is all late (the expirer's) or of
                -- stages skipped is not eligible, or it would take a share, be given nothing,
                -- stay least recently served, and come first in every claim.
                AND claimable(m.deadline, m.pipeline, m.stage, %(skip)s, %(now)s)
              ORDER BY m.priority DESC, m.not_before, m.id LIMIT 1 OFFSET 0
          ) AS x)
    ORDER BY r.last_claimed_at NULLS FIRST, r.tenant
    LIMIT %(limit)s
),
shares AS (
    SELECT e.tenant, e.last_claimed_at,
           least(e.room, ceil(%(limit)s::numeric / count(*) OVER ())::integer) AS share
    FROM eligible e
),
picked AS MATERIALIZED (
    -- Each tenant's share in priority order: one bounded scan per open tier (locking as it
    -- goes, skipping rows other claimers hold), merged; a blocked tier's backlog is never read
    -- (migration 0017). Rows beyond the merged share stay locked until this statement ends.
    SELECT c.id, c.tenant, c.rank, s.last_claimed_at, ps.max_runtime
    -- Not of the stages in `skip`: those that other live runners serve and the caller does
    -- not (migration 0034). A filter, not an index key: the claim reads past their ready work
    -- queued ahead of its own (in its lane, tier and tenant), which those runners drain.
    FROM shares s
    CROSS JOIN LATERAL (
        SELECT m.id, m.tenant, m.pipeline, m.stage,
               row_number() OVER (ORDER BY m.priority DESC, m.not_before, m.id) AS rank
        FROM unnest(%(open_tiers)s::text[]) AS o(tier)
        CROSS JOIN LATERAL (
            SELECT m.id, m.tenant, m.pipeline, m.stage, m.priority, m.not_before
            FROM agent_messages m
            WHERE m.status = 'pending' AND NOT m.deferred AND m.lane = %(lane)s::lane
              AND coalesce(m.tier, '') = o.tier AND m.tenant = s.tenant
              AND m.not_before <= clock(%(now)s)
              -- Not late, and not of a stage skipped (migration 0034).
              AND claimable(m.deadline, m.pipeline, m.stage, %(skip)s, %(now)s)
            ORDER BY m.priority DESC, m.not_before, m.id
            LIMIT s.share
            FOR UPDATE OF m SKIP LOCKED
        ) AS m
    ) AS c
    LEFT JOIN pipeline_stages ps ON ps.pipeline = c.pipeline AND ps.stage = c.stage
    WHERE c.rank <= s.share
),
counters AS MATERIALIZED (
    -- The serialisation point: lock the claim counters of the tenants picked, in tenant order
    -- (no deadlocks), and read them as of now (a lock waits for the latest). Leases ended, and
    -- the caller's finished attempts, are `eligible`'s: read from this statement's snapshot,
    -- unlocked (migration 0008), both as of the same moment, so an attempt is discounted
    -- exactly when its end is not yet counted; one ended since then is not counted yet, which
    -- can only make the room smaller, never exceed a limit.
    SELECT r.tenant, e.cap - r.claimed + e.freed AS room
    FROM tenant_runtime r
    JOIN eligible e ON e.tenant = r.tenant
    WHERE r.tenant IN (SELECT tenant FROM picked)
    ORDER BY r.tenant
    FOR UPDATE OF r
),
allowed AS (
    -- Round-robin: every tenant's first message, then every tenant's second, ...
    SELECT p.id, coalesce(p.max_runtime, %(max_runtime)s::interval) AS rt
    FROM picked p
    JOIN counters c ON c.tenant = p.tenant
    WHERE p.rank <= c.room
    ORDER BY p.rank, p.last_claimed_at NULLS FIRST, p.tenant
    LIMIT %(limit)s
),
backlog AS (
    -- The lane's claimable-looking work as this claim found it (at most limit + 1 rows): more
    -- than it took means tenant limits, locks or backpressure left some behind, so the
    -- runner asks again when its own work finishes; otherwise it waits for the doorbell.
    -- Counted for claims of the whole lane only (backlog_limit = limit + 1): a caller that
    -- does not ask, or claims for one tenant, passes 0 and nothing is read.
    SELECT least(count(*), %(limit)s + 1) AS pending
    FROM unnest(%(open_tiers)s::text[]) AS o(tier)
    CROSS JOIN LATERAL (
        SELECT FROM agent_messages m
        WHERE m.status = 'pending' AND NOT m.deferred AND m.lane = %(lane)s::lane
          AND coalesce(m.tier, '') = o.tier AND m.not_before <= clock(%(now)s)
          -- What `picked` could take: not late work (the expirer's), work of a blocked tier
          -- or of a stage skipped (a runner would otherwise ask again after every message).
          AND claimable(m.deadline, m.pipeline, m.stage, %(skip)s, %(now)s)
        -- The pending index's order: read from the index, never a heap scan through history.
        ORDER BY m.lane, coalesce(m.tier, ''), m.tenant, m.priority DESC, m.not_before, m.id
        LIMIT %(backlog_limit)s
    ) AS p
),
claimed AS (
    UPDATE agent_messages m
    SET status = 'running',
        attempts = m.attempts + 1,
        lease_token = nextval('agent_messages_lease_token_seq'),
        run_deadline = clock(%(now)s) + allowed.rt,
        -- Not past the run deadline, nor the message's deadline (LEAST skips a NULL one):
        -- work past it is expired, not run on (a dead worker's lease lapses there).
        lease_expires_at = clock(%(now)s)
            + least(%(lease)s::interval, allowed.rt, m.deadline - clock(%(now)s)),
        claimed_by = %(worker)s,
        claimed_at = clock(%(now)s),
        updated_at = clock(%(now)s),
        outcome = NULL,
        status_reason = 'claimed',
        status_actor = %(worker)s
    FROM allowed
    WHERE m.id = allowed.id
    RETURNING m.*
)
-- The claimed rows, each with the lane's backlog; one row of NULLs with it when none was.
SELECT claimed.*, backlog.pending AS lane_pending
FROM backlog LEFT JOIN claimed ON true;

-- name: message_heartbeat_many :many
-- Extend many leases at once, never past each attempt's hard run deadline or its message's deadline (past either: overran); rows another statement is writing right now (a completion) are skipped, not waited for; report every lease's fate. Commits without waiting for the WAL flush (a lost heartbeat only shortens a lease).
WITH nondurable AS MATERIALIZED (
    SELECT set_config('synchronous_commit', 'off', true) AS setting
),
input AS (
    SELECT i.* FROM nondurable, unnest(%(id)s::bigint[], %(token)s::bigint[]) AS i(id, token)
),
mine AS MATERIALIZED (
    SELECT m.id
    FROM agent_messages m
    JOIN input i ON i.id = m.id AND i.token = m.lease_token
    WHERE m.lease_expires_at IS NOT NULL
    ORDER BY m.id
    FOR UPDATE OF m SKIP LOCKED
),
beat AS (
    -- Never past the attempt's run deadline, nor the message's own deadline: work past it is
    -- expired, not run on (a Bus API worker learns it here; a lease left to lapse there is
    -- reclaimed as expired).
    UPDATE agent_messages m
    SET lease_expires_at = least(
            coalesce(%(now)s::timestamptz, now()) + %(extend)s::interval,
            coalesce(m.run_deadline, 'infinity'::timestamptz),
            coalesce(m.deadline, 'infinity'::timestamptz))
    FROM mine
    WHERE m.id = mine.id
      AND least(coalesce(m.run_deadline, 'infinity'::timestamptz),
                coalesce(m.deadline, 'infinity'::timestamptz))
          > coalesce(%(now)s::timestamptz, now())
    RETURNING m.id, m.lease_token
)
-- `beat` is probed as a hashed subplan, and the new expiry computed again from the row as read
-- (the same values, the same clock): estimated at one row, a join to it was planned as a
-- nested loop that read all of it again for every lease (quadratic in the batch). By lease:
-- an attempt whose message was claimed again is not the one extended.
SELECT i.id, i.token,
       CASE WHEN (i.id, i.token) IN (SELECT b.id, b.lease_token FROM beat b) THEN
           least(coalesce(%(now)s::timestamptz, now()) + %(extend)s::interval,
                 coalesce(m.run_deadline, 'infinity'::timestamptz),
                 coalesce(m.deadline, 'infinity'::timestamptz))
       END AS lease_expires_at,
       m.status, m.lease_token = i.token AS same_lease,
       least(m.run_deadline, m.deadline) <= coalesce(%(now)s::timestamptz, now()) AS overran,
       i.id NOT IN (SELECT id FROM mine) AS busy
FROM input i
LEFT JOIN agent_messages m ON m.id = i.id;

-- name: message_deferrals :one
-- How many times a message went to pending deferred with a reason starting `prefix` (taken literally), from its log.
SELECT count(*) AS n
FROM message_transitions t
WHERE t.message_id = %(id)s AND t.to_status = 'pending' AND starts_with(t.reason, %(prefix)s);

-- name: message_lease_lock :one
-- Lock a running attempt's row under its lease until the transaction ends, waiting at most 5 s for another session's lock (none: the lease is not current, or the row stayed locked).
SELECT m.id
FROM (SELECT set_config('lock_timeout', '5s', true)) AS waiting,
     agent_messages m
WHERE m.id = %(id)s AND m.lease_token = %(token)s AND m.lease_expires_at IS NOT NULL
FOR UPDATE OF m;

-- name: message_release :many
-- Give leases back without counting the attempt (graceful shutdown, or claimed-ahead work that
-- never started): running -> pending now, keeping its place in line (its not_before).
WITH input AS (
    SELECT * FROM unnest(%(id)s::bigint[], %(token)s::bigint[]) AS i(id, token)
)
UPDATE agent_messages m
SET status = 'pending',
    attempts = greatest(m.attempts - 1, 0),
    lease_expires_at = NULL,
    lease_token = NULL,
    not_before = least(m.not_before, coalesce(%(now)s::timestamptz, now())),
    deferred = false,
    updated_at = coalesce(%(now)s::timestamptz, now()),
    status_reason = 'released',
    status_actor = %(actor)s
FROM input i
WHERE m.id = i.id AND m.lease_token = i.token AND m.lease_expires_at IS NOT NULL
RETURNING m.id;

-- name: message_expire_running :one
-- Expire a running attempt under its lease (its message's deadline passed while it ran).
UPDATE agent_messages
SET status = 'expired',
    lease_expires_at = NULL,
    lease_token = NULL,
    finished_at = coalesce(%(now)s::timestamptz, now()),
    updated_at = coalesce(%(now)s::timestamptz, now()),
    status_reason = %(reason)s,
    status_actor = %(actor)s
WHERE id = %(id)s AND lease_token = %(token)s AND lease_expires_at IS NOT NULL
RETURNING id;

-- name: message_archive :one
-- Move one bounded batch of terminal messages finished before the cutoff to the archive.
SELECT archive_messages(
    coalesce(%(now)s::timestamptz, now()) - %(retention)s::interval,
    %(batch)s,
    %(now)s::timestamptz
) AS moved;

-- name: idempotency_keys_purge :one
-- Delete one bounded batch of expired idempotency keys (0 while another runner purges).
SELECT purge_idempotency_keys(%(now)s::timestamptz, %(batch)s) AS purged;

-- name: pipeline_stage_upsert :one
-- Write one declared stage (the runner syncs its pipelines' graphs on start); `retier`: its model tier is not the one its messages were stamped with (a new stage with a tier, or a changed tier).
WITH before AS (
    SELECT s.tier FROM pipeline_stages s WHERE s.pipeline = %(pipeline)s AND s.stage = %(stage)s
)
INSERT INTO pipeline_stages
    (pipeline, stage, lane, task_kind, tier, handler, directive, max_runtime, max_attempts,
     updated_at)
VALUES (%(pipeline)s, %(stage)s, %(lane)s::lane, %(task_kind)s, %(tier)s, %(handler)s,
        %(directive)s, %(max_runtime)s, %(max_attempts)s, now())
ON CONFLICT (pipeline, stage) DO UPDATE
SET lane = excluded.lane, task_kind = excluded.task_kind, tier = excluded.tier,
    handler = excluded.handler,
    directive = excluded.directive, max_runtime = excluded.max_runtime,
    max_attempts = excluded.max_attempts, updated_at = excluded.updated_at
RETURNING (SELECT b.tier FROM before b) IS DISTINCT FROM %(tier)s::text AS retier;

-- name: pipeline_known :one
-- Whether some runner has written a pipeline's stage graph.
SELECT EXISTS (SELECT FROM pipeline_stages s WHERE s.pipeline = %(pipeline)s) AS known;

-- name: pipeline_stage_names :many
-- The stages written for a pipeline (none: no runner or submit has declared it).
SELECT s.stage FROM pipeline_stages s WHERE s.pipeline = %(pipeline)s ORDER BY s.stage;

-- name: item_stage_holders :many
-- A source item's runs so far, as its tenant (row-level security): for each stage the pipeline's routes lead to from `stage`, the message holding that stage's derived key (source, source id, stage), kept still; what a hand-off of the item to that stage would be a duplicate of.
WITH RECURSIVE ahead (stage) AS (
    SELECT r.next_stage FROM stage_routes r
    WHERE r.pipeline = %(pipeline)s AND r.stage = %(stage)s
    UNION  -- not ALL: a loop in the graph ends
    SELECT r.next_stage FROM stage_routes r
    JOIN ahead a ON r.pipeline = %(pipeline)s AND r.stage = a.stage
)
SELECT a.stage, k.message_id
FROM ahead a
JOIN idempotency_keys k
  ON k.tenant = %(tenant)s AND k.key = idempotency_key(%(source)s, %(source_id)s, a.stage)
WHERE a.stage <> %(stage)s AND k.expires_at > now()
ORDER BY k.message_id;

-- name: pipeline_routes_clear :exec
-- Forget a pipeline's routes before writing the declared ones.
DELETE FROM stage_routes WHERE pipeline = %(pipeline)s;

-- name: pipeline_route_insert :exec
-- Write one declared route: outcome of a stage -> next stage.
INSERT INTO stage_routes (pipeline, stage, outcome, next_stage)
VALUES (%(pipeline)s, %(stage)s, %(outcome)s, %(next_stage)s);

-- name: pipeline_stages_prune :many
-- Forget stages a pipeline no longer declares; the stages forgotten that had a model tier.
DELETE FROM pipeline_stages
WHERE pipeline = %(pipeline)s AND NOT (stage = ANY(%(stages)s))
RETURNING stage, tier IS NOT NULL AS retier;

-- name: stage_tiers_fence :exec
-- Wait for every enqueue in flight (each holds this lock shared while it reads stage tiers) and hold new ones off until this transaction ends: taken by a pipeline sync that changed a stage's tier, before it re-stamps the stage's messages. The re-stamp is one statement over every unfinished message of the stages, so this transaction has no statement timeout: cancelled, the runner's start would fail and repeat it, holding every enqueue off each time.
SELECT pg_advisory_xact_lock(hashtext('appliance'), hashtext('stage_tiers')),
       set_config('statement_timeout', '0', true);

-- name: pipeline_messages_retier :one
-- Stamp the not yet finished messages of these stages of a pipeline (dead ones included: a redrive revives them) with their stage's model tier now (NULL: no model work, or a stage no longer declared), which the claim scans by (migration 0017). Rows another statement holds (an acknowledgement in flight) are skipped, never waited for; `stale`: the rows found with another tier, `stamped`: those re-stamped. Rare: a stage's tier changed, or a stage with one was declared or dropped.
WITH stages AS (
    SELECT u.stage, ps.tier
    FROM unnest(%(stages)s::text[]) AS u(stage)
    LEFT JOIN pipeline_stages ps ON ps.pipeline = %(pipeline)s AND ps.stage = u.stage
),
stale AS MATERIALIZED (
    SELECT m.id, s.tier
    FROM agent_messages m
    JOIN stages s ON s.stage = m.stage
    WHERE m.pipeline = %(pipeline)s
      AND m.status NOT IN ('done', 'cancelled', 'expired')
      AND m.tier IS DISTINCT FROM s.tier
),
victims AS MATERIALIZED (
    SELECT m.id, st.tier
    FROM agent_messages m
    JOIN stale st ON st.id = m.id
    WHERE m.tier IS DISTINCT FROM st.tier
    ORDER BY m.id
    FOR UPDATE OF m SKIP LOCKED
),
stamped AS (
    UPDATE agent_messages m
    SET tier = v.tier
    FROM victims v
    WHERE m.id = v.id
    RETURNING m.id
)
SELECT (SELECT count(*) FROM stale) AS stale, (SELECT count(*) FROM stamped) AS stamped;

-- name: runner_register :one
-- Record a runner at start, with the stages it serves ('pipeline/stage' each). `seen_at` NULL: the database clock, the one liveness is judged by. An id is taken only from a runner that stopped, went quiet (no report within `alive`) or is this same one (host, pid and start). No row back: a live runner holds the id.
INSERT INTO runners AS r (id, host, pid, started_at, seen_at, listener_connected, serves)
VALUES (%(id)s, %(host)s, %(pid)s, %(started_at)s,
        coalesce(%(seen_at)s::timestamptz, now()), %(listener_connected)s, %(serves)s::text[])
ON CONFLICT (id) DO UPDATE
SET host = excluded.host, pid = excluded.pid, started_at = excluded.started_at,
    seen_at = excluded.seen_at, stopped_at = NULL, listener_connected = excluded.listener_connected,
    serves = excluded.serves,
    last_missed_wakeup_at = NULL, missed_wakeups = 0, claimed = 0, completed = 0, failed = 0,
    stats = '{}'::jsonb
WHERE r.stopped_at IS NOT NULL
   OR r.seen_at < excluded.seen_at - %(alive)s::interval
   OR (r.host = excluded.host AND r.pid = excluded.pid AND r.started_at = excluded.started_at)
RETURNING r.id;

-- name: runner_holder :one
-- The live runner (not stopped, reported within `alive`) that holds a runner id, with its last report and that report's age by the given clock (the database's when NULL).
SELECT host, pid, started_at, seen_at,
       extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - seen_at)::float8 AS seen_age_s
FROM runners
WHERE id = %(id)s
  AND stopped_at IS NULL
  AND seen_at >= coalesce(%(now)s::timestamptz, now()) - %(alive)s::interval;

-- name: runner_report :one
-- A runner's periodic health report (`seen_at` NULL: the database clock); a `stopped_at` given marks it stopped, at the database clock's time. Fenced by host, pid and start: no row back when another runner has taken the id over.
UPDATE runners
SET seen_at = coalesce(%(seen_at)s::timestamptz, now()),
    stopped_at = CASE WHEN %(stopped_at)s::timestamptz IS NULL THEN NULL
                      ELSE coalesce(%(seen_at)s::timestamptz, now()) END,
    listener_connected = %(listener_connected)s,
    last_missed_wakeup_at = %(last_missed_wakeup_at)s, missed_wakeups = %(missed_wakeups)s,
    claimed = %(claimed)s, completed = %(completed)s, failed = %(failed)s, stats = %(stats)s
WHERE id = %(id)s AND host = %(host)s AND pid = %(pid)s AND started_at = %(started_at)s
RETURNING id;

-- name: runner_list :many
-- Runners seen in the last day, newest first, with their ages by the database clock.
SELECT id, host, pid, listener_connected, missed_wakeups, claimed, completed, failed, stats,
       stopped_at,
       extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - seen_at) AS seen_age_s,
       extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - last_missed_wakeup_at)
           AS missed_age_s
FROM runners
WHERE seen_at > coalesce(%(now)s::timestamptz, now()) - interval '1 day'
ORDER BY seen_at DESC;

-- name: runner_stages_elsewhere :one
-- The stages ('pipeline/stage') that live runners other than `id` serve: reported within `alive` and not stopped.
SELECT coalesce(array_agg(DISTINCT s.stage ORDER BY s.stage), '{}') AS stages
FROM runners r
CROSS JOIN LATERAL unnest(r.serves) AS s(stage)
WHERE r.id <> %(id)s AND r.stopped_at IS NULL
  AND r.seen_at > coalesce(%(now)s::timestamptz, now()) - %(alive)s::interval;

-- name: bus_activity :one
-- Reclaims and keys hit by duplicates in the last hour (dispatch and dedup health).
SELECT
    (SELECT count(*) FROM message_transitions
     WHERE reason = 'lease_expired'
       AND at > coalesce(%(now)s::timestamptz, now()) - interval '1 hour') AS reclaims,
    (SELECT count(*) FROM idempotency_keys
     WHERE last_hit_at > coalesce(%(now)s::timestamptz, now()) - interval '1 hour')
        AS dedup_keys_hit;

-- name: message_park :one
-- Park a running attempt in a waiting state (waiting_capability: no tier allowed to serve it is up; held_budget: no hold against the cap): the attempt is not counted, nothing retries it, and the wait ends by `expires_at` at the latest.
UPDATE agent_messages m
SET status = %(status)s::message_status,
    waiting_for = %(waiting_for)s,
    attempts = greatest(m.attempts - 1, 0),
    wait_expires_at = %(expires_at)s::timestamptz,
    lease_expires_at = NULL,
    lease_token = NULL,
    updated_at = coalesce(%(now)s::timestamptz, now()),
    status_reason = %(reason)s,
    status_actor = %(actor)s
WHERE m.id = %(id)s AND m.lease_token = %(token)s AND m.lease_expires_at IS NOT NULL
RETURNING m.id;

-- name: message_resume_capability :many
-- Messages waiting for any of `tiers` go back to pending (the update trigger rings the doorbell); a bounded batch.
WITH ready AS (
    SELECT m.id
    FROM agent_messages m
    WHERE m.status = 'waiting_capability' AND m.waiting_for = ANY(%(tiers)s::text[])
    -- The index's order (tier, id): read tier by tier, nothing but the tiers asked for, never a
    -- walk of the whole table in id order (migration 0014).
    ORDER BY m.waiting_for, m.id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
UPDATE agent_messages m
SET status = 'pending',
    waiting_for = NULL,
    wait_expires_at = NULL,
    not_before = coalesce(%(now)s::timestamptz, now()),
    deferred = false,
    updated_at = coalesce(%(now)s::timestamptz, now()),
    status_reason = 'capability_available: ' || m.waiting_for,
    status_actor = %(actor)s
FROM ready
WHERE m.id = ready.id
RETURNING m.id;

-- name: message_park_stage :one
-- Park a running attempt of a stage that no live runner serves (waiting_capability, waiting for 'stage:pipeline/stage', for `wait` by the database clock), the attempt not counted; or, when a live runner other than `actor` now says it serves the stage (it started since the claim), give it back to pending for that runner. Returns the status it took.
WITH served AS (
    SELECT EXISTS (
        SELECT FROM runners r
        WHERE r.id <> %(actor)s AND r.stopped_at IS NULL
          AND r.seen_at > coalesce(%(now)s::timestamptz, now()) - %(alive)s::interval
          AND %(stage)s::text = ANY (r.serves)
    ) AS elsewhere
)
UPDATE agent_messages m
SET status = CASE WHEN served.elsewhere THEN 'pending'
                  ELSE 'waiting_capability' END::message_status,
    waiting_for = CASE WHEN served.elsewhere THEN NULL ELSE %(waiting_for)s END,
    wait_expires_at = CASE WHEN served.elsewhere THEN NULL
                           ELSE coalesce(%(now)s::timestamptz, now()) + %(wait)s::interval END,
    attempts = greatest(m.attempts - 1, 0),
    -- Given back, it keeps its place in line (as a release does); parked, it is due when
    -- resumed, which sets not_before again.
    not_before = CASE WHEN served.elsewhere
                      THEN least(m.not_before, coalesce(%(now)s::timestamptz, now()))
                      ELSE coalesce(%(now)s::timestamptz, now()) END,
    lease_expires_at = NULL,
    lease_token = NULL,
    updated_at = coalesce(%(now)s::timestamptz, now()),
    status_reason = CASE WHEN served.elsewhere
                         THEN 'released: ' || %(stage)s::text || ' is served by another runner'
                         ELSE %(reason)s END,
    status_actor = %(actor)s
FROM served
WHERE m.id = %(id)s AND m.lease_token = %(token)s AND m.lease_expires_at IS NOT NULL
RETURNING m.status;

-- name: inference_call_insert :exec
-- Record one model call against its message.
INSERT INTO inference_calls
    (tenant, message_id, pipeline, stage, kind, tier, min_tier, route_reason, model, model_sha256,
     status, error, prompt_tokens, completion_tokens, queue_seconds, ttft_seconds, total_seconds,
     at)
VALUES (%(tenant)s, %(message_id)s, %(pipeline)s, %(stage)s, %(kind)s, %(tier)s, %(min_tier)s,
        %(route_reason)s, %(model)s, %(model_sha256)s, %(status)s, %(error)s, %(prompt_tokens)s,
        %(completion_tokens)s, %(queue_seconds)s, %(ttft_seconds)s, %(total_seconds)s,
        coalesce(%(at)s::timestamptz, now()));

-- name: inference_calls_of_message :many
-- The model calls of one message, oldest first (run in the tenant's transaction: row-level security limits them to its own).
SELECT kind, tier, min_tier, route_reason, model, model_sha256, status, error, prompt_tokens,
       completion_tokens, queue_seconds, ttft_seconds, total_seconds, at
FROM inference_calls
WHERE message_id = %(message_id)s
ORDER BY id;

-- name: message_terminate :one
-- End a running attempt for good under its lease: dead, with the reason (a run budget exhausted, too many hops); never retried.
UPDATE agent_messages m
SET status = 'dead',
    error = %(reason)s,
    lease_expires_at = NULL,
    lease_token = NULL,
    finished_at = coalesce(%(now)s::timestamptz, now()),
    updated_at = coalesce(%(now)s::timestamptz, now()),
    status_reason = %(reason)s,
    status_actor = %(actor)s
WHERE m.id = %(id)s AND m.lease_token = %(token)s AND m.lease_expires_at IS NOT NULL
RETURNING m.id;

-- name: message_defer :one
-- Give a running attempt back to pending after `delay`, not counted as an attempt (the cap is not exhausted, only held by calls in flight that will settle below their reservations).
UPDATE agent_messages m
SET status = 'pending',
    attempts = greatest(m.attempts - 1, 0),
    not_before = coalesce(%(now)s::timestamptz, now()) + %(delay)s::interval,
    -- Out of the claim's index until due (migration 0020).
    deferred = %(delay)s::interval > interval '0',
    lease_expires_at = NULL,
    lease_token = NULL,
    updated_at = coalesce(%(now)s::timestamptz, now()),
    status_reason = %(reason)s,
    status_actor = %(actor)s
WHERE m.id = %(id)s AND m.lease_token = %(token)s AND m.lease_expires_at IS NOT NULL
RETURNING m.id;

-- name: planner_stats_refresh :one
-- Re-analyze each table the runtime reads by key whose heap reached `growth` times its size at its last ANALYZE (at least `min_pages`), so that kept plans are remade on current figures (migration 0009); the tables analyzed.
SELECT refresh_planner_stats(%(min_pages)s, %(growth)s) AS analyzed;

-- name: history_prune :one
-- Remove one bounded batch of history finished before the retention (migration 0025): archive months with their transition logs, model calls, past months' ledger lines and alerts, old runner records (0 while another runner prunes).
SELECT prune_history(coalesce(%(now)s::timestamptz, now()) - %(retention)s::interval, %(batch)s)
    AS pruned;
