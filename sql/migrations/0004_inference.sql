-- Inference: which stages need which tier, messages waiting for a tier, and every model call.

-- The weakest tier a stage's model work may run on (NULL: the stage does no inference). The
-- claim skips stages whose tier has no room, so the pool's queue bounds what a runner claims.
ALTER TABLE pipeline_stages ADD COLUMN tier text
    CHECK (tier IS NULL OR tier IN ('mechanical', 'reasoning'));

-- What a waiting message waits for (the weakest tier that may serve it, or 'budget'), and until
-- when: every wait has an expiry of its own, which never shortens the message's deadline.
ALTER TABLE agent_messages
    ADD COLUMN waiting_for text,
    ADD COLUMN wait_expires_at timestamptz;
CREATE INDEX agent_messages_waiting_capability_idx
    ON agent_messages (waiting_for) WHERE status = 'waiting_capability';
CREATE INDEX agent_messages_wait_expires_at_idx
    ON agent_messages (wait_expires_at) WHERE wait_expires_at IS NOT NULL;

-- One row per model call: which model (name and hash) on which tier, why, tokens and timings.
-- The routing audit trail: a reasoning call served by a mechanical model would show here.
CREATE TABLE inference_calls (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant text NOT NULL REFERENCES tenants (name),
    message_id bigint NOT NULL,
    pipeline text NOT NULL,
    stage text NOT NULL,
    kind text NOT NULL,
    tier text NOT NULL CHECK (tier IN ('mechanical', 'reasoning')),
    min_tier text NOT NULL CHECK (min_tier IN ('mechanical', 'reasoning')),
    route_reason text NOT NULL,
    model text NOT NULL,
    model_sha256 text NOT NULL,
    status text NOT NULL CHECK (status IN ('ok', 'error', 'cancelled', 'refused', 'invalid_output')),
    error text,
    prompt_tokens integer NOT NULL DEFAULT 0 CHECK (prompt_tokens >= 0),
    completion_tokens integer NOT NULL DEFAULT 0 CHECK (completion_tokens >= 0),
    queue_seconds double precision NOT NULL DEFAULT 0,
    ttft_seconds double precision NOT NULL DEFAULT 0,
    total_seconds double precision NOT NULL DEFAULT 0,
    at timestamptz NOT NULL DEFAULT now(),
    -- Never a downgrade: the serving tier is at or above the weakest allowed one.
    CONSTRAINT inference_calls_never_downgrade
        CHECK (NOT (min_tier = 'reasoning' AND tier = 'mechanical'))
);
CREATE INDEX inference_calls_message_idx ON inference_calls (message_id);
CREATE INDEX inference_calls_at_idx ON inference_calls (at);

ALTER TABLE inference_calls ENABLE ROW LEVEL SECURITY;
ALTER TABLE inference_calls FORCE ROW LEVEL SECURITY;
CREATE POLICY inference_calls_tenant_isolation ON inference_calls TO appliance_app
    USING (tenant = current_tenant());
CREATE POLICY inference_calls_bus_machinery ON inference_calls
    TO appliance_system, appliance_owner USING (true) WITH CHECK (true);

GRANT SELECT ON inference_calls TO appliance_app;
GRANT SELECT, INSERT ON inference_calls TO appliance_system;
