-- The envelope (agent_messages), its idempotency keys, its transition log, and the doorbell.

-- Declaration order is claim order: interactive before system before batch.
CREATE TYPE lane AS ENUM ('interactive', 'system', 'batch');

CREATE TYPE message_status AS ENUM (
    'pending', 'running', 'done', 'dead', 'cancelled', 'expired',
    'awaiting_approval', 'held_budget', 'waiting_capability'
);

-- Legal status changes; the update trigger refuses anything else. Kept equal to
-- appliance.domain.envelope.LEGAL_TRANSITIONS by a test.
CREATE TABLE message_status_transitions (
    from_status message_status NOT NULL,
    to_status message_status NOT NULL,
    PRIMARY KEY (from_status, to_status)
);
INSERT INTO message_status_transitions (from_status, to_status)
SELECT f::message_status, t::message_status
FROM (VALUES
    ('pending', 'running'), ('pending', 'cancelled'), ('pending', 'expired'), ('pending', 'dead'),
    ('running', 'done'), ('running', 'pending'), ('running', 'dead'), ('running', 'cancelled'),
    ('running', 'expired'), ('dead', 'pending'), ('dead', 'cancelled')
) AS v(f, t)
UNION ALL
SELECT s::message_status, w::message_status
FROM unnest(ARRAY['pending', 'running']) AS s,
     unnest(ARRAY['awaiting_approval', 'held_budget', 'waiting_capability']) AS w
UNION ALL
SELECT w::message_status, t::message_status
FROM unnest(ARRAY['awaiting_approval', 'held_budget', 'waiting_capability']) AS w,
     unnest(ARRAY['pending', 'cancelled', 'expired', 'dead']) AS t;

CREATE SEQUENCE agent_messages_id_seq AS bigint;
-- Every claim draws a fresh token, so a worker whose lease was reclaimed can never write again.
CREATE SEQUENCE agent_messages_lease_token_seq AS bigint;

CREATE TABLE agent_messages (
    id bigint PRIMARY KEY,
    tenant text NOT NULL REFERENCES tenants (name),
    pipeline text NOT NULL,
    stage text NOT NULL,
    source text NOT NULL,
    source_id text NOT NULL,
    idempotency_key text NOT NULL,
    directive text NOT NULL CHECK (btrim(directive) <> ''),
    context jsonb NOT NULL DEFAULT 'null'::jsonb,
    from_agent text,
    to_agent text,
    lane lane NOT NULL DEFAULT 'interactive',
    status message_status NOT NULL DEFAULT 'pending',
    priority smallint NOT NULL DEFAULT 0,
    attempts integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    max_attempts integer NOT NULL DEFAULT 5 CHECK (max_attempts BETWEEN 1 AND 100),
    lease_token bigint,
    lease_expires_at timestamptz,
    claimed_by text,
    claimed_at timestamptz,
    not_before timestamptz NOT NULL,
    deadline timestamptz,
    result jsonb,
    error text,
    -- Why and by whom the status last changed; the log trigger copies them into the log.
    status_reason text NOT NULL DEFAULT 'enqueued',
    status_actor text NOT NULL DEFAULT 'bus',
    created_at timestamptz NOT NULL,
    updated_at timestamptz NOT NULL,
    finished_at timestamptz,
    -- Running iff leased: at most one current lease per message, by construction.
    CONSTRAINT agent_messages_lease_check CHECK ((status = 'running') = (lease_expires_at IS NOT NULL))
);
ALTER SEQUENCE agent_messages_id_seq OWNED BY agent_messages.id;

-- Claimable work only: the claim reads this index in claim order and nothing else.
CREATE INDEX agent_messages_lane_priority_not_before_id_idx
    ON agent_messages (lane, priority DESC, not_before, id) WHERE status = 'pending';
-- The reclaimer's path: running rows by lease expiry.
CREATE INDEX agent_messages_lease_expires_at_idx
    ON agent_messages (lease_expires_at) WHERE status = 'running';
-- The expirer's paths: deadlines of waiting work, and queue age per lane.
CREATE INDEX agent_messages_deadline_idx
    ON agent_messages (deadline)
    WHERE deadline IS NOT NULL
      AND status IN ('pending', 'awaiting_approval', 'held_budget', 'waiting_capability');
CREATE INDEX agent_messages_lane_created_at_idx
    ON agent_messages (lane, created_at) WHERE status = 'pending';

