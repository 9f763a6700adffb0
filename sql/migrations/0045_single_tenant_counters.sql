-- Statements of one tenant: counters written and the tenant checked by key.
--
-- The update trigger counted leases taken and ended with statements written for any number of
-- tenants: each grouped the transition tables by tenant again, locked the tenants' rows in
-- order and updated them through a join, a plan of a dozen nodes or more started for every
-- claim and every acknowledgement. Almost every such statement is of one tenant (a claim takes
-- one tenant's work, or several tenants' at once only when several have work ready; a worker
-- acknowledges what it claimed). The trigger's first statement now also finds the first and
-- last tenant of the statement's rows and, when they are the same, updates that tenant's
-- counter row by key from the counts it already has; statements of several tenants take the
-- general statements, unchanged.
--
-- The insert trigger likewise checks the tenant of a one-tenant enqueue by key (it probed the
-- tenants for every row), reading the new rows once for that and for the rows that do not
-- enter the envelope as enqueue_requests writes them (two statements before).
--
-- Same-run A/B (bench/bus_throughput.py's measurements on one server, alternating pairs,
-- median of the pairs' ratios), claim(10) + complete_many: 1 worker +4 % messages/s (20,000
-- messages x 9 pairs) and +8 % to +15 % (5,000 x 21, two runs), server CPU per message -4 % to
-- -12 %; 4 workers +9 % (5,000 x 21) and +12 % (20,000 x 9), server CPU -12 % to -14 %. Batch
-- enqueue (50,000 x 15): +2 %, server CPU -3 %.

CREATE OR REPLACE FUNCTION agent_messages_log_update() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'appliance', 'pg_catalog', 'pg_temp'
    SET enable_nestloop TO 'off'
    AS $$
DECLARE
    seen record;
    bad record;
    nxt record;
BEGIN
    SELECT count(*) FILTER (WHERE o.id IS NULL OR n.tenant IS DISTINCT FROM o.tenant) AS moved,
           count(*) FILTER (WHERE n.status <> o.status) AS changed,
           count(*) FILTER (WHERE n.status <> o.status AND t.from_status IS NULL) AS illegal,
           count(*) FILTER (WHERE n.status = 'running' AND o.status <> 'running') AS taken,
           count(*) FILTER (WHERE o.status = 'running' AND n.status <> 'running') AS ended,
           count(*) FILTER (WHERE n.status = 'done' AND o.status = 'running') AS done,
           count(*) FILTER (WHERE n.status = 'pending' AND o.status <> 'pending') AS pending,
           -- One tenant's rows only (the usual statement: a claim or acknowledgement of one
           -- tenant's work) when the first and last tenant are the same: see below.
           min(n.tenant) AS first_tenant, max(n.tenant) AS last_tenant,
           max(n.claimed_at) FILTER (WHERE n.status = 'running' AND o.status <> 'running')
               AS claimed
    INTO seen
    FROM new_rows n
    LEFT JOIN old_rows o ON o.id = n.id
    LEFT JOIN message_status_transitions t
      ON t.from_status = o.status AND t.to_status = n.status;
    IF seen.moved > 0 THEN
        -- A row whose id changed pairs with no old row: its status change would go unchecked,
        -- unlogged and uncounted; one whose tenant changed would move work between tenants.
        RAISE EXCEPTION 'a message''s id and tenant cannot change'
            USING ERRCODE = 'check_violation';
    END IF;
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

    -- The counters of a statement of one tenant are written from the counts above, by key, in
    -- a statement of one or two plan nodes: the general statements below (any number of
    -- tenants) group the transition tables again and start plans of a dozen nodes or more,
    -- which was most of what a claim or an acknowledgement of ten messages cost in this
    -- trigger (migration 0045).
    IF seen.taken > 0 AND seen.first_tenant = seen.last_tenant THEN
        UPDATE tenant_runtime r
        SET claimed = r.claimed + seen.taken,
            last_claimed_at = greatest(r.last_claimed_at, seen.claimed)
        WHERE r.tenant = seen.first_tenant;
    ELSIF seen.taken > 0 THEN
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
    IF seen.ended > 0 AND seen.first_tenant = seen.last_tenant THEN
        -- As below for one tenant: a shard no other transaction holds, this session's own
        -- first; when every shard is held (none found), this session's own, waited for.
        UPDATE tenant_released_shards x
        SET released = x.released + seen.ended
        WHERE x.tenant = seen.first_tenant
          AND x.shard = coalesce((SELECT f.shard FROM tenant_released_shards f
                                  WHERE f.tenant = seen.first_tenant
                                  ORDER BY (f.shard + 8 - pg_backend_pid() % 8) % 8
                                  LIMIT 1
                                  FOR UPDATE SKIP LOCKED),
                                 pg_backend_pid() % 8);
    ELSIF seen.ended > 0 THEN
        -- Leases ended count up one of the tenant's tenant_released_shards (rows no claim
        -- locks). Any shard will do, so a statement takes one that no other transaction holds
        -- (SKIP LOCKED: never waits), this session's own first (its backend's shard), so that
        -- concurrent acknowledgements of one tenant no longer queue behind each other's WAL
        -- flush. Only when every shard of a tenant is held does it wait, for its own shard,
        -- in tenant order (so that two statements touching the same tenants never deadlock).
        -- The shards are probed by key through arrays (= ANY): with nested loops off, a join
        -- would read the whole table.
        WITH delta AS (
            SELECT n.tenant, count(*) AS ended
            FROM new_rows n JOIN old_rows o ON o.id = n.id
            WHERE o.status = 'running' AND n.status <> 'running'
            GROUP BY n.tenant
        ),
        picked AS MATERIALIZED (
            SELECT d.tenant, d.ended,
                   (SELECT x.shard FROM tenant_released_shards x
                    WHERE x.tenant = d.tenant
                    ORDER BY (x.shard + 8 - pg_backend_pid() % 8) % 8
                    LIMIT 1
                    FOR UPDATE SKIP LOCKED) AS free
            FROM delta d
        ),
        waited AS (
            -- Tenants whose every shard another transaction holds (none, usually): this
            -- session's own shard, waited for in tenant order before anything is counted.
            SELECT x.tenant FROM tenant_released_shards x
            WHERE x.tenant = ANY (ARRAY(SELECT p.tenant FROM picked p WHERE p.free IS NULL))
              AND x.shard = pg_backend_pid() % 8
            ORDER BY x.tenant
            FOR UPDATE
        )
        UPDATE tenant_released_shards x
        SET released = x.released + picked.ended
        FROM picked
        WHERE x.tenant = picked.tenant
          AND x.shard = coalesce(picked.free, pg_backend_pid() % 8)
          AND x.tenant = ANY (ARRAY(SELECT p.tenant FROM picked p))
          AND (SELECT count(*) FROM waited) >= 0;  -- after the waits above
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
                -- One hand-off per key: two messages of one run that route to the same next
                -- stage (a fan-in), finished in one statement, asked enqueue_requests for the
                -- same key twice, which ON CONFLICT cannot do (the whole statement failed).
                -- The first, by id, hands off; the others are what they would be one statement
                -- later, the same key's duplicates.
                SELECT DISTINCT ON (n.tenant, idempotency_key(n.source, n.source_id, r.next_stage))
                       jsonb_build_array(
                           n.tenant, n.pipeline, r.next_stage, n.source, n.source_id,
                           idempotency_key(n.source, n.source_id, r.next_stage), s.directive,
                           n.pipeline || '.' || n.stage, n.pipeline || '.' || r.next_stage,
                           s.lane, n.priority, s.max_attempts, NULL, n.deadline, n.hops + 1,
                           coalesce(n.result, 'null'::jsonb)) AS request,
                       n.updated_at AS at,
                       -- One primary-key probe per hand-off. A parent whose key is gone
                       -- (purged: it was in flight longer than its retention) hands off with
                       -- the default retention.
                       coalesce((SELECT coalesce(k.retention, k.expires_at - k.created_at)
                                 FROM idempotency_keys k
                                 WHERE k.key = n.idempotency_key AND k.tenant = n.tenant),
                                interval '90 days') AS retention
                FROM new_rows n
                JOIN old_rows o ON o.id = n.id
                JOIN stage_routes r
                  ON r.pipeline = n.pipeline AND r.stage = n.stage
                 AND r.outcome = coalesce(n.outcome, 'ok')
                JOIN pipeline_stages s ON s.pipeline = r.pipeline AND s.stage = r.next_stage
                WHERE n.status = 'done' AND o.status = 'running'
                ORDER BY n.tenant, idempotency_key(n.source, n.source_id, r.next_stage), n.id
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

