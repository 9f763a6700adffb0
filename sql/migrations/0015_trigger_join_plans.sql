-- The update trigger joins its transition tables (old_rows with new_rows, by id) in several
-- statements. PL/pgSQL plans each of them once per session, for the row count of the first
-- statement that fires the trigger there, and keeps that plan. A session whose first update
-- wrote one row planned nested loops, and a later update of many rows then compared every row
-- with every row: measured here, complete_many of 2,000 took 1.3 s where hash joins take 35 ms,
-- and a maintenance batch of 500 took 72 ms where it takes 7-13. The trigger now plans without
-- nested loops; it finds the tenants' counter rows by key through arrays (= ANY), which needs
-- no join (as a hash join, it would read every tenant's row: 20,000 tenants made an
-- acknowledgement of 10 take 8.5 ms instead of 3.2). The small statements of the hot path
-- measured the same (claim(10) + complete_many of 10, A/B in one run: within noise). Otherwise
-- as in 0010.

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
        -- The requests in enqueue_requests' row layout.
        SELECT jsonb_agg(jsonb_build_array(
                   n.tenant, n.pipeline, r.next_stage, n.source, n.source_id,
                   idempotency_key(n.source, n.source_id, r.next_stage), s.directive,
                   n.pipeline || '.' || n.stage, n.pipeline || '.' || r.next_stage, s.lane,
                   n.priority, s.max_attempts, NULL, n.deadline, n.hops + 1,
                   coalesce(n.result, 'null'::jsonb))) AS requests,
               max(n.updated_at) AS at
        INTO nxt
        FROM new_rows n
        JOIN old_rows o ON o.id = n.id
        JOIN stage_routes r
          ON r.pipeline = n.pipeline AND r.stage = n.stage
         AND r.outcome = coalesce(n.outcome, 'ok')
        JOIN pipeline_stages s ON s.pipeline = r.pipeline AND s.stage = r.next_stage
        WHERE n.status = 'done' AND o.status = 'running';
        IF nxt.requests IS NOT NULL THEN
            PERFORM enqueue_requests(
                nxt.at,
                coalesce(nullif(current_setting('appliance.idempotency_retention', true), ''),
                         '90 days')::interval,
                nxt.requests);
        END IF;
    END IF;

    IF seen.pending > 0
       AND current_setting('appliance.notify', true) IS DISTINCT FROM 'off' THEN
        PERFORM pg_notify('appliance_work', l::text)
        FROM (SELECT DISTINCT n.lane AS l
              FROM new_rows n JOIN old_rows o ON o.id = n.id
              WHERE n.status = 'pending' AND o.status <> 'pending') AS s;
    END IF;
    RETURN NULL;
END
$$;

-- enqueue_requests, which the trigger calls for stage hand-offs, keeps the planner's usual
-- choice: its own plans are kept per session too, made by whichever caller runs it first.
ALTER FUNCTION enqueue_requests(timestamptz, interval, jsonb, integer, text)
    SET enable_nestloop = on;
