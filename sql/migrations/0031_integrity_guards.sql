-- Guards against the runtime roles' own SQL, and key lifetimes that could outgrow history.
--
-- 1. A message entered the envelope however its INSERT said. appliance_app may insert (it
--    enqueues under row-level security), so a row could arrive running (its tenant's released
--    leases then counted up when it ended, its claimed ones never: the tenant's concurrency
--    limit no longer held), or with an id ahead of the sequence (every later enqueue that
--    drew it failed, any tenant's). The insert trigger now refuses both.
-- 2. An UPDATE that changed a message's id paired no old row in the update trigger, which
--    then saw no status change: a forbidden one (cancelled -> done) went unchecked, unlogged
--    and uncounted. Changing the id or the tenant is now refused.
-- 3. A key kept past its expiry for a message still in the envelope (migration 0024) was
--    extended by a whole retention, and hand-offs read a key's retention as expires_at -
--    created_at: each extension lengthened the retention of every later stage of the run,
--    without bound, until a key outlived the history of its message (a duplicate was then
--    answered with the id of a message gone from everywhere). Keys now carry their retention
--    (NULL for keys written before this: read as before), an extension lasts that retention,
--    and hand-offs read it. The settings now require history to outlive keys plus the archive.
-- 4. A tenant could be deleted or renamed once its hot messages were gone, leaving its
--    archive and keys to whichever tenant was next registered under that name (a duplicate
--    request was answered with the old tenant's message). Refused while any remain.
-- 5. The month's amortisation was charged by the scheduler's first tick of the month, after
--    holds of the new month could already fill the cap (spent + reserved then passed it). The
--    month's first reservation charges it first.

-- Nullable: adding it rewrites nothing, and the keys written before keep their old reading.
ALTER TABLE idempotency_keys ADD COLUMN retention interval;

CREATE OR REPLACE FUNCTION enqueue_requests(p_now timestamp with time zone, p_retention interval, p_requests jsonb, p_default_max_attempts integer DEFAULT 5, p_scope text DEFAULT NULL::text) RETURNS TABLE(ord integer, id bigint, new boolean)
    LANGUAGE plpgsql
    SET search_path TO 'appliance', 'pg_catalog', 'pg_temp'
    SET enable_nestloop TO 'on'
    AS $$
BEGIN
IF jsonb_typeof(p_requests) IS DISTINCT FROM 'array' THEN
    RAISE EXCEPTION 'enqueue requests must be a JSON array, got %', jsonb_typeof(p_requests)
        USING ERRCODE = 'invalid_parameter_value';
END IF;
-- p_scope: the tenant of this transaction (SET LOCAL), so that a tenant's enqueue is one
-- autocommit statement, one round trip; row-level security then checks every row against it.
IF p_scope IS NOT NULL THEN
    PERFORM set_config('appliance.tenant', p_scope, true);
END IF;
-- Unknown tenants are refused by the insert trigger (agent_messages_log_insert, below).
-- The stage tiers read below are current: a pipeline sync that changes one takes this lock
-- exclusively before it re-stamps messages, so it waits for every enqueue that may have read the
-- old tier to commit (and then sees its rows), and enqueues after it wait for its commit. Taken
-- before the statement below, whose snapshot is then taken after the wait.
PERFORM pg_advisory_xact_lock_shared(hashtext('appliance'), hashtext('stage_tiers'));
RETURN QUERY
WITH raw AS (
    SELECT (e.n - 1)::integer AS ord, e.r->>0 AS tenant, e.r->>1 AS pipeline, e.r->>2 AS stage,
           e.r->>3 AS source, e.r->>4 AS source_id, e.r->>5 AS key, e.r->>6 AS directive,
           e.r->>7 AS from_agent, e.r->>8 AS to_agent, (e.r->>9)::lane AS lane,
           (e.r->>10)::smallint AS priority, (e.r->>11)::integer AS max_attempts,
           (e.r->>12)::timestamptz AS not_before, (e.r->>13)::timestamptz AS deadline,
           (e.r->>14)::integer AS hops, e.r->15 AS context
    FROM jsonb_array_elements(p_requests) WITH ORDINALITY AS e(r, n)
),
req AS (
    -- Unset lane and max attempts come from the declared stage, else the defaults.
    SELECT r.ord, r.tenant, r.pipeline, r.stage, r.source, r.source_id, r.key, r.directive,
           coalesce(r.context, 'null'::jsonb) AS context, r.from_agent, r.to_agent,
           coalesce(r.lane, s.lane, 'interactive') AS lane, coalesce(r.priority, 0) AS priority,
           coalesce(r.max_attempts, s.max_attempts, p_default_max_attempts) AS max_attempts,
           r.not_before, r.deadline, r.hops, coalesce(p_now, now()) AS at,
           -- The stage's model tier, on the message for the claim's per-tier scans.
           s.tier
    FROM raw r
    LEFT JOIN pipeline_stages s ON s.pipeline = r.pipeline AND s.stage = r.stage
),
keys AS (
    INSERT INTO idempotency_keys AS ik
        (tenant, key, message_id, created_at, expires_at, retention)
    SELECT req.tenant, req.key, nextval('agent_messages_id_seq'), req.at, req.at + p_retention,
           p_retention
    FROM req
    ON CONFLICT (tenant, key) DO UPDATE
    -- A live key answers with its message; an expired one is taken over by the new request.
    -- Taken over only when its message has left the hot table as well (migration 0024): a
    -- dead message, or work deferred or held longer than the retention, keeps its key, which
    -- then lives as long as the message plus a retention from its last hit.
    SET hits = CASE WHEN ik.expires_at <= excluded.created_at
                         AND NOT EXISTS (SELECT FROM agent_messages h WHERE h.id = ik.message_id)
                    THEN 0 ELSE ik.hits + 1 END,
        last_hit_at = CASE WHEN ik.expires_at <= excluded.created_at
                                AND NOT EXISTS (SELECT FROM agent_messages h
                                                WHERE h.id = ik.message_id)
                           THEN NULL ELSE excluded.created_at END,
        message_id = CASE WHEN ik.expires_at <= excluded.created_at
                               AND NOT EXISTS (SELECT FROM agent_messages h
                                               WHERE h.id = ik.message_id)
                          THEN excluded.message_id ELSE ik.message_id END,
        created_at = CASE WHEN ik.expires_at <= excluded.created_at
                               AND NOT EXISTS (SELECT FROM agent_messages h
                                               WHERE h.id = ik.message_id)
                          THEN excluded.created_at ELSE ik.created_at END,
        retention = CASE WHEN ik.expires_at <= excluded.created_at
                              AND NOT EXISTS (SELECT FROM agent_messages h
                                              WHERE h.id = ik.message_id)
                         THEN excluded.retention ELSE ik.retention END,
        -- A live key keeps its expiry: hits do not slide it. Taken over: the new request's.
        -- Kept for its hot message: its own retention from this request (migration 0031: the
        -- request's could differ, and hand-offs read the key's retention).
        expires_at = CASE WHEN ik.expires_at > excluded.created_at THEN ik.expires_at
                          WHEN NOT EXISTS (SELECT FROM agent_messages h
                                           WHERE h.id = ik.message_id)
                          THEN excluded.expires_at
                          ELSE excluded.created_at + coalesce(ik.retention, excluded.retention)
                          END
    RETURNING ik.tenant, ik.key, ik.message_id, ik.hits = 0 AS new
),
inserted AS (
    INSERT INTO agent_messages (
        id, tenant, pipeline, stage, source, source_id, idempotency_key, directive, context,
        from_agent, to_agent, lane, priority, max_attempts, not_before, deadline, hops,
        created_at, updated_at, tier, deferred)
    SELECT keys.message_id, req.tenant, req.pipeline, req.stage, req.source, req.source_id,
           req.key, req.directive, req.context, req.from_agent, req.to_agent, req.lane,
           req.priority, req.max_attempts, coalesce(req.not_before, req.at), req.deadline,
           coalesce(req.hops, 0), req.at, req.at, req.tier,
           -- Not due yet: out of the claim's index until the promoter puts it back.
           coalesce(req.not_before, req.at) > req.at
    FROM req JOIN keys ON keys.tenant = req.tenant AND keys.key = req.key
    WHERE keys.new
    RETURNING 1
)
SELECT req.ord, keys.message_id, keys.new
FROM req JOIN keys ON keys.tenant = req.tenant AND keys.key = req.key
ORDER BY req.ord;
END
$$;

CREATE OR REPLACE FUNCTION agent_messages_log_insert() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'appliance', 'pg_catalog', 'pg_temp'
    AS $$
DECLARE
    unknown text;
    bad bigint;
BEGIN
    SELECT n.tenant INTO unknown FROM new_rows n
    WHERE NOT EXISTS (SELECT FROM tenants t WHERE t.name = n.tenant) LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'unknown tenant %', unknown
            USING ERRCODE = 'foreign_key_violation', DETAIL = unknown;
    END IF;
    -- Work enters the envelope as enqueue_requests writes it. A row inserted running would
    -- count up its tenant's released leases when it ended, never its claimed ones, lifting the
    -- tenant's concurrency limit; an id ahead of the sequence would make every enqueue that
    -- later draws it fail.
    SELECT n.id INTO bad FROM new_rows n
    WHERE n.status <> 'pending' OR n.attempts <> 0 OR n.lease_token IS NOT NULL
       OR n.lease_expires_at IS NOT NULL
       -- The last id given out: last_value, or one before it while is_called is false (a
       -- fresh or restarted sequence). Exact with the sequence's CACHE 1.
       OR n.id > (SELECT CASE WHEN s.is_called THEN s.last_value ELSE s.last_value - 1 END
                  FROM agent_messages_id_seq s)
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'message % must enter the envelope pending, unattempted and unleased,'
            ' with an id drawn from agent_messages_id_seq', bad
            USING ERRCODE = 'check_violation';
    END IF;
    INSERT INTO message_transitions
        (tenant, message_id, from_status, to_status, reason, actor, attempt, lease_token, at)
    SELECT n.tenant, n.id, NULL, n.status, n.status_reason, n.status_actor, n.attempts,
           n.lease_token, n.updated_at
    FROM new_rows n;
    -- The doorbell: the lane only, never data. PostgreSQL folds identical notifications of one
    -- transaction into one, so a batch rings once per lane.
    IF current_setting('appliance.notify', true) IS DISTINCT FROM 'off' THEN
        PERFORM pg_notify('appliance_work', l::text)
        FROM (SELECT DISTINCT n.lane AS l FROM new_rows n
              WHERE n.status = 'pending' AND NOT n.deferred) AS s;
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION agent_messages_log_update() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'appliance', 'pg_catalog', 'pg_temp'
    SET enable_nestloop TO 'off'
    AS $$
DECLARE
    seen record;
    bad record;
    nxt record;
BEGIN
    SELECT count(*) FILTER (WHERE o.id IS NULL OR n.tenant IS DISTINCT FROM o.tenant) AS moved,
           count(*) FILTER (WHERE n.status <> o.status) AS changed,
           count(*) FILTER (WHERE n.status <> o.status AND t.from_status IS NULL) AS illegal,
           count(*) FILTER (WHERE n.status = 'running' AND o.status <> 'running') AS taken,
           count(*) FILTER (WHERE o.status = 'running' AND n.status <> 'running') AS ended,
           count(*) FILTER (WHERE n.status = 'done' AND o.status = 'running') AS done,
           count(*) FILTER (WHERE n.status = 'pending' AND o.status <> 'pending') AS pending
    INTO seen
    FROM new_rows n
    LEFT JOIN old_rows o ON o.id = n.id
    LEFT JOIN message_status_transitions t
      ON t.from_status = o.status AND t.to_status = n.status;
    IF seen.moved > 0 THEN
        -- A row whose id changed pairs with no old row: its status change would go unchecked,
        -- unlogged and uncounted; one whose tenant changed would move work between tenants.
        RAISE EXCEPTION 'a message''s id and tenant cannot change'
            USING ERRCODE = 'check_violation';
    END IF;
    IF seen.changed = 0 THEN
        RETURN NULL;  -- heartbeats and other in-place updates: nothing to log or count
    END IF;
    IF seen.illegal > 0 THEN
        SELECT o.id, o.status AS from_status, n.status AS to_status INTO bad
        FROM new_rows n JOIN old_rows o ON o.id = n.id
        WHERE n.status <> o.status
          AND NOT EXISTS (SELECT FROM message_status_transitions t
                          WHERE t.from_status = o.status AND t.to_status = n.status)
        LIMIT 1;
        RAISE EXCEPTION 'illegal status change of message %: % -> %',
            bad.id, bad.from_status, bad.to_status
            USING ERRCODE = 'check_violation';
    END IF;

    INSERT INTO message_transitions
        (tenant, message_id, from_status, to_status, reason, actor, attempt, lease_token, at)
    -- A lease leaving running is cleared on the row; the log keeps which lease it was.
    SELECT n.tenant, n.id, o.status, n.status, n.status_reason, n.status_actor, n.attempts,
           coalesce(n.lease_token, o.lease_token), n.updated_at
    FROM new_rows n JOIN old_rows o ON o.id = n.id
    WHERE n.status <> o.status;

    IF seen.taken > 0 THEN
        -- Leases taken count up tenant_runtime.claimed (the row a claim locks), locked in
        -- tenant order so that two statements touching the same tenants never deadlock. The
        -- tenants' rows are probed by key through an array (= ANY): with nested loops off, a
        -- join would read the whole table.
        WITH delta AS (
            SELECT n.tenant, count(*) AS taken, max(n.claimed_at) AS claimed
            FROM new_rows n JOIN old_rows o ON o.id = n.id
            WHERE n.status = 'running' AND o.status <> 'running'
            GROUP BY n.tenant
        ),
        took AS (
            SELECT r.tenant FROM tenant_runtime r
            WHERE r.tenant = ANY (ARRAY(SELECT d.tenant FROM delta d))
            ORDER BY r.tenant
            FOR UPDATE
        )
        UPDATE tenant_runtime r
        SET claimed = r.claimed + delta.taken,
            last_claimed_at = greatest(r.last_claimed_at, delta.claimed)
        FROM delta JOIN took ON took.tenant = delta.tenant
        WHERE r.tenant = delta.tenant
          AND r.tenant = ANY (ARRAY(SELECT d.tenant FROM delta d));
    END IF;
    IF seen.ended > 0 THEN
        -- Leases ended count up tenant_released.released (a row no claim locks), in tenant
        -- order too.
        WITH delta AS (
            SELECT n.tenant, count(*) AS ended
            FROM new_rows n JOIN old_rows o ON o.id = n.id
            WHERE o.status = 'running' AND n.status <> 'running'
            GROUP BY n.tenant
        ),
        gave AS (
            SELECT x.tenant FROM tenant_released x
            WHERE x.tenant = ANY (ARRAY(SELECT d.tenant FROM delta d))
            ORDER BY x.tenant
            FOR UPDATE
        )
        UPDATE tenant_released x
        SET released = x.released + delta.ended
        FROM delta JOIN gave ON gave.tenant = delta.tenant
        WHERE x.tenant = delta.tenant
          AND x.tenant = ANY (ARRAY(SELECT d.tenant FROM delta d));
    END IF;

    IF seen.done > 0 THEN
        -- Stage hand-off: done -> the next stage for the outcome, keyed (source, source id,
        -- stage), so a retried completion or a second runner can never enqueue it twice.
        -- The requests in enqueue_requests' row layout. The next stage's key is kept as long
        -- as the finished message's key was (its parent's retention, and so the one the run's
        -- first enqueue was given): one enqueue per retention among the hand-offs, usually one.
        FOR nxt IN
            SELECT h.retention, jsonb_agg(h.request) AS requests, max(h.at) AS at
            FROM (
                SELECT jsonb_build_array(
                           n.tenant, n.pipeline, r.next_stage, n.source, n.source_id,
                           idempotency_key(n.source, n.source_id, r.next_stage), s.directive,
                           n.pipeline || '.' || n.stage, n.pipeline || '.' || r.next_stage,
                           s.lane, n.priority, s.max_attempts, NULL, n.deadline, n.hops + 1,
                           coalesce(n.result, 'null'::jsonb)) AS request,
                       n.updated_at AS at,
                       -- One primary-key probe per hand-off. A parent whose key is gone
                       -- (purged: it was in flight longer than its retention) hands off with
                       -- the default retention.
                       coalesce((SELECT coalesce(k.retention, k.expires_at - k.created_at)
                                 FROM idempotency_keys k
                                 WHERE k.key = n.idempotency_key AND k.tenant = n.tenant),
                                interval '90 days') AS retention
                FROM new_rows n
                JOIN old_rows o ON o.id = n.id
                JOIN stage_routes r
                  ON r.pipeline = n.pipeline AND r.stage = n.stage
                 AND r.outcome = coalesce(n.outcome, 'ok')
                JOIN pipeline_stages s ON s.pipeline = r.pipeline AND s.stage = r.next_stage
                WHERE n.status = 'done' AND o.status = 'running'
            ) AS h
            GROUP BY h.retention
        LOOP
            PERFORM enqueue_requests(nxt.at, nxt.retention, nxt.requests);
        END LOOP;
    END IF;

    IF seen.pending > 0
       AND current_setting('appliance.notify', true) IS DISTINCT FROM 'off' THEN
        PERFORM pg_notify('appliance_work', l::text)
        FROM (SELECT DISTINCT n.lane AS l
              FROM new_rows n JOIN old_rows o ON o.id = n.id
              WHERE n.status = 'pending' AND o.status <> 'pending' AND NOT n.deferred) AS s;
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION tenants_guard() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'appliance', 'pg_catalog', 'pg_temp'
    AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.name = OLD.name THEN
        RETURN NEW;
    END IF;
    IF EXISTS (SELECT FROM agent_messages WHERE tenant = OLD.name) THEN
        RAISE EXCEPTION 'tenant % still has messages', OLD.name  -- checked again under the lock
            USING ERRCODE = 'foreign_key_violation', DETAIL = OLD.name;
    END IF;
    -- History before the lock below stops the bus's writes: the keys are read without
    -- an index on the tenant. Transition logs go with the archived messages (prune_history),
    -- so these two say whether any history is left. A message archived from now on has a key
    -- already (one is written with every message and kept while it is in the envelope).
    IF EXISTS (SELECT FROM agent_messages_archive WHERE tenant = OLD.name)
       OR EXISTS (SELECT FROM idempotency_keys WHERE tenant = OLD.name) THEN
        RAISE EXCEPTION 'tenant % still has history (archived messages or idempotency keys):'
            ' a tenant registered under its name would inherit it', OLD.name
            USING ERRCODE = 'foreign_key_violation', DETAIL = OLD.name;
    END IF;
    LOCK TABLE agent_messages IN SHARE MODE;
    IF EXISTS (SELECT FROM agent_messages WHERE tenant = OLD.name) THEN
        RAISE EXCEPTION 'tenant % still has messages', OLD.name
            USING ERRCODE = 'foreign_key_violation', DETAIL = OLD.name;
    END IF;
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END
$$;

CREATE OR REPLACE FUNCTION spend_reserve(p_tenant text, p_lane lane, p_amount numeric, p_message_id bigint, p_lease_token bigint, p_pipeline text, p_stage text, p_kind text, p_model text, p_tier text, p_now timestamp with time zone) RETURNS TABLE(hold_id bigint, refusal text, month date, cap numeric, spent numeric, reserved numeric, behind bigint, wait boolean)
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
    -- The platform's fixed cost of the month is charged before its first hold (migration
    -- 0031): charged at the scheduler's next tick, it came after holds of the new month that
    -- could already fill the cap. Once a month (the ledger's unique index).
    IF cfg.amortisation_monthly > 0 AND NOT EXISTS (
        SELECT FROM spend_ledger l
        WHERE l.month = m AND l.status = 'platform' AND l.note = 'amortisation'
    ) THEN
        PERFORM spend_platform_month(at);
    END IF;
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