CREATE OR REPLACE FUNCTION agent_messages_log_insert() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'appliance', 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    seen record;
    unknown text;
BEGIN
    -- One read of the new rows for both checks: the first and last tenant (a statement of one
    -- tenant, the usual enqueue, has its tenant checked by key), and any row that does not
    -- enter the envelope as enqueue_requests writes it. A row inserted running would count up
    -- its tenant's released leases when it ended, never its claimed ones, lifting the tenant's
    -- concurrency limit; an id ahead of the sequence would make every enqueue that later draws
    -- it fail.
    SELECT min(n.tenant) AS first_tenant, max(n.tenant) AS last_tenant,
           min(n.id) FILTER (
               WHERE n.status <> 'pending' OR n.attempts <> 0 OR n.lease_token IS NOT NULL
                  OR n.lease_expires_at IS NOT NULL
                  -- The last id given out: last_value, or one before it while is_called is
                  -- false (a fresh or restarted sequence). Exact with the sequence's CACHE 1.
                  OR n.id > (SELECT CASE WHEN s.is_called THEN s.last_value
                                         ELSE s.last_value - 1 END
                             FROM agent_messages_id_seq s)) AS bad
    INTO seen
    FROM new_rows n;
    IF seen.first_tenant = seen.last_tenant THEN
        IF NOT EXISTS (SELECT FROM tenants t WHERE t.name = seen.first_tenant) THEN
            unknown := seen.first_tenant;
        END IF;
    ELSE
        SELECT n.tenant INTO unknown FROM new_rows n
        WHERE NOT EXISTS (SELECT FROM tenants t WHERE t.name = n.tenant) LIMIT 1;
    END IF;
    IF unknown IS NOT NULL THEN
        RAISE EXCEPTION 'unknown tenant %', unknown
            USING ERRCODE = 'foreign_key_violation', DETAIL = unknown;
    END IF;
    IF seen.bad IS NOT NULL THEN
        RAISE EXCEPTION 'message % must enter the envelope pending, unattempted and unleased,'
            ' with an id drawn from agent_messages_id_seq', seen.bad
            USING ERRCODE = 'check_violation';
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
