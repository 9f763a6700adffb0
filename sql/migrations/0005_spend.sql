-- Spend: the monthly cap enforced by reservation, the spend ledger, alerts, and run budgets.
--
-- Every inference call reserves its worst-case cost with spend_reserve() (one atomic statement:
-- it locks the month's rows of every scope in scope order, checks them all and holds the amount
-- only when everything fits) and settles to the measured cost with spend_settle(). A hold whose
-- lease died is released by spend_release_dead() (the reclaimer). Month boundaries follow the
-- database clock in spend_config.time_zone; a hold settles in the month it was taken.

CREATE TABLE spend_config (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    time_zone text NOT NULL DEFAULT 'UTC',
    currency text NOT NULL DEFAULT 'EUR',
    -- The share of the appliance cap only interactive work may use: batch and system spend
    -- stop at (1 - share) of the cap, so they can never lock out a live request.
    interactive_share numeric NOT NULL DEFAULT 0.2 CHECK (interactive_share BETWEEN 0 AND 1),
    alert_fractions numeric[] NOT NULL DEFAULT '{0.5,0.8,0.95}',
    -- Hardware amortisation per month, held as a platform cost at each month's start.
    amortisation_monthly numeric NOT NULL DEFAULT 0 CHECK (amortisation_monthly >= 0)
);
INSERT INTO spend_config DEFAULT VALUES;

CREATE TABLE spend_caps (
    scope text PRIMARY KEY CHECK (scope = 'appliance' OR scope LIKE 'tenant:%'),
    monthly_cap numeric NOT NULL CHECK (monthly_cap >= 0),
    updated_at timestamptz NOT NULL DEFAULT now(),
    updated_by text NOT NULL DEFAULT 'bus'
);

CREATE TABLE spend_months (
    month date NOT NULL,
    scope text NOT NULL,
    spent numeric NOT NULL DEFAULT 0 CHECK (spent >= 0),
    reserved numeric NOT NULL DEFAULT 0 CHECK (reserved >= 0),
    created_at timestamptz NOT NULL,
    PRIMARY KEY (month, scope)
);

CREATE TABLE spend_ledger (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    month date NOT NULL,
    tenant text REFERENCES tenants (name),
    lane lane,
    message_id bigint,
    lease_token bigint,
    pipeline text,
    stage text,
    kind text,
    model text,
    tier text,
    status text NOT NULL CHECK (status IN ('reserved', 'settled', 'released', 'platform')),
    reserved numeric NOT NULL DEFAULT 0 CHECK (reserved >= 0),
    amount numeric NOT NULL DEFAULT 0 CHECK (amount >= 0),
    energy_joules double precision,
    provenance text CHECK (provenance IN ('measured', 'estimated', 'replayed')),
    note text,
    created_at timestamptz NOT NULL,
    settled_at timestamptz
);
CREATE INDEX spend_ledger_reserved_idx ON spend_ledger (message_id) WHERE status = 'reserved';
-- Held work by when it was held: the month rollover's path.
CREATE INDEX agent_messages_held_budget_idx
    ON agent_messages (updated_at) WHERE status = 'held_budget';
CREATE INDEX spend_ledger_month_idx ON spend_ledger (month, tenant);
CREATE INDEX spend_ledger_message_idx ON spend_ledger (message_id);

CREATE TABLE spend_alerts (
    month date NOT NULL,
    scope text NOT NULL,
    fraction numeric NOT NULL,
    spent numeric NOT NULL,
    cap numeric NOT NULL,
    at timestamptz NOT NULL,
    PRIMARY KEY (month, scope, fraction)
);

CREATE FUNCTION spend_month(p_at timestamptz) RETURNS date
    LANGUAGE sql STABLE SET search_path = appliance, pg_catalog AS $$
    SELECT date_trunc('month', p_at AT TIME ZONE (SELECT time_zone FROM spend_config))::date
$$;

