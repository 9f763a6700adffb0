-- A batch's messages are given their ids in the order of its requests.
--
-- enqueue_requests drew each message's id while reading its requests through a join with the
-- stage table, in the join's order, not the batch's: a hash join hands its rows on in reverse,
-- so a batch submitted n0..n7 got descending ids, and, sharing one not-before, was claimed
-- n7 first. As in 0031 otherwise.

CREATE OR REPLACE FUNCTION enqueue_requests(p_now timestamp with time zone, p_retention interval, p_requests jsonb, p_default_max_attempts integer DEFAULT 5, p_scope text DEFAULT NULL::text) RETURNS TABLE(ord integer, id bigint, new boolean)
    LANGUAGE plpgsql
    SET search_path TO 'appliance', 'pg_catalog', 'pg_temp'
    SET enable_nestloop TO 'on'
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
    INSERT INTO idempotency_keys AS ik
        (tenant, key, message_id, created_at, expires_at, retention)
    SELECT req.tenant, req.key, nextval('agent_messages_id_seq'), req.at, req.at + p_retention,
           p_retention
    FROM req
    -- Ids in the order of the requests: a batch's messages share their not-before, so the
    -- claim takes them by id, and the join above hands its rows on in its own order (a hash
    -- join's: reversed). nextval is evaluated after the sort (PostgreSQL postpones volatile
    -- expressions of the target list past an ORDER BY).
    ORDER BY req.ord
    ON CONFLICT (tenant, key) DO UPDATE
    -- A live key answers with its message; an expired one is taken over by the new request.
    -- Taken over only when its message has left the hot table as well (migration 0024): a
    -- dead message, or work deferred or held longer than the retention, keeps its key, which
    -- then lives as long as the message plus a retention from its last hit.
    SET hits = CASE WHEN ik.expires_at <= excluded.created_at
                         AND NOT EXISTS (SELECT FROM agent_messages h WHERE h.id = ik.message_id)
                    THEN 0 ELSE ik.hits + 1 END,
        last_hit_at = CASE WHEN ik.expires_at <= excluded.created_at
                                AND NOT EXISTS (SELECT FROM agent_messages h
                                                WHERE h.id = ik.message_id)
                           THEN NULL ELSE excluded.created_at END,
        message_id = CASE WHEN ik.expires_at <= excluded.created_at
                               AND NOT EXISTS (SELECT FROM agent_messages h
                                               WHERE h.id = ik.message_id)
                          THEN excluded.message_id ELSE ik.message_id END,
        created_at = CASE WHEN ik.expires_at <= excluded.created_at
                               AND NOT EXISTS (SELECT FROM agent_messages h
                                               WHERE h.id = ik.message_id)
                          THEN excluded.created_at ELSE ik.created_at END,
        retention = CASE WHEN ik.expires_at <= excluded.created_at
                              AND NOT EXISTS (SELECT FROM agent_messages h
                                              WHERE h.id = ik.message_id)
                         THEN excluded.retention ELSE ik.retention END,
        -- A live key keeps its expiry: hits do not slide it. Taken over: the new request's.
        -- Kept for its hot message: its own retention from this request (migration 0031: the
        -- request's could differ, and hand-offs read the key's retention).
        expires_at = CASE WHEN ik.expires_at > excluded.created_at THEN ik.expires_at
                          WHEN NOT EXISTS (SELECT FROM agent_messages h
                                           WHERE h.id = ik.message_id)
                          THEN excluded.expires_at
                          ELSE excluded.created_at + coalesce(ik.retention, excluded.retention)
                          END
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
