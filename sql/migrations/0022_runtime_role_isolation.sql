-- The tenant-scoped runtime role (appliance_app) is held to its tenant in two more places.
--
-- 1. Temporary tables could stand in for the appliance's own. A function's search_path that
--    does not name pg_temp searches the session's temporary schema FIRST, and every role may
--    create temporary tables. So appliance_app could create a temporary `message_transitions`
--    (or `message_status_transitions`, `tenant_runtime`, `stage_routes`, ...) and the SECURITY
--    DEFINER log trigger, running as the owner, would then read and write that table instead:
--    status changes the life cycle forbids (cancelled -> done), kept out of the real log, and
--    the tenant's claim counters or hand-offs corrupted. Every function of the schema that
--    fixes its search_path now names pg_temp last, where it can shadow nothing (the
--    PostgreSQL documentation's advice for SECURITY DEFINER functions). Functions that later
--    migrations define must do the same: tests/db/test_tenancy.py checks every one.
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure
        FROM pg_proc p
        WHERE p.pronamespace = 'appliance'::regnamespace
          AND EXISTS (SELECT FROM unnest(p.proconfig) AS c(setting)
                      WHERE c.setting LIKE 'search\_path=%')
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = appliance, pg_catalog, pg_temp', f);
    END LOOP;
END
$$;

-- 2. Tables keyed by tenant that had no row-level security were readable across tenants: as
--    tenant A, appliance_app saw tenant B's claim counters and last activity (tenant_runtime,
--    tenant_released, the tenant_running view), B's cap (spend_caps), B's monthly spend and
--    alerts (spend_months, spend_alerts, keyed 'tenant:<name>'), and every tenant's name and
--    display name (tenants). No code path of the tenant role reads them (the bus machinery,
--    appliance_system, and the owner's triggers do), so the grants go. `tenants` stays
--    readable, under row-level security: a tenant sees its own row only.
REVOKE SELECT ON tenant_runtime, tenant_released, tenant_running, spend_caps, spend_months,
    spend_alerts FROM appliance_app;

ALTER TABLE tenants ENABLE ROW LEVEL SECURITY;
ALTER TABLE tenants FORCE ROW LEVEL SECURITY;
-- The machinery (and the owner's SECURITY DEFINER triggers, which check that a tenant exists)
-- see every tenant; BYPASSRLS makes the first policy moot for appliance_system where granted.
CREATE POLICY tenants_bus_machinery ON tenants TO appliance_owner, appliance_system
    USING (true) WITH CHECK (true);
CREATE POLICY tenants_tenant_isolation ON tenants FOR SELECT TO appliance_app
    USING (name = current_tenant());