-- Reserve `p_amount` against every scope (the appliance, the tenant) or nothing. Returns the
-- hold's id, or NULL with the dimension and figures that refused it.
CREATE FUNCTION spend_reserve(
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
        WHERE am.id = p_message_id AND am.lease_token = p_lease_token AND am.status = 'running'
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

-- Settle (or release) a hold to what the call really cost, in the month it was taken, and
-- record the alert fractions crossed. Idempotent: a hold already settled changes nothing and
-- returns NULL. A call that finished after the reclaimer released its hold (its lease was lost
-- while it ran) is still charged what it measured, as a late entry: nothing it used is dropped.
CREATE FUNCTION spend_settle(
    p_hold bigint, p_amount numeric, p_energy double precision, p_provenance text,
    p_status text, p_note text, p_now timestamptz
) RETURNS numeric
    LANGUAGE plpgsql SET search_path = appliance, pg_catalog AS $$
DECLARE
    at timestamptz := coalesce(p_now, now());
    h record;
    late spend_ledger;
BEGIN
    IF p_status NOT IN ('settled', 'released') THEN
        RAISE EXCEPTION 'spend_settle: status must be settled or released, not %', p_status;
    END IF;
    SELECT l.* INTO late FROM spend_ledger l WHERE l.id = p_hold FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'spend_settle: no hold %', p_hold;
    END IF;
    -- The month's rows in scope order, as spend_reserve locks them: no deadlock between a
    -- settlement and a reservation of the same tenant.
    PERFORM 1 FROM spend_months sm
    WHERE sm.month = late.month AND sm.scope IN ('appliance', 'tenant:' || late.tenant)
    ORDER BY sm.scope
    FOR UPDATE;
    IF late.status <> 'reserved' THEN
        IF late.status = 'released' AND p_status = 'settled' AND p_amount > 0
           AND late.note LIKE 'lease gone%' THEN
            INSERT INTO spend_ledger (month, tenant, lane, message_id, lease_token, pipeline,
                                      stage, kind, model, tier, status, reserved, amount,
                                      energy_joules, provenance, note, created_at, settled_at)
            VALUES (late.month, late.tenant, late.lane, late.message_id, late.lease_token,
                    late.pipeline, late.stage, late.kind, late.model, late.tier, 'settled', 0,
                    p_amount, p_energy, p_provenance,
                    'late: the call ended after its hold ' || p_hold || ' was released', at, at);
            UPDATE spend_months sm SET spent = sm.spent + p_amount
            WHERE sm.month = late.month AND sm.scope IN ('appliance', 'tenant:' || late.tenant);
            RETURN p_amount;
        END IF;
        RETURN NULL;
    END IF;
    UPDATE spend_ledger l
    SET status = p_status, amount = p_amount, energy_joules = p_energy,
        provenance = p_provenance, settled_at = at, note = coalesce(p_note, l.note)
    WHERE l.id = p_hold
    RETURNING l.month, l.tenant, l.reserved INTO h;
    UPDATE spend_months sm
    SET reserved = sm.reserved - h.reserved, spent = sm.spent + p_amount
    WHERE sm.month = h.month AND sm.scope IN ('appliance', 'tenant:' || h.tenant);
    INSERT INTO spend_alerts (month, scope, fraction, spent, cap, at)
    SELECT sm.month, sm.scope, f, sm.spent, c.monthly_cap, at
    FROM spend_months sm
    JOIN spend_caps c ON c.scope = sm.scope
    CROSS JOIN unnest((SELECT alert_fractions FROM spend_config)) AS f
    WHERE sm.month = h.month AND sm.scope IN ('appliance', 'tenant:' || h.tenant)
      AND c.monthly_cap > 0 AND sm.spent >= f * c.monthly_cap
    ON CONFLICT DO NOTHING;
    RETURN p_amount;
END
$$;

-- Release the holds of leases that are gone (the holder died, was reclaimed, or its message
-- finished without settling): nothing is charged for them here. A bounded batch.
CREATE FUNCTION spend_release_dead(p_batch integer, p_now timestamptz) RETURNS integer
    LANGUAGE plpgsql SET search_path = appliance, pg_catalog AS $$
DECLARE
    n integer := 0;
    h record;
BEGIN
    FOR h IN
        SELECT l.id
        FROM spend_ledger l
        LEFT JOIN agent_messages m ON m.id = l.message_id
        WHERE l.status = 'reserved'
          AND (m.id IS NULL OR m.status <> 'running' OR m.lease_token IS DISTINCT FROM l.lease_token)
        ORDER BY l.id
        LIMIT p_batch
        FOR UPDATE OF l SKIP LOCKED
    LOOP
        PERFORM spend_settle(h.id, 0, NULL, NULL, 'released', 'lease gone: released by the reclaimer',
                             p_now);
        n := n + 1;
    END LOOP;
    RETURN n;
END
$$;

-- A pipeline instance's budget: (tenant, source, source id) moving through stages. Work is
-- reserved before it starts, so fan-out cannot oversubscribe; ordinary work may not touch the
-- verification reserve.
CREATE TABLE run_budgets (
    tenant text NOT NULL REFERENCES tenants (name),
    source text NOT NULL,
    source_id text NOT NULL,
    pipeline text NOT NULL,
    limits jsonb NOT NULL,
    verification_reserve numeric NOT NULL CHECK (verification_reserve BETWEEN 0 AND 1),
    used jsonb NOT NULL DEFAULT '{}'::jsonb,
    started_at timestamptz NOT NULL,
    exhausted text,
    PRIMARY KEY (tenant, source, source_id)
);

-- Reserve `p_ask` ({"steps": 1, "tokens": 900, ...}) against the run's budget, creating it with
-- `p_limits` on first use. Returns NULL, or the first dimension that does not fit.
CREATE FUNCTION run_budget_reserve(
    p_tenant text, p_source text, p_source_id text, p_pipeline text, p_limits jsonb,
    p_reserve numeric, p_verification boolean, p_ask jsonb, p_now timestamptz
) RETURNS text
    LANGUAGE plpgsql SET search_path = appliance, pg_catalog AS $$
DECLARE
    at timestamptz := coalesce(p_now, now());
    b run_budgets;
    d text;
    lim numeric;
    usable numeric;
BEGIN
    INSERT INTO run_budgets (tenant, source, source_id, pipeline, limits, verification_reserve,
                             started_at)
    VALUES (p_tenant, p_source, p_source_id, p_pipeline, p_limits, p_reserve, at)
    ON CONFLICT DO NOTHING;
    SELECT * INTO b FROM run_budgets
    WHERE tenant = p_tenant AND source = p_source AND source_id = p_source_id
    FOR UPDATE;
    IF b.limits ? 'wall_seconds'
       AND extract(epoch FROM at - b.started_at) > (b.limits ->> 'wall_seconds')::numeric THEN
        UPDATE run_budgets SET exhausted = coalesce(exhausted, 'wall_time')
        WHERE tenant = p_tenant AND source = p_source AND source_id = p_source_id;
        RETURN 'wall_time';
    END IF;
    FOR d IN SELECT jsonb_object_keys(p_ask) ORDER BY 1 LOOP
        CONTINUE WHEN NOT b.limits ? d;
        lim := (b.limits ->> d)::numeric;
        usable := CASE WHEN p_verification THEN lim ELSE lim * (1 - b.verification_reserve) END;
        IF coalesce((b.used ->> d)::numeric, 0) + (p_ask ->> d)::numeric > usable THEN
            UPDATE run_budgets SET exhausted = coalesce(exhausted, d)
            WHERE tenant = p_tenant AND source = p_source AND source_id = p_source_id;
            RETURN d;
        END IF;
    END LOOP;
    UPDATE run_budgets r
    SET used = (SELECT jsonb_object_agg(k, coalesce((r.used ->> k)::numeric, 0)
                                            + coalesce((p_ask ->> k)::numeric, 0))
                FROM (SELECT jsonb_object_keys(r.used) AS k
                      UNION SELECT jsonb_object_keys(p_ask)) AS keys)
    WHERE tenant = p_tenant AND source = p_source AND source_id = p_source_id;
    RETURN NULL;
END
$$;

-- Give back what a reservation did not use (p_delta holds negative numbers: reserved - used).
CREATE FUNCTION run_budget_adjust(
    p_tenant text, p_source text, p_source_id text, p_delta jsonb
) RETURNS void
    LANGUAGE sql SET search_path = appliance, pg_catalog AS $$
    UPDATE run_budgets r
    SET used = (SELECT jsonb_object_agg(k, greatest(0, coalesce((r.used ->> k)::numeric, 0)
                                                   + coalesce((p_delta ->> k)::numeric, 0)))
                FROM (SELECT jsonb_object_keys(r.used) AS k) AS keys)
    WHERE tenant = p_tenant AND source = p_source AND source_id = p_source_id
$$;

ALTER TABLE spend_ledger ENABLE ROW LEVEL SECURITY;
ALTER TABLE spend_ledger FORCE ROW LEVEL SECURITY;
CREATE POLICY spend_ledger_tenant_isolation ON spend_ledger TO appliance_app
    USING (tenant = current_tenant());
CREATE POLICY spend_ledger_bus_machinery ON spend_ledger
    TO appliance_system, appliance_owner USING (true) WITH CHECK (true);
ALTER TABLE run_budgets ENABLE ROW LEVEL SECURITY;
ALTER TABLE run_budgets FORCE ROW LEVEL SECURITY;
CREATE POLICY run_budgets_tenant_isolation ON run_budgets TO appliance_app
    USING (tenant = current_tenant());
CREATE POLICY run_budgets_bus_machinery ON run_budgets
    TO appliance_system, appliance_owner USING (true) WITH CHECK (true);

GRANT SELECT ON spend_config, spend_caps, spend_months, spend_alerts TO appliance_app;
GRANT SELECT ON spend_ledger, run_budgets TO appliance_app;
GRANT SELECT, UPDATE ON spend_config TO appliance_system;
GRANT SELECT, INSERT, UPDATE ON spend_caps, spend_months, spend_ledger, spend_alerts,
    run_budgets TO appliance_system;
GRANT EXECUTE ON FUNCTION spend_month(timestamptz), spend_reserve(text, lane, numeric, bigint,
    bigint, text, text, text, text, text, timestamptz), spend_settle(bigint, numeric,
    double precision, text, text, text, timestamptz), spend_release_dead(integer, timestamptz),
    run_budget_reserve(text, text, text, text, jsonb, numeric, boolean, jsonb, timestamptz),
    run_budget_adjust(text, text, text, jsonb) TO appliance_system;

-- Joules per token per model file, measured by `appliance energy calibrate` (with a counter) or
-- estimated (without one): what the bus prices a call's worst case with.
CREATE TABLE energy_calibration (
    model text NOT NULL,
    sha256 text NOT NULL,
    joules_per_token numeric NOT NULL CHECK (joules_per_token > 0),
    idle_watts numeric NOT NULL CHECK (idle_watts >= 0),
    tokens integer NOT NULL CHECK (tokens > 0),
    provenance text NOT NULL CHECK (provenance IN ('measured', 'estimated', 'replayed')),
    source text NOT NULL,
    measured_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (model, sha256)
);
GRANT SELECT ON energy_calibration TO appliance_app;
GRANT SELECT, INSERT, UPDATE ON energy_calibration TO appliance_system;

-- The month's hardware amortisation, charged once as a platform cost when the month starts.
CREATE UNIQUE INDEX spend_ledger_amortisation_once
    ON spend_ledger (month) WHERE status = 'platform' AND note = 'amortisation';

CREATE FUNCTION spend_platform_month(p_now timestamptz) RETURNS numeric
    LANGUAGE plpgsql SET search_path = appliance, pg_catalog AS $$
DECLARE
    at timestamptz := coalesce(p_now, now());
    m date := spend_month(at);
    amount numeric := (SELECT amortisation_monthly FROM spend_config);
BEGIN
    IF amount <= 0 THEN
        RETURN 0;
    END IF;
    INSERT INTO spend_ledger (month, status, amount, note, created_at, settled_at)
    VALUES (m, 'platform', amount, 'amortisation', at, at)
    ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    INSERT INTO spend_months (month, scope, created_at) VALUES (m, 'appliance', at)
    ON CONFLICT DO NOTHING;
    UPDATE spend_months SET spent = spent + amount WHERE month = m AND scope = 'appliance';
    RETURN amount;
END
$$;
GRANT EXECUTE ON FUNCTION spend_platform_month(timestamptz) TO appliance_system;
