-- The stage runner: stage graphs, stage hand-off by trigger, per-tenant concurrency, leases with
-- a hard maximum runtime, runners' health, and the archive that keeps the hot table small.

-- The same text as appliance.domain.envelope.idempotency_key (a test holds them equal):
-- length-prefixed parts, so no characters inside a part can make two triples collide.
CREATE FUNCTION idempotency_key(source text, source_id text, stage text) RETURNS text
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$
    SELECT 'k1:' || encode(sha256(convert_to(
        length(source) || ':' || source || '|' || length(source_id) || ':' || source_id || '|'
        || length(stage) || ':' || stage, 'UTF8')), 'hex')
$$;

-- Stage graphs, written by the runner from the pipelines declared in code (one declaration).
CREATE TABLE pipeline_stages (
    pipeline text NOT NULL,
    stage text NOT NULL,
    lane lane NOT NULL,
    task_kind text NOT NULL,
    handler text NOT NULL,
    directive text NOT NULL CHECK (btrim(directive) <> ''),
    max_runtime interval NOT NULL CHECK (max_runtime > interval '0'),
    max_attempts integer NOT NULL CHECK (max_attempts BETWEEN 1 AND 100),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (pipeline, stage)
);

CREATE TABLE stage_routes (
    pipeline text NOT NULL,
    stage text NOT NULL,
    outcome text NOT NULL,
    next_stage text NOT NULL,
    PRIMARY KEY (pipeline, stage, outcome),
    FOREIGN KEY (pipeline, stage) REFERENCES pipeline_stages (pipeline, stage) ON DELETE CASCADE,
    FOREIGN KEY (pipeline, next_stage) REFERENCES pipeline_stages (pipeline, stage)
        ON DELETE CASCADE
);

ALTER TABLE agent_messages
    ADD COLUMN outcome text,
    -- The hard end of the current attempt: heartbeats never extend a lease past it.
    ADD COLUMN run_deadline timestamptz,
    -- How many hand-offs led here: bounds a message that keeps re-enqueueing itself.
    ADD COLUMN hops integer NOT NULL DEFAULT 0 CHECK (hops >= 0);

-- Claims go lane by lane, tenant by tenant: the claim index leads with both.
DROP INDEX agent_messages_lane_priority_not_before_id_idx;
CREATE INDEX agent_messages_lane_tenant_priority_not_before_id_idx
    ON agent_messages (lane, tenant, priority DESC, not_before, id) WHERE status = 'pending';

-- Per-tenant concurrency: the serialisation point that SKIP LOCKED alone cannot give. A claim
-- locks the tenant's row (skipping it when another claimer holds it), the update trigger keeps
-- `running` exact, and last_claimed_at orders tenants round-robin.
ALTER TABLE tenants ADD COLUMN max_running integer CHECK (max_running > 0);
CREATE TABLE tenant_runtime (
    tenant text PRIMARY KEY REFERENCES tenants (name) ON DELETE CASCADE,
    running integer NOT NULL DEFAULT 0 CHECK (running >= 0),
    last_claimed_at timestamptz
);
INSERT INTO tenant_runtime (tenant, running)
SELECT t.name, (SELECT count(*) FROM agent_messages m WHERE m.tenant = t.name AND m.status = 'running')
FROM tenants t;

CREATE FUNCTION tenants_runtime_row() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = appliance, pg_catalog
    AS $$
BEGIN
    INSERT INTO tenant_runtime (tenant) SELECT n.name FROM new_rows n ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;
CREATE TRIGGER tenants_insert_trg
    AFTER INSERT ON tenants REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION tenants_runtime_row();

-- Enqueue as one set-based function, shared by the API (message_enqueue) and stage hand-off.
-- SECURITY INVOKER: row-level security applies to whoever calls it.
CREATE FUNCTION enqueue_messages(
    p_now timestamptz, p_retention interval, p_ord integer[], p_tenant text[], p_pipeline text[],
    p_stage text[], p_source text[], p_source_id text[], p_key text[], p_directive text[],
    p_context jsonb[], p_from_agent text[], p_to_agent text[], p_lane lane[],
    p_priority smallint[], p_max_attempts integer[], p_not_before timestamptz[],
    p_deadline timestamptz[], p_hops integer[], p_default_max_attempts integer DEFAULT 5,
    p_scope text DEFAULT NULL
) RETURNS TABLE (ord integer, id bigint, new boolean)
    LANGUAGE plpgsql SET search_path = appliance, pg_catalog
    AS $$
