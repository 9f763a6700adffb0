-- A call deferred because the cap's room is held by calls in flight keeps its place in line.
--
-- A call refused for room that is only reserved (spent + its ask fits the cap, spent + reserved
-- + its ask does not) is deferred and asks again a second or two later. Meanwhile calls in
-- flight settle and free room, and smaller calls that asked after it took that room first: a
-- large call could be deferred again and again for as long as small ones kept coming, up to the
-- month's end. Now such a call is a waiter of each scope that refused it, from its first
-- refusal on. A later call of the same or a less urgent lane (interactive, then system, then
-- batch) fits only beside the room of the live waiters ahead of it, so freed room gathers
-- until the oldest waiter fits; a more urgent lane never waits for a less urgent one. A waiter
-- is live while it asks again within a minute (a deferred call comes back within seconds): one
-- whose message was cancelled or ended stops holding room a minute later. It keeps its place
-- when it comes back after that. A hold taken, or a refusal that spend alone causes (the
-- message then waits in held_budget for a raised cap or a new month), ends its waits.
-- Calls without a message (none in the runner) neither wait nor yield.

CREATE TABLE spend_waiters (
    month date NOT NULL,
    scope text NOT NULL,
    message_id bigint NOT NULL,
    lane lane NOT NULL,
    amount numeric NOT NULL CHECK (amount > 0),
    -- First refused: its place in line.
    since timestamptz NOT NULL,
    -- Last refused: in line while this is within a minute.
    seen_at timestamptz NOT NULL,
    PRIMARY KEY (month, scope, message_id)
);
CREATE INDEX spend_waiters_message_idx ON spend_waiters (message_id);

CREATE OR REPLACE FUNCTION spend_reserve(
    p_tenant text, p_lane lane, p_amount numeric, p_message_id bigint, p_lease_token bigint,
    p_pipeline text, p_stage text, p_kind text, p_model text, p_tier text, p_now timestamptz
) RETURNS TABLE(hold_id bigint, refusal text, month date, cap numeric, spent numeric,
                reserved numeric)
    LANGUAGE plpgsql
    SET search_path TO 'appliance', 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    cfg spend_config;
    at timestamptz := coalesce(p_now, now());
    m date;
    scopes text[] := ARRAY['appliance', 'tenant:' || p_tenant];
    live constant interval := interval '1 minute';
    r record;
    lim numeric;
    ahead numeric;
    ahead_n integer;
    hold bigint;
    refused record;
    is_refused boolean := false;
    waiting text[] := '{}';
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
    -- Both scopes' rows locked, in scope order, before either is judged: their waiters are
    -- read and written under these locks.
    PERFORM 1 FROM spend_months sm
    WHERE sm.month = m AND sm.scope = ANY(scopes)
    ORDER BY sm.scope
    FOR UPDATE;
    FOR r IN
        SELECT sm.scope, sm.spent, sm.reserved, c.monthly_cap
        FROM spend_months sm
        LEFT JOIN spend_caps c ON c.scope = sm.scope
        WHERE sm.month = m AND sm.scope = ANY(scopes)
        ORDER BY sm.scope
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
        IF r.spent + p_amount > lim THEN
            -- Spend alone leaves no room: the message waits in held_budget, out of every line.
            DELETE FROM spend_waiters w WHERE w.message_id = p_message_id;
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
        -- The live waiters ahead of this call in this scope: first refused before it (or at
        -- all, when it is not waiting yet), of its lane or a more urgent one.
        SELECT coalesce(sum(w.amount), 0), count(*) INTO ahead, ahead_n
        FROM spend_waiters w
        LEFT JOIN spend_waiters me
          ON me.month = m AND me.scope = r.scope AND me.message_id = p_message_id
        WHERE p_message_id IS NOT NULL
          AND w.month = m AND w.scope = r.scope AND w.message_id <> p_message_id
          AND w.seen_at > at - live
          AND (me.message_id IS NULL OR (w.since, w.message_id) < (me.since, me.message_id))
          AND array_position(ARRAY['interactive', 'system', 'batch']::lane[], w.lane)
              <= array_position(ARRAY['interactive', 'system', 'batch']::lane[], p_lane);
        IF r.spent + r.reserved + ahead + p_amount > lim THEN
            waiting := waiting || r.scope::text;
            IF NOT is_refused THEN
                is_refused := true;
                SELECT r.scope AS scope, lim AS lim, r.spent AS spent, r.reserved AS reserved,
                       ahead AS ahead, ahead_n AS ahead_n, r.monthly_cap AS cap
                INTO refused;
            END IF;
        END IF;
    END LOOP;
    IF is_refused THEN
        -- Held by calls in flight (or kept for earlier waiters): in line in every scope that
        -- refused it, from its first refusal.
        IF p_message_id IS NOT NULL THEN
            INSERT INTO spend_waiters AS w (month, scope, message_id, lane, amount, since,
                                            seen_at)
            SELECT m, s, p_message_id, p_lane, p_amount, at, at FROM unnest(waiting) AS s
            ON CONFLICT ON CONSTRAINT spend_waiters_pkey DO UPDATE
            SET lane = excluded.lane, amount = excluded.amount, seen_at = excluded.seen_at;
            -- Waiters gone for an hour (their work ended or moved on, or their month did)
            -- are forgotten.
            DELETE FROM spend_waiters w WHERE w.seen_at < at - interval '1 hour';
        END IF;
        RETURN QUERY SELECT NULL::bigint,
            CASE WHEN refused.scope = 'appliance' AND p_lane <> 'interactive'
                 THEN format('money: %s work may use %s of the appliance cap %s %s '
                             '(the rest is kept for interactive work)',
                             p_lane, 1 - cfg.interactive_share, refused.cap, cfg.currency)
                 WHEN refused.scope = 'appliance'
                 THEN format('money: appliance monthly cap %s %s', refused.cap, cfg.currency)
                 ELSE format('money: %s monthly cap %s %s', refused.scope, refused.cap,
                             cfg.currency) END
            || CASE WHEN refused.ahead_n > 0
                    THEN format(' (room kept for %s earlier call%s asking %s)',
                                refused.ahead_n, CASE WHEN refused.ahead_n = 1 THEN '' ELSE 's'
                                                 END, refused.ahead)
                    ELSE '' END,
            m, refused.lim, refused.spent, refused.reserved;
        RETURN;
    END IF;
    DELETE FROM spend_waiters w WHERE w.message_id = p_message_id;
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

GRANT SELECT, INSERT, UPDATE, DELETE ON spend_waiters TO appliance_system;
