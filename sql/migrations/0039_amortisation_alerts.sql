-- The month's amortised platform cost is checked against the alert fractions like any charge.
--
-- spend_platform_month added it to the appliance's spend without the alert check every other
-- charge runs: an amortisation that alone reached 80 % of the cap, or passed it (no work could
-- then run all month), recorded no alert, though reaching 100 % always alerts.

CREATE OR REPLACE FUNCTION spend_platform_month(p_now timestamptz)
    RETURNS numeric
    LANGUAGE plpgsql
    SET search_path = appliance, pg_catalog, pg_temp
    AS $$
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
    PERFORM spend_alert_check(m, NULL, at);  -- the appliance's scope only
    RETURN amount;
END
$$;
