-- Work that is not due yet stays out of the claim's index.
--
-- The claim reads the pending index in priority order, and a pending message whose not_before
-- lies ahead (a retry's backoff, a deferral while the cap was busy, work enqueued for later)
-- sat in it beside work that is due. Every claim read past the not-yet-due messages of higher
-- priority to reach the due work of lower: measured here, 10,000 deferred messages of priority
-- 5 ahead of due ones of priority 0 made a claim of 10 take 4.3 ms instead of 2.7; at 50,000,
-- the kept plans turned to the lane's created_at index and sorted the lane (80 ms a claim).
--
-- A pending message that is not due yet is now `deferred`: out of the pending index (which
-- keeps its name and key), in an index of its own by not_before. Writes that make work pending
-- decide it (an enqueue whose not_before is ahead, a failed attempt's retry after a backoff, a
-- deferral); the rest make it due at once. The promoter (message_promote_due: maintenance every
-- second, and a runner whose own retry's backoff ended, before it claims) clears the flag for
-- work that has come due, a bounded batch at a time, and rings its lanes: what a claim reads is
-- what it may take. The flag is not a status: no transition is logged for it, the life cycle is
-- unchanged. A message that leaves pending is never deferred (checked).
--
-- The doorbell rings for due work only: a failed attempt that backs off, or an enqueue for
-- later, no longer wakes every runner to find nothing; the promoter rings when it comes due.

ALTER TABLE agent_messages ADD COLUMN deferred boolean NOT NULL DEFAULT false;
UPDATE agent_messages SET deferred = true WHERE status = 'pending' AND not_before > now();
ALTER TABLE agent_messages ADD CONSTRAINT agent_messages_deferred_only_pending
    CHECK (NOT deferred OR status = 'pending');

DROP INDEX agent_messages_lane_tier_tenant_priority_not_before_id_idx;
CREATE INDEX agent_messages_lane_tier_tenant_priority_not_before_id_idx
    ON agent_messages (lane, coalesce(tier, ''), tenant, priority DESC, not_before, id)
    WHERE status = 'pending' AND NOT deferred;
CREATE INDEX agent_messages_deferred_not_before_idx ON agent_messages (not_before)
    WHERE status = 'pending' AND deferred;

-- Enqueue: as in 0017, deciding `deferred`.
CREATE OR REPLACE FUNCTION enqueue_requests(
    p_now timestamptz, p_retention interval, p_requests jsonb,
    p_default_max_attempts integer DEFAULT 5, p_scope text DEFAULT NULL
) RETURNS TABLE (ord integer, id bigint, new boolean)
    LANGUAGE plpgsql SET search_path = appliance, pg_catalog SET enable_nestloop = on
    AS $$
BEGIN
IF jsonb_typeof(p_requests) IS DISTINCT FROM 'array' THEN
    RAISE EXCEPTION 'enqueue requests must be a JSON array, got %', jsonb_typeof(p_requests)
        USING ERRCODE = 'invalid_parameter_value';
END IF;
-- p_scope: the tenant of this transaction (SET LOCAL), so that a tenant's enqueue is one
-- autocommit statement, one round trip; row-level security then checks every row against it.
IF p_scope IS NOT NULL THEN
    PERFORM set_config('appliance.tenant', p_scope, true);
END IF;
-- Unknown tenants are refused by the insert trigger (agent_messages_log_insert, below).
-- The stage tiers read below are current: a pipeline sync that changes one takes this lock
-- exclusively before it re-stamps messages, so it waits for every enqueue that may have read the
-- old tier to commit (and then sees its rows), and enqueues after it wait for its commit. Taken
-- before the statement below, whose snapshot is then taken after the wait.
PERFORM pg_advisory_xact_lock_shared(hashtext('appliance'), hashtext('stage_tiers'));
RETURN QUERY
WITH raw AS (
    SELECT (e.n - 1)::integer AS ord, e.r->>0 AS tenant, e.r->>1 AS pipeline, e.r->>2 AS stage,
           e.r->>3 AS source, e.r->>4 AS source_id, e.r->>5 AS key, e.r->>6 AS directive,
           e.r->>7 AS from_agent, e.r->>8 AS to_agent, (e.r->>9)::lane AS lane,
           (e.r->>10)::smallint AS priority, (e.r->>11)::integer AS max_attempts,
           (e.r->>12)::timestamptz AS not_before, (e.r->>13)::timestamptz AS deadline,
           (e.r->>14)::integer AS hops, e.r->15 AS context
    FROM jsonb_array_elements(p_requests) WITH ORDINALITY AS e(r, n)
),
req AS (
    -- Unset lane and max attempts come from the declared stage, else the defaults.
    SELECT r.ord, r.tenant, r.pipeline, r.stage, r.source, r.source_id, r.key, r.directive,
           coalesce(r.context, 'null'::jsonb) AS context, r.from_agent, r.to_agent,
           coalesce(r.lane, s.lane, 'interactive') AS lane, coalesce(r.priority, 0) AS priority,
           coalesce(r.max_attempts, s.max_attempts, p_default_max_attempts) AS max_attempts,
           r.not_before, r.deadline, r.hops, coalesce(p_now, now()) AS at,
           -- The stage's model tier, on the message for the claim's per-tier scans.
           s.tier
    FROM raw r
    LEFT JOIN pipeline_stages s ON s.pipeline = r.pipeline AND s.stage = r.stage
),
keys AS (
    INSERT INTO idempotency_keys AS ik (tenant, key, message_id, created_at, expires_at)
    SELECT req.tenant, req.key, nextval('agent_messages_id_seq'), req.at, req.at + p_retention
    FROM req
    ON CONFLICT (tenant, key) DO UPDATE
    -- A live key answers with its message; an expired one is taken over by the new request.
    SET hits = CASE WHEN ik.expires_at <= excluded.created_at THEN 0 ELSE ik.hits + 1 END,
        last_hit_at = CASE WHEN ik.expires_at <= excluded.created_at THEN NULL
                           ELSE excluded.created_at END,
        message_id = CASE WHEN ik.expires_at <= excluded.created_at THEN excluded.message_id
                          ELSE ik.message_id END,
        created_at = CASE WHEN ik.expires_at <= excluded.created_at THEN excluded.created_at
                          ELSE ik.created_at END,
        expires_at = CASE WHEN ik.expires_at <= excluded.created_at THEN excluded.expires_at
                          ELSE ik.expires_at END
    RETURNING ik.tenant, ik.key, ik.message_id, ik.hits = 0 AS new
),
inserted AS (
    INSERT INTO agent_messages (
        id, tenant, pipeline, stage, source, source_id, idempotency_key, directive, context,
        from_agent, to_agent, lane, priority, max_attempts, not_before, deadline, hops,
        created_at, updated_at, tier, deferred)
    SELECT keys.message_id, req.tenant, req.pipeline, req.stage, req.source, req.source_id,
           req.key, req.directive, req.context, req.from_agent, req.to_agent, req.lane,
           req.priority, req.max_attempts, coalesce(req.not_before, req.at), req.deadline,
           coalesce(req.hops, 0), req.at, req.at, req.tier,
           -- Not due yet: out of the claim's index until the promoter puts it back.
           coalesce(req.not_before, req.at) > req.at
    FROM req JOIN keys ON keys.tenant = req.tenant AND keys.key = req.key
    WHERE keys.new
    RETURNING 1
)
SELECT req.ord, keys.message_id, keys.new
FROM req JOIN keys ON keys.tenant = req.tenant AND keys.key = req.key
ORDER BY req.ord;
END
$$;

-- The doorbell of an insert: as in 0007, for work that is due.
CREATE OR REPLACE FUNCTION agent_messages_log_insert() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = appliance, pg_catalog
    AS $$
DECLARE
    unknown text;
BEGIN
    SELECT n.tenant INTO unknown FROM new_rows n
    WHERE NOT EXISTS (SELECT FROM tenants t WHERE t.name = n.tenant) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'unknown tenant %', unknown
            USING ERRCODE = 'foreign_key_violation', DETAIL = unknown;
    END IF;
    INSERT INTO message_transitions
        (tenant, message_id, from_status, to_status, reason, actor, attempt, lease_token, at)
    SELECT n.tenant, n.id, NULL, n.status, n.status_reason, n.status_actor, n.attempts,
           n.lease_token, n.updated_at
    FROM new_rows n;
    -- The doorbell: the lane only, never data. PostgreSQL folds identical notifications of one
    -- transaction into one, so a batch rings once per lane.
    IF current_setting('appliance.notify', true) IS DISTINCT FROM 'off' THEN
        PERFORM pg_notify('appliance_work', l::text)
        FROM (SELECT DISTINCT n.lane AS l FROM new_rows n
              WHERE n.status = 'pending' AND NOT n.deferred) AS s;
    END IF;
    RETURN NULL;
END
$$;

-- The update trigger: as in 0018, ringing for work that became due.
CREATE OR REPLACE FUNCTION agent_messages_log_update() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = appliance, pg_catalog
    SET enable_nestloop = off
    AS $$
DECLARE
    seen record;
    bad record;
    nxt record;
BEGIN
    SELECT count(*) FILTER (WHERE n.status <> o.status) AS changed,
           count(*) FILTER (WHERE n.status <> o.status AND t.from_status IS NULL) AS illegal,
           count(*) FILTER (WHERE n.status = 'running' AND o.status <> 'running') AS taken,
           count(*) FILTER (WHERE o.status = 'running' AND n.status <> 'running') AS ended,
           count(*) FILTER (WHERE n.status = 'done' AND o.status = 'running') AS done,
           count(*) FILTER (WHERE n.status = 'pending' AND o.status <> 'pending') AS pending
    INTO seen
    FROM new_rows n
    JOIN old_rows o ON o.id = n.id
    LEFT JOIN message_status_transitions t
      ON t.from_status = o.status AND t.to_status = n.status;
    IF seen.changed = 0 THEN
        RETURN NULL;  -- heartbeats and other in-place updates: nothing to log or count
    END IF;
    IF seen.illegal > 0 THEN
        SELECT o.id, o.status AS from_status, n.status AS to_status INTO bad
        FROM new_rows n JOIN old_rows o ON o.id = n.id
        WHERE n.status <> o.status
          AND NOT EXISTS (SELECT FROM message_status_transitions t
                          WHERE t.from_status = o.status AND t.to_status = n.status)
        LIMIT 1;
        RAISE EXCEPTION 'illegal status change of message %: % -> %',
            bad.id, bad.from_status, bad.to_status
            USING ERRCODE = 'check_violation';
    END IF;

    INSERT INTO message_transitions
        (tenant, message_id, from_status, to_status, reason, actor, attempt, lease_token, at)
    -- A lease leaving running is cleared on the row; the log keeps which lease it was.
    SELECT n.tenant, n.id, o.status, n.status, n.status_reason, n.status_actor, n.attempts,
           coalesce(n.lease_token, o.lease_token), n.updated_at
    FROM new_rows n JOIN old_rows o ON o.id = n.id
    WHERE n.status <> o.status;

    IF seen.taken > 0 THEN
        -- Leases taken count up tenant_runtime.claimed (the row a claim locks), locked in
        -- tenant order so that two statements touching the same tenants never deadlock. The
        -- tenants' rows are probed by key through an array (= ANY): with nested loops off, a
        -- join would read the whole table.
        WITH delta AS (
            SELECT n.tenant, count(*) AS taken, max(n.claimed_at) AS claimed
            FROM new_rows n JOIN old_rows o ON o.id = n.id
            WHERE n.status = 'running' AND o.status <> 'running'
            GROUP BY n.tenant
        ),
        took AS (
            SELECT r.tenant FROM tenant_runtime r
            WHERE r.tenant = ANY (ARRAY(SELECT d.tenant FROM delta d))
            ORDER BY r.tenant
            FOR UPDATE
        )
        UPDATE tenant_runtime r
        SET claimed = r.claimed + delta.taken,
            last_claimed_at = greatest(r.last_claimed_at, delta.claimed)
        FROM delta JOIN took ON took.tenant = delta.tenant
        WHERE r.tenant = delta.tenant
          AND r.tenant = ANY (ARRAY(SELECT d.tenant FROM delta d));
    END IF;
    IF seen.ended > 0 THEN
        -- Leases ended count up tenant_released.released (a row no claim locks), in tenant
        -- order too.
        WITH delta AS (
            SELECT n.tenant, count(*) AS ended
            FROM new_rows n JOIN old_rows o ON o.id = n.id
            WHERE o.status = 'running' AND n.status <> 'running'
            GROUP BY n.tenant
        ),
        gave AS (
            SELECT x.tenant FROM tenant_released x
            WHERE x.tenant = ANY (ARRAY(SELECT d.tenant FROM delta d))
            ORDER BY x.tenant
            FOR UPDATE
        )
        UPDATE tenant_released x
        SET released = x.released + delta.ended
        FROM delta JOIN gave ON gave.tenant = delta.tenant
        WHERE x.tenant = delta.tenant
          AND x.tenant = ANY (ARRAY(SELECT d.tenant FROM delta d));
    END IF;

    IF seen.done > 0 THEN
        -- Stage hand-off: done -> the next stage for the outcome, keyed (source, source id,
        -- stage), so a retried completion or a second runner can never enqueue it twice.
        -- The requests in enqueue_requests' row layout. The next stage's key is kept as long
        -- as the finished message's key was (its parent's retention, and so the one the run's
        -- first enqueue was given): one enqueue per retention among the hand-offs, usually one.
        FOR nxt IN
            SELECT h.retention, jsonb_agg(h.request) AS requests, max(h.at) AS at
            FROM (
                SELECT jsonb_build_array(
                           n.tenant, n.pipeline, r.next_stage, n.source, n.source_id,
                           idempotency_key(n.source, n.source_id, r.next_stage), s.directive,
                           n.pipeline || '.' || n.stage, n.pipeline || '.' || r.next_stage,
                           s.lane, n.priority, s.max_attempts, NULL, n.deadline, n.hops + 1,
                           coalesce(n.result, 'null'::jsonb)) AS request,
                       n.updated_at AS at,
                       -- One primary-key probe per hand-off. A parent whose key is gone
                       -- (purged: it was in flight longer than its retention) hands off with
                       -- the default retention.
                       coalesce((SELECT k.expires_at - k.created_at FROM idempotency_keys k
                                 WHERE k.key = n.idempotency_key AND k.tenant = n.tenant),
                                interval '90 days') AS retention
                FROM new_rows n
                JOIN old_rows o ON o.id = n.id
                JOIN stage_routes r
                  ON r.pipeline = n.pipeline AND r.stage = n.stage
                 AND r.outcome = coalesce(n.outcome, 'ok')
                JOIN pipeline_stages s ON s.pipeline = r.pipeline AND s.stage = r.next_stage
                WHERE n.status = 'done' AND o.status = 'running'
            ) AS h
            GROUP BY h.retention
        LOOP
            PERFORM enqueue_requests(nxt.at, nxt.retention, nxt.requests);
        END LOOP;
    END IF;

    IF seen.pending > 0
       AND current_setting('appliance.notify', true) IS DISTINCT FROM 'off' THEN
        PERFORM pg_notify('appliance_work', l::text)
        FROM (SELECT DISTINCT n.lane AS l
              FROM new_rows n JOIN old_rows o ON o.id = n.id
              WHERE n.status = 'pending' AND o.status <> 'pending' AND NOT n.deferred) AS s;
    END IF;
    RETURN NULL;
END
$$;
