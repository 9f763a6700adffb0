-- Finished work no longer waits on its tenant's claims, nor holds them up.
--
-- A tenant's running count was one row (tenant_runtime.running) that every claim locked and
-- every status change into or out of running updated. An acknowledgement held that row lock
-- until its commit was flushed to disk, so with one busy tenant each claim queued behind the
-- last acknowledgement's WAL flush (and the acknowledgements behind each other's claims). On the
-- bus benchmark (4 workers, claim 10 + complete 10, one tenant) the decrements alone cost about a
-- fifth of the throughput.
--
-- The count is now two monotonic counters in two rows: tenant_runtime.claimed (leases taken,
-- only by claims, which lock it as before) and tenant_released.released (leases ended: done,
-- failed, reclaimed, released, parked, cancelled or expired while running), which no claim
-- locks. running = claimed - released. A claim reads `released` from its statement's snapshot,
-- so an acknowledgement committed after the claim began is not yet counted: the claim may see
-- a tenant as busier than it is, never as less busy, so the limit still holds exactly.

ALTER TABLE tenant_runtime DROP CONSTRAINT tenant_runtime_running_check;
ALTER TABLE tenant_runtime RENAME COLUMN running TO claimed;
ALTER TABLE tenant_runtime ALTER COLUMN claimed TYPE bigint;
ALTER TABLE tenant_runtime ADD CONSTRAINT tenant_runtime_claimed_check CHECK (claimed >= 0);

CREATE TABLE tenant_released (
    tenant text PRIMARY KEY REFERENCES tenants (name) ON DELETE CASCADE,
    released bigint NOT NULL DEFAULT 0 CHECK (released >= 0)
);
INSERT INTO tenant_released (tenant) SELECT tenant FROM tenant_runtime;

-- What the count means, for status pages and tests.
CREATE VIEW tenant_running AS
SELECT r.tenant, r.claimed - x.released AS running, r.last_claimed_at
FROM tenant_runtime r
JOIN tenant_released x ON x.tenant = r.tenant;

GRANT SELECT ON tenant_released, tenant_running TO appliance_app, appliance_system;

CREATE OR REPLACE FUNCTION tenants_runtime_row() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = appliance, pg_catalog
    AS $$
BEGIN
    INSERT INTO tenant_runtime (tenant) SELECT n.name FROM new_rows n ON CONFLICT DO NOTHING;
    INSERT INTO tenant_released (tenant) SELECT n.name FROM new_rows n ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;

-- The update trigger, as in 0007 but for the two counters.
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
        -- Running counts per tenant, in two rows: leases taken count up tenant_runtime.claimed
        -- (the row a claim locks), leases ended count up tenant_released.released (a row no
        -- claim locks). Each set of rows is locked in tenant order, so that two statements
        -- touching the same tenants can never deadlock.
        WITH delta AS (
            SELECT n.tenant,
                   count(*) FILTER (WHERE n.status = 'running') AS taken,
                   count(*) FILTER (WHERE o.status = 'running') AS ended,
                   max(n.claimed_at) FILTER (WHERE n.status = 'running') AS claimed
            FROM new_rows n JOIN old_rows o ON o.id = n.id
            WHERE n.status <> o.status AND 'running' IN (n.status, o.status)
            GROUP BY n.tenant
        ),
        took AS (
            SELECT r.tenant FROM tenant_runtime r
            WHERE r.tenant IN (SELECT d.tenant FROM delta d WHERE d.taken > 0)
            ORDER BY r.tenant
            FOR UPDATE
        ),
        counted AS (
            UPDATE tenant_runtime r
            SET claimed = r.claimed + delta.taken,
                last_claimed_at = greatest(r.last_claimed_at, delta.claimed)
            FROM delta JOIN took ON took.tenant = delta.tenant
            WHERE r.tenant = delta.tenant
        ),
        gave AS (
            SELECT x.tenant FROM tenant_released x
            WHERE x.tenant IN (SELECT d.tenant FROM delta d WHERE d.ended > 0)
            ORDER BY x.tenant
            FOR UPDATE
        )
        UPDATE tenant_released x
        SET released = x.released + delta.ended
        FROM delta JOIN gave ON gave.tenant = delta.tenant
        WHERE x.tenant = delta.tenant;
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
