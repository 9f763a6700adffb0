-- The update trigger, leaner: one pass over the changed rows says which of its steps apply, and
-- only those run. Every claim and every acknowledgement pays this trigger, and before, each of
-- them ran all six of its statements (a claim ran the stage hand-off and the doorbell query to
-- find nothing to do). What it does is unchanged: refuse illegal status changes, log every
-- change, keep each tenant's running count exact, hand completed work to the next stage, ring
-- the doorbell for work that became pending.
CREATE OR REPLACE FUNCTION agent_messages_log_update() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = appliance, pg_catalog
    AS $$
DECLARE
    seen record;
    bad record;
    nxt record;
BEGIN
    SELECT count(*) FILTER (WHERE n.status <> o.status) AS changed,
           count(*) FILTER (WHERE n.status <> o.status AND t.from_status IS NULL) AS illegal,
           count(*) FILTER (WHERE n.status <> o.status
                              AND 'running' IN (n.status, o.status)) AS running,
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

    IF seen.running > 0 THEN
        -- Running counts per tenant. Rows are locked in tenant order so that two statements
        -- touching the same tenants can never deadlock.
        WITH delta AS (
            SELECT n.tenant,
                   sum((n.status = 'running')::integer - (o.status = 'running')::integer) AS d,
                   max(n.claimed_at) FILTER (WHERE n.status = 'running') AS claimed
            FROM new_rows n JOIN old_rows o ON o.id = n.id
            WHERE n.status <> o.status AND 'running' IN (n.status, o.status)
            GROUP BY n.tenant
        ),
        locked AS (
            SELECT r.tenant FROM tenant_runtime r
            WHERE r.tenant IN (SELECT tenant FROM delta)
            ORDER BY r.tenant
            FOR UPDATE
        )
        UPDATE tenant_runtime r
        SET running = r.running + delta.d,
            last_claimed_at = greatest(r.last_claimed_at, delta.claimed)
        FROM delta JOIN locked ON locked.tenant = delta.tenant
        WHERE r.tenant = delta.tenant;
    END IF;

    IF seen.done > 0 THEN
        -- Stage hand-off: done -> the next stage for the outcome, keyed (source, source id,
        -- stage), so a retried completion or a second runner can never enqueue it twice.
        SELECT array_agg(x.ord) AS ord, array_agg(x.tenant) AS tenant,
               array_agg(x.pipeline) AS pipeline, array_agg(x.stage) AS stage,
               array_agg(x.source) AS source, array_agg(x.source_id) AS source_id,
               array_agg(x.key) AS key, array_agg(x.directive) AS directive,
               array_agg(x.context) AS context, array_agg(x.from_agent) AS from_agent,
               array_agg(x.to_agent) AS to_agent, array_agg(x.lane) AS lane,
               array_agg(x.priority) AS priority, array_agg(x.max_attempts) AS max_attempts,
               array_agg(x.not_before) AS not_before, array_agg(x.deadline) AS deadline,
               array_agg(x.hops) AS hops, max(x.at) AS at, count(*) AS n
        INTO nxt
        FROM (
            SELECT row_number() OVER ()::integer AS ord, n.tenant, n.pipeline,
                   r.next_stage AS stage, n.source, n.source_id,
                   idempotency_key(n.source, n.source_id, r.next_stage) AS key,
                   s.directive, coalesce(n.result, 'null'::jsonb) AS context,
                   n.pipeline || '.' || n.stage AS from_agent,
                   n.pipeline || '.' || r.next_stage AS to_agent, s.lane, n.priority,
                   s.max_attempts, NULL::timestamptz AS not_before, n.deadline,
                   n.hops + 1 AS hops, n.updated_at AS at
            FROM new_rows n
            JOIN old_rows o ON o.id = n.id
            JOIN stage_routes r
              ON r.pipeline = n.pipeline AND r.stage = n.stage
             AND r.outcome = coalesce(n.outcome, 'ok')
            JOIN pipeline_stages s ON s.pipeline = r.pipeline AND s.stage = r.next_stage
            WHERE n.status = 'done' AND o.status = 'running'
        ) AS x;
        IF nxt.n > 0 THEN
            PERFORM enqueue_messages(
                nxt.at,
                coalesce(nullif(current_setting('appliance.idempotency_retention', true), ''),
                         '90 days')::interval,
                nxt.ord, nxt.tenant, nxt.pipeline, nxt.stage, nxt.source, nxt.source_id, nxt.key,
                nxt.directive, nxt.context, nxt.from_agent, nxt.to_agent, nxt.lane, nxt.priority,
                nxt.max_attempts, nxt.not_before, nxt.deadline, nxt.hops);
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
