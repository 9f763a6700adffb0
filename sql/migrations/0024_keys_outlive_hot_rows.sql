-- Two ways the appliance lost track of work, and one wait without end.
--
-- 1. An idempotency key could expire while its message was still in the envelope: its expiry
--    is set at enqueue (retention, 90 days by default), but a dead message stays until it is
--    redriven, and work can be deferred or held for budget longer than that. Past the expiry
--    the key purge deleted the key, or an enqueue of the same key took it over: the same work
--    was enqueued again beside the first (which a redrive then ran too). A key is now taken
--    over, or purged, only once its message has left the hot table; a hit on a kept (expired)
--    key extends it by a retention.
-- 2. archive_messages creates a month's partition, which needs the archive to itself: behind a
--    long reader it waited without end (see its comment).
-- The three functions are otherwise as they stood (with the search_path of 0022).

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
    INSERT INTO idempotency_keys AS ik (tenant, key, message_id, created_at, expires_at)
    SELECT req.tenant, req.key, nextval('agent_messages_id_seq'), req.at, req.at + p_retention
    FROM req
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
        -- Expired (taken over, or kept for its hot message): a retention from this request.
        -- A live key keeps its expiry: hits do not slide it.
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

CREATE OR REPLACE FUNCTION purge_idempotency_keys(p_now timestamp with time zone, p_batch integer) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'appliance', 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    at timestamptz := coalesce(p_now, now());
    window_pages constant bigint := 1024;
    first_block bigint;
    last_block bigint;
    purged integer;
BEGIN
    -- One purger at a time across runners; the others skip this round.
    IF NOT pg_try_advisory_xact_lock(hashtext('appliance.purge_keys')) THEN
        RETURN 0;
    END IF;
    first_block := upkeep_window_start('idempotency_keys', 'appliance.idempotency_keys');
    -- A key an enqueue is taking over right now is locked: skipped here, and its new expiry
    -- keeps it. The expiry is checked again on the row deleted. The window is read by a TID
    -- range scan and the rows deleted by their tuple ids, whatever the statistics.
    WITH gone AS (
        DELETE FROM idempotency_keys k
        WHERE k.ctid = ANY (ARRAY(
                  SELECT d.ctid FROM idempotency_keys d
                  WHERE d.ctid >= format('(%s,0)', first_block)::tid
                    AND d.ctid < format('(%s,0)', first_block + window_pages)::tid
                    AND d.expires_at <= at
                    -- A key outlives its hot row (migration 0024): never purged while its
                    -- message is still in the envelope (dead, or waiting longer than the
                    -- retention); a later sweep takes it once the message is archived.
                    AND NOT EXISTS (SELECT FROM agent_messages h WHERE h.id = d.message_id)
                  ORDER BY d.ctid
                  LIMIT p_batch
                  FOR UPDATE SKIP LOCKED))
          AND k.expires_at <= at
        RETURNING k.ctid
    )
    SELECT count(*), max((g.ctid::text::point)[0])::bigint INTO purged, last_block FROM gone g;
    PERFORM upkeep_window_done('idempotency_keys', first_block, window_pages, purged, p_batch,
                               last_block);
    RETURN purged;
END
$$;

CREATE OR REPLACE FUNCTION archive_messages(p_cutoff timestamp with time zone, p_batch integer, p_now timestamp with time zone) RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'appliance', 'pg_catalog', 'pg_temp'
    SET lock_timeout TO '1s'
    AS $$
DECLARE
    month date;
    moved integer;
BEGIN
    -- One archiver at a time across runners; the others skip this round.
    IF NOT pg_try_advisory_xact_lock(hashtext('appliance.archive')) THEN
        RETURN 0;
    END IF;
    -- A new month's partition needs the archive to itself: behind a long reader (a backup) it
    -- waited without end, every later round skipped and readers of the archive queued behind
    -- it. Now it waits a second (the function's lock_timeout, which ends with the call) and
    -- tries again next round (migration 0024).
    FOR month IN
        SELECT DISTINCT date_trunc('month', v.finished_at AT TIME ZONE 'UTC')::date
        FROM (SELECT finished_at FROM agent_messages
              WHERE status IN ('done', 'cancelled', 'expired') AND finished_at < p_cutoff
              ORDER BY finished_at LIMIT p_batch) AS v
    LOOP
        IF to_regclass(format('appliance.agent_messages_archive_y%sm%s',
                              to_char(month, 'YYYY'), to_char(month, 'MM'))) IS NULL THEN
            -- Rows of this month may already sit in the default partition; move them over.
            CREATE TEMP TABLE IF NOT EXISTS archive_spill (LIKE agent_messages_archive)
                ON COMMIT DROP;
            WITH spilled AS (
                DELETE FROM agent_messages_archive_default
                WHERE finished_at >= (month::timestamp AT TIME ZONE 'UTC')
                  AND finished_at < ((month + interval '1 month')::timestamp AT TIME ZONE 'UTC')
                RETURNING *
            )
            INSERT INTO archive_spill SELECT * FROM spilled;
            EXECUTE format(
                'CREATE TABLE appliance.%I PARTITION OF appliance.agent_messages_archive'
                ' FOR VALUES FROM (%L) TO (%L)',
                format('agent_messages_archive_y%sm%s', to_char(month, 'YYYY'),
                       to_char(month, 'MM')),
                month::timestamp AT TIME ZONE 'UTC',
                (month + interval '1 month')::timestamp AT TIME ZONE 'UTC');
            INSERT INTO agent_messages_archive SELECT * FROM archive_spill;
            TRUNCATE archive_spill;
        END IF;
    END LOOP;

    WITH victims AS MATERIALIZED (
        SELECT id FROM agent_messages
        WHERE status IN ('done', 'cancelled', 'expired') AND finished_at < p_cutoff
        ORDER BY finished_at
        LIMIT p_batch
        FOR UPDATE SKIP LOCKED
    ),
    gone AS (
        DELETE FROM agent_messages m USING victims v WHERE m.id = v.id RETURNING m.*
    )
    INSERT INTO agent_messages_archive
        (id, tenant, pipeline, stage, source, source_id, status, finished_at, archived_at, body)
    SELECT g.id, g.tenant, g.pipeline, g.stage, g.source, g.source_id, g.status, g.finished_at,
           coalesce(p_now, now()), to_jsonb(g)
    FROM gone g;
    GET DIAGNOSTICS moved = ROW_COUNT;
    RETURN moved;
EXCEPTION WHEN lock_not_available THEN
    RAISE NOTICE 'archive_messages: the archive is in use (%); trying again next round',
        SQLERRM;
    RETURN 0;
END
$$;
