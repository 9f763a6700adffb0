-- A hold whose lease is gone keeps its room under the cap.
--
-- The reclaimer used to release such a hold at 0, freeing its room, while the old worker's
-- model call could still be running (a lost lease is ordinary: a database blip, a stalled
-- event loop). The room was then reserved again by the re-run, and when the old call ended its
-- late settlement added the full amount on top: spent went past the cap (cap 1: 0.6 reserved,
-- lease lost, released, 0.6 reserved again, both settled: spent 1.2). A worker that died with
-- its call (SIGKILL) spent energy too, which a release at 0 never counted.
--
-- Now the reclaimer CHARGES the whole reservation, the worst case the cap admitted: the room
-- stays taken, so no overshoot, and the charge is an upper bound, labelled as one in the note.
-- A late settlement from a worker still alive replaces that charge with the measured (or
-- estimated) cost of the call; a late release (no usage) replaces it with 0.
--
-- Reaching the cap is always an alert (fraction 1), whatever alert fractions are configured:
-- a settlement above its reservation (a measured cost beyond the worst case priced in) can
-- take spent past the cap, and that must not pass unseen.
CREATE OR REPLACE FUNCTION spend_alert_check(p_month date, p_tenant text, p_at timestamptz)
RETURNS void
LANGUAGE sql
SET search_path = appliance, pg_catalog, pg_temp
AS $$
    INSERT INTO spend_alerts (month, scope, fraction, spent, cap, at)
    SELECT sm.month, sm.scope, f, sm.spent, c.monthly_cap, p_at
    FROM spend_months sm
    JOIN spend_caps c ON c.scope = sm.scope
    CROSS JOIN (SELECT DISTINCT f FROM unnest(
        (SELECT alert_fractions FROM spend_config) || ARRAY[1.0]::numeric[]) AS a(f)) AS fr
    WHERE sm.month = p_month AND sm.scope IN ('appliance', 'tenant:' || p_tenant)
      AND c.monthly_cap > 0 AND sm.spent >= f * c.monthly_cap
    ON CONFLICT DO NOTHING
$$;

CREATE OR REPLACE FUNCTION spend_release_dead(p_batch integer, p_now timestamptz)
RETURNS integer
LANGUAGE plpgsql
SET search_path = appliance, pg_catalog, pg_temp
AS $$
DECLARE
    n integer := 0;
    h record;
BEGIN
    FOR h IN
        SELECT l.id, l.reserved
        FROM spend_ledger l
        LEFT JOIN agent_messages m ON m.id = l.message_id
        WHERE l.status = 'reserved'
          AND (m.id IS NULL OR m.status <> 'running' OR m.lease_token IS DISTINCT FROM l.lease_token)
        ORDER BY l.id
        LIMIT p_batch
        FOR UPDATE OF l SKIP LOCKED
    LOOP
        PERFORM spend_settle(h.id, h.reserved, NULL, NULL, 'settled',
                             'lease gone: charged the whole reservation, an upper bound (the call '
                             'may have run); a late settlement replaces it with the call''s cost',
                             p_now);
        n := n + 1;
    END LOOP;
    RETURN n;
END
$$;

CREATE OR REPLACE FUNCTION spend_settle(
    p_hold bigint, p_amount numeric, p_energy double precision, p_provenance text,
    p_status text, p_note text, p_now timestamptz
) RETURNS numeric
LANGUAGE plpgsql
SET search_path = appliance, pg_catalog, pg_temp
AS $$
DECLARE
    at timestamptz := coalesce(p_now, now());
    h record;
    late spend_ledger;
    charged numeric;
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
        IF late.status = 'settled' AND late.note LIKE 'lease gone%' THEN
            -- The call's own figure replaces the upper bound the reclaimer charged.
            charged := CASE WHEN p_status = 'settled' THEN p_amount ELSE 0 END;
            UPDATE spend_ledger l
            SET amount = charged, energy_joules = p_energy, provenance = p_provenance,
                settled_at = at,
                note = 'late: the call ended after its lease was lost; its cost replaced the '
                       'reservation charged (' || late.amount || ')'
            WHERE l.id = p_hold;
            UPDATE spend_months sm SET spent = sm.spent - late.amount + charged
            WHERE sm.month = late.month AND sm.scope IN ('appliance', 'tenant:' || late.tenant);
            PERFORM spend_alert_check(late.month, late.tenant, at);
            RETURN charged;
        END IF;
        IF late.status = 'released' AND p_status = 'settled' AND p_amount > 0
           AND late.note LIKE 'lease gone%' THEN
            -- A hold released at 0 before migration 0023: the call's cost is added.
            INSERT INTO spend_ledger (month, tenant, lane, message_id, lease_token, pipeline,
                                      stage, kind, model, tier, status, reserved, amount,
                                      energy_joules, provenance, note, created_at, settled_at)
            VALUES (late.month, late.tenant, late.lane, late.message_id, late.lease_token,
                    late.pipeline, late.stage, late.kind, late.model, late.tier, 'settled', 0,
                    p_amount, p_energy, p_provenance,
                    'late: the call ended after its hold ' || p_hold || ' was released', at, at);
            UPDATE spend_months sm SET spent = sm.spent + p_amount
            WHERE sm.month = late.month AND sm.scope IN ('appliance', 'tenant:' || late.tenant);
            PERFORM spend_alert_check(late.month, late.tenant, at);
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
    PERFORM spend_alert_check(h.month, h.tenant, at);
    RETURN p_amount;
END
$$;