DECLARE
    unknown text;
BEGIN
-- p_scope: the tenant of this transaction (SET LOCAL), so that a tenant's enqueue is one
-- autocommit statement, one round trip; row-level security then checks every row against it.
IF p_scope IS NOT NULL THEN
    PERFORM set_config('appliance.tenant', p_scope, true);
END IF;
-- One set-based check instead of a foreign-key probe per key row.
SELECT t INTO unknown FROM unnest(p_tenant) AS t
WHERE NOT EXISTS (SELECT FROM tenants WHERE name = t) LIMIT 1;
IF FOUND THEN
    RAISE EXCEPTION 'unknown tenant %', unknown
        USING ERRCODE = 'foreign_key_violation', DETAIL = unknown;
END IF;
RETURN QUERY
WITH req AS (
    -- Unset lane and max attempts come from the declared stage, else the defaults.
    SELECT r.ord, r.tenant, r.pipeline, r.stage, r.source, r.source_id, r.key, r.directive,
           r.context, r.from_agent, r.to_agent,
           coalesce(r.lane, s.lane, 'interactive') AS lane, r.priority,
           coalesce(r.max_attempts, s.max_attempts, p_default_max_attempts) AS max_attempts,
           r.not_before, r.deadline, r.hops, coalesce(p_now, now()) AS at
    FROM unnest(p_ord, p_tenant, p_pipeline, p_stage, p_source, p_source_id, p_key, p_directive,
                p_context, p_from_agent, p_to_agent, p_lane, p_priority, p_max_attempts,
                p_not_before, p_deadline, p_hops)
        AS r(ord, tenant, pipeline, stage, source, source_id, key, directive, context,
             from_agent, to_agent, lane, priority, max_attempts, not_before, deadline, hops)
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
        created_at, updated_at)
    SELECT keys.message_id, req.tenant, req.pipeline, req.stage, req.source, req.source_id,
           req.key, req.directive, req.context, req.from_agent, req.to_agent, req.lane,
           req.priority, req.max_attempts, coalesce(req.not_before, req.at), req.deadline,
           coalesce(req.hops, 0), req.at, req.at
    FROM req JOIN keys ON keys.tenant = req.tenant AND keys.key = req.key
    WHERE keys.new
    RETURNING 1
)
SELECT req.ord, keys.message_id, keys.new
FROM req JOIN keys ON keys.tenant = req.tenant AND keys.key = req.key
ORDER BY req.ord;
END
$$;

-- The update trigger now also keeps each tenant's running count exact and hands completed work
-- to the next stage of its pipeline, in the same transaction as the completion.
CREATE OR REPLACE FUNCTION agent_messages_log_update() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = appliance, pg_catalog
    AS $$
DECLARE
    bad record;
    nxt record;
BEGIN
    SELECT o.id, o.status AS from_status, n.status AS to_status INTO bad
    FROM new_rows n JOIN old_rows o ON o.id = n.id
    WHERE n.status <> o.status
      AND NOT EXISTS (SELECT FROM message_status_transitions t
                      WHERE t.from_status = o.status AND t.to_status = n.status)
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'illegal status change of message %: % -> %',
            bad.id, bad.from_status, bad.to_status
            USING ERRCODE = 'check_violation';
    END IF;
    IF NOT EXISTS (SELECT FROM new_rows n JOIN old_rows o ON o.id = n.id
                   WHERE n.status <> o.status) THEN
        RETURN NULL;  -- heartbeats and other in-place updates: nothing to log or count
    END IF;

    INSERT INTO message_transitions
        (tenant, message_id, from_status, to_status, reason, actor, attempt, lease_token, at)
    -- A lease leaving running is cleared on the row; the log keeps which lease it was.
    SELECT n.tenant, n.id, o.status, n.status, n.status_reason, n.status_actor, n.attempts,
           coalesce(n.lease_token, o.lease_token), n.updated_at
    FROM new_rows n JOIN old_rows o ON o.id = n.id
    WHERE n.status <> o.status;

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

    -- Stage hand-off: done -> the next stage for the outcome, keyed (source, source id, stage),
    -- so a retried completion or a second runner can never enqueue it twice.
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
               s.max_attempts, NULL::timestamptz AS not_before, n.deadline, n.hops + 1 AS hops,
               n.updated_at AS at
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

    IF current_setting('appliance.notify', true) IS DISTINCT FROM 'off' THEN
        PERFORM pg_notify('appliance_work', l::text)
        FROM (SELECT DISTINCT n.lane AS l
              FROM new_rows n JOIN old_rows o ON o.id = n.id
              WHERE n.status = 'pending' AND o.status <> 'pending') AS s;
    END IF;
    RETURN NULL;
