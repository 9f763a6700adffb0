-- The tenant-scoped runtime role (appliance_app) no longer writes the envelope's tables at all.
--
-- Migration 0035 took its UPDATE on agent_messages; it kept INSERT there and INSERT, UPDATE on
-- idempotency_keys, because its enqueues ran enqueue_requests as itself. With them it could
-- insert a message under a key another message holds (no index ties a message to its key
-- row: two messages, one key, both claimed), or point a key at another message or expire it
-- (the next enqueue of that key was then `new` while the first message still ran). Row-level
-- security kept it to its tenant; nothing kept it to the enqueue's rules.
--
-- Now its enqueue is a function owned by the owner (SECURITY DEFINER) that refuses unless
-- every request is of the enqueue's scope (the tenant it sets for its transaction), then
-- enqueues as the owner. The table grants go. The bus machinery (appliance_system) enqueues
-- across tenants with enqueue_requests, as before.

CREATE FUNCTION enqueue_tenant_requests(
    p_now timestamptz, p_retention interval, p_requests jsonb, p_default_max_attempts integer,
    p_scope text
)
    RETURNS TABLE (ord integer, id bigint, new boolean)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = appliance, pg_catalog, pg_temp
    AS $$
DECLARE
    other text;
BEGIN
    -- The refusals read as row-level security's own (the same error code and words), which
    -- is what they stand in for.
    IF p_scope IS NULL OR p_scope = '' THEN
        RAISE EXCEPTION 'new row violates row-level security policy: an enqueue of the tenant '
            'role names no tenant'
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    -- Held to the tenant its transaction set, if it set one (an enqueue scoped to another
    -- would move the transaction to that tenant).
    IF current_tenant() IS DISTINCT FROM p_scope AND current_tenant() IS NOT NULL THEN
        RAISE EXCEPTION 'new row violates row-level security policy: an enqueue of tenant % '
            'in a transaction of tenant %', p_scope, current_tenant()
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    -- Keys born expired would let the next enqueue of a key take it over at once.
    IF p_retention IS NULL OR p_retention <= interval '0' THEN
        RAISE EXCEPTION 'idempotency retention must be positive, got %', p_retention
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF jsonb_typeof(p_requests) = 'array' THEN  -- anything else: enqueue_requests says what
        SELECT e.r->>0 INTO other
        FROM jsonb_array_elements(p_requests) AS e(r)
        WHERE e.r->>0 IS DISTINCT FROM p_scope
        LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'new row violates row-level security policy: a request of tenant % '
                'in an enqueue of tenant %', coalesce(other, 'none'), p_scope
                USING ERRCODE = 'insufficient_privilege';
        END IF;
    END IF;
    RETURN QUERY
    SELECT r.ord, r.id, r.new
    FROM enqueue_requests(p_now, p_retention, p_requests, p_default_max_attempts, p_scope) AS r;
END
$$;

REVOKE ALL ON FUNCTION enqueue_tenant_requests(timestamptz, interval, jsonb, integer, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION enqueue_tenant_requests(timestamptz, interval, jsonb, integer, text)
    TO appliance_app;
-- Run as the caller, enqueue_requests needs the table grants it no longer has; it is the
-- machinery's (and the owner's: hand-offs) alone.
REVOKE ALL ON FUNCTION enqueue_requests(timestamptz, interval, jsonb, integer, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION enqueue_requests(timestamptz, interval, jsonb, integer, text)
    TO appliance_system;

REVOKE INSERT ON agent_messages FROM appliance_app;
REVOKE INSERT, UPDATE ON idempotency_keys FROM appliance_app;
-- Ids and lease tokens are drawn by the owner's functions and the machinery only.
REVOKE USAGE, UPDATE ON SEQUENCE agent_messages_id_seq, agent_messages_lease_token_seq
    FROM appliance_app;
