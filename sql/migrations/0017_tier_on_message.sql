-- Claims under model backpressure read what they can take, not the blocked tier's backlog.
--
-- A runner whose model pool has no room for a tier claims with that tier blocked (a runner
-- without a pool blocks every tier). The claim found a message's tier through its stage, row by
-- row, as a filter on the pending index: with the support pipeline's shape under load (drafts
-- for the reasoning tier piling up ahead of new tickets to classify), every claim read the whole
-- blocked backlog to reach the work behind it. Measured: 10,000 pending reasoning messages
-- ahead of 20 mechanical ones, a claim of 10 read 20,041 rows in 14 ms, growing with the
-- backlog; the same claim now reads a few dozen rows.
--
-- The stage's tier now sits on the message (copied from pipeline_stages at enqueue; a runner's
-- pipeline sync re-stamps the unfinished messages of a stage whose tier it changed, fenced
-- against enqueues in flight by an advisory lock that enqueues share), and the
-- pending index leads with (lane, tier), '' standing for work without model calls. A claim
-- scans the index once per tier open to it, '' included, each scan in priority order, and
-- merges them; a blocked tier's rows are never read. Work without model calls (the only kind
-- in the no-op benchmarks) is one scan, as before, and an enqueue still writes one pending
-- index entry.

ALTER TABLE agent_messages ADD COLUMN tier text;

UPDATE agent_messages m
SET tier = s.tier
FROM pipeline_stages s
WHERE s.pipeline = m.pipeline AND s.stage = m.stage AND s.tier IS NOT NULL
  AND m.status NOT IN ('done', 'cancelled', 'expired');

DROP INDEX agent_messages_lane_tenant_priority_not_before_id_idx;
CREATE INDEX agent_messages_lane_tier_tenant_priority_not_before_id_idx
    ON agent_messages (lane, coalesce(tier, ''), tenant, priority DESC, not_before, id)
    WHERE status = 'pending';

-- Enqueue stamps the tier (the same join that already gave lane and max attempts).
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
        created_at, updated_at, tier)
    SELECT keys.message_id, req.tenant, req.pipeline, req.stage, req.source, req.source_id,
           req.key, req.directive, req.context, req.from_agent, req.to_agent, req.lane,
           req.priority, req.max_attempts, coalesce(req.not_before, req.at), req.deadline,
           coalesce(req.hops, 0), req.at, req.at, req.tier
    FROM req JOIN keys ON keys.tenant = req.tenant AND keys.key = req.key
    WHERE keys.new
    RETURNING 1
)
SELECT req.ord, keys.message_id, keys.new
FROM req JOIN keys ON keys.tenant = req.tenant AND keys.key = req.key
ORDER BY req.ord;
END
$$;