END
$$;

-- The archive: terminal messages older than the retention leave the hot table in bounded
-- batches. The body is kept whole as jsonb, so later columns need no archive migration;
-- the transition log (by message id) and idempotency keys still reach archived messages.
CREATE TABLE agent_messages_archive (
    id bigint NOT NULL,
    tenant text NOT NULL,
    pipeline text NOT NULL,
    stage text NOT NULL,
    source text NOT NULL,
    source_id text NOT NULL,
    status message_status NOT NULL,
    finished_at timestamptz NOT NULL,
    archived_at timestamptz NOT NULL,
    body jsonb NOT NULL
) PARTITION BY RANGE (finished_at);
CREATE TABLE agent_messages_archive_default PARTITION OF agent_messages_archive DEFAULT;
CREATE INDEX agent_messages_archive_id_idx ON agent_messages_archive (id);
CREATE INDEX agent_messages_archive_tenant_source_idx
    ON agent_messages_archive (tenant, source, source_id);

-- Terminal rows by age: the archiver's path.
CREATE INDEX agent_messages_finished_at_idx
    ON agent_messages (finished_at) WHERE status IN ('done', 'cancelled', 'expired');

ALTER TABLE agent_messages_archive ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_messages_archive FORCE ROW LEVEL SECURITY;
CREATE POLICY agent_messages_archive_tenant_isolation ON agent_messages_archive TO appliance_app
    USING (tenant = current_tenant());
CREATE POLICY agent_messages_archive_bus_machinery ON agent_messages_archive
    TO appliance_system, appliance_owner USING (true) WITH CHECK (true);

-- Moves one bounded batch; creates the month's partition on first use. SECURITY DEFINER: the
-- runtime roles may archive through this function but cannot DELETE or create tables.
CREATE FUNCTION archive_messages(p_cutoff timestamptz, p_batch integer, p_now timestamptz)
    RETURNS integer
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = appliance, pg_catalog
    AS $$
DECLARE
    month date;
    moved integer;
BEGIN
    -- One archiver at a time across runners; the others skip this round.
    IF NOT pg_try_advisory_xact_lock(hashtext('appliance.archive')) THEN
        RETURN 0;
    END IF;
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
END
$$;

-- Runners report themselves here: the cockpit's and `appliance status`'s view of dispatch.
CREATE TABLE runners (
    id text PRIMARY KEY,
    host text NOT NULL,
    pid integer NOT NULL,
    started_at timestamptz NOT NULL,
    seen_at timestamptz NOT NULL,
    stopped_at timestamptz,
    listener_connected boolean NOT NULL DEFAULT false,
    -- The last fallback poll that found work no notification announced (a dispatch health
    -- signal: frequent misses mean notifications are being lost).
    last_missed_wakeup_at timestamptz,
    missed_wakeups bigint NOT NULL DEFAULT 0,
    claimed bigint NOT NULL DEFAULT 0,
    completed bigint NOT NULL DEFAULT 0,
    failed bigint NOT NULL DEFAULT 0,
    stats jsonb NOT NULL DEFAULT '{}'::jsonb
);

-- Reclaims and dedup activity of the last hour are read from these.
CREATE INDEX message_transitions_lease_expired_at_idx
    ON message_transitions (at) WHERE reason = 'lease_expired';
CREATE INDEX idempotency_keys_last_hit_at_idx
    ON idempotency_keys (last_hit_at) WHERE last_hit_at IS NOT NULL;

GRANT SELECT ON pipeline_stages, stage_routes TO appliance_app;
GRANT SELECT, INSERT, UPDATE, DELETE ON pipeline_stages, stage_routes TO appliance_system;
GRANT SELECT ON tenant_runtime TO appliance_app;
GRANT SELECT, UPDATE ON tenant_runtime TO appliance_system;
GRANT SELECT ON agent_messages_archive TO appliance_app, appliance_system;
GRANT SELECT, INSERT, UPDATE ON runners TO appliance_system;
GRANT SELECT ON runners TO appliance_app;
GRANT EXECUTE ON FUNCTION idempotency_key(text, text, text) TO appliance_app, appliance_system;
REVOKE ALL ON FUNCTION archive_messages(timestamptz, integer, timestamptz) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION archive_messages(timestamptz, integer, timestamptz)
    TO appliance_system;
