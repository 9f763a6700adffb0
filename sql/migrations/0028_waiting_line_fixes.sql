-- The waiting line of 0026, five ways it went wrong, fixed:
--
-- 1. A waiter that more urgent work kept from fitting held its lane up: a large batch call
--    needs spent + reserved + its ask within batch's share, interactive calls rightly ignore
--    it, and while they kept room reserved it never fitted, so no later batch call ran at all.
--    A waiter now counts as ahead only while its room can gather in every scope it needs:
--    spent, plus what the lanes more urgent than its own hold in flight (read from the open
--    reservations), plus its ask, fit each scope's limit. Judged at its own last refusal, for
--    the appliance and its tenant together: one that its tenant's cap keeps out holds no room
--    in the appliance's line either.
-- 2. Two waiters could block each other (and everyone behind them) with nothing in flight: a
--    message's place was its first refusal in each scope, so two messages could stand in
--    opposite orders in the appliance's line and a tenant's. A message now has one place, its
--    first refusal this month in any scope, used in every scope; its rows in a scope that
--    admits it are removed.
-- 3. A waiter whose message was cancelled, finished, or parked held room for a minute: only
--    messages still pending or running (deferred work is pending) count as waiting now, and
--    only while they asked within the last minute (a deferred call asks again within seconds).
--    A waiter keeps its place for an hour after its last ask.
-- 4. Every reservation read the whole line, and every refusal the whole table for stale rows:
--    the line is read in order from an index, the first 1,000 waiters that count (of a lane
--    the call yields to, able to gather, asked within the minute), and stale rows are found
--    by an index on when they were last seen.

ALTER TABLE spend_waiters ADD COLUMN gatherable boolean NOT NULL DEFAULT true;
CREATE INDEX spend_waiters_line_idx
    ON spend_waiters (month, scope, since, message_id) INCLUDE (lane, amount, seen_at, gatherable);
CREATE INDEX spend_waiters_seen_at_idx ON spend_waiters (seen_at);

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
    ahead_n integer;
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
    -- This message's one place in line: its first refusal this month, in any scope.
    IF p_message_id IS NOT NULL THEN
        SELECT min(w.since) INTO my_since
        FROM spend_waiters w WHERE w.message_id = p_message_id AND w.month = m;
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
                    NULL::numeric, r.spent, r.reserved;
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
                m, lim, r.spent, r.reserved;
            RETURN;
        END IF;
        IF r.scope = 'appliance' THEN
            app_spent := r.spent;
            app_lim := lim;
        ELSE
            ten_spent := r.spent;
            ten_lim := lim;
        END IF;
        -- The waiters ahead of this call: placed before it, of its lane or a more urgent one
        -- (the lane enum is in claim order), able to gather their room, asked within the
        -- minute, and still pending or running. The first 1,000 of them at most: bounded work
        -- under the lock every reservation of the scope takes (a longer line only keeps less
        -- room for its tail; the cap itself never depends on it).
        ahead := 0;
        ahead_n := 0;
        IF p_message_id IS NOT NULL THEN
            SELECT coalesce(sum(a.amount), 0), count(*) INTO ahead, ahead_n
            FROM (
                SELECT w.message_id, w.amount
                FROM spend_waiters w
                WHERE w.month = m AND w.scope = r.scope
                  AND (w.since, w.message_id) < (my_since, p_message_id)
                  AND w.message_id <> p_message_id
                  AND w.lane <= p_lane
                  AND w.gatherable
                  AND w.seen_at > at - interval '1 minute'
                ORDER BY w.since, w.message_id
                LIMIT 1000
            ) AS a
            JOIN agent_messages h
              ON h.id = a.message_id AND h.status IN ('pending', 'running');
        END IF;
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
        -- Held by calls in flight (or kept for earlier waiters): in line, at its one place,
        -- in every scope that refused it, and out of the others.
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
            DELETE FROM spend_waiters w
            WHERE w.message_id = p_message_id AND w.month = m AND w.scope <> ALL (waiting);
            -- Waiters gone for an hour (their work ended, or their month did) lose their place.
            DELETE FROM spend_waiters w WHERE w.seen_at < at - interval '1 hour';
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
