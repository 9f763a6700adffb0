-- The waiting line, fifth review. spend_reserve now also says whether the refused call should
-- wait in place (`wait`): only the head of the line (no one ahead of it in any scope that
-- refused it), refused by room held in flight, whose room can gather. Every waiter whose room
-- could not gather (more urgent work holds it) was told nothing and so waited in place as a
-- head, holding a runner slot for minutes. `behind` now names the first head ahead of the
-- call in any scope that refused it (it named the first refusing scope's only, so a call kept
-- back in its tenant's line could wait in place as the appliance's head). An admitted call
-- keeps its message's place (a handler's second, larger call kept the place its first had
-- earned; it went to the back of the line).

DROP FUNCTION spend_reserve(text, lane, numeric, bigint, bigint, text, text, text, text, text,
                            timestamptz);

CREATE FUNCTION spend_reserve(
    p_tenant text, p_lane lane, p_amount numeric, p_message_id bigint, p_lease_token bigint,
    p_pipeline text, p_stage text, p_kind text, p_model text, p_tier text, p_now timestamptz
) RETURNS TABLE(hold_id bigint, refusal text, month date, cap numeric, spent numeric,
                reserved numeric, behind bigint, wait boolean)
    LANGUAGE plpgsql
    SET search_path TO 'appliance', 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    cfg spend_config;
    at timestamptz := coalesce(p_now, now());
    m date;
    scopes text[] := ARRAY['appliance', 'tenant:' || p_tenant];
    r record;
    lim numeric;
    share numeric;
    held_all numeric;
    held_tenant numeric;
    app_spent numeric;
    app_lim numeric;
    ten_spent numeric;
    ten_lim numeric;
    can_gather boolean;
    ahead numeric;
    head_id bigint;
    live constant interval := interval '15 seconds';
    place_kept constant interval := interval '1 hour';
    refusing text[] := '{}';
    first_head bigint;
    my_since timestamptz;
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
    share := 1 - cfg.interactive_share;
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
    -- This message's one place in line: its first refusal this month, in any scope (kept for
    -- an hour after its last refusal).
    IF p_message_id IS NOT NULL THEN
        SELECT min(w.since) INTO my_since
        FROM spend_waiters w
        WHERE w.message_id = p_message_id AND w.month = m AND w.seen_at > at - place_kept;
    END IF;
    my_since := coalesce(my_since, at);
    FOR r IN
        SELECT sm.scope, sm.spent, sm.reserved, c.monthly_cap
        FROM spend_months sm
        LEFT JOIN spend_caps c ON c.scope = sm.scope
        WHERE sm.month = m AND sm.scope = ANY(scopes)
        ORDER BY sm.scope
    LOOP
        IF r.monthly_cap IS NULL THEN
            IF r.scope = 'appliance' THEN
                DELETE FROM spend_waiters w WHERE w.message_id = p_message_id;
                RETURN QUERY SELECT NULL::bigint,
                    'money: no monthly cap is set (appliance cap set AMOUNT)'::text, m,
                    NULL::numeric, r.spent, r.reserved, NULL::bigint, false;
                RETURN;
            END IF;
            CONTINUE;  -- a tenant without a cap of its own is bounded by the appliance's
        END IF;
        lim := r.monthly_cap;
        IF r.scope = 'appliance' AND p_lane <> 'interactive' THEN
            lim := r.monthly_cap * share;
        END IF;
        IF r.spent + p_amount > lim THEN
            -- Spend alone leaves no room: the message waits in held_budget, out of every line.
            DELETE FROM spend_waiters w WHERE w.message_id = p_message_id;
            RETURN QUERY SELECT NULL::bigint,
                CASE WHEN r.scope = 'appliance' AND p_lane <> 'interactive'
                     THEN format('money: %s work may use %s of the appliance cap %s %s '
                                 '(the rest is kept for interactive work)',
                                 p_lane, share, r.monthly_cap, cfg.currency)
                     WHEN r.scope = 'appliance'
                     THEN format('money: appliance monthly cap %s %s', r.monthly_cap,
                                 cfg.currency)
                     ELSE format('money: %s monthly cap %s %s', r.scope, r.monthly_cap,
                                 cfg.currency) END,
                m, lim, r.spent, r.reserved, NULL::bigint, false;
            RETURN;
        END IF;
        IF r.scope = 'appliance' THEN
            app_spent := r.spent;
            app_lim := lim;
        ELSE
            ten_spent := r.spent;
            ten_lim := lim;
        END IF;
        -- The head of the line ahead of this call: the first waiter placed before it, of its
        -- lane or a more urgent one (the lane enum is in claim order), able to gather its
        -- room, asked within the last 15 seconds, still pending or running. Each lane's line
        -- is read no further than its first 1,000 places (index entries; only those that
        -- asked lately are looked up among the messages): bounded under the scope's lock.
        ahead := 0;
        head_id := NULL;
        IF p_message_id IS NOT NULL THEN
            SELECT a.amount, a.message_id INTO ahead, head_id
            FROM unnest(ARRAY['interactive', 'system', 'batch']::lane[]) AS ln(lane)
            CROSS JOIN LATERAL (
                SELECT w.message_id, w.amount, w.since, w.seen_at, w.gatherable
                FROM spend_waiters w
                WHERE w.month = m AND w.scope = r.scope AND w.lane = ln.lane
                  AND (w.since, w.message_id) < (my_since, p_message_id)
                ORDER BY w.since, w.message_id
                LIMIT 1000
            ) AS a
            JOIN agent_messages h
              ON h.id = a.message_id AND h.status IN ('pending', 'running')
            WHERE ln.lane <= p_lane
              AND a.message_id <> p_message_id
              AND a.gatherable
              AND a.seen_at > at - live
              -- and spend alone still leaves it room
              AND r.spent + a.amount
                  <= CASE WHEN r.scope = 'appliance' AND ln.lane <> 'interactive'
                          THEN r.monthly_cap * share ELSE r.monthly_cap END
            ORDER BY a.since, a.message_id
            LIMIT 1;
            ahead := coalesce(ahead, 0);
        END IF;
        -- Refused by room held in flight: this call joins the line in this scope.
        IF r.spent + r.reserved + p_amount > lim THEN
            waiting := waiting || r.scope::text;
        END IF;
        IF r.spent + r.reserved + ahead + p_amount > lim THEN
            refusing := refusing || r.scope::text;
            first_head := coalesce(first_head, head_id);
            IF NOT is_refused THEN
                is_refused := true;
                SELECT r.scope AS scope, lim AS lim, r.spent AS spent, r.reserved AS reserved,
                       ahead AS ahead, head_id AS head_id, r.monthly_cap AS cap
                INTO refused;
            END IF;
        END IF;
    END LOOP;
    IF is_refused THEN
        -- In line, at its one place, in every scope whose room is held in flight; its place
        -- kept (seen now) in the other scopes that refused it; out of those that admit it.
        IF p_message_id IS NOT NULL THEN
            -- Can its room gather? Only what lanes more urgent than its own hold in flight is
            -- out of its reach (room its own lane and the less urgent ones hold is kept for
            -- it as they settle), in the appliance's scope and its tenant's together. The open
            -- holds are the calls in flight: read through their own index, whatever the
            -- statistics say, never through the month's whole ledger.
            held_all := 0;
            held_tenant := 0;
            IF p_lane <> 'interactive' THEN
                SELECT coalesce(sum(l.reserved), 0),
                       coalesce(sum(l.reserved) FILTER (WHERE l.tenant = p_tenant), 0)
                INTO held_all, held_tenant
                FROM (SELECT o.lane, o.reserved, o.tenant FROM spend_ledger o
                      WHERE o.status = 'reserved' AND o.month = m
                      ORDER BY o.id LIMIT 100000) AS l
                WHERE l.lane < p_lane;
            END IF;
            can_gather := (app_lim IS NULL OR app_spent + held_all + p_amount <= app_lim)
                      AND (ten_lim IS NULL OR ten_spent + held_tenant + p_amount <= ten_lim);
            INSERT INTO spend_waiters AS w (month, scope, message_id, lane, amount, since,
                                            seen_at, gatherable)
            SELECT m, s, p_message_id, p_lane, p_amount, my_since, at, can_gather
            FROM unnest(waiting) AS s
            ON CONFLICT ON CONSTRAINT spend_waiters_pkey DO UPDATE
            SET lane = excluded.lane, amount = excluded.amount, since = excluded.since,
                seen_at = excluded.seen_at, gatherable = excluded.gatherable;
            UPDATE spend_waiters w
            SET lane = p_lane, amount = p_amount, since = my_since, seen_at = at,
                gatherable = can_gather
            WHERE w.message_id = p_message_id AND w.month = m AND w.scope = ANY (refusing)
              AND w.scope <> ALL (waiting);
            DELETE FROM spend_waiters w
            WHERE w.message_id = p_message_id AND w.month = m AND w.scope <> ALL (refusing);
            -- Waiters gone for an hour (their work ended, or their month did) lose their
            -- place, 100 at a time.
            DELETE FROM spend_waiters w
            WHERE w.ctid = ANY (ARRAY(SELECT x.ctid FROM spend_waiters x
                                      WHERE x.seen_at < at - place_kept
                                      ORDER BY x.seen_at LIMIT 100));
        END IF;
        RETURN QUERY SELECT NULL::bigint,
            CASE WHEN refused.scope = 'appliance' AND p_lane <> 'interactive'
                 THEN format('money: %s work may use %s of the appliance cap %s %s '
                             '(the rest is kept for interactive work)',
                             p_lane, share, refused.cap, cfg.currency)
                 WHEN refused.scope = 'appliance'
                 THEN format('money: appliance monthly cap %s %s', refused.cap, cfg.currency)
                 ELSE format('money: %s monthly cap %s %s', refused.scope, refused.cap,
                             cfg.currency) END
            || CASE WHEN refused.head_id IS NOT NULL
                    THEN format(' (room kept for an earlier call asking %s, message %s)',
                                refused.ahead, refused.head_id)
                    ELSE '' END,
            m, refused.lim, refused.spent, refused.reserved, coalesce(refused.head_id, first_head),
            first_head IS NULL AND cardinality(waiting) > 0 AND coalesce(can_gather, false);
        RETURN;
    END IF;
    -- Admitted: out of every line, but its place is kept (a later call of the same handler
    -- keeps it, for the hour a place is kept).
    UPDATE spend_waiters w SET seen_at = at - live - interval '1 second'
    WHERE w.message_id = p_message_id AND w.seen_at > at - live;
    UPDATE spend_months sm SET reserved = sm.reserved + p_amount
    WHERE sm.month = m AND sm.scope = ANY(scopes);
    INSERT INTO spend_ledger (month, tenant, lane, message_id, lease_token, pipeline, stage, kind,
                              model, tier, status, reserved, created_at)
    VALUES (m, p_tenant, p_lane, p_message_id, p_lease_token, p_pipeline, p_stage, p_kind,
            p_model, p_tier, 'reserved', p_amount, at)
    RETURNING id INTO hold;
    RETURN QUERY SELECT hold, NULL::text, m, NULL::numeric, NULL::numeric, NULL::numeric,
        NULL::bigint, false;
END
$$;

GRANT EXECUTE ON FUNCTION spend_reserve(text, lane, numeric, bigint, bigint, text, text, text,
                                        text, text, timestamptz) TO appliance_system;