-- Idempotency outlives the hot row: one key per tenant, kept for a retention window (default
-- 90 days) after which the key may be used again. hits counts duplicates (dedup activity).
-- No per-row foreign key to tenants: every key is written with its message, whose foreign key
-- (and the enqueue's own set-based check) already names an unknown tenant.
CREATE TABLE idempotency_keys (
    tenant text NOT NULL,
    key text NOT NULL,
    message_id bigint NOT NULL,
    created_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    hits integer NOT NULL DEFAULT 0,
    last_hit_at timestamptz,
    PRIMARY KEY (tenant, key)
);

-- Every status change, written by trigger so that no code path can skip it.
CREATE TABLE message_transitions (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant text NOT NULL,
    message_id bigint NOT NULL,
    from_status message_status,
    to_status message_status NOT NULL,
    reason text NOT NULL,
    actor text NOT NULL,
    attempt integer NOT NULL,
    lease_token bigint,
    at timestamptz NOT NULL
);
CREATE INDEX message_transitions_message_id_idx ON message_transitions (message_id, id);

-- Statement-level triggers with transition tables: one call logs (and checks) a whole batch.
-- SECURITY DEFINER so the runtime roles need no write grant on the log: they cannot forge it.
CREATE FUNCTION agent_messages_log_insert() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = appliance, pg_catalog
    AS $$
BEGIN
    INSERT INTO message_transitions
        (tenant, message_id, from_status, to_status, reason, actor, attempt, lease_token, at)
    SELECT n.tenant, n.id, NULL, n.status, n.status_reason, n.status_actor, n.attempts,
           n.lease_token, n.updated_at
    FROM new_rows n;
    -- The doorbell: the lane only, never data. PostgreSQL folds identical notifications of one
    -- transaction into one, so a batch rings once per lane.
    IF current_setting('appliance.notify', true) IS DISTINCT FROM 'off' THEN
        PERFORM pg_notify('appliance_work', l::text)
        FROM (SELECT DISTINCT n.lane AS l FROM new_rows n WHERE n.status = 'pending') AS s;
    END IF;
    RETURN NULL;
END
$$;

CREATE FUNCTION agent_messages_log_update() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = appliance, pg_catalog
    AS $$
DECLARE
    bad record;
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
    INSERT INTO message_transitions
        (tenant, message_id, from_status, to_status, reason, actor, attempt, lease_token, at)
    SELECT n.tenant, n.id, o.status, n.status, n.status_reason, n.status_actor, n.attempts,
           n.lease_token, n.updated_at
    FROM new_rows n JOIN old_rows o ON o.id = n.id
    WHERE n.status <> o.status;
    IF current_setting('appliance.notify', true) IS DISTINCT FROM 'off' THEN
        PERFORM pg_notify('appliance_work', l::text)
        FROM (SELECT DISTINCT n.lane AS l
              FROM new_rows n JOIN old_rows o ON o.id = n.id
              WHERE n.status = 'pending' AND o.status <> 'pending') AS s;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER agent_messages_insert_trg
    AFTER INSERT ON agent_messages REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION agent_messages_log_insert();
CREATE TRIGGER agent_messages_update_trg
    AFTER UPDATE ON agent_messages REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION agent_messages_log_update();

-- Row-level security on every tenant-scoped table: ENABLE + FORCE (the owner is bound too).
-- appliance_app sees exactly the tenant of its transaction; appliance_system is the bus
-- machinery (claim, reclaim, expire, status) and the owner writes the log from the trigger.
ALTER TABLE agent_messages ENABLE ROW LEVEL SECURITY;
ALTER TABLE agent_messages FORCE ROW LEVEL SECURITY;
CREATE POLICY agent_messages_tenant_isolation ON agent_messages TO appliance_app
    USING (tenant = current_tenant()) WITH CHECK (tenant = current_tenant());
CREATE POLICY agent_messages_bus_machinery ON agent_messages TO appliance_system, appliance_owner
    USING (true) WITH CHECK (true);

ALTER TABLE idempotency_keys ENABLE ROW LEVEL SECURITY;
ALTER TABLE idempotency_keys FORCE ROW LEVEL SECURITY;
CREATE POLICY idempotency_keys_tenant_isolation ON idempotency_keys TO appliance_app
    USING (tenant = current_tenant()) WITH CHECK (tenant = current_tenant());
CREATE POLICY idempotency_keys_bus_machinery ON idempotency_keys
    TO appliance_system, appliance_owner USING (true) WITH CHECK (true);

ALTER TABLE message_transitions ENABLE ROW LEVEL SECURITY;
ALTER TABLE message_transitions FORCE ROW LEVEL SECURITY;
CREATE POLICY message_transitions_tenant_isolation ON message_transitions TO appliance_app
    USING (tenant = current_tenant());
CREATE POLICY message_transitions_bus_machinery ON message_transitions
    TO appliance_system, appliance_owner USING (true) WITH CHECK (true);

GRANT SELECT ON message_status_transitions TO appliance_app, appliance_system;
GRANT SELECT, INSERT, UPDATE ON agent_messages TO appliance_app, appliance_system;
GRANT SELECT, INSERT, UPDATE ON idempotency_keys TO appliance_app, appliance_system;
GRANT SELECT ON message_transitions TO appliance_app, appliance_system;
GRANT USAGE ON SEQUENCE agent_messages_id_seq TO appliance_app, appliance_system;
GRANT USAGE ON SEQUENCE agent_messages_lease_token_seq TO appliance_app, appliance_system;
