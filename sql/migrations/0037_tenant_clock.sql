-- The tenant-scoped runtime role (appliance_app) could stop the machinery of every tenant.
--
-- Its functions (cancel_message, redrive_messages, enqueue_tenant_requests) write the
-- caller's clock (`p_now`, which tests inject) into rows as it is. An infinite one broke the
-- machinery for all: a message cancelled at -infinity sorted first in every archive round,
-- which then failed creating its partition (no row was archived or pruned again), and one
-- enqueued at -infinity failed every status report (an infinite age). The clock given must be
-- a finite time now; the machinery's own callers (Python datetimes) never had another.
--
-- (The other way, its advisory locks, is closed in bootstrap.sql: only a superuser can.)

CREATE FUNCTION tenant_clock(p_now timestamptz)
    RETURNS timestamptz
    LANGUAGE plpgsql STABLE
    AS $$
BEGIN
    IF p_now IS NOT NULL AND NOT isfinite(p_now) THEN
        RAISE EXCEPTION 'the time given (%) is not a finite time', p_now
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN coalesce(p_now, now());
END
$$;

REVOKE ALL ON FUNCTION tenant_clock(timestamptz) FROM PUBLIC;

CREATE OR REPLACE FUNCTION cancel_message(
    p_id bigint, p_reason text, p_actor text, p_now timestamptz
)
    RETURNS SETOF bigint
    LANGUAGE sql SECURITY DEFINER
    SET search_path = appliance, pg_catalog, pg_temp
    AS $$
    UPDATE agent_messages
    SET status = 'cancelled',
        deferred = false,
        lease_expires_at = NULL,
        finished_at = tenant_clock(p_now),
        updated_at = tenant_clock(p_now),
        status_reason = p_reason,
        status_actor = p_actor
    WHERE id = p_id
      AND tenant = current_tenant()
      AND status NOT IN ('done', 'cancelled', 'expired')
    RETURNING id
$$;

CREATE OR REPLACE FUNCTION redrive_messages(
    p_ids bigint[], p_actor text, p_now timestamptz, p_clear_deadline boolean
)
    RETURNS TABLE (id bigint, moved boolean)
    LANGUAGE sql SECURITY DEFINER
    SET search_path = appliance, pg_catalog, pg_temp
    AS $$
    WITH moved AS (
        UPDATE agent_messages m
        SET status = 'pending',
            deadline = CASE WHEN p_clear_deadline AND m.deadline <= tenant_clock(p_now)
                            THEN NULL ELSE m.deadline END,
            attempts = 0,
            not_before = tenant_clock(p_now),
            deferred = false,
            finished_at = NULL,
            updated_at = tenant_clock(p_now),
            status_reason = 'redriven',
            status_actor = p_actor
        WHERE m.status = 'dead'
          AND m.tenant = current_tenant()
          AND (p_ids IS NULL OR m.id = ANY (p_ids))
          AND (p_clear_deadline OR m.deadline IS NULL OR m.deadline > tenant_clock(p_now))
        RETURNING m.id
    )
    SELECT moved.id, true FROM moved
    UNION ALL
    -- As of the statement's snapshot, so never a row moved above (it had no passed deadline).
    SELECT m.id, false FROM agent_messages m
    WHERE m.status = 'dead' AND NOT p_clear_deadline
      AND m.tenant = current_tenant()
      AND (p_ids IS NULL OR m.id = ANY (p_ids))
      AND m.deadline <= tenant_clock(p_now)
$$;

CREATE OR REPLACE FUNCTION enqueue_tenant_requests(
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
    PERFORM tenant_clock(p_now);  -- a finite time, or the database's
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
