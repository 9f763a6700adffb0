-- Writes under a lease tell "running" by `lease_expires_at IS NOT NULL`, never by the status.
--
-- The two are the same thing (agent_messages_lease_check), but only the status condition lets
-- the planner read the partial index of running messages. Runtime connections keep generic
-- plans (migration 0009); a plan made on statistics taken before the running set grew sees
-- that index as empty and scans all of it to find one message by id. Measured here with 10,000
-- messages running on statistics from before they were claimed: an acknowledgement of 10
-- 3.4 -> 0.9 ms, of one 3.1 -> 0.65 ms, a heartbeat 2.7 -> 0.36 ms, a failure 2.1 -> 0.7 ms.
-- The named queries (sql/queries) changed with this migration; here, the same for the lease
-- check in spend_reserve, which every model call runs. Otherwise as in 0005.

CREATE OR REPLACE FUNCTION spend_reserve(
    p_tenant text, p_lane lane, p_amount numeric, p_message_id bigint, p_lease_token bigint,
    p_pipeline text, p_stage text, p_kind text, p_model text, p_tier text, p_now timestamptz
) RETURNS TABLE (hold_id bigint, refusal text, month date, cap numeric, spent numeric,
                 reserved numeric)
    LANGUAGE plpgsql SET search_path = appliance, pg_catalog AS $$
DECLARE
    cfg spend_config;
    at timestamptz := coalesce(p_now, now());
    m date;
    scopes text[] := ARRAY['appliance', 'tenant:' || p_tenant];
    r record;
    lim numeric;
    hold bigint;
BEGIN
    IF p_amount IS NULL OR p_amount <= 0 THEN
        RAISE EXCEPTION 'spend_reserve: the amount must be > 0 (a call that cannot be priced '
                        'is refused)';
    END IF;
    -- Only the current holder of a lease may spend for its message: a worker whose lease was
    -- reclaimed cannot take a hold the reclaimer would never see.
    IF p_message_id IS NOT NULL AND NOT EXISTS (
        SELECT FROM agent_messages am
        WHERE am.id = p_message_id AND am.lease_token = p_lease_token
          AND am.lease_expires_at IS NOT NULL  -- running, by agent_messages_lease_check
    ) THEN
        RAISE EXCEPTION 'spend_reserve: message % is not running under lease %',
            p_message_id, p_lease_token USING ERRCODE = 'lock_not_available';
    END IF;
    SELECT * INTO cfg FROM spend_config;
    m := spend_month(at);
    -- The month's rows start once (a rollover creates them on its first reservation).
    INSERT INTO spend_months (month, scope, created_at)
    SELECT m, s, at FROM unnest(scopes) AS s
    ON CONFLICT DO NOTHING;
    FOR r IN
        SELECT sm.scope, sm.spent, sm.reserved, c.monthly_cap
        FROM spend_months sm
        LEFT JOIN spend_caps c ON c.scope = sm.scope
        WHERE sm.month = m AND sm.scope = ANY(scopes)
        ORDER BY sm.scope
        FOR UPDATE OF sm
    LOOP
        IF r.monthly_cap IS NULL THEN
            IF r.scope = 'appliance' THEN
                RETURN QUERY SELECT NULL::bigint,
                    'money: no monthly cap is set (appliance cap set AMOUNT)'::text, m,
                    NULL::numeric, r.spent, r.reserved;
                RETURN;
            END IF;
            CONTINUE;  -- a tenant without a cap of its own is bounded by the appliance's
        END IF;
        lim := r.monthly_cap;
        IF r.scope = 'appliance' AND p_lane <> 'interactive' THEN
            lim := r.monthly_cap * (1 - cfg.interactive_share);
        END IF;
        IF r.spent + r.reserved + p_amount > lim THEN
            RETURN QUERY SELECT NULL::bigint,
                CASE WHEN r.scope = 'appliance' AND p_lane <> 'interactive'
                     THEN format('money: %s work may use %s of the appliance cap %s %s '
                                 '(the rest is kept for interactive work)',
                                 p_lane, 1 - cfg.interactive_share, r.monthly_cap, cfg.currency)
                     WHEN r.scope = 'appliance'
                     THEN format('money: appliance monthly cap %s %s', r.monthly_cap,
                                 cfg.currency)
                     ELSE format('money: %s monthly cap %s %s', r.scope, r.monthly_cap,
                                 cfg.currency) END,
                m, lim, r.spent, r.reserved;
            RETURN;
        END IF;
    END LOOP;
    UPDATE spend_months sm SET reserved = sm.reserved + p_amount
    WHERE sm.month = m AND sm.scope = ANY(scopes);
    INSERT INTO spend_ledger (month, tenant, lane, message_id, lease_token, pipeline, stage, kind,
                              model, tier, status, reserved, created_at)
    VALUES (m, p_tenant, p_lane, p_message_id, p_lease_token, p_pipeline, p_stage, p_kind,
            p_model, p_tier, 'reserved', p_amount, at)
    RETURNING id INTO hold;
    RETURN QUERY SELECT hold, NULL::text, m, NULL::numeric, NULL::numeric, NULL::numeric;
END
$$;
