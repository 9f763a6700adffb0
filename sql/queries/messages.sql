-- Named queries of the envelope. Parameters are named (%(name)s) and always passed separately.
-- Every `now` parameter may be NULL, which means the database clock (the production case);
-- tests pass an injected time instead of sleeping.
--
-- A statement that writes one attempt under its lease finds the row by primary key and tells
-- that it is running by `lease_expires_at IS NOT NULL`, which the table's check
-- agent_messages_lease_check makes the same as `status = 'running'`. Written with the status,
-- the condition would let the planner read the partial index of running messages instead: it
-- looks empty on statistics taken before the running set grew, and the runtime keeps that
-- generic plan, so every acknowledgement would read every running message.

-- name: message_enqueue :many
-- Insert a batch of requests (a JSON array in enqueue_requests' row layout, keys already unique in the batch) in one statement, scoped to `scope` (the tenant) when given; a key seen before returns its message (new = false) and creates no work.
SELECT e.ord, e.id, e.new
FROM enqueue_requests(
    %(now)s::timestamptz, %(retention)s::interval, %(requests)s::jsonb,
    %(default_max_attempts)s::integer, %(scope)s::text
) AS e;

-- name: message_enqueue_tenant :many
-- message_enqueue as the tenant role: every request must be of `scope`, the tenant (migration 0036: that role may not write the envelope's tables itself).
SELECT e.ord, e.id, e.new
FROM enqueue_tenant_requests(
    %(now)s::timestamptz, %(retention)s::interval, %(requests)s::jsonb,
    %(default_max_attempts)s::integer, %(scope)s::text
) AS e;

-- name: message_complete :many
-- Record results under their leases (a batch: a JSON array of [id, lease token, result, outcome]); a lease that is no longer current changes nothing and is reported with the row's status. A row another session holds locked for over `lock_timeout` fails the statement (lock_not_available) instead of holding every result of the batch behind it.
WITH waiting AS MATERIALIZED (
    -- For this statement's own transaction (autocommit): a row held by a session that keeps
    -- its transaction open (an operator's SELECT ... FOR UPDATE) held the batch, and every
    -- result queued after it, for up to the statement timeout (minutes).
    SELECT set_config('lock_timeout', %(lock_timeout)s, true) AS setting
),
input AS (
    -- One JSON parameter rather than four arrays: cheaper to write for the client (as for
    -- enqueue, migration 0007), and each result is already JSON.
    SELECT (e.r->>0)::bigint AS id, (e.r->>1)::bigint AS token, e.r->2 AS result,
           e.r->>3 AS outcome
    FROM waiting, jsonb_array_elements(%(acks)s::jsonb) AS e(r)
),
done AS (
    UPDATE agent_messages m
    SET status = 'done',
        result = i.result,
        outcome = i.outcome,
        error = NULL,
        lease_expires_at = NULL,
        finished_at = coalesce(%(now)s::timestamptz, now()),
        updated_at = coalesce(%(now)s::timestamptz, now()),
        status_reason = 'completed',
        status_actor = %(actor)s
    FROM input i
    WHERE m.id = i.id AND m.lease_token = i.token AND m.lease_expires_at IS NOT NULL
    RETURNING m.id, m.lease_token
)
-- Matched by lease as well: two attempts of one message may be acknowledged together (the
-- older one's lease lost meanwhile), and only the current one applies. `done` is probed as a
-- hashed subplan: estimated at one row, a join to it was planned as a nested loop that read
-- all of it again for every acknowledgement (quadratic: a third of a 100-row batch's time).
-- `same_answer`: a message already done under this lease (a completion sent again, its first
-- commit's answer lost) holds this result and outcome; a different one changed nothing.
SELECT i.id, (i.id, i.token) IN (SELECT d.id, d.lease_token FROM done d) AS applied, m.status,
       m.lease_token = i.token AS same_lease, i.token,
       m.result IS NOT DISTINCT FROM i.result AND m.outcome IS NOT DISTINCT FROM i.outcome
           AS same_answer
FROM input i
LEFT JOIN agent_messages m ON m.id = i.id;

-- name: message_fail :one
-- Fail the current attempt under its lease: back to pending after `retry_delay`, or dead when attempts are used up.
WITH failed AS (
    UPDATE agent_messages m
    SET status = CASE WHEN m.attempts >= m.max_attempts THEN 'dead'
                      ELSE 'pending' END::message_status,
        not_before = coalesce(%(now)s::timestamptz, now()) + %(retry_delay)s::interval,
        -- Out of the claim's index until due (migration 0020).
        deferred = m.attempts < m.max_attempts AND %(retry_delay)s::interval > interval '0',
        error = %(error)s,
        lease_expires_at = NULL,
        lease_token = NULL,
        finished_at = CASE WHEN m.attempts >= m.max_attempts
                           THEN coalesce(%(now)s::timestamptz, now()) END,
        updated_at = coalesce(%(now)s::timestamptz, now()),
        status_reason = CASE WHEN m.attempts >= m.max_attempts THEN 'attempts_exhausted'
                             ELSE 'attempt_failed' END,
        status_actor = %(actor)s
    WHERE m.id = %(id)s AND m.lease_token = %(token)s AND m.lease_expires_at IS NOT NULL
    RETURNING m.status
)
SELECT (SELECT status FROM failed) AS new_status, m.status, m.lease_token = %(token)s AS same_lease
FROM agent_messages m
WHERE m.id = %(id)s;

-- name: message_lease_states :many
-- Messages' status and lease token as of now: the answer for a write under a lease that waited behind another statement (a cancel) and found its row changed; its own snapshot still shows the row as it was.
SELECT id, status, lease_token FROM agent_messages WHERE id = ANY(%(ids)s::bigint[]);

-- name: message_cancel :one
-- Cancel a message of the transaction's tenant in any non-terminal state; a running holder learns it at its next heartbeat or write. A function (migration 0035): the tenant's role may not update envelope rows itself.
SELECT c.id FROM cancel_message(%(id)s, %(reason)s, %(actor)s, %(now)s::timestamptz) AS c(id);

-- name: message_expire_deadline :many
-- Expire waiting or pending messages whose deadline, or whose wait's own expiry, has passed (a bounded batch), instead of running them late.
WITH late AS MATERIALIZED (
    SELECT id FROM agent_messages
    WHERE deadline <= coalesce(%(now)s::timestamptz, now())
      AND deadline IS NOT NULL
      AND status IN ('pending', 'awaiting_approval', 'held_budget', 'waiting_capability')
    ORDER BY deadline
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
),
waited AS MATERIALIZED (
    SELECT id FROM agent_messages
    WHERE wait_expires_at <= coalesce(%(now)s::timestamptz, now())
      AND wait_expires_at IS NOT NULL
      AND status IN ('awaiting_approval', 'held_budget', 'waiting_capability')
      AND id NOT IN (SELECT id FROM late)
    ORDER BY wait_expires_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
),
victims AS (
    SELECT id, false AS wait FROM late
    UNION ALL
    SELECT id, true AS wait FROM waited
)
UPDATE agent_messages m
SET status = 'expired',
    deferred = false,
    finished_at = coalesce(%(now)s::timestamptz, now()),
    updated_at = coalesce(%(now)s::timestamptz, now()),
    status_reason = CASE WHEN victims.wait
                         THEN 'wait_expired: ' || coalesce(m.waiting_for, m.status::text)
                         ELSE 'deadline_passed' END,
    status_actor = %(actor)s
FROM victims
WHERE m.id = victims.id
RETURNING m.id;

-- name: message_expire_queue_age :many
-- Expire pending messages of one lane that have been due for longer than the lane's maximum queue age (since enqueued, or since their not_before: migration 0021), a bounded batch.
WITH victims AS MATERIALIZED (
    SELECT id FROM agent_messages
    WHERE status = 'pending'
      AND lane = %(lane)s::lane
      AND greatest(created_at, not_before)
          < coalesce(%(now)s::timestamptz, now()) - %(max_age)s::interval
    ORDER BY greatest(created_at, not_before)
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
UPDATE agent_messages m
SET status = 'expired',
    deferred = false,
    finished_at = coalesce(%(now)s::timestamptz, now()),
    updated_at = coalesce(%(now)s::timestamptz, now()),
    status_reason = 'max_queue_age',
    status_actor = %(actor)s
FROM victims
WHERE m.id = victims.id
RETURNING m.id;

-- name: message_reclaim :many
-- Return running messages whose lease expired (by the database clock unless `now` is given) to pending after a retry's backoff (`retry_base` doubled per attempt, at most `retry_cap`, half-jittered as a failed attempt's, the jitter a hash of the row under `jitter_seed`), to dead when attempts are used up, or to expired when the message's deadline has passed; a bounded batch.
WITH stuck AS MATERIALIZED (
    SELECT id FROM agent_messages
    WHERE status = 'running'
      AND lease_expires_at < coalesce(%(now)s::timestamptz, now())
    ORDER BY lease_expires_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
UPDATE agent_messages m
SET status = CASE WHEN m.deadline <= coalesce(%(now)s::timestamptz, now()) THEN 'expired'
                  WHEN m.attempts >= m.max_attempts THEN 'dead'
                  ELSE 'pending' END::message_status,
    -- Backed off like a failed attempt (domain/retry.py): a message whose handler takes its
    -- worker down (a native crash in the model, memory) would otherwise be taken again at
    -- once by the next runner, and take that one down too, as fast as leases lapse. Dead
    -- rows keep not_before as of now (nothing waits for it).
    not_before = coalesce(%(now)s::timestamptz, now())
        + CASE WHEN m.attempts >= m.max_attempts
                    OR m.deadline <= coalesce(%(now)s::timestamptz, now()) THEN interval '0'
               -- In seconds, capped before it becomes an interval (as in retry.py).
               ELSE interval '1 second'
                    * least(extract(epoch FROM %(retry_base)s::interval)
                                * power(2::double precision,
                                        least(greatest(m.attempts, 1) - 1, 32)),
                            extract(epoch FROM %(retry_cap)s::interval))
                    -- Half-jittered per row by a hash of the row under the caller's seed,
                    -- not random(): the same seed gives the same delays, so a run is
                    -- reproducible (the caller draws a fresh seed per batch).
                    * (0.5 + 0.5 * abs(hashint8extended(m.id, %(jitter_seed)s::bigint)
                                       %% 1000000)::double precision / 1000000) END,
    -- Out of the claim's index until due (migration 0020): the promoter puts it back.
    deferred = m.attempts < m.max_attempts
               AND NOT coalesce(m.deadline <= coalesce(%(now)s::timestamptz, now()), false),
    lease_expires_at = NULL,
    lease_token = NULL,
    -- Says which way it ran out: "went silent" was also written of a live worker whose
    -- handler overran, or that could not reach the database.
    error = CASE WHEN m.deadline <= coalesce(%(now)s::timestamptz, now())
                 THEN 'lease expired past the message''s deadline (worker '
                      || coalesce(m.claimed_by, '?') || '): expired, not retried'
                 WHEN m.run_deadline <= m.lease_expires_at
                 THEN 'lease expired at its run deadline (the handler on worker '
                      || coalesce(m.claimed_by, '?') || ' ran past the stage''s maximum runtime)'
                 ELSE 'lease expired (worker ' || coalesce(m.claimed_by, '?')
                      || ' stopped renewing it: it died, stalled or lost the database)' END,
    finished_at = CASE WHEN m.attempts >= m.max_attempts
                            OR m.deadline <= coalesce(%(now)s::timestamptz, now())
                       THEN coalesce(%(now)s::timestamptz, now()) END,
    updated_at = coalesce(%(now)s::timestamptz, now()),
    status_reason = 'lease_expired',
    status_actor = %(actor)s
FROM stuck
WHERE m.id = stuck.id
-- due_in: seconds until its retry is due, by the clock the statement used (NULL: dead or expired).
RETURNING m.id, CASE WHEN m.status = 'pending'
                     THEN extract(epoch FROM m.not_before - coalesce(%(now)s::timestamptz, now()))
                          ::double precision END AS due_in;

-- name: message_promote_due :one
-- Put deferred work that has come due (a retry's backoff over, a not_before reached) back into the claim's index, a bounded batch, lane by lane in the order given (claim order), each oldest due first; ring each lane it fills (migrations 0020, 0021).
WITH due AS MATERIALIZED (
    -- The lanes one after the other: a lane's rows are read only while the batch has room,
    -- and only the rows taken are locked.
    SELECT d.id
    FROM unnest(%(lanes)s::lane[]) AS l(lane)
    CROSS JOIN LATERAL (
        SELECT m.id FROM agent_messages m
        WHERE m.status = 'pending' AND m.deferred AND m.lane = l.lane
          AND m.not_before <= coalesce(%(now)s::timestamptz, now())
        ORDER BY m.not_before
        LIMIT %(batch)s
        FOR UPDATE SKIP LOCKED
    ) AS d
    LIMIT %(batch)s
),
promoted AS (
    -- Not a change of status: nothing is logged, and the update trigger rings no bell for it.
    UPDATE agent_messages m
    SET deferred = false
    FROM due
    WHERE m.id = due.id
    RETURNING m.lane
)
SELECT count(*) AS promoted,
       (SELECT count(pg_notify('appliance_work', l.lane::text))
        FROM (SELECT DISTINCT p.lane FROM promoted p) AS l
        WHERE current_setting('appliance.notify', true) IS DISTINCT FROM 'off') AS rung
FROM promoted;

-- name: message_redrive :many
-- Send the transaction's tenant's dead messages back to pending with fresh attempts (all of its dead ones when `ids` is NULL); one past its deadline only with `clear_deadline` (which removes it): otherwise it would be reported redriven, then expire unrun. Rows: (id, moved), the ones left for their deadline with moved = false. A function (migration 0035): the tenant's role may not update envelope rows itself.
SELECT r.id, r.moved
FROM redrive_messages(%(ids)s::bigint[], %(actor)s, %(now)s::timestamptz,
                      %(clear_deadline)s::boolean) AS r;

-- name: bus_overdue :one
-- Work past an expiry that the maintenance has not moved yet (each counted up to 10,000, on its partial index): leases expired, deferred work due but not promoted, work past its deadline, waits past their expiry. Non-zero for long means no runner's maintenance is running.
SELECT
    (SELECT count(*) FROM (SELECT FROM agent_messages m
                           WHERE m.status = 'running' AND m.lease_expires_at < clock(%(now)s)
                           LIMIT 10000) x) AS leases_expired,
    (SELECT count(*) FROM (SELECT FROM agent_messages m
                           WHERE m.status = 'pending' AND m.deferred
                             AND m.lane = ANY (enum_range(NULL::lane))
                             AND m.not_before <= clock(%(now)s)
                           LIMIT 10000) x) AS due_not_promoted,
    (SELECT count(*) FROM (SELECT FROM agent_messages m
                           WHERE m.deadline IS NOT NULL AND m.deadline < clock(%(now)s)
                             AND m.status IN ('pending', 'awaiting_approval', 'held_budget',
                                              'waiting_capability')
                           LIMIT 10000) x) AS past_deadline,
    (SELECT count(*) FROM (SELECT FROM agent_messages m
                           WHERE m.wait_expires_at IS NOT NULL
                             AND m.wait_expires_at < clock(%(now)s)
                             AND m.status IN ('awaiting_approval', 'held_budget',
                                              'waiting_capability')
                           LIMIT 10000) x) AS waits_expired;

-- name: message_get :one
-- One message by id, from the hot table or the archive (row-level security limits it to the transaction's tenant).
SELECT * FROM agent_messages WHERE id = %(id)s
UNION ALL
SELECT (jsonb_populate_record(NULL::agent_messages, a.body)).*
FROM agent_messages_archive a
WHERE a.id = %(id)s AND NOT EXISTS (SELECT FROM agent_messages WHERE id = %(id)s)
LIMIT 1;

-- name: message_list :many
-- The transaction's tenant's messages in the hot table, newest first: of the statuses given (any when NULL) and the lane given (any when NULL), below id `before` (the next page; from the newest when NULL), at most `limit` (row-level security limits it to the transaction's tenant).
SELECT * FROM agent_messages m
WHERE (%(statuses)s::message_status[] IS NULL OR m.status = ANY (%(statuses)s::message_status[]))
  AND (%(lane)s::lane IS NULL OR m.lane = %(lane)s::lane)
  AND (%(before)s::bigint IS NULL OR m.id < %(before)s::bigint)
ORDER BY m.id DESC
LIMIT %(limit)s;

-- name: message_transitions :many
-- The transition log of one message, oldest first.
SELECT from_status, to_status, reason, actor, attempt, lease_token, at
FROM message_transitions
WHERE message_id = %(id)s
ORDER BY id;

-- name: bus_status :many
-- Counts by lane, status, pipeline and stage in one read of the table (pending ones not due yet also counted apart), with the oldest pending age and oldest running lease age of each group. The pending age counts from when the work became due (enqueued, or its not_before reached): work enqueued for later or backing off waits on purpose.
SELECT m.lane, m.status, m.pipeline, m.stage, count(*) AS n,
       count(*) FILTER (WHERE m.deferred) AS deferred,
       extract(epoch FROM coalesce(%(now)s::timestamptz, now())
               - min(greatest(m.created_at, m.not_before)) FILTER (
                   WHERE m.status = 'pending'
                     AND m.not_before <= coalesce(%(now)s::timestamptz, now()))
       ) AS oldest_pending_s,
       extract(epoch FROM coalesce(%(now)s::timestamptz, now())
               - min(m.claimed_at) FILTER (WHERE m.status = 'running')) AS oldest_lease_s
FROM agent_messages m
GROUP BY m.lane, m.status, m.pipeline, m.stage;

-- name: stage_outputs :many
-- The latest message of each work item (source, source id) at one stage of a pipeline, with its status and result (row-level security limits it to the transaction's tenant).
SELECT DISTINCT ON (m.source_id) m.id, m.source_id, m.status, m.result, m.error
FROM agent_messages m
WHERE m.pipeline = %(pipeline)s AND m.stage = %(stage)s AND m.source = %(source)s
  AND m.source_id = ANY(%(source_ids)s::text[])
ORDER BY m.source_id, m.id DESC;

-- name: messages_waiting :many
-- A tenant's messages waiting for something (approval, budget, a model tier), with why (row-level security limits it to the transaction's tenant).
SELECT m.id, m.pipeline, m.stage, m.source_id, m.status, m.status_reason, m.deadline
FROM agent_messages m
WHERE m.status IN ('awaiting_approval', 'held_budget', 'waiting_capability')
ORDER BY m.id
LIMIT %(limit)s;
