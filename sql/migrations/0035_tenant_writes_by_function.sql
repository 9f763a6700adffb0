-- The tenant-scoped runtime role (appliance_app) no longer updates envelope rows directly.
--
-- It held UPDATE on agent_messages for two statements, cancel and redrive, and with it could
-- write any column of its tenant's messages: finish a running message without its lease
-- (running -> done is a legal move, so the log trigger let it through, unfenced), move work to
-- the interactive lane or the top priority, reset attempts, rewrite a result or a tier. Row-
-- level security kept it to its own tenant; nothing kept it to the two moves it needs.
--
-- Now those two moves are functions owned by the owner (SECURITY DEFINER), each held to the
-- tenant of the caller's transaction (current_tenant(); none set: nothing changes, as under
-- row-level security), and the grant goes. Enqueues still insert as the tenant (the insert
-- trigger checks every new row; row-level security its tenant).

CREATE FUNCTION cancel_message(p_id bigint, p_reason text, p_actor text, p_now timestamptz)
    RETURNS SETOF bigint
    LANGUAGE sql SECURITY DEFINER
    SET search_path = appliance, pg_catalog, pg_temp
    AS $$
    UPDATE agent_messages
    SET status = 'cancelled',
        deferred = false,
        lease_expires_at = NULL,
        finished_at = coalesce(p_now, now()),
        updated_at = coalesce(p_now, now()),
        status_reason = p_reason,
        status_actor = p_actor
    WHERE id = p_id
      AND tenant = current_tenant()
      AND status NOT IN ('done', 'cancelled', 'expired')
    RETURNING id
$$;

-- Dead messages of the caller's tenant back to pending with fresh attempts (all of them when
-- p_ids is NULL); one past its deadline only with p_clear_deadline (which removes it), else it
-- is returned with moved = false: it would be reported redriven, then expire unrun.
CREATE FUNCTION redrive_messages(
    p_ids bigint[], p_actor text, p_now timestamptz, p_clear_deadline boolean
)
    RETURNS TABLE (id bigint, moved boolean)
    LANGUAGE sql SECURITY DEFINER
    SET search_path = appliance, pg_catalog, pg_temp
    AS $$
    WITH moved AS (
        UPDATE agent_messages m
        SET status = 'pending',
            deadline = CASE WHEN p_clear_deadline AND m.deadline <= coalesce(p_now, now())
                            THEN NULL ELSE m.deadline END,
            attempts = 0,
            not_before = coalesce(p_now, now()),
            deferred = false,
            finished_at = NULL,
            updated_at = coalesce(p_now, now()),
            status_reason = 'redriven',
            status_actor = p_actor
        WHERE m.status = 'dead'
          AND m.tenant = current_tenant()
          AND (p_ids IS NULL OR m.id = ANY (p_ids))
          AND (p_clear_deadline OR m.deadline IS NULL OR m.deadline > coalesce(p_now, now()))
        RETURNING m.id
    )
    SELECT moved.id, true FROM moved
    UNION ALL
    -- As of the statement's snapshot, so never a row moved above (it had no passed deadline).
    SELECT m.id, false FROM agent_messages m
    WHERE m.status = 'dead' AND NOT p_clear_deadline
      AND m.tenant = current_tenant()
      AND (p_ids IS NULL OR m.id = ANY (p_ids))
      AND m.deadline <= coalesce(p_now, now())
$$;

REVOKE ALL ON FUNCTION cancel_message(bigint, text, text, timestamptz),
    redrive_messages(bigint[], text, timestamptz, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION cancel_message(bigint, text, text, timestamptz),
    redrive_messages(bigint[], text, timestamptz, boolean) TO appliance_app;

REVOKE UPDATE ON agent_messages FROM appliance_app;
